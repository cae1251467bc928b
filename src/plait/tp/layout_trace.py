"""Refuse a plan that would not reproduce single-process training, before anything changes.

A style's `validate` sees one module. What only the whole forward shows (a norm running on
sequence shards without a style, a region that wraps a residual addition, a replicated
attention fed sequence shards, positions computed from a shard's length) is found by a layout
trace: the model is copied to the meta device (no data, no memory), split as rank 0 would hold
it, its styles installed, and run once on fake tensors (`plait._torch_compat.fake_tensors`:
shapes only, and code that branches on values, such as transformers' check for packed
sequences when there is no KV cache, skips the branch as it does under torch.compile) with
every collective emulated
(`plait.tp.collectives.emulated`: a tensor of the right shape, nothing moves). Every tensor
carries its layout:

====  =================================================================================
R     replicated: the same full tensor on every rank (untagged)
W     a parameter whose gradient is summed over tp (`SequenceParallel` under SP), or a
      tensor computed from one alone
I     a `ParallelRegion`'s input after f: a replicated value whose gradient each rank
      computes only in part (f sums them)
F     split by features (local heads, local hidden units), inside a region
S     split along the sequence (dim 1) under sequence parallelism
V     logits split by vocabulary (a `VocabParallelOutput` that keeps them sharded)
====  =================================================================================

The styles' own modules (column- and row-parallel layers, the vocabulary embedding) are
trusted and set their outputs' layouts; every other operation is checked with the rules of
`_Trace`. In short: only column-parallel layers may read a region's input; feature-split
tensors stay inside their region and never meet a replicated tensor that needs a gradient
(its gradient would be partial); only position-wise operations (elementwise, reductions over
the hidden dims, norms, dropout on the per-rank stream) touch sequence shards, and a
replicated parameter used on them must have its gradient summed (``SequenceParallel``); a
summed parameter never meets a full replicated activation; dropout draws from the stream that
matches its input (the synchronized one for replicated tensors, the per-rank one for split
ones); the model's outputs are replicated or vocabulary-split logits. Anything the rules do
not know is refused: a plan passes only when every operation on a split tensor is one they
prove correct.

Limits: code between a region's column- and row-parallel layers is trusted to work per head
or per hidden unit (a reduction over the split features there is not detected); the run
follows the control flow of the example inputs.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from plait._torch_compat import fake_tensors
from plait.state.placement.shards import ShardSpec
from plait.tp.attention import SplitRMSNorm
from plait.tp.collectives import emulated
from plait.tp.context import Style, TPContext
from plait.tp.experts import MoEParallel
from plait.tp.layers import find_activation
from plait.tp.numeric import describe
from plait.tp.sequence import GatherSequence, ScatterSequence
from plait.tp.styles import (
    ColwiseParallel,
    ParallelRegion,
    RowwiseParallel,
    SequenceParallel,
    VocabParallelEmbedding,
    VocabParallelOutput,
)


class PlanError(ValueError):
    """A tensor-parallel plan that would not reproduce single-process training."""


R, W, IN, F, S, V = "R", "W", "IN", "F", "S", "V"
WORDS = {R: "replicated", W: "gradient-summed", IN: "region-input", F: "feature-split",
         S: "sequence-split", V: "vocabulary-split"}
_ATTR = "_plait_layout"


def layout_of(t: torch.Tensor) -> str:
    return getattr(t, _ATTR, R)


def mark(obj: Any, tag: str) -> None:
    """Give every tensor in ``obj`` the layout ``tag``."""
    for t in _tensors(obj):
        setattr(t, _ATTR, tag)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


# ------------------------------------------------------------------ operations, by name
def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


ELEMENTWISE = _names("""
    add sub subtract mul multiply div divide true_divide floor_divide remainder fmod pow neg negative
    abs absolute exp exp2 expm1 log log2 log10 log1p sqrt rsqrt reciprocal square tanh sigmoid relu
    relu6 gelu silu mish erf erfc sin cos sign clamp clip clamp_min clamp_max maximum minimum fmax fmin
    where masked_fill lerp addcmul addcdiv softplus softsign hardtanh leaky_relu elu selu celu
    logsigmoid hardswish hardsigmoid glu tanhshrink threshold eq ne lt le gt ge logical_and logical_or
    logical_not logical_xor and or xor invert isnan isinf isfinite nan_to_num float double half bfloat16
    to type type_as contiguous clone detach requires_grad copy zero fill zeros_like ones_like empty_like
    full_like""")
CONVERT = _names("to float double half bfloat16 type type_as contiguous clone detach requires_grad")
REDUCE = _names("""mean sum nansum var std amax amin max min logsumexp softmax log_softmax var_mean
    std_mean prod argmax argmin cumsum cumprod all any count_nonzero norm normalize""")
NORMS = _names("layer_norm rms_norm")
DROPOUT = _names("dropout alpha_dropout feature_alpha_dropout dropout1d dropout2d dropout3d")
LINEAR = _names("linear matmul mm")
SPLIT = _names("chunk split narrow tensor_split unbind")
VIEWS = _names("view reshape flatten unflatten unsqueeze squeeze expand expand_as view_as reshape_as")
MOVES = _names("transpose swapaxes swapdims permute movedim")
SHAPE = _names(".shape size numel len nelement")
META = _names("""dim ndimension .ndim .dtype .device .requires_grad .is_leaf .grad_fn .is_meta .is_cuda
    .layout is_floating_point is_complex element_size get_device is_contiguous stride storage_offset
    data_ptr format repr""")


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", "") or ""
    if name == "__get__":
        return "." + getattr(getattr(func, "__self__", None), "__name__", "?")
    n = name.strip("_")
    if n not in ELEMENTWISE and n[:1] in ("r", "i") and n[1:] in ELEMENTWISE:
        n = n[1:]  # __radd__, __iadd__
    return n


def _dims(value: Any, ndim: int) -> list[int] | None:
    if value is None:
        return None
    values = value if isinstance(value, (list, tuple, torch.Size)) else [value]
    return [int(d) % ndim for d in values]


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, key: str, default: Any = None) -> Any:
    if key in kwargs:
        return kwargs[key]
    return args[i] if len(args) > i else default


# ------------------------------------------------------------------ the trace
Args = tuple[Any, ...]
Kwargs = dict[str, Any]
# Trusted: they set their outputs.
INTERNAL = (ColwiseParallel, RowwiseParallel, VocabParallelEmbedding, SplitRMSNorm, MoEParallel)


class _Trace(TorchFunctionMode):
    """Checks every torch operation outside the styles' own layers and tags its outputs."""

    def __init__(self, ctx: TPContext, kinds: dict[str, str], sharded: dict[int, str]) -> None:
        super().__init__()
        self.ctx, self.kinds, self.sharded = ctx, kinds, sharded
        self.stack: list[str] = []
        self.internal = self.regions = self.seq_local = self.quiet = 0
        self.failed_at: str | None = None

    # ---- where we are
    def where(self, name: str | None = None) -> str:
        name = self.stack[-1] if name is None and self.stack else name or ""
        if name:
            return f"module {name!r} ({self.kinds.get(name, '?')})"
        return f"the model's own forward ({self.kinds.get('', '?')})"

    def refuse(self, reason: str, name: str | None = None) -> PlanError:
        return PlanError(f"plan refused: {self.where(name)}: {reason}")

    @contextlib.contextmanager
    def quietly(self) -> Iterator[None]:
        self.quiet += 1
        try:
            yield
        finally:
            self.quiet -= 1

    # ---- module hooks
    def enter(self, name: str, style: Style | None, mod: nn.Module, args: Args, kwargs: Kwargs) -> None:
        self.stack.append(name)
        if style is None:
            return
        x = find_activation(mod, args, kwargs)
        if x is not None:
            self._check_entry(name, style, layout_of(x))
        if isinstance(style, INTERNAL):
            self.internal += 1
        elif isinstance(style, ParallelRegion):
            self.regions += 1
        elif isinstance(style, SequenceParallel):
            self.seq_local += 1

    def leave(self, name: str, style: Style | None, mod: nn.Module, args: Args, kwargs: Kwargs,
              out: Any) -> None:
        if sys.exc_info()[0] is not None and self.failed_at is None:
            self.failed_at = self.stack[-1] if self.stack else name
        self.stack.pop()
        if isinstance(style, INTERNAL):
            self.internal -= 1
            mark(out, self._produces(style))
        elif isinstance(style, ParallelRegion):
            self.regions -= 1
        elif isinstance(style, SequenceParallel):
            self.seq_local -= 1

    def _produces(self, style: Style) -> str:
        sp = self.ctx.sequence_parallel
        if isinstance(style, ColwiseParallel):
            return R if style.gather_output else V if isinstance(style, VocabParallelOutput) else F
        if isinstance(style, VocabParallelEmbedding):
            return S if sp and style.shard_sequence else R
        if isinstance(style, SplitRMSNorm):
            return F
        return S if sp else R

    def _expects(self, style: Style) -> tuple[str, str] | None:
        """(layout, description) of the activation a style's module must receive."""
        sp = self.ctx.sequence_parallel
        entry = S if sp else R
        if isinstance(style, ColwiseParallel):
            if not style.input_comm:
                return IN, "the input of its enclosing ParallelRegion"
            own = entry if style.input_is_sequence_parallel else R
            return own, "an activation to enter through its own f"
        if isinstance(style, RowwiseParallel):
            if style.input_is_parallel:
                return F, "the feature-split output of column-parallel layers"
            return R, "a full replicated activation to split"
        if isinstance(style, VocabParallelEmbedding):
            return R, "replicated token ids"
        if isinstance(style, SplitRMSNorm):
            return F, "the feature-split output of its column-parallel projection"
        if isinstance(style, (ParallelRegion, MoEParallel)):
            return entry, "this rank's sequence shard" if sp else "a replicated activation"
        if isinstance(style, ScatterSequence) and sp:
            return R, "the full-length replicated activation to cut"
        if isinstance(style, GatherSequence) and sp:
            return S, "this rank's sequence shard to gather"
        return None

    def _check_entry(self, name: str, style: Style, got: str) -> None:
        """The activation a style's module receives, before the style's own hook touches it."""
        expected = self._expects(style)
        if expected is None or expected[0] == got:
            return
        want, what = expected
        hint = ""
        if got == IN:
            hint = " (it is already inside a ParallelRegion: use input_comm=False)"
        elif got == R and self.ctx.sequence_parallel:
            hint = (" (under sequence parallelism nothing split the sequence before it: a ScatterSequence or "
                    "a sequence-sharding embedding is missing upstream)")
        raise self.refuse(f"{style!r} expects {what} ({WORDS[want]}), but receives a {WORDS[got]} one{hint}",
                          name)

    # ---- operations
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.internal or self.quiet:
            return func(*args, **kwargs)
        tag = self._check(func, args, kwargs)
        out = func(*args, **kwargs)
        if tag != R:
            mark(out, tag)
        return out

    def _check(self, func: Any, args: Args, kwargs: Kwargs) -> str:
        name = _op_name(func)
        ts = list(_tensors((args, kwargs)))
        if not ts or name in META:
            return R
        tags = {layout_of(t) for t in ts}
        if name in SHAPE:
            if S in tags and not self.seq_local and not _reads_other_dim(name, args, kwargs):
                raise self.refuse(f"reads the shape ({name.lstrip('.')}) of a sequence-split activation: "
                                  "under sequence parallelism that is this rank's shard, not the sequence "
                                  "(positions or masks derived from it would be wrong)")
            return R
        for t in ts:
            if id(t) in self.sharded:
                raise self.refuse(f"uses the tp-sharded parameter {self.sharded[id(t)]!r} outside the module "
                                  "that owns it, where it is only this rank's slice")
        strong = tags - {R, W}
        if len(strong) > 1 or (W in tags and strong - {S, F}):
            raise self.refuse(f"{name} combines {' and '.join(WORDS[t] for t in sorted(tags))} tensors, "
                              "which hold different parts of the data on each rank")
        if not strong:
            return self._replicated(name, args, kwargs, ts, tags)
        tag = strong.pop()
        if any(layout_of(t) == R and t.requires_grad for t in ts):
            fix = " (give this module SequenceParallel() if it is position-wise)" if tag == S else ""
            raise self.refuse(f"{name} applies a replicated tensor that needs a gradient (a parameter of a "
                              f"module without a style, or a value computed from one) to a {WORDS[tag]} "
                              f"activation: each rank would compute only part of its gradient{fix}")
        handlers = {IN: self._region_input, F: self._features, S: self._sequence, V: self._vocab}
        return handlers[tag](name, args, kwargs)

    def _replicated(self, name: str, args: Args, kwargs: Kwargs, ts: list[torch.Tensor],
                    tags: set[str]) -> str:
        if W in tags:
            if any(layout_of(t) == R and t.requires_grad for t in ts):
                raise self.refuse(f"{name} applies a parameter whose gradient is summed over the tp ranks "
                                  "(SequenceParallel under sequence parallelism) to a full replicated "
                                  "activation: the sum would count its gradient tp times (is the sequence "
                                  "split before it?)")
            return W
        self._dropout(name, args, kwargs, R)
        return R

    def _dropout(self, name: str, args: Args, kwargs: Kwargs, tag: str) -> None:
        """Dropout must draw from the stream that matches what it drops (see `RNGFork`)."""
        if name in DROPOUT:
            p, training = _arg(args, kwargs, 1, "p", 0.5), _arg(args, kwargs, 2, "training", True)
        elif name == "scaled_dot_product_attention":
            p, training = _arg(args, kwargs, 4, "dropout_p", 0.0), True
        else:
            return
        if not p or not training:
            return
        forked = self.ctx.rng.active
        if tag == R and forked:
            raise self.refuse("drops out a replicated activation on the per-rank random stream: every rank "
                              "would draw a different mask (leave it outside ParallelRegions, or after the "
                              "RowwiseParallel layer)")
        if tag != R and not forked:
            raise self.refuse(f"drops out a {WORDS[tag]} activation on the synchronized random stream: "
                              "every rank would draw the same mask for different data (give it "
                              "SequenceParallel(), or keep fork_rng on its ParallelRegion)")

    def _region_input(self, name: str, args: Args, kwargs: Kwargs) -> str:
        if name in CONVERT or name in VIEWS or name == "getitem":
            return IN
        raise self.refuse(f"{name} reads the input of its ParallelRegion directly; only column-parallel "
                          "layers may (f sums the gradient each rank computes for that input over the tp "
                          "ranks, so a norm, a residual addition or any other use inside the region would be "
                          "counted tp times): put the region around the attention or MLP only")

    def _features(self, name: str, args: Args, kwargs: Kwargs) -> str:
        if not self.regions:
            raise self.refuse(f"{name} uses a feature-split activation (local heads or hidden units) "
                              "outside every ParallelRegion: a RowwiseParallel layer must combine it first")
        self._dropout(name, args, kwargs, F)
        return F

    def _vocab(self, name: str, args: Args, kwargs: Kwargs) -> str:
        if name in ELEMENTWISE:
            return V
        raise self.refuse(f"{name} on vocabulary-split logits (a VocabParallelOutput that keeps them "
                          "sharded): only elementwise operations are exact on them; use "
                          "plait.vocab_parallel_cross_entropy for the loss, or gather the logits "
                          "(loss_parallel=False)")

    def _sequence(self, name: str, args: Args, kwargs: Kwargs) -> str:
        x = next(t for t in _tensors((args, kwargs)) if layout_of(t) == S)
        if _position_wise(name, args, kwargs, x, inside_norm=self.seq_local > 0):
            self._dropout(name, args, kwargs, S)
            return S
        raise self.refuse(f"{name} on a sequence-split activation is not position-wise: under sequence "
                          "parallelism only elementwise operations, reductions over the hidden dims, norms "
                          "and dropout may run on sequence shards (attention or anything else mixing "
                          "positions needs a ParallelRegion, or sequence_parallel=False)")


