"""Tensor and sequence parallelism (Megatron-LM), applied to unmodified models by a plan.

    mesh = plait.Mesh(dp=2, tp=2)
    with torch.device("meta"):
        model = GPT(cfg)
    model = plait.tensor_parallel(model, mesh, plait.gpt_plan(cfg), sequence_parallel=True, seed=0)
    loss_fn = plait.loss_fn_for(model)        # vocab-parallel cross-entropy, or lm_loss
    loss = loss_fn(model(idx), targets)

A plan maps module-name patterns to styles (`plait.tp.styles`). Patterns follow
`plait.state.names.matches`: ``*`` stands for one name segment (``layers.*.attn`` matches
``layers.3.attn``, not ``layers.3.x.attn``), with the usual `fnmatch` rules inside a segment.

Only the ``tp`` axis of the mesh is used, so data or fully sharded parallelism can wrap the
result on the other axes. Each rank materializes only its shards: a module on the meta device
gets its full initial values from `plait.state.materialize.materialize` (one module at a time) and
keeps its slice, so values equal the slice of a single-process `init_weights` under the same
seed; an already materialized module is sliced in place instead.

Communication per transformer block (Megatron, section 3): forward all-reduce after the
attention and after the MLP, backward all-reduce where each region's input entered (2 + 2).
With ``sequence_parallel=True`` each all-reduce becomes a reduce-scatter / all-gather pair
along the sequence, and norms and dropouts run on sequence shards.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.losses import lm_loss
from plait.runtime import comm
from plait.runtime.env import device as _device
from plait.runtime.mesh import Mesh
from plait.runtime.rng import RNGFork
from plait.runtime.routing import share_routing_over
from plait.state.materialize import Keep, materialize, module_seed
from plait.state.names import matches
from plait.state.placement.records import TPInfo, attach_tp_info, attached_tp_info, tp_info
from plait.state.placement.shards import ShardSpec
from plait.state.placement.state import place_state_dict
from plait.state.placement.tp_params import place_tp_parameters
from plait.tp.context import SequenceShardGrads, Style, TPContext
from plait.tp.layers import activation_name
from plait.tp.layout_trace import PlanError, mark, meta_copy, shard_parameters, trace_layouts
from plait.tp.loss import vocab_parallel_cross_entropy
from plait.tp.numeric import verify
from plait.tp.sequence import ScatterSequence
from plait.tp.styles import VocabParallelEmbedding, VocabParallelOutput

Plan = Mapping[str, Style]
# Names of a forward's first parameter that mean "token ids": the layout trace can make such an input.
TOKEN_INPUTS = ("input_ids", "idx", "ids", "tokens", "token_ids", "input_tokens")


def tensor_parallel(
    module: nn.Module, mesh: Mesh, plan: Plan, *, sequence_parallel: bool = False, seed: int = 0,
    strict: bool = True, example_inputs: Any = None, check: bool | str = True,
    origin: nn.Module | None = None,
) -> nn.Module:
    """Shard ``module`` in place over ``mesh.group('tp')`` following ``plan``; return it.

    ``seed`` is the `plait.init_weights` seed used for modules still on the meta device.
    ``strict=False`` lets plan patterns match nothing (a pipeline stage holding only some of
    the model's modules); by default such a pattern is an error, since it is usually a typo.
    Every argument and the whole plan are checked before any parameter changes or any
    collective runs; the only collective here is one broadcast that synchronizes the default
    random generator across the tp group (replicated dropout masks must agree).

    The check includes `check_plan`'s layout trace on the meta device, which refuses a plan that
    would not reproduce single-process training. It runs here on ``example_inputs`` (see
    `check_plan`), or on token ids it makes itself when ``forward``'s first parameter is named
    like them; otherwise on the first call's own inputs, before that call communicates.
    The check then verifies the plan by its numbers (`plait.tp.numeric`): each distinct unit
    (an attention, an MLP, the embedding...) is built whole on the CPU in float64, run as one
    process and split over ``tp`` ranks on the same random inputs, and a difference in outputs
    or gradients refuses the plan, naming the module and the tensor. ``check="shapes"`` runs
    the layout trace only (it costs no data; the numeric check costs one forward and backward of
    each distinct unit, logged at INFO; skipped on the meta device, where a layout is only
    rehearsed, and for a unit over `plait.tp.numeric.MAX_UNIT_BYTES`, with a warning);
    ``check=False`` skips both (a model whose forward
    cannot run without data).
    ``origin``, the whole model when ``module`` holds only some of it (see
    `plait.state.materialize.materialize`), gives a meta tensor tied to a module outside ``module`` its
    first owner's initial values (a pipeline's last stage holding the LM head tied to the first
    stage's embedding), and the modules above ``module``'s their ``init_weights()``.
    """
    _check_arguments(module, mesh, plan)
    numeric = _check_mode(check)

    # The tp group and this rank's place in it, read from the mesh once; all below uses them.
    n, r, group, first = mesh.size("tp"), mesh.rank("tp"), mesh.group("tp"), mesh.group_ranks("tp")[0]
    dev = _device()
    ctx = TPContext(group=group, size=n, rank=r, sequence_parallel=bool(sequence_parallel),
                    rng=RNGFork(module_seed(seed, f"plait.tp.rng.{r}"), dev),
                    seq_grads=SequenceShardGrads(group))
    ctx.assigned = assign_styles(module, plan, strict)
    modules = dict(module.named_modules())
    for name, style in ctx.assigned.items():
        style.validate(modules[name], name, ctx)
    specs = _param_specs(module, ctx)
    named_specs = {k: specs[id(p)] for k, p in _named_params(module) if id(p) in specs}
    heads = [(name, s) for name, s in ctx.assigned.items()
             if isinstance(s, VocabParallelOutput) and not s.gather_output]
    vocab_size = _head_vocab(specs, modules, heads)
    later = None
    if check:
        numeric = numeric and dev.type != "meta"  # a rehearsal of the layout (`plait plan`): no values
        later = _check_now_or_later(module, plan, n, bool(sequence_parallel), strict, example_inputs, numeric)

    materialize(module, seed, _keep_tp_shard(specs, dev), origin)
    for name, style in ctx.assigned.items():
        style.install(modules[name], name, ctx)
    if later is not None:  # first in line: before any hook of the call communicates
        later.handle = module.register_forward_pre_hook(later, prepend=True, with_kwargs=True)
    if n > 1:
        _sync_default_rng(group, first, dev)
    if ctx.sequence_parallel and n > 1:
        # MoE layers (plait's GPT plan runs them replicated, on sequence shards): their balancing
        # counts and the experts in use are summed over tp, with or without expert parallelism.
        share_routing_over(module, ctx.group, n)

    info = TPInfo(group=ctx.group, size=n, rank=r, sequence_parallel=ctx.sequence_parallel,
                  specs=named_specs, styles=dict(ctx.assigned), vocab_size=vocab_size)
    attach_tp_info(module, info)
    if n > 1:  # torch's tools see DTensors of the full tensors (DCP, clip, Muon): as one process
        place_state_dict(module, info)  # the plain shards' entries, once DDP or a pipeline makes them plain
        place_tp_parameters(module, info)
    return module


def _check_arguments(module: nn.Module, mesh: Mesh, plan: Plan) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"tensor_parallel(module=...) expects an nn.Module, got {type(module).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"tensor_parallel(mesh=...) expects a plait.Mesh, got {type(mesh).__name__}")
    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(f"tensor_parallel(plan=...) expects a non-empty mapping of module-name pattern -> "
                        f"style, got {plan!r}")
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not isinstance(style, Style):
            raise TypeError(f"tensor_parallel(plan=...): entry {pattern!r}: {style!r} is not "
                            "'pattern (str)': Style (e.g. ColwiseParallel())")
    if attached_tp_info(module) is not None:
        raise ValueError("tensor_parallel: this module is already tensor-parallel")


def _head_vocab(specs: dict[int, ShardSpec], modules: dict[str, nn.Module],
                heads: Sequence[tuple[str, Style]]) -> int | None:
    """The full vocabulary of the one lm_head whose logits stay sharded (None: none do)."""
    if len(heads) > 1:
        raise ValueError(f"plan: at most one VocabParallelOutput may leave its logits sharded, got "
                         f"{[h for h, _ in heads]}")
    return specs[id(modules[heads[0][0]].weight)].full if heads else None


def loss_fn_for(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss a training loop should call on ``model``'s output: `lm_loss` for full logits,
    vocab-parallel cross-entropy when the model's lm_head leaves its logits sharded."""
    info = tp_info(model)
    if info is None or info.vocab_size is None:
        return lm_loss
    return partial(vocab_parallel_cross_entropy, group=info.group, vocab_size=info.vocab_size)


def _check_mode(check: bool | str) -> bool:
    """Whether ``check`` (True, "shapes" or False) asks for the numeric check."""
    if check not in (True, False, "shapes"):
        raise ValueError(f"check= must be True (layout trace and numeric check), 'shapes' (layout trace "
                         f"only) or False, got {check!r}")
    return check is True


def check_plan(module: nn.Module, plan: Plan, *, tp: int, sequence_parallel: bool = False,
               example_inputs: Any = None, strict: bool = True, numeric: bool = True) -> None:
    """Refuse ``plan`` for ``module`` at tensor-parallel size ``tp`` if it would not reproduce
    single-process training: raise ``ValueError`` (`plait.tp.layout_trace.PlanError` for what the
    layout trace finds) naming the module and the reason. No process group is needed, nothing
    communicates and ``module`` is not changed (the layout trace works on a meta-device copy).

    ``example_inputs``: the forward's arguments, as a tensor, a tuple of positional arguments
    or a dict of keyword arguments (their values are not used, only shapes and dtypes); by
    default token ids of shape ``(1, 2 * tp)`` when ``forward``'s first parameter is named like
    token ids (``input_ids``, ``idx``...), and as ``decoder_input_ids`` when it takes those.
    Under sequence parallelism, floating-point inputs count as this rank's sequence shard unless
    the plan splits the sequence itself (a `ScatterSequence` or a `VocabParallelEmbedding`).

    ``numeric`` (default): also verify each distinct unit by its numbers (`plait.tp.numeric`).
    """
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"check_plan(tp=...) must be a positive int, got {tp!r}")
    inputs = _example_inputs(module, tp, example_inputs)
    if inputs is None:
        raise TypeError(f"check_plan: {type(module).__name__}.forward does not take token ids as its first "
                        "argument; pass example_inputs=(args...) or {kwargs...}")
    _trace_plan(module, plan, tp, sequence_parallel, strict, inputs, numeric)


