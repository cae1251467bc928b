"""Whether a layout can run: one rule set, decided before any process group exists.

    from plait.compose.rules import MeshShape, check_layout

    with torch.device("meta"):
        model = build()
    check_layout(model, MeshShape(fsdp=2, tp=3), plait.ParallelPlan(tp=plait.plan_for(model), data="fsdp"))
    # LayoutError: tp=3: ... ; nearest valid: tp=2 (fsdp=3), tp=1 (fsdp=6)

`check_layout` reads a model (on the meta device or real; nothing is allocated or changed), the
mesh's shape (a `MeshShape`, a dict of degrees, or a `plait.Mesh`) and a `plait.ParallelPlan`.
`plait.parallelize` calls it on every rank before its first collective; `plait train`,
`plait check` and `plait plan` call it in the parent, before any process starts, and name their
flags for the fields a refusal names (`LayoutError.fields`). Where a degree does not fit, the
refusal lists the nearest degrees that do (the data axis takes up the difference).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from torch import nn

from plait.compose.activation_checkpointing import select_blocks
from plait.compose.layout_error import LayoutError
from plait.compose.parallel_plan import ParallelPlan
from plait.cp.apply import ALGORITHMS
from plait.cp.positions import rotaries
from plait.ep.apply import expert_counts, no_moe_reason
from plait.ep.stacked import stacked_expert_modules
from plait.models.moe import MoE, moe_layers
from plait.pipeline.actions import Kind
from plait.pipeline.arguments import resolve_schedule
from plait.pipeline.schedules import Schedule
from plait.pipeline.split import plan_stages, segments
from plait.pipeline.ties import find_ties
from plait.state.names import matches
from plait.state.precision import check_castable
from plait.tp.apply import check_plan, validate_styles
from plait.tp.styles import ParallelRegion

if TYPE_CHECKING:
    from plait.runtime.mesh import Mesh

__all__ = ["MeshShape", "LayoutError", "Layout", "check_layout"]

ZERO3_SPLIT_BACKWARD = (
    "ZeRO-3 frees each stage's gathered parameters when a backward pass ends, so the deferred W, "
    "which runs later from the saved graph, could read freed parameters (any weight gradient that "
    "depends on the weight itself); use zero_stage=2 (parameters stay gathered) or data='ddp', or a "
    "schedule without W: 'gpipe', '1f1b' or 'interleaved'")


@dataclass(frozen=True)
class MeshShape:
    """The degrees of a `plait.Mesh`, without its process groups (``ep`` is folded out of dp x fsdp)."""

    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise LayoutError(f"{f.name}={v!r}: a mesh degree must be a positive integer", (f.name,))
        if (self.dp * self.fsdp) % self.ep:
            raise LayoutError(f"ep={self.ep}: expert parallelism folds its groups out of the data axes, "
                              f"dp x fsdp = {self.dp * self.fsdp} ranks here; ep must divide them",
                              ("ep",), axis="ep")

    @classmethod
    def of(cls, mesh: MeshShape | Mesh | Mapping[str, int]) -> MeshShape:
        """The shape of a mesh, or of degrees given by axis name (absent axes are 1)."""
        if isinstance(mesh, MeshShape):
            return mesh
        if isinstance(mesh, Mapping):
            unknown = sorted(set(mesh) - {f.name for f in fields(cls)})
            if unknown:
                raise LayoutError(f"unknown mesh axes {unknown}; the axes are pp, dp, fsdp, cp, tp and ep",
                                  tuple(unknown))
            return cls(**mesh)
        return cls(**mesh.shape, ep=mesh.ep)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.fsdp * self.cp * self.tp

    def size(self, axes: str | Sequence[str]) -> int:
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        return math.prod(getattr(self, a) for a in names)

    def __str__(self) -> str:
        shown = [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) > 1]
        return "mesh " + (" x ".join(shown) or "of one rank")


@dataclass(frozen=True)
class Layout:
    """What `check_layout` derived on its way, for the composition to use as it is: the mesh's
    shape and, with pp > 1, the pipeline schedule (made and validated once)."""

    shape: MeshShape
    schedule: Schedule | None


def check_layout(model: nn.Module, mesh: MeshShape | Mesh | Mapping[str, int], plan: ParallelPlan, *,
                 tp_trace: bool = False, numeric: bool = False, suggest: bool = True) -> Layout:
    """Raise `LayoutError` if ``plan`` cannot run ``model`` on a mesh of this shape; return the
    `Layout` it derived if it can. Nothing communicates and ``model`` is not changed.

    Each tensor-parallel style is validated against its module (`plait.tp.validate_styles`: no
    forward runs). ``tp_trace``: also run the plan's layout trace, a forward on fake tensors
    (`plait.tp.check_plan`: a second or more for a deep model), which finds what only a forward
    shows (a module that reads a global head count); ``numeric`` adds its numeric check of each
    distinct block (blocks materialized). `plait.parallelize` runs both through
    `plait.tensor_parallel`. ``suggest``: a refusal about
    a degree lists the nearest degrees that pass.
    """
    _validated(plan)  # a malformed plan is refused as such, whatever the mesh
    shape = MeshShape.of(mesh)
    try:
        return _check(model, shape, plan, tp_trace, numeric)
    except LayoutError as e:
        if suggest and e.axis is not None:
            e.nearest = _nearest(model, shape, plan, e.axis, tp_trace)
        raise


def _validated(plan: ParallelPlan) -> None:
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"expected a plait.ParallelPlan, got {type(plan).__name__}")
    plan.validate()  # again: its fields may have been changed since it was made


def _check(model: nn.Module, shape: MeshShape, plan: ParallelPlan, tp_trace: bool, numeric: bool) -> Layout:
    _data_rules(model, shape, plan)
    _tp_rules(model, shape, plan, tp_trace, numeric)
    if shape.cp > 1:
        _cp_rules(model, shape, plan)
    sched = _schedule(shape, plan) if shape.pp > 1 else None
    _expert_rules(model, shape, plan, sched)
    if plan.precision is not None and plan.data != "fsdp":
        check_castable(model)
    if plan.fsdp_units is not None:  # against the whole model: each stage holds only some units
        names = [n for n, _ in model.named_modules() if n]
        for u in plan.fsdp_units:
            if isinstance(u, str) and not any(matches(u, n) for n in names):
                raise LayoutError(f"ParallelPlan(fsdp_units=...): {u!r} matches no submodule of "
                                  f"{type(model).__name__}", ("fsdp_units",))
    if plan.ac is not None:
        select_blocks(model, plan.ac_blocks, plan.ac_every)  # raises when nothing is matched
    if shape.pp == 1:
        given = plan.pipeline_options()
        if given:
            listed = ", ".join(f"{k}={v!r}" for k, v in given.items())
            one = len(given) == 1
            what, them = ("is a pipeline option", "it") if one else ("are pipeline options", "them")
            raise LayoutError(f"ParallelPlan({listed}) {what}, read only when the mesh has pp > 1; {shape} "
                              f"has pp=1: leave {them} unset or add a pp axis", tuple(given))
    else:
        assert sched is not None
        _pipeline_rules(model, shape, plan, sched)
    return Layout(shape, sched)


def _schedule(shape: MeshShape, plan: ParallelPlan) -> Schedule:
    """The pipeline schedule the plan names, made once for every rule that reads it."""
    try:
        return resolve_schedule(plan.pp_schedule, shape.pp, plan.pp_microbatches, plan.pp_chunks)
    except ValueError as e:
        named = f"pp_schedule={plan.pp_schedule!r} with " if isinstance(plan.pp_schedule, str) else ""
        raise LayoutError(f"{named}pp={shape.pp}, pp_microbatches={plan.pp_microbatches}, "
                          f"pp_chunks={plan.pp_chunks}: {e}",
                          ("pp_schedule", "pp_microbatches", "pp_chunks")) from None


def _data_rules(model: nn.Module, shape: MeshShape, plan: ParallelPlan) -> None:
    if plan.data == "ddp" and shape.fsdp > 1:
        raise LayoutError(f"data='ddp' uses the dp axis, but {shape} has fsdp={shape.fsdp}; use "
                          "data='fsdp' or put those ranks on dp", ("data", "fsdp"))


def _tp_rules(model: nn.Module, shape: MeshShape, plan: ParallelPlan, trace: bool, numeric: bool) -> None:
    if shape.tp > 1 and plan.tp is None:
        raise LayoutError(f"{shape} has tp={shape.tp} but the plan has no tp styles", ("tp",))
    if plan.sequence_parallel and shape.tp < 2:
        raise LayoutError("sequence_parallel=True splits the sequence over the tensor-parallel ranks: "
                          f"it needs tp >= 2, and {shape} has tp={shape.tp}", ("sequence_parallel", "tp"))
    split_experts = [p for p, st in (plan.tp or {}).items()
                     if ".experts." in p and isinstance(st, ParallelRegion)]
    if plan.sequence_parallel and split_experts:
        raise LayoutError(f"tensor-parallel experts ({split_experts[0]!r}) with sequence parallelism: an "
                          "expert's rows are the tokens routed to it, not a sequence that SP's all-gather "
                          "and reduce-scatter could cut; use gpt_plan(experts='replicate') or "
                          "sequence_parallel=False", ("sequence_parallel", "tp"))
    if plan.tp is None or shape.tp == 1:
        return
    try:
        validate_styles(model, plan.tp, tp=shape.tp, sequence_parallel=plan.sequence_parallel)
        if trace and plan.tp_check is not False:
            check_plan(model, plan.tp, tp=shape.tp, sequence_parallel=plan.sequence_parallel, strict=False,
                       numeric=numeric and plan.tp_check is True)
    except (ValueError, TypeError) as e:
        hint = f"the tp degrees up to {max(_TP_TRIED)} this plan splits: one of {_tp_degrees(model, plan)}"
        raise LayoutError(f"tp={shape.tp}: {e}; {hint}", ("tp",), axis="tp") from None


_TP_TRIED = (1, 2, 3, 4, 5, 6, 7, 8, 16)


def _tp_degrees(model: nn.Module, plan: ParallelPlan) -> list[int]:
    """The degrees in `_TP_TRIED` whose styles validate (no forward run), whatever the world size."""
    fits = [1]
    for tp in _TP_TRIED[1:]:
        try:
            validate_styles(model, plan.tp or {}, tp=tp, sequence_parallel=plan.sequence_parallel)
        except (ValueError, TypeError):
            continue
        fits.append(tp)
    return fits


def _cp_rules(model: nn.Module, shape: MeshShape, plan: ParallelPlan) -> None:
    if plan.cp is None:
        raise LayoutError(f"{shape} has cp={shape.cp} but the plan names no context-parallel algorithm; "
                          f"set ParallelPlan(cp=...) to one of {tuple(ALGORITHMS)}", ("cp",))
    if plan.data == "none":
        raise LayoutError(f"cp={shape.cp} ranks hold the same parameters and see different tokens, so "
                          "their gradients must be averaged; data='none' would leave each rank with its "
                          "own: use data='ddp' or 'fsdp'", ("cp", "data"))
    if shape.pp > 1 and not rotaries(model):
        raise LayoutError("context parallelism inside a pipeline gives positions only to modules whose "
                          "forward takes positions (plait GPT's rotary tables); "
                          f"{type(model).__name__} has none (its positions are computed in its forward, "
                          "which pipeline stages replay on local tokens)", ("cp", "pp"))
    heads = _attention_heads(model)
    if plan.cp == "ulysses" and heads is not None and (heads // shape.tp) % shape.cp:
        raise LayoutError(f"cp='ulysses' splits each rank's {heads // shape.tp} attention heads over "
                          f"cp={shape.cp}; they must divide evenly (or use 'ring' or 'allgather')",
                          ("cp",), axis="cp")


def _attention_heads(model: nn.Module) -> int | None:
    """The query heads a model's config declares (transformers' ``config``, a ``cfg``), else None."""
    for holder in ("config", "cfg"):
        config = getattr(model, holder, None)
        for name in ("num_attention_heads", "n_heads", "n_head"):
            heads = getattr(config, name, None)
            if isinstance(heads, int):
                return heads
    return None


def _expert_rules(model: nn.Module, shape: MeshShape, plan: ParallelPlan, sched: Schedule | None) -> None:
    layers = moe_layers(model)
    counts = expert_counts(model)
    if shape.ep > 1 and not counts:
        raise LayoutError(f"{shape} has ep={shape.ep}, but {no_moe_reason(model)}", ("ep",))
    for _, count in counts:
        if count % shape.ep:
            raise LayoutError(f"ep={shape.ep} splits the {count} experts evenly: it must divide "
                              "them", ("ep",), axis="ep")
    stacked = [n for n, _ in stacked_expert_modules(model)]
    # plait's MoE experts are placed at any ep (marked at ep=1), stacked ones when ep splits them.
    placed = [n for n, m in model.named_modules() if isinstance(m, MoE)] or (stacked if shape.ep > 1 else [])
    lowered = {k: v for k, v, on in (("mixed_precision", plan.mixed_precision, plan.precision is not None),
                                     ("offload", plan.offload, plan.offload)) if on}
    if plan.data == "fsdp" and placed and lowered:
        listed = ", ".join(f"{k}={v!r}" for k, v in lowered.items())
        them = "it" if len(lowered) == 1 else "them"
        raise LayoutError(f"experts ({placed[0]!r}) with data='fsdp' and ParallelPlan({listed}): the experts "
                          "stay whole outside FSDP's shards, where FSDP's mixed precision and offloading "
                          f"would not reach them; train them in fp32 on the device (leave {them} unset) or "
                          "use data='ddp'", ("data", *lowered))
    split = [p for p, st in (plan.tp or {}).items() if any(matches(p, n) for n in stacked)]
    if shape.ep > 1 and shape.tp > 1 and split and plan.data == "fsdp":
        raise LayoutError(f"ep={shape.ep} and tp={shape.tp} both splitting the stacked experts {split[0]!r} "
                          "under FSDP, which keeps experts whole outside its shards and would save their tp "
                          "shards as whole experts; use DDP with ep x tp, or FSDP with ep or tp alone",
                          ("ep", "tp", "data"))
    if shape.pp > 1 and any(m.bias_update_rate and m.balance_statistic == "microbatch" for m in layers):
        raise LayoutError("bias balancing over each micro-batch (balance_statistic='microbatch') with a "
                          "pipeline: the balancing step reads every stage's routing counts, which pipeline "
                          "stages keep apart; use balance_statistic='global' (each layer's counts over the "
                          "whole step)", ("balance_statistic", "pp"))
    weighted = [m for m in layers if m.aux_loss_coef]
    per_microbatch = [m for m in weighted if m.balance_statistic == "microbatch"]
    if shape.cp > 1 and per_microbatch:
        raise LayoutError("an MoE balancing loss over each micro-batch (balance_statistic='microbatch') "
                          "with context parallelism: each cp rank would count the assignments of its part "
                          "of the sequence only; use balance_statistic='global' (or aux_loss_coef=0 with "
                          "bias balancing)", ("cp",))
    if sched is not None and len(per_microbatch) < len(weighted) and not sched.forwards_first:
        raise LayoutError(f"the MoE balancing loss over the step's whole batch "
                          f"(balance_statistic='global') with the {sched.name!r} pipeline schedule: a "
                          "stage runs a microbatch's backward before the step's last forward, so the "
                          "statistic over every microbatch is not known when that backward needs it; "
                          "use pp_schedule='gpipe' (every forward first), or "
                          "balance_statistic='microbatch' (each microbatch's own statistic)",
                          ("pp_schedule",))


def _pipeline_rules(model: nn.Module, shape: MeshShape, plan: ParallelPlan, sched: Schedule) -> None:
    if plan.ddp_options.get("find_unused_parameters"):
        raise LayoutError("ParallelPlan(ddp_options={'find_unused_parameters': True}) cannot be used with a "
                          "pipeline: DDP walks a forward's graph for unused parameters, but a stage's "
                          "microbatches run several forwards before the backward that reduces; every "
                          "parameter of a stage must get a gradient", ("ddp_options",))
    if plan.ddp_options.get("broadcast_buffers"):
        raise LayoutError("ParallelPlan(ddp_options={'broadcast_buffers': True}) cannot be used with a "
                          "pipeline: the broadcast writes the buffers in place before every forward, while "
                          "earlier microbatches' graphs still hold them for their backward; pipeline stages "
                          "get their buffers broadcast once, when wrapped", ("ddp_options",))
    split_backward = any(a.kind is Kind.W for row in sched.actions for a in row)
    if plan.data == "fsdp" and plan.zero_stage == 3 and split_backward:
        raise LayoutError(f"pp_schedule={sched.name!r} with zero_stage=3: the schedule splits backward into "
                          f"B and W; {ZERO3_SPLIT_BACKWARD}",
                          ("pp_schedule", "zero_stage"))
    segs = segments(model)
    names = [n for n, _ in segs]
    if sched.stages > len(segs):
        raise LayoutError(f"pp={shape.pp} x {sched.stages // shape.pp} stages per rank (the chunks, or 2 "
                          f"for the V schedules) = {sched.stages} pipeline stages, but "
                          f"{type(model).__name__} has only {len(segs)} segments to split "
                          f"({', '.join(names)})", ("pp", "pp_chunks"), axis="pp")
    try:
        stage_plan = plan_stages(segs, sched.stages, plan.pp_split)
    except ValueError as e:
        raise LayoutError(f"pp={shape.pp}: {e}", ("pp", "pp_split", "pp_chunks"), axis="pp") from None
    for rank in range(shape.pp):
        mine = [i for s in sched.rank_stages(rank) for i in stage_plan[s]]
        if not any(p.numel() for i in mine for p in segs[i][1].parameters()):
            held = ", ".join(names[i] for i in mine)
            raise LayoutError(f"pp={shape.pp} x {sched.stages // shape.pp} stages per rank: cutting "
                              f"{type(model).__name__}'s {len(segs)} segments into {sched.stages} stages "
                              f"leaves pipeline rank {rank} with only {held}, which holds no parameters; "
                              "use fewer stages", ("pp", "pp_chunks"), axis="pp")
    ties = find_ties(segs, stage_plan, sched) if plan.data == "fsdp" else []
    if ties:
        shared = [t.names for t in ties]
        raise LayoutError(f"weights shared across pp ranks ({shared}) cannot be FSDP-sharded "
                          "per stage (each rank keeps a plain copy whose gradients are summed); untie them "
                          "(e.g. GPTConfig(tie_embeddings=False)) or use data='ddp'", ("data", "pp"))


def _nearest(model: nn.Module, shape: MeshShape, plan: ParallelPlan, axis: str,
             tp_trace: bool) -> list[dict[str, int]]:
    """Degrees of ``axis`` that pass on the same number of ranks, nearest first (at most three):
    the data axis takes up the difference (``ep`` is folded out of the data axes as it is)."""
    data = "fsdp" if plan.data == "fsdp" else "dp"
    world = shape.world
    current = getattr(shape, axis)
    found: list[dict[str, int]] = []
    candidates = [d for d in range(1, world + 1) if world % d == 0 and d != current]
    for d in sorted(candidates, key=lambda d: (abs(math.log(d / current)), d)):
        try:
            if axis == "ep":
                trial = replace(shape, ep=d)
            else:
                rest = shape.size(tuple(a for a in ("pp", "dp", "fsdp", "cp", "tp") if a not in (axis, data)))
                if (world // d) % rest:
                    continue
                trial = replace(shape, **{axis: d, data: world // d // rest})
            _check(model, trial, plan, tp_trace, numeric=False)
        except (LayoutError, ValueError, TypeError):
            continue
        found.append({axis: d} if axis == "ep" else {axis: d, data: getattr(trial, data)})
        if len(found) == 3:
            break
    return found