def _position_wise(name: str, args: Args, kwargs: Kwargs, x: torch.Tensor, inside_norm: bool) -> bool:
    """Whether ``name`` acts on each position of the sequence-split ``x`` (dim 1) on its own."""
    nd = x.dim()
    if name in ELEMENTWISE or name in DROPOUT:
        return True
    if name in ("max", "min") and isinstance(_arg(args, kwargs, 1, "other"), torch.Tensor):
        return True
    if name in REDUCE:
        dims = _dims(_arg(args, kwargs, 2 if name in ("norm", "normalize") else 1, "dim"), nd)
        return dims is not None and all(d >= 2 for d in dims)
    if name in NORMS:
        return len(tuple(_arg(args, kwargs, 1, "normalized_shape", ()))) <= nd - 2
    if name in LINEAR:
        other = args[1] if len(args) > 1 else kwargs.get("weight")
        return len(args) > 0 and args[0] is x and isinstance(other, torch.Tensor) and other.dim() <= 2
    if name in SPLIT:
        dim = _arg(args, kwargs, 1, "dim", 0) if name == "narrow" else _arg(args, kwargs, 2, "dim", 0)
        return int(dim) % nd >= 2
    if name == "permute":
        raw = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
        dims = _dims(raw or kwargs.get("dims"), nd)
        return dims is not None and dims[:2] == [0, 1]
    if name in MOVES:
        dims = _dims([a for a in args[1:] if isinstance(a, int)] or kwargs.get("dims"), nd)
        return dims is not None and all(d >= 2 for d in dims)
    if name == "getitem":
        return _keeps_leading(args[1] if len(args) > 1 else None, nd)
    return name in VIEWS and inside_norm  # a norm's reshapes keep (batch, sequence)


