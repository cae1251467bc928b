"""How a tensor-parallel parameter is split: which rows of which dimension each tp rank holds.

Styles answer ``shard_specs`` with these (`plait.tp.styles`); materialization, the checkpoint
layout (`plait.state.placement.state`) and the layout trace read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from plait.state.tensor_source import FullValue


@dataclass(frozen=True)
class ShardSpec:
    """Rank ``rank`` holds rows ``[start, start + local)`` of dim ``dim`` of a tensor whose full
    size there is ``full``. When ``tp * local > full`` the tail is zero padding (only the
    vocabulary styles allow it), so the rows this rank really owns are ``valid``.

    A fused tensor (``parts``: the full sizes of the tensors concatenated along ``dim``, e.g.
    q, k and v) is split part by part: the rank holds its slice of every part, in order
    (`pieces`), so its local tensor is the fused layout of its own shards."""

    dim: int
    full: int
    local: int
    rank: int
    parts: tuple[int, ...] = ()

    @property
    def start(self) -> int:
        return self.rank * self.local

    @property
    def valid(self) -> int:
        return max(0, min(self.local, self.full - self.start))

    @property
    def contiguous(self) -> bool:
        """Whether the rank's rows are one block of the full tensor (not a fused split)."""
        return len(self.parts) < 2

    def pieces(self) -> list[tuple[int, int]]:
        """(first row in the full tensor, rows) of each block this rank holds, in its order."""
        if self.contiguous:
            return [(min(self.start, self.full), self.valid)]
        n = self.full // self.local
        out, offset = [], 0
        for p in self.parts:
            out.append((offset + self.rank * (p // n), p // n))
            offset += p
        return out

    def take(self, full: FullValue, dim: int | None = None) -> torch.Tensor:
        """This rank's (zero-padded) slice of ``full`` along ``dim`` (default: the spec's); a
        `plait.state.tensor_source.TensorSource` is asked for this rank's rows only."""
        d = self.dim if dim is None else dim
        blocks = [full.narrow(d, s, k) for s, k in self.pieces()]
        if not self.contiguous:
            return torch.cat(blocks, dim=d)
        if self.valid == self.local:
            return blocks[0].clone()
        shape = list(full.shape)
        shape[d] = self.local - self.valid
        pad = torch.zeros(shape, dtype=blocks[0].dtype, device=blocks[0].device)
        return torch.cat([blocks[0], pad], dim=d)


def make_spec(dim: int, full: int, n: int, rank: int, unit: int = 1,
              parts: tuple[int, ...] = ()) -> ShardSpec:
    """Split ``full`` rows into ``n`` equal shards made of whole ``unit``s (padding the end), or,
    with ``parts``, each part into ``n`` equal slices (callers check divisibility)."""
    if parts:
        return ShardSpec(dim=dim, full=full, local=full // n, rank=rank, parts=tuple(parts))
    local = math.ceil(full / (n * unit)) * unit
    return ShardSpec(dim=dim, full=full, local=local, rank=rank)
