"""Which tokens of a sequence each context-parallel rank holds.

The sequence is cut into ``2 * cp`` chunks and rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r`` (the "zigzag" layout). Under a causal mask a query attends to every key
before it, so the work of a chunk grows with its position: pairing an early chunk with a late
one gives every rank the same work (rank 0 of cp=2 holds chunks 0 and 3, rank 1 chunks 1 and 2).

When the length does not divide into ``2 * cp`` equal chunks, the first ``len % (2 * cp)``
chunks are one token longer (as `torch.tensor_split` cuts), so ranks may hold lengths that
differ by up to two; every rank knows every rank's lengths from the layout alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Span:
    """Tokens ``start .. start + length - 1`` of the full sequence."""

    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Layout:
    """The zigzag split of ``seq_len`` tokens over ``size`` ranks, seen from ``rank``."""

    seq_len: int
    size: int
    rank: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"Layout: rank {self.rank} is not in a context-parallel group of {self.size}")
        if self.seq_len < 2 * self.size:
            raise ValueError(f"context parallelism over cp={self.size} cuts the sequence into "
                             f"{2 * self.size} chunks, two per rank; a sequence of {self.seq_len} tokens is "
                             "too short")

    @property
    def chunks(self) -> tuple[Span, ...]:
        """The ``2 * size`` chunks in sequence order (computed each time, a few integers: a
        cached property would write to the frozen instance, which torch.compile cannot trace)."""
        n = 2 * self.size
        base, extra = divmod(self.seq_len, n)
        spans, start = [], 0
        for i in range(n):
            length = base + (i < extra)
            spans.append(Span(start, length))
            start += length
        return tuple(spans)

    def spans(self, rank: int | None = None) -> tuple[Span, Span]:
        """The two chunks ``rank`` (default: this rank) holds, in the order it holds them."""
        r = self.rank if rank is None else rank
        return self.chunks[r], self.chunks[2 * self.size - 1 - r]

    def local_len(self, rank: int | None = None) -> int:
        return sum(s.length for s in self.spans(rank))

    @property
    def even(self) -> bool:
        """Whether every rank holds the same number of tokens."""
        return self.seq_len % (2 * self.size) == 0

    def positions(self, rank: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of the tokens ``rank`` holds, in its local order."""
        return torch.cat([torch.arange(s.start, s.end, device=device) for s in self.spans(rank)])

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a full-sequence tensor (a copy, contiguous)."""
        if t.shape[dim] != self.seq_len:
            raise ValueError(f"Layout.shard: dimension {dim} of a {tuple(t.shape)} tensor has {t.shape[dim]} "
                             f"entries, not the {self.seq_len} tokens of the layout")
        return torch.cat([t.narrow(dim, s.start, s.length) for s in self.spans()], dim=dim)

    def unshard(self, parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The full-sequence tensor from every rank's shard (``parts[r]``: rank r's, in rank order)."""
        if len(parts) != self.size:
            raise ValueError(f"Layout.unshard needs {self.size} shards, one per rank; got {len(parts)}")
        pieces: list[tuple[int, torch.Tensor]] = []
        for r, part in enumerate(parts):
            first, second = self.spans(r)
            pieces.append((first.start, part.narrow(dim, 0, first.length)))
            pieces.append((second.start, part.narrow(dim, first.length, second.length)))
        return torch.cat([p for _, p in sorted(pieces, key=lambda x: x[0])], dim=dim)
