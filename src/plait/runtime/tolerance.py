"""The bound a numeric check holds a layout to: what rounding allows, and no more.

A layout's checks (tensor parallelism's units, context parallelism's first forward) compare the
same computation run whole and split, on the same values. Splitting changes only the order of
sums: in float64 a few ulps per operation, ~1e-13 after a block's reductions, so a tensor passes
when its largest difference is at most `RTOL` = 1e-8 of the reference's largest entry. A run
that computes in a lower precision anywhere (a float32 norm inside a float64 model, bf16 mixed
precision) is held to 256 eps of the lowest floating dtype it produced (float32: 3e-5), capped
at 5%. A wrong layout moves results by O(1) of their size, far past either bound.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

RTOL = 1e-8
_CAP = 0.05


class LowestPrecision(TorchFunctionMode):
    """Records the lowest floating precision any operation run under it produced; `rtol` is
    the bound for results computed at it."""

    def __init__(self) -> None:
        super().__init__()
        self.eps = torch.finfo(torch.float64).eps

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.eps = max(self.eps, torch.finfo(t.dtype).eps)
        return out

    def rtol(self) -> float:
        return _rtol(self.eps)


def rtol_for(dtypes: Iterable[torch.dtype]) -> float:
    """The bound for results computed in ``dtypes`` (the least precise floating one counts)."""
    return _rtol(max((torch.finfo(d).eps for d in dtypes if d.is_floating_point),
                     default=torch.finfo(torch.float64).eps))


def _rtol(eps: float) -> float:
    return max(RTOL, min(_CAP, 256 * eps)) if eps > torch.finfo(torch.float64).eps else RTOL