def validate_tied_splits(module: nn.Module, plan: Plan, *, tp: int) -> None:
    """Refuse ``plan`` when it splits a tensor shared by several modules of ``module`` (an
    embedding tied to the LM head) differently at its uses, e.g. the embedding by vocabulary and
    the head not at all. A pipeline keeps such a tensor as one copy per pp rank and sums the
    copies' gradients between the ranks of the same tp coordinate, which is exact only when each
    tp rank holds the same rows at every use (`VocabParallelEmbedding` and `VocabParallelOutput`
    both take rows ``[r * ceil(V / tp), ...)``, padding included). Nothing communicates and
    ``module`` is not changed."""
    validate_styles(module, plan, tp=tp)


def validate_styles(module: nn.Module, plan: Plan, *, tp: int, sequence_parallel: bool = False) -> None:
    """Each style of ``plan`` against the module it is assigned to at size ``tp`` (what it splits
    divides evenly, the module is of a kind it can split) and every tensor split one way: the static
    part of `check_plan`, without running a forward (milliseconds for a model of any depth).
    Nothing communicates and ``module`` is not changed."""
    ctx = TPContext(group=None, size=tp, rank=0, sequence_parallel=sequence_parallel,
                    rng=RNGFork(0, torch.device("cpu")), seq_grads=SequenceShardGrads(None))
    ctx.assigned = assign_styles(module, plan, strict=False)
    modules = dict(module.named_modules())
    for name, style in ctx.assigned.items():
        style.validate(modules[name], name, ctx)
    _param_specs(module, ctx)  # raises for a tied tensor split two ways


