"""Proof that `plait check` finds layout bugs: each test-only fault switch (`plait.faults`) against
the smallest layout that exposes it fails the check and is named where it lives; the same layout
without the switch passes, so each switch is what the check sees.

Tiny float64 GPTs, 2 ranks of the shared pool, one SGD step each. The factories live here so the
one-process run can import them (``test_faults:...`` inside pytest's rank pool).
"""

from __future__ import annotations

import pytest
from torch import nn

from plait.models.gpt import GPT, GPTConfig

TINY = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)
PADDED = GPTConfig(vocab_size=63, seq_len=16, d_model=32, n_layers=2, n_heads=4)  # tp=2 pads a row
TIED = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, tie_embeddings=True)
MOE = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, d_ff=32, n_experts=4, top_k=2)


def tiny_gpt() -> nn.Module:
    return GPT(TINY)


def padded_gpt() -> nn.Module:
    return GPT(PADDED)


def tied_gpt() -> nn.Module:
    return GPT(TIED)


def moe_gpt() -> nn.Module:
    return GPT(MOE)


def _layout(fault: str):
    """The model and the smallest layout that exposes ``fault``: (factory, mesh degrees, plan)."""
    from plait.models.plans import gpt_plan
    from plait.parallelize import ParallelPlan

    pipe = ParallelPlan(data="none", pp_schedule="gpipe", pp_microbatches=2)
    return {
        "ddp-divisor": (tiny_gpt, {"dp": 2}, ParallelPlan()),
        "tp-backward-all-reduce": (tiny_gpt, {"tp": 2}, ParallelPlan(data="none")),
        "tp-vocab-padding": (padded_gpt, {"tp": 2}, ParallelPlan(data="none", tp=gpt_plan(PADDED))),
        "pp-recv-order": (tiny_gpt, {"pp": 2}, pipe),
        "fsdp-reduce-scatter-shard": (tiny_gpt, {"fsdp": 2}, ParallelPlan(data="fsdp")),
        "pp-tied-grad": (tied_gpt, {"pp": 2}, pipe),
        "ep-expert-divisor": (moe_gpt, {"dp": 2, "ep": 2}, ParallelPlan()),
        "cp-ring-grad": (tiny_gpt, {"cp": 2}, ParallelPlan(cp="ring")),
    }[fault]


# What the check names for each fault, as measured: (the divergence's kind, its module, its parameter).
# The loss itself has no module: "" is the model's output.
NAMED = {
    "ddp-divisor": ("gradient", "lm_head", "lm_head.weight"),
    "tp-backward-all-reduce": ("gradient", "norm", "norm.weight"),
    "tp-vocab-padding": ("loss", "", "lm_head.weight"),
    "pp-recv-order": ("activation", "layers.1.attn_norm", "layers.1.attn_norm.weight"),
    "fsdp-reduce-scatter-shard": ("gradient", "lm_head", "lm_head.weight"),
    "pp-tied-grad": ("gradient", "lm_head", "lm_head.weight"),
    "ep-expert-divisor": ("gradient", "layers.1.mlp.experts.3.down_proj",
                          "layers.1.mlp.experts.3.down_proj.weight"),
    "cp-ring-grad": ("gradient", "layers.1.attn.v_proj", "layers.1.attn.v_proj.weight"),
}


def _checks_in_job():
    """Every fault's layout checked with the fault and without it, one step each, one reference
    process for all of them."""
    import plait
    from plait import faults
    from plait.testing import cached_mesh

    out = {}
    with plait.check.shared_reference():
        for fault in NAMED:
            factory, mesh, plan = _layout(fault)
            runs = []
            for on in ((fault,), ()):
                with faults.inject(*on):
                    runs.append(plait.check(factory, plan, mesh=cached_mesh(**mesh), steps=1, batch_size=4))
            out[fault] = tuple(runs)
    return out


@pytest.fixture(scope="module")
def reports(pools):
    return pools[2].run(_checks_in_job)[0]


def test_every_fault_has_a_layout():
    from plait import faults

    assert sorted(NAMED) == sorted(faults.FAULTS)


@pytest.mark.parametrize("fault", list(NAMED))
def test_the_check_finds_and_names_each_injected_bug(reports, fault):
    bad, good = reports[fault]
    # Without the switch the same layout matches one process at rounding level: the switch is what
    # the check sees, and the check of this layout is one that can fail.
    assert good.ok, good.format()
    assert all(d.rel < 1e-11 for d in good.steps[0].grads.values()), good.format()
    assert good.steps[0].compared > 0, good.format()
    assert not bad.ok and bad.first is not None, bad.format()
    assert (bad.first.kind, bad.first.module, bad.first.parameter) == NAMED[fault], bad.format()
    assert bad.first.step == 1 and bad.first.rel > 1e-3, bad.format()
    assert "FAILED" in bad.format()


def test_what_each_fault_leaves_right(reports):
    # The named tensor is where the bug is, not only the first of many that differ.
    grads = {f: reports[f][0].steps[0].grads for f in NAMED}
    tol = reports["ddp-divisor"][0].tolerance
    # DDP's divisor 3 for 2: every gradient is 2/3 of the right one.
    assert all(abs(d.rel - 1 / 3) < 1e-6 for d in grads["ddp-divisor"].values() if d.abs > 0)
    # The all-reduce dropped is of lm_head's input: lm_head's own gradient is right, the norm's is not.
    assert not grads["tp-backward-all-reduce"]["lm_head.weight"].over(tol)
    # Expert gradients twice the right ones (two replicas, not divided); the dense ones untouched.
    for name, d in grads["ep-expert-divisor"].items():
        assert d.over(tol) == (".experts." in name and d.abs > 0), name
    assert any(abs(d.rel - 1) < 1e-6 for d in grads["ep-expert-divisor"].values())
    # A receive swapped on stage 1: its own forward is wrong, stage 0's outputs are right.
    assert reports["pp-recv-order"][0].first.rank == 1
    # The wrong key/value block gradient reaches k and v of the last layer, never q.
    cp = grads["cp-ring-grad"]
    assert cp["layers.1.attn.k_proj.weight"].over(tol) and not cp["layers.1.attn.q_proj.weight"].over(tol)
    # The tied weight keeps one stage's share: wrong; the loss and forward are right.
    tied = reports["pp-tied-grad"][0].steps[0]
    assert tied.grads["lm_head.weight"].over(tol) and not tied.loss_rel > tol


def test_faults_are_off_unless_injected():
    from plait import faults

    assert not any(faults.active(f) for f in faults.FAULTS)
    with faults.inject("ddp-divisor"):
        assert faults.active("ddp-divisor")
    assert not faults.active("ddp-divisor")
    with pytest.raises(ValueError, match="unknown faults"), faults.inject("no-such-fault"):
        pass
