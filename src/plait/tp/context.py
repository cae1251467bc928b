"""What every tensor-parallel style shares during one `tensor_parallel` call: the group, the
layout, the per-rank random stream and the gradient sums of replicated parameters; and the
`Style` base class whose methods receive them (the styles themselves: `plait.tp.styles`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait import comm
from plait.tp.shards import ShardSpec

__all__ = ["RNGFork", "SequenceShardGrads", "Style", "TPContext"]


class RNGFork:
    """A second random stream, seeded differently on every tp rank, swapped in around the
    regions whose activations are *sharded* (attention heads; the sequence under SP).

    Outside those regions the default generator runs, which `tensor_parallel` synchronizes
    across the tp group, so replicated activations get the same dropout mask on every rank
    while sharded ones get independent masks (Megatron's RNG tracker, section 3 of the paper).
    Nesting is allowed: only the outermost region swaps states. ``pause`` hands the rest of the
    outermost region back to the default stream: a row-parallel layer calls it after its
    all-reduce, when what follows inside the region (GPT-2's residual dropout) is replicated.
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._device = device
        with torch.random.fork_rng(devices=[device] if self._cuda else []):
            torch.manual_seed(seed)
            self._state = self._get()
        self._saved: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._depth = 0
        self._paused = False

    def _get(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.get_rng_state(), torch.cuda.get_rng_state(self._device) if self._cuda else None

    def _set(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.set_rng_state(state[0])
        if self._cuda and state[1] is not None:
            torch.cuda.set_rng_state(state[1], self._device)

    @property
    def active(self) -> bool:
        """Whether the per-rank stream is the one running now."""
        return self._depth > 0 and not self._paused

    @torch.compiler.disable  # swaps generator states: eager, between graphs
    def enter(self, *_: Any) -> None:
        if self._depth == 0:
            self._saved = self._get()
            self._set(self._state)
        self._depth += 1

    @torch.compiler.disable  # swaps generator states: eager, between graphs
    def exit(self, *_: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            if not self._paused and self._saved is not None:
                self._state = self._get()
                self._set(self._saved)
            self._saved, self._paused = None, False

    @torch.compiler.disable  # swaps generator states: eager, between graphs
    def pause(self) -> None:
        """Run the default stream until the outermost region exits (no-op outside regions)."""
        if self.active and self._saved is not None:
            self._state = self._get()
            self._set(self._saved)
            self._paused = True

    @property
    def entered(self) -> bool:
        """Whether a region is running (its stream swapped in, or paused)."""
        return self._depth > 0

    # Activation checkpointing recomputes a block in backward: its regions must draw what they
    # drew in forward, and the stream must then continue as if nothing had been recomputed.
    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The per-rank stream's state between regions (the next region starts from it)."""
        if self._depth:
            raise RuntimeError("RNGFork.snapshot inside a region: the stream's state is the default "
                               "generator's until the region exits")
        return self._state

    def restore(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        """Make the next region start from ``state`` (a `snapshot`)."""
        if self._depth:
            raise RuntimeError("RNGFork.restore inside a region")
        self._state = state


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
        p.register_hook(self._sum)
        # Also listed on the parameter, so FSDP (which replaces it) registers it on its leaf.
        hooks = getattr(p, "_plait_grad_hooks", None)
        if hooks is None:
            hooks = []
            p._plait_grad_hooks = hooks  # type: ignore[attr-defined]
        hooks.append(self._sum)

    def _sum(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone(memory_format=torch.contiguous_format)  # autograd may share the buffer
        comm.all_reduce(grad, self.group)
        return grad


@dataclass
class TPContext:
    """What styles need to know about the call: the group, the layout and the whole plan.
    ``group`` is None only in `plait.tp.check_plan`'s dry run, where no collective runs."""

    group: Any  # dist.ProcessGroup; None in a dry run
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

    def install(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        pass
