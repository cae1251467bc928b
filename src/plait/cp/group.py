"""The context-parallel group as the attention algorithms see it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from plait.cp.layout import Layout
from plait.runtime import comm
from plait.runtime.mesh import Mesh


class Whole:
    """Whether a context-parallel model runs on whole sequences just now: the numeric check's
    reference run (`plait.cp.numeric`), in which every rank computes the whole sequence as one
    process would, its attention and positions left as the model's own."""

    def __init__(self) -> None:
        self.on = False

    @contextmanager
    def __call__(self) -> Iterator[None]:
        self.on = True
        try:
            yield
        finally:
            self.on = False


@dataclass(frozen=True)
class CPGroup:
    """The ranks sharing one sequence: their process group, global ranks (by cp index) and this
    rank's index."""

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    rank: int
    whole: Whole = field(default_factory=Whole, compare=False, repr=False)

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

    def unshard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The full sequence from every cp rank's shard ``t`` along ``dim`` (an all-gather; not
        differentiable)."""
        layout = self.layout(t.shape[dim] * self.size)
        flag = t.dtype == torch.bool  # gathered as bytes: not every backend reduces or gathers bools
        moved = (t.to(torch.uint8) if flag else t).movedim(dim, 0).contiguous()
        out = moved.new_empty((self.size, *moved.shape))
        comm.all_gather_into(out.view(-1), moved.view(-1), self.group)
        full = layout.unshard([p.movedim(0, dim) for p in out], dim=dim)
        return full.bool() if flag else full