def _example_inputs(module: nn.Module, n: int, given: Any) -> tuple[tuple, dict] | None:
    if given is None:
        if activation_name(module) not in TOKEN_INPUTS:
            return None
        ids = torch.zeros(1, 2 * n, dtype=torch.long, device="meta")
        # An encoder-decoder (T5) needs its decoder's ids too.
        decoder = "decoder_input_ids" in inspect.signature(module.forward).parameters
        return (ids,), {"decoder_input_ids": ids} if decoder else {}
    if isinstance(given, torch.Tensor):
        return (given,), {}
    if isinstance(given, dict):
        return (), dict(given)
    if isinstance(given, tuple):
        return given, {}
    raise TypeError(f"example_inputs must be a tensor, a tuple of arguments or a dict of keyword arguments, "
                    f"got {type(given).__name__}")


def _trace_plan(module: nn.Module, plan: Plan, n: int, sp: bool, strict: bool,
                  inputs: tuple[tuple, dict], numeric: bool = True) -> None:
    """`check_plan` on ``inputs``: the styles' own checks, `plait.tp.layout_trace.trace_layouts`, then
    (``numeric``) `plait.tp.numeric.verify` of each distinct unit the layout trace called."""
    template = meta_copy(module)
    ctx = TPContext(group=None, size=n, rank=0, sequence_parallel=sp, rng=RNGFork(0, torch.device("cpu")),
                    seq_grads=SequenceShardGrads(None))
    ctx.assigned = assign_styles(template, plan, strict)
    modules = dict(template.named_modules())
    for name, style in ctx.assigned.items():
        style.validate(modules[name], name, ctx)
    specs = _param_specs(template, ctx)
    splits = any(isinstance(s, (ScatterSequence, VocabParallelEmbedding)) for s in ctx.assigned.values())
    floats = "S" if sp and not splits else "R"
    args, kwargs = _on_meta(inputs[0], floats), _on_meta(inputs[1], floats)
    record: dict[str, Any] | None = dict.fromkeys(ctx.assigned) if numeric else None
    trace_layouts(template, ctx, specs, args, kwargs, allow_sequence_output=floats == "S", record=record)
    if record is not None:
        seen = {k: v for k, v in record.items() if v is not None}
        verify(module, ctx.assigned, n, sp, seen, PlanError, _split_for_check)


