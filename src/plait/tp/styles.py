"""Tensor-parallel styles: how one module is split over the ``tp`` group and where it talks.

A style is a small frozen dataclass used as a value in a plan (module-name pattern -> style).
`plait.tp.apply` asks each style three things, in this order:

1. ``validate``: can this module be split this way? Raises ``ValueError`` naming the module,
   the style and the numbers, before any parameter is touched or any collective runs.
2. ``shard_specs``: which of the module's own parameters are split, along which dimension
   (`ShardSpec`); the rest stay replicated. Materialization itself is done centrally.
3. ``install``: hooks or a forward override that put the Megatron f / g operators (or their
   sequence-parallel all-gather / reduce-scatter) from `plait.comm` around the computation.

Sequence parallelism (Korthikanti et al. 2022) is a property of the whole call, not of a
style: every style reads ``ctx.sequence_parallel`` so that one plan serves both layouts.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from plait import comm
from plait.tp.collectives import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
)

__all__ = [
    "ShardSpec", "TPContext", "RNGFork", "SequenceShardGrads", "Style", "ColwiseParallel", "RowwiseParallel",
    "VocabParallelEmbedding", "VocabParallelOutput", "ParallelRegion", "SequenceParallel",
]


# ------------------------------------------------------------------ shards
def _size(mod: nn.Module, attr: str) -> int:
    """A layer's size attribute (``out_features``, ``num_embeddings``...), checked to be an int."""
    value = getattr(mod, attr)
    if not isinstance(value, int):
        raise TypeError(f"{type(mod).__name__}.{attr} is {value!r}, not a size")
    return value


def _set_size(mod: nn.Module, attr: str, value: int) -> None:
    """Record a layer's local size (what its forward and repr see after sharding)."""
    setattr(mod, attr, value)


