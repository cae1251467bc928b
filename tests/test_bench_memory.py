"""The memory benchmark's CPU tracker and its activation formula, in one process (no ranks).

`bench.live_memory.LiveStorageBytes` must count known allocations, frees, storage resizes and
tensors that only autograd holds exactly; `bench.memory_theory.plait_block` must equal what a plait
GPT block keeps for backward, measured by that tracker, under each checkpointing policy.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is a package beside src/, not installed
    sys.path.insert(0, str(ROOT))

from bench.live_memory import LiveStorageBytes  # noqa: E402
from bench.memory_theory import Shape, korthikanti, plait_block  # noqa: E402


def test_counts_known_allocations_and_frees_exactly():
    with LiveStorageBytes() as m:
        a = torch.empty(1000, dtype=torch.float32)
        m.mark("a")
        del a
        b = torch.empty(3000, dtype=torch.uint8)
        v = b[10:]  # a view: no new storage
        m.mark("b")
        del b, v
        m.mark("none")
    s = m.start
    assert m.marks == [("a", s + 4000), ("b", s + 3000), ("none", s)]
    assert m.peak == s + 4000


def test_resized_storage_counts_its_current_size():
    t = torch.empty(1000, dtype=torch.float32)
    with LiveStorageBytes() as m:
        before = m.start
        t.untyped_storage().resize_(0)  # how FSDP frees a gathered parameter
        m.mark("freed")
        t.untyped_storage().resize_(8000)  # and gathers it again: seen when an op touches it
        t.view(torch.uint8).zero_()
        m.mark("regrown")
    assert m.marks == [("freed", before - 4000), ("regrown", before + 4000)]
    assert m.peak == before + 4000


def test_tensors_saved_for_backward_count_until_backward_frees_them():
    x = torch.randn(256, requires_grad=True)
    with LiveStorageBytes() as m:
        y = x.exp()  # exp saves its result for backward
        z = y.sum()
        del y  # Python lets go; autograd still holds it
        m.mark("forward")
        z.backward()
        m.mark("backward")
    s = m.start
    assert m.marks == [("forward", s + 1024 + 4), ("backward", s + 4 + 1024)]  # x.grad replaced y
    # During backward: y (saved), z, the seed gradient of z, and x's gradient at once.
    assert m.peak == s + 1024 + 4 + 4 + 1024


def _block_deltas(policy: str | None, dtype: str) -> tuple[list[int], Shape]:
    import plait
    from plait.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(seq_len=32, d_model=64, n_layers=3, n_heads=4, dropout=0.1)
    model = plait.init_weights(GPT(cfg), 0)
    if policy is not None:
        plait.activation_checkpointing(model, policy)
    if dtype == "bf16":
        plait.mixed_precision(model, "bf16")
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with LiveStorageBytes() as m:
        def entry(*_: object) -> None:  # a pre-hook's return value would replace the input
            m.mark("entry")

        hooks = [mod.register_forward_pre_hook(entry) for mod in (*model.layers, model.norm)]
        model(x).float().sum().backward()
    for h in hooks:
        h.remove()
    vals = [v for _, v in m.marks]
    assert cfg.d_ff is not None and cfg.n_kv_heads is not None
    shape = Shape(s=cfg.seq_len, b=2, h=cfg.d_model, a=cfg.n_heads, kv=cfg.n_kv_heads, f=cfg.d_ff,
                  e=2 if dtype == "bf16" else 4, rng=torch.get_rng_state().numel())
    return [b - a for a, b in zip(vals, vals[1:])], shape


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("policy", [None, "full", "selective"])
def test_plait_block_formula_equals_the_measured_bytes(policy, dtype):
    deltas, shape = _block_deltas(policy, dtype)
    want = sum(v for _, v in plait_block(shape, policy))
    assert deltas == [want] * len(deltas), (deltas, want, plait_block(shape, policy))


def test_korthikanti_formula_values():
    x = Shape(s=128, b=4, h=256, a=8, kv=8, f=688)
    sbh = 128 * 4 * 256
    assert korthikanti(x, None) == sbh * (34 + 5 * 8 * 128 / 256)
    assert korthikanti(x, "full") == 2 * sbh
    tp = dataclasses.replace(x, t=2)
    assert korthikanti(tp, None) == sbh * (10 + 24 / 2 + 5 * 8 * 128 / (256 * 2))
    assert korthikanti(dataclasses.replace(tp, sp=True), None) == korthikanti(x, None) / 2
    assert korthikanti(dataclasses.replace(tp, sp=True), "selective") == 34 * sbh / 2
