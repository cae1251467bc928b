"""ZeRO stage 1 as an optimizer wrapper: each rank keeps the optimizer state of a share of the
parameters, steps those, and broadcasts them to the others.

For loops whose gradients are already averaged over the data-parallel group (a pipeline after
`plait.average_gradients`, or a DDP model) but whose modules cannot host FSDP's hooks: a
pipeline runs many backward passes per step, one per microbatch, and its gradients are only
complete after the last one. Partitioning is by whole parameters (balanced by size, the same
on every rank), so each rank's optimizer is the user's optimizer class on real parameters, and
checkpoints keep one key layout: the owner of a parameter writes its optimizer state.

What it saves, for Ψ parameters on N ranks with Adam (fp32): the two moment buffers, 8Ψ
bytes per rank, become 8Ψ/N. What it costs: after each step every parameter is broadcast from
its owner (Ψ elements per step, one flat broadcast per owner and dtype), on top of the
gradient all-reduce. Gradients stay full on every rank (stage 2 would shard them after the
reduction, which saves nothing while a pipeline accumulates them over microbatches).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.runtime.comm import broadcast_coalesced
from plait.state.placement.records import plain_leaf


def partition(sizes: list[int], world: int) -> list[int]:
    """Owner rank of each parameter: largest first to the least-loaded rank (ties: lowest rank,
    then the parameter's order), so every rank computes the same assignment."""
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda k: (load[k], k))
        owner[i] = r
        load[r] += sizes[i]
    return owner


class ZeroRedundancyOptimizer:
    """``optimizer_class(owned_params, **defaults)`` on this rank's share of ``params``.

    Use like the optimizer it wraps: ``step()`` (after the gradients were averaged over
    ``group``), ``zero_grad()``, ``param_groups`` (learning-rate schedules write through),
    ``state``. Every rank of ``group`` must pass the same parameters in the same order.
    """

    def __init__(self, params: Iterable[nn.Parameter], optimizer_class: type[torch.optim.Optimizer],
                 group: dist.ProcessGroup | None = None, **defaults: Any) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not isinstance(optimizer_class, type) or not issubclass(optimizer_class, torch.optim.Optimizer):
            raise TypeError(f"ZeroRedundancyOptimizer: optimizer_class must be a torch.optim.Optimizer "
                            f"subclass, got {optimizer_class!r}")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("ZeroRedundancyOptimizer: a parameter is listed twice")
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        # Sized, and broadcast, as the tensors held: a tp DTensor parameter's plain rows (`plain_leaf`).
        self.owner = partition([plain_leaf(p).numel() for p in self.params], self.world)
        # (global rank of the owner, its share), for the broadcasts after each step
        self._shares = [(dist.get_global_rank(group, r) if group is not None else r,
                         [p for p, o in zip(self.params, self.owner) if o == r]) for r in range(self.world)]
        self.owned = self._shares[self.rank][1]
        self.optimizer_class, self.defaults = optimizer_class, dict(defaults)
        # A rank may own nothing (more ranks than parameters): it keeps the hyper-parameters so a
        # schedule can still set them, and steps nothing.
        self.optimizer = optimizer_class(self.owned, **defaults) if self.owned else None
        self._idle_groups = [dict(defaults, params=[])]
        self._owned_ids = {id(p) for p in self.owned}

    # ------------------------------------------------------------------ torch.optim.Optimizer's face
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups if self.optimizer is not None else self._idle_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state if self.optimizer is not None else {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """Step this rank's parameters, then broadcast every parameter from its owner."""
        if self.optimizer is not None:
            self.optimizer.step()
        if self.world == 1:
            return
        for src, share in self._shares:
            if share:
                broadcast_coalesced([plain_leaf(p) for p in share], src, self.group)

    def owns(self, p: nn.Parameter) -> bool:
        """Whether this rank steps ``p`` (and keeps, and checkpoints, its optimizer state)."""
        return id(p) in self._owned_ids
