"""Where each parameter of a flat group lives, and what every group of one FSDP wrapper shares.

A `Slot` is one original parameter's place: ``per`` rows of it on each rank (torch.chunk's rule,
the last chunks short or empty), its chunk at ``local_offset`` in this rank's shard and its
``N*chunk`` padded elements at ``offset`` in the gathered buffer (`plait.fsdp.flat` explains both
orders). `lay_out` assigns those numbers once, when the group is built; `ShardCfg` carries the
groups, dtypes and device the wrapper chose for all of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement


@dataclass
class Slot:
    """Where one original parameter lives: its owners (several when tied), its padded range of
    the gathered buffer and its chunk of the rank-major shard."""

    fqn: str
    shape: torch.Size
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)  # fqns of tied copies (state dicts list them)
    grad_hooks: list = field(default_factory=list)  # carried over from the original parameter
    offset: int = 0  # start of its N*chunk elements in ``buf`` (rank r's chunk at r*chunk)
    local_offset: int = 0  # start of its chunk in the shard
    per: int = 0  # rows per rank (padded)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def replicated(self) -> bool:
        return len(self.shape) == 0  # nothing to split: every rank holds it

    @property
    def rows(self) -> int:
        return self.shape[0] if len(self.shape) else 1

    @property
    def row(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def chunk(self) -> int:
        return self.per * self.row

    def rows_of(self, rank: int) -> tuple[int, int]:
        """The rows ``rank`` holds, ``[a, b)`` (a 0-d parameter: its one value, on every rank)."""
        if self.replicated:
            return 0, 1
        a = min(rank * self.per, self.rows)
        return a, min(a + self.per, self.rows)


# (device mesh, placements, global shape) of one slot's DTensor parameter.
Placing = Callable[[Slot], tuple[DeviceMesh, tuple[Placement, ...], torch.Size]]


@dataclass
class ShardCfg:
    """What every flat group of one FSDP wrapper shares."""

    stage: int
    group: dist.ProcessGroup  # the fsdp axis: shards live here
    dp_group: dist.ProcessGroup | None  # hybrid: replicas across dp
    world: int  # ranks on the fsdp axis
    rank: int
    replicas: int  # ranks on the dp axis
    device: torch.device  # where compute runs
    param_dtype: torch.dtype | None  # mixed precision compute dtype (None: keep)
    reduce_dtype: torch.dtype | None  # gradient reduction dtype (None: gradient's dtype)
    offload: bool
    placing: Placing | None = None  # set by the wrapper before the flats are built
    divide_factor: float | None = None  # reduced gradients are divided by this (None: the ranks' count)


def lay_out(slots: list[Slot], world: int) -> int:
    """Give every slot its rows per rank and offsets; returns the shard's size ``S``."""
    local = gathered = 0
    for s in slots:
        s.per = 1 if s.replicated else -(-s.rows // world)
        s.local_offset, s.offset = local, gathered
        local, gathered = local + s.chunk, gathered + world * s.chunk
    return local
