"""Tensor-parallel styles: how one module is split over the ``tp`` group and where it talks.

A style is a small frozen dataclass used as a value in a plan (module-name pattern -> style).
`plait.tp.apply` asks each style three things, in this order:

1. ``validate``: can this module be split this way? Raises ``ValueError`` naming the module,
   the style and the numbers, before any parameter is touched or any collective runs.
2. ``shard_specs``: which of the module's own parameters are split, along which dimension
   (`plait.tp.shards.ShardSpec`); the rest stay replicated. Materialization itself is done centrally.
3. ``install``: hooks or a forward override that put the Megatron f / g operators (or their
   sequence-parallel all-gather / reduce-scatter) from `plait.comm` around the computation.

What the styles cannot see from one module (a norm on sequence shards with no style, a
region around a residual addition) is checked for the whole plan by the layout trace in
`plait.tp.layout_trace`. Sequence parallelism (Korthikanti et al. 2022) is a property of the whole
call, not of a style: every style reads ``ctx.sequence_parallel`` so one plan serves both.

Linear styles accept ``nn.Linear`` and transposed Conv1D-like layers (`plait.tp.layers`); a
style's activation is the first argument of the module's forward, by position or keyword.
More styles: `plait.tp.attention` (heads, for models that read head counts in forward) and
`plait.tp.sequence` (where sequence parallelism starts and ends).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait._torch_compat import set_class
from plait.state.placement.shards import ShardSpec, make_spec
from plait.tp.collectives import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
)
from plait.tp.context import Style, TPContext
from plait.tp.layers import LinearLayout, input_pre_hook, linear_layout


# ------------------------------------------------------------------ helpers
def _size(mod: nn.Module, attr: str) -> int:
    """A layer's size attribute (``num_embeddings``...), checked to be an int."""
    value = getattr(mod, attr)
    if not isinstance(value, int):
        raise TypeError(f"{type(mod).__name__}.{attr} is {value!r}, not a size")
    return value


def check_sequence(x: torch.Tensor, ctx: TPContext, where: str) -> None:
    """Sequence parallelism splits dim 1; say so plainly before a reduce-scatter would fail."""
    if x.dim() < 2 or x.shape[1] % ctx.size:
        raise ValueError(
            f"{where}: sequence parallelism splits dim 1 (the sequence) across tp={ctx.size}, "
            f"but the activation has shape {tuple(x.shape)}; use a sequence length divisible by {ctx.size}"
        )


def reduce_out(y: torch.Tensor, ctx: TPContext, where: str) -> torch.Tensor:
    """g: sum the partial outputs of the tp ranks (reduce-scatter along the sequence under SP)."""
    if ctx.sequence_parallel:
        check_sequence(y, ctx, where)
        return reduce_scatter_to_sp(y, ctx.group, dim=1)
    return reduce_from_tp(y, ctx.group)


def enter_parallel(x: torch.Tensor, ctx: TPContext, sequence_sharded: bool = True) -> torch.Tensor:
    """f: a replicated (or, under SP, sequence-sharded) activation enters a tp-sharded region."""
    if ctx.sequence_parallel and sequence_sharded:
        return gather_from_sp(x, ctx.group, dim=1)
    return copy_to_tp(x, ctx.group)


def _in_region(name: str, ctx: TPContext) -> bool:
    """Whether a ParallelRegion encloses module ``name`` (the root has the empty name)."""
    parts = name.split(".")
    prefixes = (".".join(parts[:i]) for i in range(len(parts)))
    return any(isinstance(ctx.assigned.get(p), ParallelRegion) for p in prefixes)


