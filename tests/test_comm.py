"""The comm layer's accounting (faults, desyncs and timeouts: tests/test_failures.py)."""

from __future__ import annotations

import torch

from plait import comm
from plait.testing import cached_mesh


def _traffic() -> dict:
    mesh = cached_mesh(dp=2)
    g = mesh.group("dp")
    with comm.counting() as counts:
        comm.all_reduce(torch.ones(10), g)
        out = torch.empty(8)
        comm.all_gather_into(out, torch.ones(4), g)
        comm.reduce_scatter_into(torch.empty(4), torch.ones(8), g)
    return counts.as_dict()


def test_bytes_and_wire_bytes_per_axis(pools):
    s = pools[2].run(_traffic)[0]
    assert s["all_reduce@dp"] == {"calls": 1, "bytes": 40, "wire_bytes": 40.0}  # 2(n-1)/n = 1
    assert s["all_gather@dp"] == {"calls": 1, "bytes": 32, "wire_bytes": 16.0}  # (n-1)/n = 1/2
    assert s["reduce_scatter@dp"] == {"calls": 1, "bytes": 32, "wire_bytes": 16.0}
