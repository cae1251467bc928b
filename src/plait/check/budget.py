"""Error budgets: how far a correct layout may drift from one process in a given dtype.

A layout computes the same sums as one process, split and ordered differently: a data-parallel
gradient is a sum of per-rank partial sums, a tensor-parallel matmul a sum of per-rank partial
products. Two evaluation orders of a sum of ``k`` terms in unit roundoff ``u`` differ by about
``u * sqrt(k)`` of the terms' size (the probabilistic rounding bound: errors of independent
roundings add in quadrature), and the difference carries into every later step.

So a tensor's budget, relative to its largest value, is::

    SAFETY * (u * sqrt(parts) + u_acc * sqrt(terms)) * (1 + steps)

* ``u``: the unit roundoff of the dtype the model computes in (half its machine epsilon);
* ``parts``: how many partial results are rounded to that dtype and summed, at most the world
  size (each rank's share of a gradient, of a matmul, of a sequence);
* ``u_acc`` and ``terms``: the sums themselves, accumulated in float32 for bfloat16 and float16
  (what CPU kernels and GPU tensor cores do) and in the dtype itself otherwise; ``terms`` is the
  longest sum in the model, the tokens of the global batch times its widest dimension;
* ``steps``: the training steps taken: every step's difference is carried into the next;
* ``SAFETY``: how far the conditioning of a sum (cancellation) and its path through the model
  may amplify rounding: correct layouts of the built-in GPT measured at most a quarter of the
  budget in each dtype (`tests/test_faults.py`).

A layout bug moves a tensor by a part of itself (a gradient divided by 3 instead of 2, another
rank's block): above the budget in float32 by two orders of magnitude or more. In bfloat16 and
float16 one rounding is already 2e-3 to 4e-3 of a value, so a bug smaller than the budget (a
padding column in a softmax over 64 classes, 3e-3 of the loss) cannot be told from rounding in
that dtype, and float64 stays the default for layout proofs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

SAFETY = 8.0
# Where a dtype's sums accumulate: matmuls and reductions of the half types run in float32 on
# CPUs and in GPU tensor cores, then round once to the half type.
ACCUMULATES_IN = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon: the largest relative error of one rounding to ``dtype``."""
    return torch.finfo(dtype).eps / 2


def longest_sum(model: nn.Module, tokens: int) -> int:
    """The number of terms of the longest sum in a step of ``model`` on ``tokens`` tokens: a weight's
    gradient sums over every token, a matmul over its input width, the loss over the vocabulary;
    the product bounds any one chain of them."""
    widest = max((max(p.shape) for p in model.parameters() if p.dim() >= 2), default=1)
    return max(1, tokens) * widest


@dataclass(frozen=True)
class Budget:
    """The error budget of a check: its dtype, how its sums are split and how long they are."""

    dtype: torch.dtype
    parts: int  # partial results rounded and summed: the world size
    terms: int  # the longest sum (`longest_sum`)

    def tolerance(self, steps: int) -> float:
        """The largest relative difference a correct layout may show after ``steps`` steps (0: the
        initial values and the first forward)."""
        u = unit_roundoff(self.dtype)
        u_acc = unit_roundoff(ACCUMULATES_IN.get(self.dtype, self.dtype))
        return SAFETY * (u * math.sqrt(self.parts) + u_acc * math.sqrt(self.terms)) * (1 + steps)

    def describe(self) -> str:
        return (f"the error budget {SAFETY:g} (u sqrt(parts) + u_acc sqrt(terms)) (1 + step): "
                f"{str(self.dtype).removeprefix('torch.')} u {unit_roundoff(self.dtype):.1e}, "
                f"{self.parts} parts, {self.terms} terms")


def tolerance_of(fixed: float | None, dtype: torch.dtype, model: nn.Module, tokens: int,
                 world: int) -> tuple[Callable[[int], float], str]:
    """A check's tolerance per step, and how it was derived: ``fixed`` when given, else the error
    budget of ``model`` in ``dtype`` on ``world`` ranks and ``tokens`` tokens per step."""
    if fixed is not None:
        return (lambda _step: fixed), ""
    budget = Budget(dtype, world, longest_sum(model, tokens))
    return budget.tolerance, budget.describe()