@dataclass(frozen=True)
class ShardSpec:
    """Rank ``rank`` holds rows ``[start, start + local)`` of dim ``dim`` of a tensor whose full
    size there is ``full``. When ``tp * local > full`` the tail is zero padding (only the
    vocabulary styles allow it), so the rows this rank really owns are ``valid``."""

    dim: int
    full: int
    local: int
    rank: int

    @property
    def start(self) -> int:
        return self.rank * self.local

    @property
    def valid(self) -> int:
        return max(0, min(self.local, self.full - self.start))

    def take(self, full: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """This rank's (zero-padded) slice of ``full`` along ``dim`` (default: the spec's)."""
        d = self.dim if dim is None else dim
        part = full.narrow(d, min(self.start, self.full), self.valid)
        if self.valid == self.local:
            return part.clone()
        shape = list(full.shape)
        shape[d] = self.local - self.valid
        return torch.cat([part, full.new_zeros(shape)], dim=d)


def make_spec(dim: int, full: int, n: int, rank: int, unit: int = 1) -> ShardSpec:
    """Split ``full`` rows into ``n`` equal shards made of whole ``unit``s (padding the end)."""
    local = math.ceil(full / (n * unit)) * unit
    return ShardSpec(dim=dim, full=full, local=local, rank=rank)


# ------------------------------------------------------------------ randomness
class RNGFork:
    """A second random stream, seeded differently on every tp rank, swapped in around the
    regions whose activations are *sharded* (attention heads; the sequence under SP).

    Outside those regions the default generator runs, which `tensor_parallel` synchronizes
    across the tp group, so replicated activations get the same dropout mask on every rank
    while sharded ones get independent masks (Megatron's RNG tracker, section 3 of the paper).
    Nesting is allowed: only the outermost region swaps states.
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._device = device
        with torch.random.fork_rng(devices=[device] if self._cuda else []):
            torch.manual_seed(seed)
            self._state = self._get()
        self._saved: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._depth = 0

    def _get(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.get_rng_state(), torch.cuda.get_rng_state(self._device) if self._cuda else None

    def _set(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.set_rng_state(state[0])
        if self._cuda and state[1] is not None:
            torch.cuda.set_rng_state(state[1], self._device)

    def enter(self, *_: Any) -> None:
        if self._depth == 0:
            self._saved = self._get()
            self._set(self._state)
        self._depth += 1

    def exit(self, *_: Any) -> None:
        self._depth -= 1
        if self._depth == 0 and self._saved is not None:
            self._state = self._get()
            self._set(self._saved)
            self._saved = None


class SequenceShardGrads:
    """Sums, across the tp group, the gradients of replicated parameters applied to sequence
    shards (norm weights, row-parallel biases under SP): each rank's gradient covers only its
    positions.

    The sum happens in the parameter's gradient hook, before autograd accumulates into
    ``.grad``: one small all-reduce per parameter, but every later hook (DDP or FSDP buckets
    on the data axes, gradient accumulation) sees the finished gradient. Batching them into one
    call at the end of backward would save those calls but hand data-parallel hooks a partial
    gradient first.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def watch(self, p: nn.Parameter) -> None:
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
    """What styles need to know about the call: the group, the layout and the whole plan."""

    group: dist.ProcessGroup
    size: int
    rank: int
    sequence_parallel: bool
    rng: RNGFork
    seq_grads: SequenceShardGrads
    assigned: dict[str, Style] = field(default_factory=dict)  # module name -> style


# ------------------------------------------------------------------ helpers
def _check_seq(x: torch.Tensor, ctx: TPContext, where: str) -> None:
    """Sequence parallelism splits dim 1; say so plainly before a reduce-scatter would fail."""
    if x.dim() < 2 or x.shape[1] % ctx.size:
        raise ValueError(
            f"{where}: sequence parallelism splits dim 1 (the sequence) across tp={ctx.size}, "
            f"but the activation has shape {tuple(x.shape)}; use a sequence length divisible by {ctx.size}"
        )


def _reduce_out(y: torch.Tensor, ctx: TPContext, where: str) -> torch.Tensor:
    """g: sum the partial outputs of the tp ranks (reduce-scatter along the sequence under SP)."""
    if ctx.sequence_parallel:
        _check_seq(y, ctx, where)
        return reduce_scatter_to_sp(y, ctx.group, dim=1)
    return reduce_from_tp(y, ctx.group)


def _enter_parallel(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """f: a replicated (or, under SP, sequence-sharded) activation enters a tp-sharded region."""
    if ctx.sequence_parallel:
        return gather_from_sp(x, ctx.group, dim=1)
    return copy_to_tp(x, ctx.group)


def _first_tensor_pre_hook(fn: Callable[[torch.Tensor], torch.Tensor], name: str):
    def hook(_mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if not args or not isinstance(args[0], torch.Tensor):
            raise TypeError(f"{name}: the tensor-parallel input hook expects the activation as the "
                            f"first positional argument, got {[type(a).__name__ for a in args]}")
        return (fn(args[0]), *args[1:])

    return hook


def _in_region(name: str, ctx: TPContext) -> bool:
    """Whether a ParallelRegion encloses module ``name`` (the root has the empty name)."""
    parts = name.split(".")
    prefixes = (".".join(parts[:i]) for i in range(len(parts)))
    return any(isinstance(ctx.assigned.get(p), ParallelRegion) for p in prefixes)


# ------------------------------------------------------------------ styles
class Style:
    """Base class of tensor-parallel styles (see the module docstring for the protocol)."""

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


def _divisible(name: str, style: Style, what: str, size: int, unit: int, ctx: TPContext) -> None:
    if size % unit or (size // unit) % ctx.size:
        count = f"{size} {what}"
        if unit > 1:
            count = f"{size // unit} {what} ({size} features in units of {unit})"
        raise ValueError(f"plan: {style!r} on {name!r} cannot split {count} evenly across tp={ctx.size}")


@dataclass(frozen=True)
class ColwiseParallel(Style):
    """Linear layer split by *output* features: rank r computes its slice of the outputs.

    Input: replicated. With ``input_comm`` the layer applies f itself (forward identity,
    backward all-reduce of the input gradient; under SP forward all-gather of the sequence,
    backward reduce-scatter). Inside a `ParallelRegion` the region has already done that once
    for all its column-parallel layers, so use ``input_comm=False``.
    Output: left sharded on the last dim, or all-gathered with ``gather_output``.
    ``unit`` keeps groups of features together (a head's ``head_dim`` features); ``what``
    names them in errors (e.g. "attention heads").
    """

    gather_output: bool = False
    input_comm: bool = True
    unit: int = 1
    what: str = "output features"
    expects = (nn.Linear,)

    def validate(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        super().validate(mod, name, ctx)
        if not self.input_comm and not _in_region(name, ctx):
            raise ValueError(f"plan: {self!r} on {name!r} has input_comm=False, so its input must come "
                             "through a ParallelRegion on an enclosing module, but none encloses it")
        self._check_size(mod, name, ctx)

    def _check_size(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        _divisible(name, self, self.what, _size(mod, "out_features"), self.unit, ctx)

    def shard_specs(self, mod: nn.Module, ctx: TPContext) -> dict[str, ShardSpec]:
        spec = make_spec(0, _size(mod, "out_features"), ctx.size, ctx.rank, self.unit)
        return {"weight": spec, **({"bias": spec} if mod.bias is not None else {})}

    def install(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        full = _size(mod, "out_features")
        _set_size(mod, "out_features", self.shard_specs(mod, ctx)["weight"].local)
        if self.input_comm:
            mod.register_forward_pre_hook(_first_tensor_pre_hook(partial(_enter_parallel, ctx=ctx), name))
        if self.gather_output:
            def gather(_m: nn.Module, _a: Any, y: torch.Tensor) -> torch.Tensor:
                # Padding (vocabulary styles) is dropped after the gather.
                return gather_from_tp(y, ctx.group).narrow(-1, 0, full)

            mod.register_forward_hook(gather)


@dataclass(frozen=True)
class VocabParallelOutput(ColwiseParallel):
    """The output projection (lm_head) split by vocabulary, padded when tp does not divide it.

    With ``gather_output=False`` (the default) the logits stay sharded on the last dim and
    `plait.vocab_parallel_cross_entropy` computes the loss without ever forming the full
    logits; `plait.loss_fn_for(model)` returns that loss for the model.
    """

    what: str = "vocabulary entries"

    def _check_size(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        pass  # padded


@dataclass(frozen=True)
class RowwiseParallel(Style):
    """Linear layer split by *input* features: each rank computes a partial sum of the output.

    Input: already sharded on the last dim (``input_is_parallel``, the output of column-parallel
    layers), else scattered first (forward keeps this rank's slice, backward all-gathers).
    Output: g, all-reduced (forward all-reduce, backward identity) or, under SP,
    reduce-scattered along the sequence (backward all-gather). The bias is added once, after
    the reduction, and under SP its gradient is summed over the tp group after backward because
    each rank saw only its sequence shard.
    """

    input_is_parallel: bool = True
    unit: int = 1
    what: str = "input features"
    expects = (nn.Linear,)

    def validate(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        super().validate(mod, name, ctx)
        if self.input_is_parallel and not _in_region(name, ctx):
            raise ValueError(f"plan: {self!r} on {name!r} expects a sharded input, which only exists "
                             "inside a ParallelRegion, but none encloses it (or use input_is_parallel=False)")
        _divisible(name, self, self.what, _size(mod, "in_features"), self.unit, ctx)

    def shard_specs(self, mod: nn.Module, ctx: TPContext) -> dict[str, ShardSpec]:
        return {"weight": make_spec(1, _size(mod, "in_features"), ctx.size, ctx.rank, self.unit)}

    def install(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        _set_size(mod, "in_features", self.shard_specs(mod, ctx)["weight"].local)
        scatter = not self.input_is_parallel

        def forward(self_: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            if scatter:
                x = scatter_to_tp(x, ctx.group)
            y = _reduce_out(F.linear(x, self_.weight), ctx, name)
            return y if self_.bias is None else y + self_.bias

        mod.forward = types.MethodType(forward, mod)
        bias = mod.bias
        if ctx.sequence_parallel and isinstance(bias, nn.Parameter):
            ctx.seq_grads.watch(bias)


@dataclass(frozen=True)
class VocabParallelEmbedding(Style):
    """Embedding table split by vocabulary rows (padded when tp does not divide the vocabulary).

    Forward: each rank looks up the ids it owns, writes zeros for the others, and the partial
    embeddings are summed: all-reduce, or reduce-scatter along the sequence under SP (so the
    activation leaves sequence-sharded). Backward: identity (all-gather under SP); each rank's
    table receives gradient only for its own rows.
    """

    expects = (nn.Embedding,)

    def validate(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        super().validate(mod, name, ctx)
        unsupported = {k: getattr(mod, k) for k in ("padding_idx", "max_norm") if getattr(mod, k) is not None}
        if unsupported or mod.sparse or mod.scale_grad_by_freq:
            raise ValueError(f"plan: {self!r} on {name!r} supports plain lookups only; the embedding has "
                             f"{unsupported or 'sparse/scale_grad_by_freq'} set")

    def shard_specs(self, mod: nn.Module, ctx: TPContext) -> dict[str, ShardSpec]:
        return {"weight": make_spec(0, _size(mod, "num_embeddings"), ctx.size, ctx.rank)}

    def install(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        spec = self.shard_specs(mod, ctx)["weight"]
        _set_size(mod, "num_embeddings", spec.local)

        def forward(self_: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
            foreign = (ids < spec.start) | (ids >= spec.start + spec.valid)
            local = (ids - spec.start).masked_fill(foreign, 0)
            out = F.embedding(local, self_.weight).masked_fill(foreign.unsqueeze(-1), 0.0)
            return _reduce_out(out, ctx, name)

        mod.forward = types.MethodType(forward, mod)


@dataclass(frozen=True)
class ParallelRegion(Style):
    """A module whose body runs on tp-sharded features (attention over local heads, an MLP over
    local hidden units): its input enters once through f (forward identity, backward all-reduce;
    under SP forward all-gather of the sequence, backward reduce-scatter), shared by all the
    column-parallel layers inside. It must contain a RowwiseParallel layer that brings the
    activation back. ``fork_rng`` (default) runs the body on the per-rank random stream,
    because dropout there acts on different heads or hidden units on every rank.
    """

    fork_rng: bool = True

    def validate(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        inside = [s for n, s in ctx.assigned.items() if n.startswith(name + ".") or not name and n]
        if not any(isinstance(s, RowwiseParallel) for s in inside):
            raise ValueError(f"plan: {self!r} on {name!r} needs a RowwiseParallel layer inside it to "
                             "reduce the sharded activation, but the plan gives it none")

    def install(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        mod.register_forward_pre_hook(_first_tensor_pre_hook(partial(_enter_parallel, ctx=ctx), name))
        if self.fork_rng:
            mod.register_forward_pre_hook(ctx.rng.enter)
            mod.register_forward_hook(ctx.rng.exit, always_call=True)


@dataclass(frozen=True)
class SequenceParallel(Style):
    """Norms and dropouts between the tensor-parallel regions.

    Without sequence parallelism: nothing (they run replicated, on the synchronized default
    random stream). With it: the module runs on this rank's sequence shard, so no
    communication in forward; its replicated parameters' gradients are summed over the tp group
    after backward (each rank saw only its part of the sequence; see `SequenceShardGrads`),
    and randomness comes from the per-rank stream so different positions get independent masks.
    """

    def install(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        if not ctx.sequence_parallel:
            return
        for p in mod.parameters(recurse=False):
            if p.requires_grad:
                ctx.seq_grads.watch(p)
        mod.register_forward_pre_hook(ctx.rng.enter)
        mod.register_forward_hook(ctx.rng.exit, always_call=True)