# ------------------------------------------------------------------ styles
def _divisible(name: str, style: Style, what: str, size: int, unit: int, ctx: TPContext) -> None:
    if size % unit or (size // unit) % ctx.size:
        count = f"{size} {what}"
        if unit > 1:
            count = f"{size // unit} {what} ({size} features in units of {unit})"
        raise ValueError(f"plan: {type(style).__name__} on {name!r} cannot split {count} evenly across "
                         f"tp={ctx.size}")


def _layout(style: Style, mod: nn.Module, name: str) -> LinearLayout:
    layout = linear_layout(mod)
    if layout is None:
        raise ValueError(f"plan: {style!r} applies to Linear modules, but {name!r} is a {type(mod).__name__} "
                         "(a transposed Conv1D-like layer, with a 2-D (in, out) weight and an int `nf`, "
                         "works too)")
    return layout


# Names of fused projections in common models (q, k and v, or gate and up, side by side).
FUSED_NAMES = frozenset({"qkv_proj", "c_attn", "W_pack", "Wqkv", "qkv", "query_key_value", "gate_up_proj"})


@dataclass(frozen=True)
class ColwiseParallel(Style):
    """Linear layer split by *output* features: rank r computes its slice of the outputs.

    Input: replicated. With ``input_comm`` the layer applies f itself (forward identity,
    backward all-reduce of the input gradient; under SP forward all-gather of the sequence,
    backward reduce-scatter). Inside a `ParallelRegion` the region has already done that once
    for all its column-parallel layers, so use ``input_comm=False``.
    Output: left sharded on the last dim, or all-gathered with ``gather_output``.
    ``unit`` keeps groups of features together (a head's ``head_dim`` features); ``what``
    names them in errors (e.g. "attention heads"). ``input_is_sequence_parallel=False``: under
    SP the input is nevertheless full-length and replicated (after a `GatherSequence`), so f is
    the plain copy rather than an all-gather.

    ``parts``: a fused projection (GPT-2's ``c_attn`` holds q, k and v; ``gate_up_proj``),
    given as the sizes of its parts in output features; each part is split on its own, so
    every rank's output is the same fusion of its own shards and the model's split still works.
    A layer named like a fused projection (`FUSED_NAMES`) must say so: split as one block, rank
    0 would hold all of q and part of k, which no check of shapes can see (``parts=(out,)``
    declares it unfused; GPT-NeoX's per-head ``query_key_value`` takes ``unit=3 * head_dim``).
    ``replicate``: when there are fewer units than ranks and tp is a multiple of them
    (grouped-query attention with fewer KV heads than ranks), every rank keeps the whole
    weight and computes only the unit its query heads use, rank r the unit
    ``r * units // tp``; the gradient, which each rank computes for its own query heads, is
    summed over tp (one all-reduce of the weight's gradient per step). With ``parts`` too, a part
    of fewer units than ranks is replicated that way and the others are split (a fused
    multi-query projection, [q | k | v] with one KV head: Falcon's, GPT-BigCode's): every rank
    keeps the whole weight and computes its slice of each split part and its unit of each
    replicated one; the gradient of the whole weight is summed over tp, each rank having
    contributed only to the rows it computed.
    """

    gather_output: bool = False
    input_comm: bool = True
    unit: int = 1
    what: str = "output features"
    parts: tuple[int, ...] = ()
    replicate: bool = False
    input_is_sequence_parallel: bool = True

    def validate(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        layout = _layout(self, mod, name)
        if not self.input_comm and not _in_region(name, ctx):
            raise ValueError(f"plan: {self!r} on {name!r} has input_comm=False, so its input must come "
                             "through a ParallelRegion on an enclosing module, but none encloses it")
        if self.gather_output and (self.parts or self._replicates(layout.sizes(mod)[1], ctx)):
            raise ValueError(f"plan: {self!r} on {name!r}: gather_output applies to a plain split only "
                             "(a fused or replicated output gathered in rank order would be reordered)")
        self._check_size(layout.sizes(mod)[1], name, ctx)

    def _replicated_part(self, size: int, ctx: TPContext) -> bool:
        units = size // self.unit
        return self.replicate and size % self.unit == 0 and units < ctx.size and ctx.size % units == 0

    def _replicates(self, out: int, ctx: TPContext) -> bool:
        """Whether the layer is kept whole on every rank (some part has fewer units than ranks)."""
        return any(self._replicated_part(p, ctx) for p in self.parts or (out,))

    def _rows(self, out: int, ctx: TPContext) -> list[tuple[int, int]]:
        """(start, length) of the output features this rank computes from a replicated weight:
        its slice of each split part, its unit of each replicated one, in the parts' order."""
        rows, start = [], 0
        for p in self.parts or (out,):
            if self._replicated_part(p, ctx):
                rows.append((start + ctx.rank * (p // self.unit) // ctx.size * self.unit, self.unit))
            else:
                rows.append((start + ctx.rank * p // ctx.size, p // ctx.size))
            start += p
        return rows

    def _check_size(self, out: int, name: str, ctx: TPContext) -> None:
        last = name.rpartition(".")[2]
        per_head = last == "query_key_value" and self.unit > 1 and self.unit % 3 == 0
        if last in FUSED_NAMES and not self.parts and not per_head:
            raise ValueError(f"plan: {self!r} on {name!r}: {name!r} is named like a fused projection "
                             "(several tensors side by side), but the style gives no parts; split as one "
                             "block, a rank would hold whole parts and none of others: give "
                             f"parts=(sizes...) (or parts=({out},) if it is not fused)")
        if not self.parts:
            if not self._replicates(out, ctx):
                _divisible(name, self, self.what, out, self.unit, ctx)
            return
        if sum(self.parts) != out:
            raise ValueError(f"plan: {self!r} on {name!r}: the parts {self.parts} do not add up to its {out} "
                             "output features")
        for i, p in enumerate(self.parts):
            if not self._replicated_part(p, ctx) and (p % self.unit or (p // self.unit) % ctx.size):
                raise ValueError(
                    f"plan: {self!r} on {name!r} cannot split part {i} of the fused projection ({p} features "
                    f"in units of {self.unit}: {p // self.unit} {self.what}) evenly across tp={ctx.size}"
                    + ("" if self.replicate else "; replicate=True keeps a part of fewer units than ranks "
                       "whole on every rank (tp a multiple of its units)"))

    def shard_specs(self, mod: nn.Module, ctx: TPContext) -> dict[str, ShardSpec]:
        layout = linear_layout(mod)
        assert layout is not None  # validated
        out = layout.sizes(mod)[1]
        if self._replicates(out, ctx):
            return {}
        specs = {"weight": make_spec(layout.out_dim, out, ctx.size, ctx.rank, self.unit, self.parts)}
        if getattr(mod, "bias", None) is not None:
            specs["bias"] = make_spec(0, out, ctx.size, ctx.rank, self.unit, self.parts)
        return specs

    def install(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        layout = linear_layout(mod)
        assert layout is not None  # validated
        full = layout.sizes(mod)[1]
        if self.input_comm:
            enter = partial(enter_parallel, ctx=ctx, sequence_sharded=self.input_is_sequence_parallel)
            mod.register_forward_pre_hook(input_pre_hook(enter, name), with_kwargs=True)
        if self._replicates(full, ctx):
            self._install_replicated(mod, layout, full, ctx)
            return
        layout.set_sizes(mod, out_features=self.shard_specs(mod, ctx)["weight"].local)
        if self.gather_output:
            def gather(_m: nn.Module, _a: Any, y: torch.Tensor) -> torch.Tensor:
                # Padding (vocabulary styles) is dropped after the gather.
                return gather_from_tp(y, ctx.group).narrow(-1, 0, full)

            mod.register_forward_hook(gather)

    def _install_replicated(self, mod: nn.Module, layout: LinearLayout, full: int, ctx: TPContext) -> None:
        rows = self._rows(full, ctx)

        def take(t: torch.Tensor, dim: int) -> torch.Tensor:
            pieces = [t.narrow(dim, start, n) for start, n in rows]
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)

        def forward(self_: nn.Module, x: torch.Tensor) -> torch.Tensor:
            w, b = self_.weight, getattr(self_, "bias", None)
            assert isinstance(w, torch.Tensor)
            return layout.apply(x, take(w, layout.out_dim), None if b is None else take(b, 0))

        mod.forward = types.MethodType(forward, mod)
        layout.set_sizes(mod, out_features=sum(n for _, n in rows))
        for p in mod.parameters(recurse=False):
            if p.requires_grad:
                ctx.seq_grads.watch(p)


@dataclass(frozen=True)
class VocabParallelOutput(ColwiseParallel):
    """The output projection (lm_head) split by vocabulary, padded when tp does not divide it.

    With ``gather_output=False`` (the default) the logits stay sharded on the last dim and
    `plait.vocab_parallel_cross_entropy` computes the loss without ever forming the full
    logits; `plait.loss_fn_for(model)` returns that loss for the model.
    """

    what: str = "vocabulary entries"

    def _check_size(self, out: int, name: str, ctx: TPContext) -> None:
        pass  # padded


@dataclass(frozen=True)
class RowwiseParallel(Style):
    """Linear layer split by *input* features: each rank computes a partial sum of the output.

    Input: already sharded on the last dim (``input_is_parallel``, the output of column-parallel
    layers), else scattered first (forward keeps this rank's slice, backward all-gathers).
    Output: g, all-reduced (forward all-reduce, backward identity) or, under SP,
    reduce-scattered along the sequence (backward all-gather). The bias is added once, after
    the reduction, and under SP its gradient is summed over the tp group after backward because
    each rank saw only its sequence shard. Without SP, whatever the enclosing region does after
    this layer acts on a replicated activation, so it runs on the default (synchronized) random
    stream again (GPT-2's residual dropout inside its attention).

    ``parts``: the input features come in blocks (sizes), each split on its own, as the output of
    a `ColwiseParallel` with ``parts`` leaves them: rank r's input is its slice of every block
    (CodeGen's attention output, whose heads are taken from each of its groups).
    """

    input_is_parallel: bool = True
    unit: int = 1
    what: str = "input features"
    parts: tuple[int, ...] = ()

    def validate(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        layout = _layout(self, mod, name)
        if self.input_is_parallel and not _in_region(name, ctx):
            raise ValueError(f"plan: {self!r} on {name!r} expects a sharded input, which only exists "
                             "inside a ParallelRegion, but none encloses it (or use input_is_parallel=False)")
        size = layout.sizes(mod)[0]
        if self.parts and sum(self.parts) != size:
            raise ValueError(f"plan: {self!r} on {name!r}: the parts {self.parts} do not add up to its "
                             f"{size} input features")
        for p in self.parts or (size,):
            _divisible(name, self, self.what, p, self.unit, ctx)

    def shard_specs(self, mod: nn.Module, ctx: TPContext) -> dict[str, ShardSpec]:
        layout = linear_layout(mod)
        assert layout is not None  # validated
        return {"weight": make_spec(layout.in_dim, layout.sizes(mod)[0], ctx.size, ctx.rank, self.unit,
                                    self.parts)}

    def install(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        layout = linear_layout(mod)
        assert layout is not None  # validated
        layout.set_sizes(mod, in_features=self.shard_specs(mod, ctx)["weight"].local)
        scatter = not self.input_is_parallel

        def forward(self_: nn.Module, x: torch.Tensor) -> torch.Tensor:
            if scatter:
                x = scatter_to_tp(x, ctx.group)
            w, b = self_.weight, getattr(self_, "bias", None)
            assert isinstance(w, torch.Tensor)
            y = reduce_out(layout.apply(x, w, None), ctx, name)
            if not ctx.sequence_parallel:
                ctx.rng.pause()
            return y if b is None else y + b

        mod.forward = types.MethodType(forward, mod)
        bias = getattr(mod, "bias", None)
        if ctx.sequence_parallel and isinstance(bias, nn.Parameter):
            ctx.seq_grads.watch(bias)


@dataclass(frozen=True)
class VocabParallelEmbedding(Style):
    """Embedding table split by vocabulary rows (padded when tp does not divide the vocabulary).

    Forward: each rank looks up the ids it owns, writes zeros for the others, and the partial
    embeddings are summed: all-reduce, or reduce-scatter along the sequence under SP (so the
    activation leaves sequence-sharded). Backward: identity (all-gather under SP); each rank's
    table receives gradient only for its own rows.

    Only the lookup is replaced: a subclass's own forward runs around it (Gemma's embedding
    still scales the summed lookup by ``embed_scale``), provided it looks up through
    ``super().forward``; one that calls ``F.embedding`` itself is refused at its first call.

    ``shard_sequence=False`` keeps the output full-length under SP too (all-reduce): for models
    that derive positions, rotary tables or masks from the embedding's length before the
    decoder layers, where a `ScatterSequence` then starts the sequence split.
    """

    shard_sequence: bool = True
    expects = (nn.Embedding,)

    def validate(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        super().validate(mod, name, ctx)
        assert isinstance(mod, nn.Embedding)
        if mod.max_norm is not None or mod.sparse or mod.scale_grad_by_freq:
            raise ValueError(f"plan: {self!r} on {name!r} supports plain lookups only; the embedding has "
                             "max_norm, sparse or scale_grad_by_freq set")

    def shard_specs(self, mod: nn.Module, ctx: TPContext) -> dict[str, ShardSpec]:
        return {"weight": make_spec(0, _size(mod, "num_embeddings"), ctx.size, ctx.rank)}

    def install(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        spec = self.shard_specs(mod, ctx)["weight"]
        setattr(mod, "num_embeddings", spec.local)  # noqa: B010 (typed as a size, not a Module attribute)
        pad = getattr(mod, "padding_idx", None)  # a full id; its row gets no gradient
        local_pad = None
        if isinstance(pad, int) and spec.start <= pad < spec.start + spec.valid:
            local_pad = pad - spec.start
        shard = self.shard_sequence

        def lookup(self_: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
            foreign = (ids < spec.start) | (ids >= spec.start + spec.valid)
            local = (ids - spec.start).masked_fill(foreign, 0)
            out = F.embedding(local, self_.weight, local_pad).masked_fill(foreign.unsqueeze(-1), 0.0)
            return reduce_out(out, ctx, name) if shard else reduce_from_tp(out, ctx.group)

        assert isinstance(mod, nn.Embedding)  # validated
        set_class(mod, _with_lookup(type(mod), lookup, name))


def _with_lookup(cls: type[nn.Embedding], lookup: Any, name: str) -> type[nn.Embedding]:
    """``cls`` with `nn.Embedding.forward` (the lookup) replaced by ``lookup``, for one module.

    A subclass's own forward still runs around the lookup: Gemma's embedding returns
    ``super().forward(ids) * embed_scale``, and its ``super()`` now reaches ``lookup``, placed
    between ``cls`` and `nn.Embedding` in the method resolution order. A forward that looks the
    table up some other way (``F.embedding`` on its weight, which now holds this rank's rows only)
    is refused at the first call that does not reach ``lookup``."""
    reached: list[bool] = []

    class Lookup(nn.Embedding):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if not reached:
                reached.append(True)
            return lookup(self, input)

    names: dict[str, Any] = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    if cls is nn.Embedding:
        return type(cls.__name__, (Lookup,), names)
    if cls.forward is not nn.Embedding.forward:  # its own forward: check that it reaches the lookup

        def forward(self: nn.Embedding, *args: Any, **kwargs: Any) -> Any:
            out = super(split, self).forward(*args, **kwargs)
            if not reached:
                raise TypeError(f"{name}: {cls.__name__}.forward does not look its table up through "
                                "nn.Embedding.forward (super().forward), where VocabParallelEmbedding puts "
                                "the split lookup")
            return out

        names["forward"] = forward
    split: type[nn.Embedding] = type(cls.__name__, (cls, Lookup), names)
    return split


@dataclass(frozen=True)
class ParallelRegion(Style):
    """A module whose body runs on tp-sharded features (attention over local heads, an MLP over
    local hidden units): its input enters once through f (forward identity, backward all-reduce;
    under SP forward all-gather of the sequence, backward reduce-scatter), shared by all the
    column-parallel layers inside. It must contain a RowwiseParallel layer that brings the
    activation back. ``fork_rng`` (default) runs the body on the per-rank random stream,
    because dropout there acts on different heads or hidden units on every rank.

    ``entry``: the child module (a dotted name under this one) whose activation enters through
    f, for a block that splits its work across sibling modules and runs replicated code around
    them: BERT's attention computes heads in ``self`` and then, in ``output``, projects them
    back (the RowwiseParallel layer), adds the attention's own input and normalizes; its layer
    runs the MLP as ``intermediate`` then ``output``, likewise. The region's own input then does
    not pass f (its other uses, the residual additions, stay replicated or on sequence shards),
    and the per-rank random stream runs from the child's call to the region's end.
    """

    fork_rng: bool = True
    entry: str = ""

    def validate(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        inside = [s for n, s in ctx.assigned.items() if n.startswith(name + ".") or not name and n]
        if not any(isinstance(s, RowwiseParallel) for s in inside):
            raise ValueError(f"plan: {self!r} on {name!r} needs a RowwiseParallel layer inside it to "
                             "reduce the sharded activation, but the plan gives it none")
        if self.entry:
            try:
                mod.get_submodule(self.entry)
            except AttributeError:
                raise ValueError(f"plan: {self!r} on {name!r}: it has no submodule {self.entry!r} for its "
                                 "entry") from None

    def install(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        where = mod.get_submodule(self.entry) if self.entry else mod
        label = f"{name}.{self.entry}" if self.entry else name
        enter = input_pre_hook(partial(enter_parallel, ctx=ctx), label)
        where.register_forward_pre_hook(enter, with_kwargs=True)
        if not self.fork_rng:
            return
        enter_rng, exit_rng = ctx.rng.region_hooks(mod)
        if not self.entry:
            mod.register_forward_pre_hook(enter_rng)
            mod.register_forward_hook(exit_rng, always_call=True)
            return
        entered: list[bool] = []  # the entry's call may not come (an exception before it)

        def enter_at_entry(*_: Any) -> None:
            enter_rng()
            entered.append(True)

        def exit_region(*_: Any) -> None:
            while entered:  # once per call of the entry (a block that calls it twice)
                entered.pop()
                exit_rng()

        enter_at_entry.rng_fork = exit_region.rng_fork = ctx.rng  # type: ignore[attr-defined]  # `fork_of`
        where.register_forward_pre_hook(enter_at_entry)
        mod.register_forward_hook(exit_region, always_call=True)


@dataclass(frozen=True)
class InlineMLP(ParallelRegion):
    """A decoder layer that runs its MLP's linear layers itself (OPT's ``fc1`` and ``fc2`` sit in
    the layer, with no MLP module to be the region): a region for the plan's rules only. Nothing
    enters through f at the layer, whose norms and residual additions run replicated: its
    column-parallel layers apply f themselves (``input_comm=True``), and the code between them
    and the row-parallel one (the activation) must act on each hidden unit alone, as inside any
    region. Nothing runs on the per-rank random stream (the layer's dropouts act on replicated
    activations). The numeric check (`plait.tp.numeric`) runs the whole layer whole and split.
    Sequence parallelism is refused: the layer's own code around its MLP would run on sequence
    shards (OPT's flattens batch and sequence into one dim), which no style of it checks."""

    fork_rng: bool = False

    def validate(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        super().validate(mod, name, ctx)
        if ctx.sequence_parallel:
            raise ValueError(f"plan: {self!r} on {name!r} ({type(mod).__name__}): the layer runs its MLP's "
                             "linear layers in its own forward, and under sequence parallelism its code "
                             "around them would see sequence shards (OPT's flattens batch and sequence); "
                             "use sequence_parallel=False")

    def install(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        pass


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
        enter_rng, exit_rng = ctx.rng.region_hooks(mod)
        mod.register_forward_pre_hook(enter_rng)
        mod.register_forward_hook(exit_rng, always_call=True)
