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
import torch.nn.functional as F
from nanogpt import build

from plait.testing import cached_mesh

TOL = {"rtol": 1e-9, "atol": 1e-12}


def _train(sp: bool, data: str = "none") -> float:
    """5 AdamW steps at tp=2 (``data="fsdp"``: inside fsdp=2, each fsdp rank on its half of the
    batch) next to one process; every gathered parameter compared at the end."""
    import plait

    fsdp = 2 if data == "fsdp" else 1
    mesh = cached_mesh(fsdp=2, tp=2) if fsdp > 1 else cached_mesh(tp=2)
    oracle = build(positions="wpe")
    model = copy.deepcopy(oracle)
    plan = plait.ParallelPlan(tp=plait.plan_for(model), sequence_parallel=sp, data=data)
    net = plait.parallelize(model, mesh, plan)
    opt_ref, opt = torch.optim.AdamW(oracle.parameters()), torch.optim.AdamW(net.parameters())
    mine = slice(mesh.rank("fsdp") * 4 // fsdp, (mesh.rank("fsdp") + 1) * 4 // fsdp)
    for step in range(5):
        w = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(step))
        idx, tgt = w[:, :-1], w[:, 1:]
        want, got = oracle(idx), net(idx[mine])
        if step == 0:
            torch.testing.assert_close(got, want[mine], **TOL)
        for logits, y, o in ((want, tgt, opt_ref), (got, tgt[mine], opt)):
            F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
            o.step()
            o.zero_grad()
    full = plait.full_state_dict(net)
    for name, ref in oracle.state_dict().items():
        torch.testing.assert_close(full[name], ref, **TOL, msg=lambda m, n=name: f"sp={sp} {data} {n}: {m}")
    attn = model.transformer.h[0].attn  # the module plait split (wrapped by FSDP when data="fsdp")
    assert attn.n_head == 2 and attn.n_embd == 16
    return max(float((full[k] - v).abs().max() / v.abs().max()) for k, v in oracle.state_dict().items())


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
    sequences in 4 microbatches, 5 AdamW steps."""
    from plait.pipeline import pipeline

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, -2), y.flatten())

    oracle = build(positions="wpe")
    pipe = pipeline(copy.deepcopy(oracle), cached_mesh(pp=2), split="auto", schedule="1f1b", microbatches=4,
                    loss_fn=loss_fn)
    mine = dict(pipe.named_parameters())
    opt, opt_ref = torch.optim.AdamW(mine.values()), torch.optim.AdamW(oracle.parameters())
    for step in range(5):
        w = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(step))
        x, y = w[:, :-1], w[:, 1:]
        loss, ref = pipe.step((x,), y), loss_fn(oracle(x), y)
        ref.backward()
        torch.testing.assert_close(loss, ref.detach(), **TOL)
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
    ref_params = dict(oracle.named_parameters(remove_duplicate=False))  # the tie under both names
    for name, p in mine.items():
        torch.testing.assert_close(p.detach(), ref_params[name].detach(), **TOL,
                                   msg=lambda m, n=name: f"{n}: {m}")
    return True


def test_pp2_1f1b_matches_single_process(pools):
    assert all(pools[2].run(_pipelined))
