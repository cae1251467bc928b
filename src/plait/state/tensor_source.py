"""Full tensors that are read on demand: what `plait.load_full_state_dict` accepts besides tensors.

A layout that keeps only a part of a tensor (a tensor-parallel shard, an FSDP slice) asks its
source for the rows that hold that part, so a rank loading weights from a file reads its own
rows, not the whole tensor. A `TensorSource` is anything with ``shape`` and
``narrow(dim, start, length)`` returning a tensor (a ``torch.Tensor`` is one), plus ``read()``
for the whole tensor; `plait.app.weights` gives safetensors files this form.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

__all__ = ["TensorSource"]


class TensorSource(Protocol):
    """A full tensor not read yet: its shape, and any block of rows on request."""

    @property
    def shape(self) -> torch.Size: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows ``[start, start + length)`` along ``dim``, read now."""
        ...

    def read(self) -> torch.Tensor:
        """The whole tensor, read now."""
        ...


FullValue = torch.Tensor | TensorSource  # what a full state dict's values may be


def whole(value: FullValue) -> torch.Tensor:
    """``value`` as a tensor (a source is read whole)."""
    return value if isinstance(value, torch.Tensor) else value.read()


def flat_range(value: FullValue, lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of ``value`` flattened, reading only the dim-0 rows that hold them
    (FSDP's slice of a tensor is such a range)."""
    shape = value.shape
    if isinstance(value, torch.Tensor) or len(shape) == 0 or lo >= hi:
        return whole(value).reshape(-1)[lo:hi]
    row = math.prod(shape[1:])
    first, last = lo // row, -(-hi // row)
    rows = value.narrow(0, first, last - first).reshape(-1)
    return rows[lo - first * row : hi - first * row]
