"""Tensor parallelism on a model that reads its global sizes in forward: the nanoGPT-shaped model
of `nanogpt`, whose attention splits the fused ``c_attn`` by ``self.n_embd`` and views the heads
by ``self.n_head``. `plait.plan_for` gives the attention its local ``n_head`` and ``n_embd``
(before, the plan check failed: "not enough values to unpack"). tp=2 with and without sequence
parallelism against one process, float64, 5 AdamW steps, every gathered parameter at
``rtol=1e-9, atol=1e-12`` (as `test_hf_tp.py`). nanoGPT's own attention takes its width from
its input's shape (``C``), which no head split can keep: refused, naming the sizes it was given.
The same model also trains as one process under FSDP x TP (fsdp=2 x tp=2, with and without SP) and
in a 1F1B pipeline at pp=2 (its tied embedding and head on different stages).
"""

from __future__ import annotations

import copy

import pytest
import torch
from nanogpt import build
from oracle import loss64, train_against_one_process, train_pipeline_against_one_process

from plait.testing import cached_mesh

TOL = {"rtol": 1e-9, "atol": 1e-12}


def _rows(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch at ``step``: 4 sequences of 16 tokens, and their targets."""
    w = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(step))
    return w[:, :-1], w[:, 1:]


def _train(sp: bool, data: str = "none") -> float:
    """5 AdamW steps at tp=2 (``data="fsdp"``: inside fsdp=2, each fsdp rank on its half of the
    batch) next to one process (`oracle.train_against_one_process`, on every rank): the logits at
    the first step and every gathered parameter at the end; returns the largest difference relative
    to each tensor's largest entry."""
    import plait

    mesh = cached_mesh(fsdp=2, tp=2) if data == "fsdp" else cached_mesh(tp=2)

    def plan(model: torch.nn.Module) -> plait.ParallelPlan:
        return plait.ParallelPlan(tp=plait.plan_for(model), sequence_parallel=sp, data=data)

    trained = train_against_one_process(lambda: build(positions="wpe"), _rows, mesh, plan, TOL,
                                        every_rank=True, label=f"sp={sp} {data}")
    attn = trained.model.transformer.h[0].attn  # the module plait split (wrapped by FSDP when data="fsdp")
    assert attn.n_head == 2 and attn.n_embd == 16
    full, want = trained.full, trained.oracle.state_dict()
    return max(float((full[k] - v).abs().max() / v.abs().max()) for k, v in want.items())


def _both() -> list[float]:
    return [_train(False), _train(True)]


def test_tp2_gives_attention_its_local_sizes(pools):
    assert all(max(r) < 1e-9 for r in pools[2].run(_both))


def test_a_width_taken_from_the_input_is_refused_by_name():
    import plait
    from plait.tp import check_plan

    model = build(width_from_input=True)
    with pytest.raises(ValueError, match=r"'transformer.h.0.attn' this rank's sizes: n_head=2, n_embd=16"):
        check_plan(model, plait.plan_for(model), tp=2)


def _fsdp_tp_both() -> list[float]:
    return [_train(False, "fsdp"), _train(True, "fsdp")]


def test_fsdp2_tp2_matches_single_process(pools):
    assert all(max(r) < 1e-9 for r in pools[4].run(_fsdp_tp_both))


def _pipelined() -> bool:
    """A 1F1B pipeline at pp=2 (the tied embedding on the first stage, the head on the last), 8
    sequences in 4 microbatches, 5 AdamW steps: the loss at every step, the gradients at the first
    and the parameters at the end (`oracle.train_pipeline_against_one_process`)."""
    from plait.pipeline import pipeline

    def batch(step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        w = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(step))
        return (w[:, :-1],), w[:, 1:]

    oracle = build(positions="wpe")
    pipe = pipeline(copy.deepcopy(oracle), cached_mesh(pp=2), split="auto", schedule="1f1b", microbatches=4,
                    loss_fn=loss64)
    train_pipeline_against_one_process(pipe, oracle, batch, loss64, TOL)
    return True


def test_pp2_1f1b_matches_single_process(pools):
    assert all(pools[2].run(_pipelined))
