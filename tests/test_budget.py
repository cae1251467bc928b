"""Error budgets (`plait.check.budget`): the tolerance a check derives from the dtype, the sums and
the steps, instead of a hand-set number. The layouts against it are in `tests/test_faults.py`:
every correct layout stays inside its float32 and bfloat16 budgets, every injected bug leaves its
float32 budget."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from plait.check.budget import SAFETY, Budget, longest_sum, tolerance_of, unit_roundoff


def test_unit_roundoff_is_half_the_epsilon_of_each_dtype():
    assert unit_roundoff(torch.float32) == 2.0 ** -24
    assert unit_roundoff(torch.bfloat16) == 2.0 ** -8
    assert unit_roundoff(torch.float16) == 2.0 ** -11
    assert unit_roundoff(torch.float64) == 2.0 ** -53


def test_the_budget_is_the_rounding_of_the_split_and_of_the_sums_grown_over_the_steps():
    fp32 = Budget(torch.float32, parts=2, terms=4096)
    u = 2.0 ** -24
    assert fp32.tolerance(0) == pytest.approx(SAFETY * (u * math.sqrt(2) + u * 64))
    assert fp32.tolerance(4) == pytest.approx(5 * fp32.tolerance(0))
    # bfloat16 sums accumulate in float32: its rounding is the parts', not the terms'.
    bf16 = Budget(torch.bfloat16, parts=2, terms=4096)
    assert bf16.tolerance(0) == pytest.approx(SAFETY * (2.0 ** -8 * math.sqrt(2) + u * 64))
    # More ranks and longer sums only widen it; float32's is below 1e-3 on the tiny GPT of a check.
    assert Budget(torch.float32, 4, 4096).tolerance(1) > fp32.tolerance(1)
    assert Budget(torch.float32, 2, 8192).tolerance(1) > fp32.tolerance(1)
    assert fp32.tolerance(5) < 1e-3 < 1 / 3  # a DDP divisor off by one moves gradients by 1/3


def test_longest_sum_is_the_tokens_times_the_widest_dimension():
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 128), nn.LayerNorm(128))
    assert longest_sum(model, tokens=4 * 16) == 64 * 128
    assert longest_sum(nn.LayerNorm(8), tokens=10) == 10  # no matrix: the tokens alone


def test_a_given_tolerance_is_used_as_is_and_says_no_budget():
    model = nn.Linear(8, 8)
    fixed, how = tolerance_of(1e-3, torch.float32, model, tokens=16, world=2)
    assert (fixed(0), fixed(7), how) == (1e-3, 1e-3, "")
    derived, how = tolerance_of(None, torch.float32, model, tokens=16, world=2)
    assert derived(3) == Budget(torch.float32, 2, 16 * 8).tolerance(3)
    assert "error budget" in how and "float32" in how


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_plait_check_takes_each_budgeted_dtype(dtype):
    pytest.importorskip("tyro")
    from plait.app.check import parse_args

    cfg = parse_args(["tests.test_faults:tiny_gpt", "--nproc", "2", "--dtype", dtype])
    assert (cfg.check.dtype, cfg.check.tolerance) == (dtype, None)


@pytest.mark.parametrize("dtype,mixed", [("bfloat16", None), ("float16", None), ("float64", "bf16")])
def test_moe_routing_in_a_half_type_is_refused_by_name(dtype, mixed):
    # Top-k routing flips on near ties between the layout and one process in bfloat16 (measured
    # 0.71 against a budget of 0.27 after 5 steps): no rounding budget bounds it.
    import plait
    from plait.check import CheckInputError
    from plait.models.gpt import GPT, GPTConfig

    def moe() -> nn.Module:
        return GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=1, n_heads=4, n_experts=4))

    plan = plait.ParallelPlan(mixed_precision=mixed) if mixed else None
    with pytest.raises(CheckInputError, match="routes tokens to experts.*check MoE layouts in float32"):
        plait.check(moe, plan, nproc=2, mesh={"dp": 2, "ep": 2}, dtype=dtype)