def _split_for_check(module: nn.Module, ctx: TPContext) -> dict[str, ShardSpec]:
    """Give ``module`` (a copy in the numeric check) rank ``ctx.rank``'s shards; by name."""
    specs = _param_specs(module, ctx)
    named = {k: specs[id(p)] for k, p in module.named_parameters() if id(p) in specs}
    shard_parameters(module, specs)
    return named


def _on_meta(obj: Any, float_layout: str) -> Any:
    """``obj`` with every tensor replaced by an empty meta tensor of the same kind; floating
    tensors get ``float_layout`` (see `plait.tp.layout_trace`)."""
    if isinstance(obj, torch.Tensor):
        t = torch.empty_like(obj, device="meta").requires_grad_(obj.requires_grad)
        if t.is_floating_point():
            mark(t, float_layout)
        return t
    if isinstance(obj, dict):
        return {k: _on_meta(v, float_layout) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_meta(v, float_layout) for v in obj)
    return obj


def _check_now_or_later(module: nn.Module, plan: Plan, n: int, sp: bool, strict: bool, given: Any,
                        numeric: bool):
    """Run `check_plan`'s layout trace now when inputs are known; else return a forward pre-hook that
    runs it on the first call's inputs (None when the module is never called as a whole)."""
    inputs = _example_inputs(module, n, given)
    if inputs is not None:
        _trace_plan(module, plan, n, sp, strict, inputs, numeric)
        return None
    if type(module).forward is nn.Module.forward:  # a container (a pipeline's view): never called
        return None
    template = meta_copy(module)

    def first_call(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
        _trace_plan(template, plan, n, sp, strict, (args, kwargs), numeric)  # refused: every call is
        first_call.handle.remove()  # type: ignore[attr-defined]

    return first_call


def assign_styles(module: nn.Module, plan: Plan, strict: bool) -> dict[str, Style]:
    """Module name -> its style under ``plan``; a name matched twice is an error, and so is a
    pattern that matches nothing when ``strict``."""
    assigned: dict[str, Style] = {}
    by: dict[str, str] = {}
    used: set[str] = set()
    for name, _ in module.named_modules():
        for pattern, style in plan.items():
            if name and matches(pattern, name):
                if name in assigned:
                    raise ValueError(f"plan: module {name!r} is matched by both {by[name]!r} and {pattern!r}")
                assigned[name], by[name] = style, pattern
                used.add(pattern)
    unused = [p for p in plan if p not in used]
    if unused and strict:
        raise ValueError(f"plan: pattern(s) {unused} match no module of this {type(module).__name__} "
                         "(a '*' stands for exactly one name segment)")
    return assigned


# ------------------------------------------------------------------ internals

def _named_params(module: nn.Module):
    return module.named_parameters(remove_duplicate=False)


def _param_specs(module: nn.Module, ctx: TPContext) -> dict[int, ShardSpec]:
    """Shard of each split parameter, by identity; tied parameters must agree on it.

    A module without a style wants its parameters whole (a tied LM head left out of the plan
    computes with the whole tensor: a plan that splits it at another use is refused), except
    where it only registers a tensor a styled module computes with: a container (BERT's MLM head
    registers the decoder's bias as its own ``bias`` too), or a second module of the same kind
    as a styled one holding it (T5's ``shared`` embedding beside each stack's ``embed_tokens``)."""
    specs: dict[int, ShardSpec | None] = {}
    owner: dict[int, str] = {}
    styled_kinds: dict[int, set[type]] = {}
    for name, mod in module.named_modules():
        if name in ctx.assigned:
            for p in mod._parameters.values():
                if p is not None:
                    styled_kinds.setdefault(id(p), set()).add(type(mod))
    for name, mod in module.named_modules():
        style = ctx.assigned.get(name)
        if style is None and (next(mod.children(), None) is not None or any(
                type(mod) in styled_kinds.get(id(p), ()) for p in mod._parameters.values() if p is not None)):
            continue
        wanted = style.shard_specs(mod, ctx) if style is not None else {}
        for key, p in mod._parameters.items():
            if p is None:
                continue
            spec, qual = wanted.get(key), f"{name}.{key}" if name else key
            if id(p) in specs and specs[id(p)] != spec:
                raise ValueError(f"plan: {owner[id(p)]!r} and {qual!r} are the same (tied) parameter but "
                                 f"the plan splits them differently ({specs[id(p)]} vs {spec})")
            specs.setdefault(id(p), spec)
            owner.setdefault(id(p), qual)
    return {k: v for k, v in specs.items() if v is not None}


def _keep_tp_shard(specs: dict[int, ShardSpec], dev: torch.device) -> Keep:
    """Tensor parallelism's share of each tensor: a split parameter's shard, anything else whole,
    on ``dev`` (a materialized tensor already there stays the same object)."""

    def keep(name: str, attr: str, full: torch.Tensor, t: torch.Tensor) -> torch.Tensor | None:
        spec = specs.get(id(t))
        if spec is None and not t.is_meta and t.device == dev:
            return None
        local = spec.take(full) if spec is not None else full
        return local.to(dev).contiguous()

    return keep


def _sync_default_rng(group: dist.ProcessGroup, src: int, dev: torch.device) -> None:
    """Give every rank of the tp ``group`` its first rank's (global ``src``) default random state
    (replicated dropout must agree)."""
    if dev.type == "meta":  # a dry run has no random state to share
        return
    states = [torch.get_rng_state()]
    if dev.type == "cuda":
        states.append(torch.cuda.get_rng_state(dev))
    for i, state in enumerate(states):
        buf = state.to(dev)
        comm.broadcast(buf, src, group)
        if i == 0:
            torch.set_rng_state(buf.cpu())
        else:
            torch.cuda.set_rng_state(buf.cpu(), dev)
