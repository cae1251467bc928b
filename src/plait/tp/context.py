"""What every tensor-parallel style shares during one `tensor_parallel` call: the group, the
layout, the per-rank random stream and the gradient sums of replicated parameters; and the
`Style` base class whose methods receive them (the styles themselves: `plait.tp.styles`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.runtime import comm
from plait.runtime.rng import RNGFork
from plait.state.placement.records import add_grad_hook
from plait.state.placement.shards import ShardSpec


class SequenceShardGrads:
    """Sums, across the tp group, the gradients of replicated parameters that each rank applied
    to only part of the work: norm weights and row-parallel biases on sequence shards under SP,
    and key/value projections replicated for grouped-query attention with fewer KV heads than
    ranks (each rank's gradient comes from its own query heads only).

    The sum happens in the parameter's gradient hook, before autograd accumulates into
    ``.grad``: one small all-reduce per parameter, but every later hook (DDP or FSDP buckets
    on the data axes, gradient accumulation) sees the finished gradient. Batching them into one
    call at the end of backward would save those calls but hand data-parallel hooks a partial
    gradient first.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.watched: set[int] = set()  # ids of the parameters whose gradients are summed

    def watch(self, p: nn.Parameter) -> None:
        if id(p) in self.watched:
            return
        self.watched.add(id(p))
        add_grad_hook(p, self._sum)  # in its placement record too: FSDP registers it on its own leaf

    def _sum(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone(memory_format=torch.contiguous_format)  # autograd may share the buffer
        comm.all_reduce(grad, self.group)
        return grad


@dataclass
class TPContext:
    """What styles need to know about the call: the group, the layout and the whole plan.
    ``group`` is None only in `plait.tp.check_plan`'s layout trace, where no collective runs."""

    group: Any  # dist.ProcessGroup; None in a layout trace
    size: int
    rank: int
    sequence_parallel: bool
    rng: RNGFork
    seq_grads: SequenceShardGrads
    assigned: dict[str, Style] = field(default_factory=dict)  # module name -> style


class Style:
    """Base class of tensor-parallel styles (the protocol: `plait.tp.styles`)."""

    expects: tuple[type[nn.Module], ...] = (nn.Module,)

    def validate(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        if not isinstance(mod, self.expects):
            wanted = " or ".join(t.__name__ for t in self.expects)
            raise ValueError(f"plan: {self!r} applies to {wanted} modules, but {name!r} is a "
                             f"{type(mod).__name__}")

    def shard_specs(self, mod: nn.Module, ctx: TPContext) -> dict[str, ShardSpec]:
        return {}

    def is_unit(self) -> bool:
        """Whether the numeric plan check runs the module as one unit when no module enclosing it
        has a style (`plait.tp.numeric.units`); False where the style only marks a span of
        modules, whose own styled modules are then the units."""
        return True

    def install(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        pass
