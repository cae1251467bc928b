"""Context parallelism on models that count their own positions (`plait.cp.positions`).

A nanoGPT-shaped model written here (`nanogpt`), its forward taking no ``position_ids``, with a
learned position table read at ``torch.arange(t)`` (nanoGPT's ``wpe``), a rotary table held as a
buffer and sliced to the length (torchtitan's ``freqs_cis[:seqlen]``) and a rotary table
computed from ``torch.arange(t)``, and a module of its own whose forward takes ``positions``
(the protocol plait GPT's rotary tables follow): cp=2 (ring, DDP over the cp ranks) against one process on the
same batches, float64, this rank's tokens of the logits and every parameter after each of two
SGD steps at ``rtol=1e-9`` (as `test_context_parallel.py`); and the torchtitan-style Llama of
`test_meta_init.py`, whose attention slices the root's ``freqs_cis`` it is passed, with every
block recomputed by activation checkpointing. Counted locally, the positions put
the logits ~100% off. Refused: a forward that counts positions under ``positions='none'`` (the
advice once given for such models), and under ``"auto"`` a model that counts none (plait cannot
tell it has none), with advice that leads to a correct run.
"""

from __future__ import annotations

import copy

import pytest
import torch
from nanogpt import build
from oracle import train_cp_against_one_process

from plait.testing import cached_mesh

TOL = {"rtol": 1e-9, "atol": 1e-12}


def _parity(positions: str) -> float:
    import plait

    mesh = cached_mesh(cp=2)
    if positions == "torchtitan":  # freqs_cis[:seqlen] inside each attention, blocks recomputed
        from test_meta_init import Transformer

        torch.manual_seed(0)
        oracle = Transformer()
        oracle.init_weights()
        plan = plait.ParallelPlan(cp="ring", ac="full")
    else:
        oracle, plan = build(positions=positions), plait.ParallelPlan(cp="ring")
    net = plait.parallelize(copy.deepcopy(oracle), mesh, plan)
    train_cp_against_one_process(oracle, net, mesh, _rows, TOL, positions)
    return 1.0


def _rows(step: int) -> torch.Tensor:
    """The global batch at ``step``: 2 rows of 17 tokens (inputs and targets shifted by one)."""
    return torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(step))


def _refusals() -> list[str]:
    import plait

    mesh = cached_mesh(cp=2)
    x = plait.cp.shard(torch.zeros(2, 16, dtype=torch.long), mesh)
    seen = []
    for positions in ("wpe", "table"):
        model = plait.context_parallel(build(positions=positions), mesh, positions="none")
        with pytest.raises(ValueError, match="counts token positions in its forward") as e:
            model(x)
        assert "positions='auto'" in str(e.value)
        seen.append(str(e.value))
    with pytest.raises(ValueError, match="counted no positions plait can place") as e:
        plait.context_parallel(build(positions="none"), mesh)(x)
    assert "take position_ids" in str(e.value) and "positions='none'" in str(e.value)
    seen.append(str(e.value))
    # Positions plait cannot see (a running count, as OPT reads its mask): "auto" refuses, and
    # "none", its advice for a model without positions, is refused by the numeric check of the
    # first forward, where it would have trained ~100% off. position_ids, the other advice, runs.
    with pytest.raises(ValueError, match="counted no positions plait can place"):
        plait.context_parallel(build(positions="cumsum"), mesh)(x)
    model = plait.context_parallel(build(positions="cumsum"), mesh, positions="none")
    with pytest.raises(ValueError, match="numeric check: GPT run split over cp=2 differs") as e:
        model(x)
    said = str(e.value)
    assert "output 0 of shape (1, 8, 64) (one sequence)" in said and "position_ids" in said, said
    seen.append(str(e.value))
    # Told it has none, the model without positions runs as on one device.
    one = build(positions="none")
    model = plait.context_parallel(copy.deepcopy(one), mesh, positions="none")
    got = model(x)
    torch.testing.assert_close(got, plait.cp.shard(one(torch.zeros(2, 16, dtype=torch.long)), mesh), **TOL)
    checked = plait.cp.verified(model)  # the check ran, on the whole 16 tokens, and passed
    assert checked is not None and checked.tokens == 16 and checked.compared == 1 and checked.worst <= 1
    return seen


def _all() -> list[str]:
    from plait.cp.positions import positions_mode, rotaries

    # A module of one's own that takes positions is given them (not left to the counting watcher).
    own = build(positions="module")
    assert positions_mode(own, "auto") == "rotary" and rotaries(own) == [own.angles_of]
    for positions in ("wpe", "table", "arange", "module", "torchtitan"):
        _parity(positions)
    return _refusals()


def test_cp2_reads_the_positions_a_model_counts_and_refuses_what_it_cannot_place(pools):
    assert all(all(r) for r in pools[2].run(_all))
