"""The context-parallel group as the attention algorithms see it."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from plait.cp.layout import Layout
from plait.mesh import Mesh

__all__ = ["CPGroup"]


@dataclass(frozen=True)
class CPGroup:
    """The ranks sharing one sequence: their process group, global ranks (by cp index) and this
    rank's index."""

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    rank: int

    @classmethod
    def of(cls, mesh: Mesh) -> CPGroup:
        return cls(mesh.group("cp"), tuple(mesh.group_ranks("cp")), mesh.rank("cp"))

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def next(self) -> int:
        """Global rank of the next rank on the ring."""
        return self.ranks[(self.rank + 1) % self.size]

    @property
    def prev(self) -> int:
        return self.ranks[(self.rank - 1) % self.size]

    def layout(self, seq_len: int) -> Layout:
        return Layout(seq_len, self.size, self.rank)

    def layout_of_local(self, local_len: int) -> Layout:
        """The layout whose even split gives this rank ``local_len`` tokens (what a model's
        attention sees: it knows only its local length)."""
        if local_len % 2:
            raise ValueError(f"context parallelism: this rank holds {local_len} tokens, but each rank holds "
                             "two equal chunks of the sequence; shard the inputs with plait.cp.shard, whose "
                             "sequence length must divide by 2 * cp")
        return Layout(local_len * self.size, self.size, self.rank)