def _reads_other_dim(name: str, args: Args, kwargs: Kwargs) -> bool:
    dim = _arg(args, kwargs, 1, "dim") if name == "size" else None
    return isinstance(dim, int) and isinstance(args[0], torch.Tensor) and dim % args[0].dim() != 1


def _keeps_leading(index: Any, nd: int) -> bool:
    """Whether ``x[index]`` keeps dims 0 and 1 whole (``x[:, :, :k]``, ``x[..., :k]``)."""
    items = index if isinstance(index, tuple) else (index,)
    if items and items[0] is Ellipsis:
        return all(isinstance(i, slice) for i in items[1:]) and len(items) - 1 <= nd - 2

    def whole(i: Any) -> bool:
        return isinstance(i, slice) and i.start in (None, 0) and i.stop is None and i.step in (None, 1)

    return all(whole(i) for i in items[:2]) and all(isinstance(i, slice) or i is Ellipsis for i in items[2:])


# ------------------------------------------------------------------ the emulated group
class _Emulator:
    """Rank 0's view of each collective: shapes only, and the layout of the result."""

    shapes_only = True

    def __init__(self, n: int, trace: _Trace) -> None:
        self.n, self.trace = n, trace

    def collective(self, op: str, x: torch.Tensor, dim: int) -> torch.Tensor:
        n = self.n
        with self.trace.quietly():
            if op in ("copy_to_tp", "reduce_from_tp"):
                out, tag = x.clone(), IN if op == "copy_to_tp" else R
            elif op in ("sum_over_tp", "sum_grad_on_first"):  # the layout stays; gradients are summed
                out, tag = x.clone(), layout_of(x)
            elif op in ("gather_from_sp", "replicate_from_sp", "gather_from_tp"):
                out, tag = torch.cat([x] * n, dim=dim), IN if op == "gather_from_sp" else R
            elif op in ("reduce_scatter_to_sp", "scatter_to_sp", "scatter_to_tp"):
                if x.shape[dim] % n:
                    raise ValueError(f"{op}: dim {dim} of a {tuple(x.shape)} tensor does not split into {n}")
                out, tag = x.narrow(dim, 0, x.shape[dim] // n), F if op == "scatter_to_tp" else S
            else:
                raise AssertionError(op)
        mark(out, tag)
        return out


# ------------------------------------------------------------------ the run
def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are on the meta device (ties kept;
    no data copied)."""
    memo: dict[int, Any] = {}
    for t in [*module.parameters(), *module.buffers()]:
        m = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(m, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else m
    try:
        return copy.deepcopy(module, memo)
    except Exception as e:
        raise PlanError(f"plan check: cannot copy the {type(module).__name__} to the meta device for the dry "
                        f"run ({type(e).__name__}: {e}); pass check=False to skip the check") from e


def shard_parameters(module: nn.Module, specs: dict[int, ShardSpec]) -> dict[int, str]:
    """Replace each split parameter of the meta ``module`` by its shard; id -> name of the shards."""
    done: dict[int, nn.Parameter] = {}
    names: dict[int, str] = {}
    for mname, mod in module.named_modules():
        for key, p in list(mod._parameters.items()):
            if p is None or id(p) not in specs:
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(specs[id(p)].take(p.detach()), requires_grad=p.requires_grad)
                names[id(done[id(p)])] = f"{mname}.{key}" if mname else key
            mod._parameters[key] = done[id(p)]
    return names


def _record(mod: nn.Module, name: str, record: dict[str, Any], trace: _Trace) -> None:
    """Store ``mod``'s first call in ``record[name]``: (args, kwargs) as `Blank`s, and the
    layouts of its output tensors, each as it enters or leaves (before or after the styles)."""
    seen: dict[str, Any] = {}

    def before(_m: nn.Module, args: Args, kwargs: Kwargs) -> None:
        if "in" not in seen:
            with trace.quietly():
                seen["in"] = (describe(args, layout_of), describe(kwargs, layout_of))

    def after(_m: nn.Module, _args: Args, _kwargs: Kwargs, out: Any) -> None:
        if "in" in seen and name not in record_done:
            record_done.add(name)
            record[name] = (*seen["in"], [layout_of(t) for t in _tensors(out)])

    record_done: set[str] = set()
    mod.register_forward_pre_hook(before, prepend=True, with_kwargs=True)
    mod.register_forward_hook(after, with_kwargs=True)


def _local_counts(ctx: TPContext, failed_at: str) -> str:
    """What the attention around ``failed_at`` was told of its local sizes, if it was."""
    from plait.tp.attention import AttentionParallel

    for name, style in ctx.assigned.items():
        inside = not name or failed_at == name or failed_at.startswith(name + ".")
        if isinstance(style, AttentionParallel) and style.attrs and inside:
            local = style.counts(ctx.size)
            given = ", ".join(f"{a}={local[what]}" for a, what in style.attrs)
            return (f"\n(the plan gave {name!r} this rank's sizes: {given}; a forward that takes a head "
                    "count or width from anywhere else, such as its input's shape (x.size()) or the "
                    "model's config, cannot be split by heads: let it read those attributes)")
    return ""


def trace_layouts(module: nn.Module, ctx: TPContext, specs: dict[int, ShardSpec], args: Args, kwargs: Kwargs,
            allow_sequence_output: bool = False, record: dict[str, Any] | None = None) -> None:
    """Run ``module`` (a meta copy, styles assigned in ``ctx`` but not installed) as rank 0 of
    ``ctx.size`` would, on ``args``/``kwargs`` (meta tensors, tagged); raise `PlanError` on the
    first operation the rules refuse, or when the run fails. Sequence-split outputs are allowed
    only when the inputs were sequence-split too (``allow_sequence_output``). ``record``: for
    each of its keys (module names), the first call's inputs and outputs' layouts are stored
    there (`plait.tp.numeric.verify` replays them with values)."""
    modules = dict(module.named_modules())
    sharded = shard_parameters(module, specs)
    for name, style in ctx.assigned.items():
        style.install(modules[name], name, ctx)
    for p in module.parameters():
        if id(p) in ctx.seq_grads.watched:
            mark(p, W)
    trace = _Trace(ctx, {n: type(m).__name__ for n, m in modules.items()}, sharded)
    for name, mod in modules.items():
        hooked = ctx.assigned.get(name)
        mod.register_forward_pre_hook(partial(trace.enter, name, hooked), prepend=True, with_kwargs=True)
        mod.register_forward_hook(partial(trace.leave, name, hooked), always_call=True, with_kwargs=True)
    if record is not None:
        for name in list(record):
            _record(modules[name], name, record, trace)
    try:
        shapes_only = fake_tensors()
        # Compiled blocks run eagerly here: the trace follows each module's own call and hooks,
        # which a compiled block's graph would run as one.
        with (torch.random.fork_rng(devices=[]), emulated(_Emulator(ctx.size, trace)), shapes_only, trace,
              torch.compiler.set_stance("force_eager")):
            out = module(*args, **kwargs)
    except PlanError:
        raise
    except Exception as e:
        layout = f"tp={ctx.size}" + (" with sequence parallelism" if ctx.sequence_parallel else "")
        raise PlanError(
            f"plan refused: the layout trace of the model split over {layout} (rank 0's shards, on fake "
            f"tensors) failed in {trace.where(trace.failed_at or '')}: {type(e).__name__}: {e}"
            f"{_local_counts(ctx, trace.failed_at or '')}\n(an error "
            "about shapes means the plan does not fit the model; one about data-dependent values or meta "
            "tensors means the forward cannot run without data: pass check=False to skip this check)") from e
    refused = (IN, F, W) if allow_sequence_output else (IN, F, S, W)
    for t in _tensors(out):
        if layout_of(t) in refused:
            raise PlanError(f"plan refused: the model returns a {WORDS[layout_of(t)]} tensor of shape "
                            f"{tuple(t.shape)}; each rank would return a different part of it (the plan "
                            "must bring every output back to a replicated tensor or vocabulary-split logits)")
