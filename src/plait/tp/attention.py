"""Attention split by heads in models that read their own head counts in forward, and the norms
inside it: over one head at a time (`HeadNorm`), or over all heads at once (`SplitRMSNorm`)."""

from __future__ import annotations

import copy
import inspect
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.state.placement.shards import ShardSpec, make_spec
from plait.tp.collectives import copy_to_tp, gather_from_tp, scatter_to_tp, sum_over_tp
from plait.tp.context import Style, TPContext
from plait.tp.styles import ParallelRegion

EPS_ATTRS = ("variance_epsilon", "eps", "epsilon")

HEAD_COUNTS = ("heads", "kv_heads", "groups", "width", "kv_width")


@dataclass(frozen=True)
class AttentionParallel(ParallelRegion):
    """An attention module split by heads: a `ParallelRegion` that also gives the module's own
    head counts their local values, for models that read them in forward.

    ``heads`` query heads and ``kv_heads`` key/value heads (0: as many as ``heads``) of
    ``head_dim`` features. ``attrs`` names attributes, as ``(path, count)`` pairs, that hold
    one of `HEAD_COUNTS`: ``heads``, ``kv_heads``, ``groups`` (heads per KV head), ``width``
    (heads * head_dim) or ``kv_width``. A dotted path (``config.num_attention_heads``) gives
    the module its own copy of the object holding the attribute, so the model's shared config
    keeps the full counts. Each attribute must hold the full count when the plan is applied.
    With fewer KV heads than ranks (tp a multiple of them) each rank keeps one KV head, the one
    its query heads use (see ``ColwiseParallel(replicate=True)``).

    ``head_groups``: the heads come in that many groups, each split across the ranks on its own
    (CodeGen's fused projection holds ``mp_num`` groups of [q v k]: rank r takes its share of
    the heads of every group), so tp must divide the heads of one group.

    ``head_inputs``: arguments of the attention's forward (by name; passed by keyword or by
    position) that hold one row per head of each sequence, laid out ``(batch * heads, 1, length)``
    (Bloom's ``alibi``: each head's ALiBi bias, built by the model for all heads): each rank
    gets the rows of its own heads, as its query and key projections give it their heads; one
    passed as None is left alone.

    ``head_bias``: an argument of forward holding an additive bias of every head, laid out
    (batch or 1, heads, queries, keys), that the attention also returns, as output
    ``bias_out``, for the next layers to reuse (T5's ``position_bias``, which the first layer of
    each stack computes from its ``relative_attention_bias``, `HeadEmbedding`). Every rank passes
    its heads' part in (backward: the gradient all-gathered), and returns the bias whole: the one
    it was given, or, when the attention made it for its own heads, all-gathered over tp (once per
    stack and kind of attention). Between layers the bias is then the same on every rank, as one
    process has it.

    ``kv_inputs``: arguments of forward holding another replicated activation that the key and
    value projections read (a cross-attention's encoder states): each enters through f as the
    attention's own input does (copy: forward identity, backward all-reduce), whole-length with
    sequence parallelism too.
    """

    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    attrs: tuple[tuple[str, str], ...] = ()
    head_groups: int = 1
    head_inputs: tuple[str, ...] = ()
    head_bias: str = ""
    bias_out: int = 1
    kv_inputs: tuple[str, ...] = ()

    def counts(self, n: int) -> dict[str, int]:
        """Every count of `HEAD_COUNTS` on one of ``n`` ranks."""
        kv_full = self.kv_heads or self.heads
        h = self.heads // n
        kv = kv_full // n if kv_full % n == 0 else 1
        return {"heads": h, "kv_heads": kv, "groups": h // max(kv, 1), "width": h * self.head_dim,
                "kv_width": kv * self.head_dim}

    def fits(self, n: int) -> bool:
        """Whether the heads split across ``n`` ranks (see `validate`)."""
        kv = self.kv_heads or self.heads
        return self.heads % (self.head_groups * n) == 0 and (kv % n == 0 or n % kv == 0)

    def validate(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        super().validate(mod, name, ctx)
        kv, n, groups = self.kv_heads or self.heads, ctx.size, self.head_groups
        works = f"tp degrees that work: {', '.join(str(t) for t in range(1, self.heads + 1) if self.fits(t))}"
        if self.heads < 1 or groups < 1 or self.head_dim < 1 or self.heads % groups:
            raise ValueError(f"plan: {self!r} on {name!r}: {self.heads} heads of {self.head_dim} features in "
                             f"{groups} groups is not a head layout")
        if self.head_inputs and groups > 1:
            raise ValueError(f"plan: {self!r} on {name!r}: head_inputs with heads in {groups} groups")
        if self.heads % (groups * n):
            grouped = f" ({groups} groups of {self.heads // groups}, each split on its own)" * (groups > 1)
            raise ValueError(f"plan: {self!r} on {name!r} cannot split {self.heads} attention heads{grouped} "
                             f"evenly across tp={n}; {works}")
        if kv % n and n % kv:
            raise ValueError(f"plan: {self!r} on {name!r}: {kv} KV heads can be neither split across tp={n} "
                             f"nor replicated (tp must divide them or be a multiple of them); {works}")
        full = self.counts(1)
        for path, what in self.attrs:
            if what not in HEAD_COUNTS:
                raise ValueError(f"plan: {self!r}: {what!r} is not one of {HEAD_COUNTS}")
            value = _resolve(mod, path)
            if value != full[what]:
                raise ValueError(f"plan: {self!r} on {name!r}: attribute {path!r} is {value!r}, but the plan "
                                 f"says it holds the full {what} ({full[what]})")

    def install(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        super().install(mod, name, ctx)
        local = self.counts(ctx.size)
        for path, what in self.attrs:
            _assign(mod, path, local[what])
        if self.head_inputs:
            mod.register_forward_pre_hook(self._own_heads_hook(mod, name, ctx), with_kwargs=True)
        if self.kv_inputs:
            mod.register_forward_pre_hook(self._kv_hook(mod, ctx), with_kwargs=True)
        if self.head_bias:
            self._install_head_bias(mod, name, ctx)

    def _kv_hook(self, mod: nn.Module, ctx: TPContext) -> Any:
        """A pre-hook passing each of `kv_inputs` through f (`copy_to_tp`)."""
        params = list(inspect.signature(mod.forward).parameters)

        def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
            for key in self.kv_inputs:
                args, kwargs = _map_arg(params, args, kwargs, key, lambda t: copy_to_tp(t, ctx.group))
            return args, kwargs

        return hook

    def _install_head_bias(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        """Hooks giving the attention its heads of `head_bias` and returning the bias whole."""
        params = list(inspect.signature(mod.forward).parameters)
        given: list[torch.Tensor | None] = []  # the whole bias of each call in flight

        def own(t: torch.Tensor) -> torch.Tensor:
            if t.dim() != 4 or t.shape[1] != self.heads:
                raise ValueError(f"{name}: {self.head_bias!r} has shape {tuple(t.shape)}, not (batch, "
                                 f"{self.heads} heads, queries, keys)")
            given[-1] = t
            return scatter_to_tp(t.movedim(1, -1), ctx.group).movedim(-1, 1)

        def before(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
            given.append(None)
            return _map_arg(params, args, kwargs, self.head_bias, own)

        def after(_m: nn.Module, _args: Any, out: Any) -> Any:
            whole = given.pop() if given else None
            if not isinstance(out, tuple) or not isinstance(out[self.bias_out], torch.Tensor):
                return out
            bias = whole if whole is not None else gather_from_tp(
                out[self.bias_out].movedim(1, -1).contiguous(), ctx.group).movedim(-1, 1)
            return (*out[:self.bias_out], bias, *out[self.bias_out + 1:])

        mod.register_forward_pre_hook(before, with_kwargs=True)
        mod.register_forward_hook(after, always_call=True)

    def _own_heads_hook(self, mod: nn.Module, name: str, ctx: TPContext) -> Any:
        """A pre-hook giving the attention its heads' rows of each of `head_inputs`."""
        params = list(inspect.signature(mod.forward).parameters)
        h = self.heads // ctx.size

        def own(key: str, t: torch.Tensor) -> torch.Tensor:
            if t.dim() != 3 or t.shape[0] % self.heads:
                # Falcon's ALiBi is (batch, heads, 1, seq), and also folded into its attention mask,
                # which would need the same split.
                raise ValueError(f"{name}: {key!r} has shape {tuple(t.shape)}, not (batch * {self.heads} "
                                 "heads, 1, length) as Bloom's ALiBi biases, the one layout "
                                 "AttentionParallel(head_inputs=...) splits; train this model with data or "
                                 "fully sharded parallelism (DDP, FSDP) instead")
            return t.unflatten(0, (-1, self.heads)).narrow(1, ctx.rank * h, h).flatten(0, 1)

        def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
            pos, kwargs = list(args), dict(kwargs)
            for key in self.head_inputs:
                i = params.index(key) if key in params else len(pos)
                passed = key in kwargs or i < len(pos)
                value = kwargs[key] if key in kwargs else pos[i] if i < len(pos) else None
                if passed and value is None:
                    continue  # the model does not use it (Falcon without ALiBi)
                if isinstance(value, torch.Tensor) and key in kwargs:
                    kwargs[key] = own(key, value)
                elif isinstance(value, torch.Tensor):
                    pos[i] = own(key, value)
                else:
                    raise TypeError(f"{name}: AttentionParallel(head_inputs={self.head_inputs}) expects a "
                                    f"tensor {key!r} of (batch * {self.heads} heads, ...) rows; the call "
                                    f"passes {len(pos)} positional arguments and keywords {sorted(kwargs)}")
            return tuple(pos), kwargs

        return hook


def _map_arg(params: list[str], args: tuple[Any, ...], kwargs: dict[str, Any], key: str,
             fn: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with the tensor passed as ``key`` (by keyword, or by position in
    ``params``) replaced by ``fn`` of it; None or absent is left alone."""
    if isinstance(kwargs.get(key), torch.Tensor):
        return args, {**kwargs, key: fn(kwargs[key])}
    i = params.index(key) if key in params else len(args)
    if i < len(args) and isinstance(args[i], torch.Tensor):
        return (*args[:i], fn(args[i]), *args[i + 1:]), kwargs
    return args, kwargs


@dataclass(frozen=True)
class HeadEmbedding(Style):
    """An embedding with one column per head inside an attention split by heads (T5's
    ``relative_attention_bias``: a bias per relative-position bucket and head): kept whole on
    every rank, its lookup narrowed to this rank's heads (`scatter_to_tp`; backward all-gathers
    the gradient, so the weight's gradient is whole on every rank, as a replicated one's is)."""

    heads: int = 0
    expects = (nn.Embedding,)

    def validate(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        super().validate(mod, name, ctx)
        assert isinstance(mod, nn.Embedding)
        if mod.embedding_dim != self.heads or self.heads % ctx.size:
            raise ValueError(f"plan: {self!r} on {name!r}: {mod.embedding_dim} columns cannot be split as "
                             f"{self.heads} heads across tp={ctx.size}")
        parts = name.split(".")
        if not any(isinstance(ctx.assigned.get(".".join(parts[:i])), AttentionParallel)
                   for i in range(len(parts))):
            raise ValueError(f"plan: {self!r} on {name!r} needs an AttentionParallel around it")

    def install(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        mod.register_forward_hook(lambda _m, _a, y: scatter_to_tp(y, ctx.group))


@dataclass(frozen=True)
class HeadNorm(Style):
    """A norm over each head's features inside an attention split by heads (Qwen3's and Gemma3's
    ``q_norm`` / ``k_norm`` over ``head_dim``): its weight is replicated, and each rank applies it
    to its own heads only, so its gradient is summed over the tp group after backward (with or
    without sequence parallelism: inside the attention every rank sees the whole sequence)."""

    def install(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        for p in mod.parameters(recurse=False):
            if p.requires_grad:
                ctx.seq_grads.watch(p)


@dataclass(frozen=True)
class SplitRMSNorm(Style):
    """An RMSNorm over a whole projection split by heads (OLMo2's ``q_norm`` and ``k_norm``
    normalize all ``heads * head_dim`` features of a position at once): each rank holds its
    heads' slice of the weight and normalizes its heads' features by the statistic of all of
    them, the mean of squares whose sum is all-reduced over tp (`sum_over_tp`: b*s values each
    way, per norm and step).

    ``width``: the norm's features (its weight's full size); ``unit``: the features of one head.
    The weight is split in whole units like the projection before it (rank r its r-th
    contiguous slice). With fewer units than ranks (tp a multiple of
    them: the key norm of a replicated KV head), every rank keeps the whole weight, applies its
    unit ``r * units // tp`` (the one ``ColwiseParallel(replicate=True)`` computes there) and the
    weight's gradient is summed over tp. Either way the mean of squares over all ranks' features
    equals the whole projection's, each unit present as often as every other.

    The module must hold an RMSNorm's one ``weight`` (1-D) and an ``eps`` (`EPS_ATTRS`); its
    forward is replaced by ``weight * x / sqrt(mean(x**2) + eps)``, computed in at least float32
    (as the models' own RMSNorms do) and returned in ``x``'s dtype. A norm that computes
    something else is caught by the numeric check (`plait.tp.numeric`) before training.
    """

    width: int = 0
    unit: int = 1
    what: str = "heads"

    def validate(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        super().validate(mod, name, ctx)
        params = dict(mod.named_parameters(recurse=False))
        w = params.get("weight")
        if set(params) != {"weight"} or w is None or w.dim() != 1 or any(True for _ in mod.children()):
            held = sorted((k, tuple(p.shape)) for k, p in mod.named_parameters())
            raise ValueError(f"plan: {self!r} on {name!r}: an RMSNorm holds one 1-D weight and no "
                             f"submodules; it has {held}")
        if _eps(mod) is None:
            raise ValueError(f"plan: {self!r} on {name!r}: no epsilon attribute ({', '.join(EPS_ATTRS)})")
        width, n = w.shape[0], ctx.size
        if width != self.width:
            raise ValueError(f"plan: {self!r} on {name!r}: its weight has {width} features, not {self.width}")
        units = width // self.unit if self.unit > 0 else 0
        if self.unit < 1 or width % self.unit or (units % n and n % units):
            raise ValueError(f"plan: {self!r} on {name!r} cannot split its {width} features in units of "
                             f"{self.unit} ({units} {self.what}) across tp={n}: tp must divide the "
                             f"{self.what} or be a multiple of them")

    def _replicates(self, ctx: TPContext) -> bool:
        return (self.width // self.unit) % ctx.size != 0

    def shard_specs(self, mod: nn.Module, ctx: TPContext) -> dict[str, ShardSpec]:
        if self._replicates(ctx):
            return {}
        return {"weight": make_spec(0, self.width, ctx.size, ctx.rank, self.unit)}

    def install(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        # Called on this rank's shards: the full width comes from the plan, not the weight.
        eps, n = _eps(mod), ctx.size
        assert eps is not None  # validated
        start = None
        if self._replicates(ctx):
            start = ctx.rank * (self.width // self.unit) // n * self.unit
            assert isinstance(mod.weight, nn.Parameter)
            ctx.seq_grads.watch(mod.weight)

        def forward(self_: nn.Module, x: torch.Tensor) -> torch.Tensor:
            w = _weight(self_)
            w = w if start is None else w.narrow(0, start, self.unit)
            h = x.to(torch.promote_types(x.dtype, torch.float32))
            # Every rank holds as many features: the mean over all of them is the sum over tp / (n * local).
            mean = sum_over_tp(h.pow(2).sum(-1, keepdim=True), ctx.group) / (n * h.shape[-1])
            return (w * (h * torch.rsqrt(mean + eps))).to(x.dtype)

        mod.forward = types.MethodType(forward, mod)


def _weight(mod: nn.Module) -> torch.Tensor:
    """The norm's weight as its forward sees it: the parameter, or under FSDP the gathered tensor
    FSDP sets in its place for the forward (a plain tensor, not a Parameter)."""
    w = mod.weight
    assert isinstance(w, torch.Tensor)
    return w


def _eps(mod: nn.Module) -> float | None:
    for a in EPS_ATTRS:
        value = getattr(mod, a, None)
        if isinstance(value, float):
            return value
    return None


def _resolve(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def _assign(mod: nn.Module, path: str, value: int) -> None:
    """Set ``mod.<path>``, copying every object on the way (a shared config stays untouched)
    but submodules, which are the model's own (BERT's attention sets ``self.num_attention_heads``
    on its ``self``)."""
    *parents, last = path.split(".")
    obj: Any = mod
    for part in parents:
        child = getattr(obj, part)
        if not isinstance(child, nn.Module):
            child = copy.copy(child)
            setattr(obj, part, child)
        obj = child
    setattr(obj, last, value)
