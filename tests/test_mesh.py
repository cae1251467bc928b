"""Mesh construction, rank order, groups, validation; comm accounting."""

from __future__ import annotations

import pytest
import torch

from plait import comm
from plait.runtime.mesh import Mesh
from plait.testing import cached_mesh


def _layout(pp: int, dp: int, fsdp: int, tp: int) -> dict:
    import torch.distributed as dist

    m = cached_mesh(pp=pp, dp=dp, fsdp=fsdp, tp=tp)
    t = torch.tensor([float(dist.get_rank())])
    with comm.counting() as counts:
        comm.all_reduce(t, m.group("tp"))
    return {
        "coords": m.coords,
        "tp_ranks": m.group_ranks("tp"),
        "dpfsdp_ranks": m.group_ranks(("dp", "fsdp")),
        "tp_sum": t.item(),
        "dpfsdp_rank": m.rank(("dp", "fsdp")),
        "pp_lines": m.all_group_ranks("pp"),
        "stats": counts.as_dict(),
    }


def test_rank_order_tp_innermost(pools):
    out = pools[8].run(_layout, 2, 1, 2, 2)
    # rank = (pp*fsdp + fsdp_i)*tp + tp_i
    assert out[5]["coords"] == {"pp": 1, "dp": 0, "fsdp": 0, "cp": 0, "tp": 1}
    assert out[5]["tp_ranks"] == [4, 5]
    assert out[5]["dpfsdp_ranks"] == [5, 7]
    assert out[7]["dpfsdp_rank"] == 1
    # Every pp line (one per fsdp x tp coordinate), the same list on every rank.
    assert out[0]["pp_lines"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert all(o["pp_lines"] == out[0]["pp_lines"] for o in out)
    assert [o["tp_sum"] for o in out] == [1, 1, 5, 5, 9, 9, 13, 13]
    assert out[0]["stats"]["all_reduce@tp"] == {"calls": 1, "bytes": 4, "wire_bytes": 4.0}


def _cp_layout() -> dict:
    m = cached_mesh(fsdp=2, cp=2, tp=2)
    return {"coords": m.coords, "cp": m.group_ranks("cp"), "shards": m.group_ranks(("fsdp", "cp")),
            "replicas": m.group_ranks(("dp", "cp")), "cp_rank": m.rank("cp")}


def test_cp_sits_between_fsdp_and_tp(pools):
    # rank = ((fsdp_i * cp + cp_i) * tp + tp_i: cp ranks are tp-neighbours apart
    out = pools[8].run(_cp_layout)
    assert out[5]["coords"] == {"pp": 0, "dp": 0, "fsdp": 1, "cp": 0, "tp": 1}
    assert out[5]["cp"] == [5, 7] and out[7]["cp_rank"] == 1
    assert out[5]["shards"] == [1, 3, 5, 7]  # FSDP shards over fsdp x cp
    assert out[5]["replicas"] == [5, 7]  # DDP averages over dp x cp


def _bad_mesh(**kw) -> None:
    from plait import Mesh

    Mesh(**kw)


def test_invalid_mesh_lists_degrees(pools):
    errors = pools[2].errors(_bad_mesh, dp=3)
    assert "dp=3" in errors[0] and "world size is 2" in errors[0]
    errors = pools[2].errors(_bad_mesh, dp=-1, tp=-1)
    assert "at most one" in errors[1]
    errors = pools[2].errors(_bad_mesh, dp=0)
    assert "invalid: dp" in errors[0]


def _wildcard() -> dict:
    from plait import Mesh

    return Mesh(dp=-1).shape


def test_wildcard_axis(pools):
    assert pools[2].run(_wildcard)[0]["dp"] == 2


def test_slurm_and_torchrun_env():
    from plait.runtime.env import launch_from_env

    job = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "8", "SLURM_NODELIST": "gpu[007-008,12]"}
    s = launch_from_env({**job, "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0"})
    assert (s.rank, s.world_size, s.local_rank, s.master_addr, s.source) == (3, 8, 1, "gpu007", "slurm")
    # An interactive shell in the allocation, or the batch script itself: no srun task, so one
    # process with a note, not rank 0 of 8 waiting for 7 peers that were never started.
    for shell in (job, {**job, "SLURM_PROCID": "0", "SLURM_STEP_ID": "4294967291"}):
        alone = launch_from_env(shell)
        assert (alone.world_size, alone.source) == (1, "single") and "not a task of srun" in alone.note
    t = launch_from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                         "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (t.rank, t.world_size, t.master_port, t.source) == (1, 2, 1234, "torchrun")
    assert launch_from_env({}).source == "single"


@pytest.mark.parametrize("world", [1])
def test_single_process_init_is_idempotent(world):
    import plait

    d1 = plait.init()
    d2 = plait.init()
    assert d1 == d2 == torch.device("cpu")


def _groups_made_and_destroyed() -> dict:
    import torch
    import torch.distributed as dist

    from plait import comm

    before = len(comm.created_groups())
    mesh = Mesh(dp=2)
    made = len(comm.created_groups()) - before
    total = torch.ones(1)
    dist.all_reduce(total, group=mesh.group("dp"))
    alone = mesh.group(("tp", "cp"))  # this rank alone: made on first use, by this rank only
    refused = ""
    try:
        mesh.group(("dp", "pp", "tp"))  # the same ranks as dp: axes of size 1 do not count
    except ValueError as e:  # pragma: no cover - reported below
        refused = str(e)
    mesh.destroy()
    return {"made": made, "sum": float(total), "alone": dist.get_world_size(alone), "refused": refused,
            "left": len(comm.created_groups()) - before}


def test_mesh_makes_the_groups_it_uses_and_destroys_them(pools):
    for r in pools[2].run(_groups_made_and_destroyed):
        # dp and its companion; the other kinds reduce to dp or to this rank alone.
        assert r["made"] == 2 and r["sum"] == 2.0 and r["alone"] == 1 and r["refused"] == ""
        assert r["left"] == 0


def _asks_for_a_group_not_made() -> str:
    mesh = Mesh(pp=2, tp=2)
    try:
        mesh.group(("pp", "tp"))
    except ValueError as e:
        return str(e)
    finally:
        mesh.destroy()
    return "made"


def test_a_group_not_made_is_refused_with_the_way_to_make_it(pools):
    for text in pools[4].run(_asks_for_a_group_not_made):
        assert "groups=[('pp', 'tp')]" in text and "no group for axes ('pp', 'tp')" in text


def test_mesh_degrees_are_keywords_in_rank_order():
    """`Mesh(dp=2, tp=2)`: keywords only (a positional call would mean whatever order the signature had),
    listed in the order ranks are laid out, tp fastest."""
    import inspect

    from plait.runtime.mesh import AXES, Mesh

    params = inspect.signature(Mesh).parameters
    assert [p for p in params if p in AXES] == list(AXES)
    assert all(params[a].kind is inspect.Parameter.KEYWORD_ONLY for a in AXES)
