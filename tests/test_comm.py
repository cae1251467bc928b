"""The comm layer: accounting, desync detection, timeouts that name what they waited for."""

from __future__ import annotations

import datetime as dt

import torch
import torch.distributed as dist

from plait import comm
from plait.testing import cached_mesh


def _traffic() -> dict:
    mesh = cached_mesh(dp=2)
    g = mesh.group("dp")
    comm.all_reduce(torch.ones(10), g)
    out = torch.empty(8)
    comm.all_gather_into(out, torch.ones(4), g)
    comm.reduce_scatter_into(torch.empty(4), torch.ones(8), g)
    return comm.stats().as_dict()


def test_bytes_and_wire_bytes_per_axis(pools):
    s = pools[2].run(_traffic)[0]
    assert s["all_reduce@dp"] == {"calls": 1, "bytes": 40, "wire_bytes": 40.0}  # 2(n-1)/n = 1
    assert s["all_gather@dp"] == {"calls": 1, "bytes": 32, "wire_bytes": 16.0}  # (n-1)/n = 1/2
    assert s["reduce_scatter@dp"] == {"calls": 1, "bytes": 32, "wire_bytes": 16.0}


def _desync() -> None:
    comm.set_debug(True)
    try:
        g = cached_mesh(dp=2).group("dp")
        if dist.get_rank() == 0:
            comm.all_reduce(torch.ones(4), g)
        else:
            comm.broadcast(torch.ones(4), 0, g)
    finally:
        comm.set_debug(False)


def _matching_under_debug() -> float:
    comm.set_debug(True)
    try:
        t = torch.ones(4, dtype=torch.bfloat16)
        comm.all_reduce(t, cached_mesh(dp=2).group("dp"))
        return float(t[0])
    finally:
        comm.set_debug(False)


def test_debug_mode_passes_matching_collectives(pools):
    assert pools[2].run(_matching_under_debug) == [2.0, 2.0]


def test_debug_mode_reports_desync_instead_of_mixing_data(pools):
    errors = pools[2].errors(_desync)
    assert "desync" in errors[0] and "all_reduce" in errors[0]
    assert "desync" in errors[1] and "broadcast" in errors[1]


def _one_rank_waits() -> str:
    # A short-timeout group so the test takes seconds; plait.init(timeout_s=...) sets the default.
    g = dist.new_group([0, 1], timeout=dt.timedelta(seconds=3))
    comm.register_group(g, "dp", [0, 1])
    if dist.get_rank() == 1:
        return "skipped"
    try:
        comm.all_reduce(torch.ones(3), g)
    except comm.CollectiveError as e:
        return str(e)
    return "no error"


def test_timeout_names_the_collective_and_group(pools):
    out = pools[2].run(_one_rank_waits)
    assert "all_reduce of a (3,) torch.float32 tensor on axis 'dp'" in out[0], out[0]
    pools[2].restart()  # rank 1's half of the group is left in an unknown state
