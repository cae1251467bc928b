"""Uneven inputs: DDP's side of torch's ``Join`` protocol (torch.distributed.algorithms.Join).

A rank that leaves the ``join`` block early keeps answering the collectives the ranks still
training issue in each step, in the same order: the sync count, the buffer broadcast, one
all-reduce of zeros per bucket, the flags. When every rank has left, every rank takes the
parameters and buffers of the last rank to join (torch: ``_sync_final_model``).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.algorithms.join import JoinHook

from plait.runtime import comm
from plait.runtime.comm import broadcast_coalesced
from plait.runtime.mesh import Mesh


class Joining(Protocol):
    """What the join hook needs of `plait.ddp.DistributedDataParallel` (which imports this module)."""

    mesh: Mesh
    module: nn.Module
    axis: Any
    group: Any
    world: int
    broadcast_buffers: bool
    _divisor: float
    _join_by_world: bool
    _buffers_due: bool

    def _sync_buffers(self, training: bool = True) -> None: ...
    def _shadow_backward(self) -> None: ...
    def _synced_params(self) -> list[torch.Tensor]: ...
    def _synced_buffers(self) -> list[torch.Tensor]: ...


def common_rank(ddp: Joining, candidate: bool) -> int:
    """The highest global rank among the candidates of ``ddp``'s group (torch's
    ``_find_common_rank``: the authority for buffers while joining, and for the final model)."""
    mine = torch.tensor([float(ddp.mesh.group_ranks(ddp.axis).index(ddp.mesh.global_rank) if candidate
                                else -1)], device=comm.device_of(ddp.group))
    with comm.operation("DDP join authority"):
        comm.all_reduce(mine, ddp.group, op=torch.distributed.ReduceOp.MAX)
    return ddp.mesh.group_ranks(ddp.axis)[int(mine.item())]


def step_counts(ddp: Joining, training: bool, sync: bool) -> tuple[float, float]:
    """(ranks still training, ranks whose backward reduces) in this step."""
    counts = torch.tensor([float(training), float(sync)], device=comm.device_of(ddp.group))
    with comm.operation("DDP join count"):
        comm.all_reduce(counts, ddp.group)
    return counts[0].item(), counts[1].item()


def mirror_layers(ddp: Joining) -> None:
    """Layers with collectives of their own (`plait.SyncBatchNorm`) mirror one step of the others.

    Here, after the sync count, as the others' forward comes after theirs; their groups are their
    own, so their backward's collectives need not be ordered with the buckets' (which the others
    launch without waiting)."""
    found = (getattr(x, "join_mirror", None) for x in ddp.module.modules())
    mirrors = {id(m): m for m in found if m is not None}
    for mirror in mirrors.values():
        mirror.shadow_step()


class DDPJoinHook(JoinHook):
    """Mirrors one step of the ranks still training (``main_hook``), then syncs the final model."""

    def __init__(self, ddp: Joining, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._join_by_world = divide_by_initial_world_size

    @torch.no_grad()
    def main_hook(self) -> None:
        ddp = self.ddp
        ddp._sync_buffers(training=False)
        _, syncing = step_counts(ddp, False, False)
        ddp._buffers_due = syncing > 0
        mirror_layers(ddp)
        if syncing > 0:
            ddp._shadow_backward()

    @torch.no_grad()
    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        src = common_rank(ddp, is_last_joiner)
        tensors = ddp._synced_params() + (ddp._synced_buffers() if ddp.broadcast_buffers else [])
        with comm.operation("DDP join final model"):
            broadcast_coalesced(tensors, src, ddp.group)
        ddp._divisor = float(ddp.world)
