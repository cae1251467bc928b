"""Composition: one function that applies the strategies in one fixed order, for every layout.

    model = plait.parallelize(model, mesh, plait.ParallelPlan(tp=plait.gpt_plan(cfg), data="fsdp"))
    pipe = plait.parallelize(model, plait.Mesh(pp=2, fsdp=2, tp=2),
                             plait.ParallelPlan(tp=plait.gpt_plan(cfg), data="fsdp", pp_microbatches=8))

The module is callable: ``plait.parallelize(...)`` is `plait.parallelize.parallelize`
(`plait.callable_module`), and ``plait.parallelize.ORDER`` stays reachable.

The order, and why it is fixed (`ORDER`; torchtitan applies the same steps to every stage):

0. **Pipeline split** (``pp`` axis, when the mesh has pp > 1): the model is cut into stages
   first, so that every later step only ever sees this rank's layers; steps 1-3 then apply to
   each of this rank's stages (`plait.pipeline`, which runs them). The result is a `Pipeline`,
   trained with ``step(inputs, targets)`` instead of a forward call.
1. **Tensor parallel** (``tp`` axis) shards single layers next. It must come before the data
   axes: DDP and FSDP then treat each rank's tensor-parallel shards as ordinary parameters,
   and the data-parallel groups (which differ only in the ``dp``/``fsdp`` coordinate) hold
   shards of identical shape. In a pipeline, one call covers all of this rank's stages (ties
   inside the rank stay ties).
1b. **Context parallel** (``cp`` axis, ``plan.cp``: `plait.context_parallel`) hooks the attention
   modules, whatever tensor parallelism made of them (each rank then attends its local heads
   over the whole sequence), before checkpointing, so that recomputed attention is context
   parallel too. The cp ranks hold replicas that see different tokens: step 3 averages their
   gradients (DDP over dp x cp) or shards over them (FSDP over fsdp x cp), so a mesh with cp > 1
   needs ``data='ddp'`` or ``'fsdp'``. In a pipeline each stage's attention is hooked.
1c. **Expert parallel** (a model with plait MoE layers; the mesh's ``ep`` groups, folded out of
   the data axes): each rank keeps its ep index's experts and exchanges tokens with all-to-alls
   (`plait.expert_parallel`); DDP sums expert gradients over the ranks holding the same experts.
2. **Activation checkpointing** (``plan.ac``: `plait.activation_checkpointing`) next: after
   tensor parallelism, whose collectives and per-rank random streams the recomputed forward must
   repeat (it finds those streams in the blocks), and before data parallelism, whose hooks sit
   outside the checkpointed forwards: an FSDP unit is gathered for backward before its block is
   recomputed, and DDP's and FSDP's gradient hooks fire as usual. In a pipeline each stage's
   share of the blocks (chosen in the whole model, so ``ac_every`` counts across stages) is
   checkpointed.
2b. **Mixed precision** (``plan.mixed_precision``), in one place for both paths: FSDP casts its
   gathered parameters itself; otherwise `plait.mixed_precision` is applied to the
   (materialized, tensor-parallel, checkpointed) model, or to each pipeline stage, before DDP
   wraps it, and DDP reads the policy's reduce dtype from it.
3. **Data parallel** last, on the ``dp`` axis (DDP) or the ``fsdp`` axis with optional ``dp``
   replication (FSDP / HSDP): it only needs the final local parameters. FSDP over tensor
   parallelism (2-D fsdp x tp, or 3-D dp x fsdp x tp) flattens and shards each rank's tp
   shards across its fsdp group; a meta-device model is materialized by TP as tp shards (1/tp
   of each split layer, replicated norms in full), which FSDP then cuts down to its slice.
   Gradient hooks TP put on parameters (sequence parallelism) move to FSDP's leaves, and
   `plait.clip_grad_norm_` counts tp-sharded gradients across tp and replicated ones once.
   In a pipeline each stage is its own DDP or FSDP module (torchtitan's layout): gradients
   accumulate over the step's microbatches and each stage's last backward of the step reduces
   them (all-reduce, or reduce-scatter for ZeRO-2/3) while it runs; see `plait.pipeline.runtime`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from plait.activation_checkpointing import check_options, checkpoint_blocks, select_blocks
from plait.blocks import blocks
from plait.callable_module import make_callable
from plait.cp.apply import ALGORITHMS, context_parallel, has_attention
from plait.cp.positions import rotaries
from plait.ddp.wrapper import DistributedDataParallel
from plait.env import device
from plait.ep.apply import expert_parallel, no_moe_reason
from plait.fsdp.wrapper import FullyShardedDataParallel
from plait.materialize import is_meta, keep_whole, materialize
from plait.mesh import Mesh
from plait.models.moe import moe_layers
from plait.names import matches
from plait.pipeline.api import Pipeline
from plait.pipeline.arguments import P2P_MODES, resolve_schedule
from plait.pipeline.generators import SCHEDULES
from plait.pipeline.schedules import Schedule
from plait.pipeline.wrapping import StageWrapper
from plait.precision import MixedPrecision, check_castable, mixed_precision, parse_mixed_precision
from plait.tp.apply import tensor_parallel
from plait.tp.context import Style
from plait.tp.styles import ParallelRegion

__all__ = ["ParallelPlan", "parallelize", "ORDER"]

DATA_STRATEGIES = ("ddp", "fsdp", "none")
ORDER = ("pipeline split", "tensor parallel", "context parallel", "expert parallel",
         "activation checkpointing", "mixed precision", "data parallel (DDP or FSDP)")
# Pipeline options and their defaults: read only when the mesh has pp > 1.
PIPELINE_DEFAULTS: dict[str, Any] = {"pp_split": "auto", "pp_schedule": "1f1b", "pp_microbatches": 4,
                                     "pp_chunks": 1, "loss_fn": None, "p2p": "auto"}
ZERO3_SPLIT_BACKWARD = (
    "ZeRO-3 frees each stage's gathered parameters when a backward pass ends, so the deferred W, "
    "which runs later from the saved graph, could read freed parameters (any weight gradient that "
    "depends on the weight itself); use zero_stage=2 (parameters stay gathered) or data='ddp', or a "
    "schedule without W: 'gpipe', '1f1b' or 'interleaved'")


@dataclass
class ParallelPlan:
    """What to apply on each mesh axis. The ``pp_*`` fields, ``loss_fn`` and ``p2p`` are
    `plait.pipeline`'s ``split``, ``schedule``, ``microbatches``, ``chunks``, ``loss_fn`` and
    ``p2p``, read when the mesh has pp > 1. ``ac``, ``ac_every`` and ``ac_blocks`` are
    `plait.activation_checkpointing`'s ``policy``, ``every`` and ``blocks``."""

    tp: Mapping[str, Style] | None = None  # module-name pattern -> style; None: no tensor parallel
    sequence_parallel: bool = False
    cp: str | None = None  # context parallel algorithm: "ring", "allgather", "ulysses"; None: off
    ac: str | None = None  # activation checkpointing: "full", "selective" or None (off)
    ac_every: int = 1  # checkpoint every k-th block only
    ac_blocks: Sequence[type | str] | None = None  # None: the blocks of the outermost containers
    data: str = "ddp"  # "ddp" over dp, "fsdp" over fsdp (hybrid with dp), or "none"
    zero_stage: int = 3
    mixed_precision: str | MixedPrecision | None = None  # "bf16" / "fp16": compute dtype, fp32 masters
    offload: bool = False
    reshard_after_forward: bool = True
    backward_prefetch: bool = True
    fsdp_units: Sequence[type | str] | None = None
    ddp_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0  # init seed for modules still on the meta device
    tp_check: bool | str = True  # `tensor_parallel(check=...)`: dry run and numeric check; "shapes"; False
    pp_split: str | Sequence[str] = "auto"  # "auto" or the segment names that start stages 1..
    pp_schedule: str | Schedule | Sequence[Sequence[Any]] = "1f1b"
    pp_microbatches: int = 4
    pp_chunks: int = 1  # stages per pp rank (interleaved schedules)
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None  # (last stage output, targets) -> scalar
    p2p: str = "auto"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> ParallelPlan:
        """Raise on a plan that names an option its data strategy would ignore, or a malformed
        pipeline option; return ``self``."""
        if self.data not in DATA_STRATEGIES:
            raise ValueError(f"ParallelPlan(data=...) must be one of {DATA_STRATEGIES}, got {self.data!r}")
        # Options only FSDP reads: under DDP or no data parallelism they would change nothing,
        # so a run asked for bf16 or offloading would silently train in fp32 on the device.
        fsdp_only = {"zero_stage": self.zero_stage != 3, "offload": self.offload,
                     "reshard_after_forward": not self.reshard_after_forward,
                     "backward_prefetch": not self.backward_prefetch,
                     "fsdp_units": self.fsdp_units is not None}
        given = [f"{k}={getattr(self, k)!r}" for k, on in fsdp_only.items() if on]
        if self.data != "fsdp" and given:
            raise ValueError(f"ParallelPlan({', '.join(given)}): FSDP options, read only with data='fsdp' "
                             f"(FSDP / HSDP); data={self.data!r} would ignore them: use data='fsdp' or leave "
                             "them unset")
        if self.data != "ddp" and self.ddp_options:
            raise ValueError(f"ParallelPlan(ddp_options={self.ddp_options!r}) applies to data='ddp'; "
                             f"got data={self.data!r}")
        if self.cp is not None and self.cp not in ALGORITHMS:
            raise ValueError(f"ParallelPlan(cp=...) must be one of {tuple(ALGORITHMS)} or None, got "
                             f"{self.cp!r}")
        _check_precision(self)
        _check_pipeline_fields(self)
        check_options(self.ac, self.ac_every, self.ac_blocks, where="ParallelPlan(ac=...)")
        return self

    @property
    def precision(self) -> MixedPrecision | None:
        """``mixed_precision`` as a `MixedPrecision` (None: fp32)."""
        return parse_mixed_precision(self.mixed_precision, "ParallelPlan(mixed_precision=...)")

    def pipeline_options(self) -> dict[str, Any]:
        """The pipeline fields set to something other than their defaults."""
        return {k: getattr(self, k) for k, d in PIPELINE_DEFAULTS.items() if getattr(self, k) != d}


def _check_precision(plan: ParallelPlan) -> None:
    """Mixed precision under every data strategy: FSDP casts its gathered parameters itself; DDP and
    no data parallelism use `plait.mixed_precision`, whose reduce dtype DDP reads (see `_ddp_options`)."""
    mp = plan.precision  # raises on a value that names no precision
    if mp is None or plan.data != "ddp":
        return
    asked = plan.ddp_options.get("gradient_compression")
    if mp.wire_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"ParallelPlan(mixed_precision={plan.mixed_precision!r}): DDP reduces the fp32 "
                         f"master gradients as they are or as a bf16 / fp16 copy, not in {mp.wire_dtype}")
    if asked is not None and _COMPRESSION_NAMES.get(mp.wire_dtype) != asked:
        raise ValueError(f"ParallelPlan(ddp_options={{'gradient_compression': {asked!r}}}) disagrees with "
                         f"mixed_precision={plan.mixed_precision!r}, which reduces gradients in "
                         f"{mp.wire_dtype}; drop the option (it follows the precision's reduce dtype) or "
                         "change the reduce dtype")


# DDP's gradient_compression for a reduce dtype (fp32: none; the master gradients are fp32).
_COMPRESSION_NAMES: dict[torch.dtype, str | None] = {torch.float32: None, torch.bfloat16: "bf16",
                                                     torch.float16: "fp16"}


def _check_pipeline_fields(plan: ParallelPlan) -> None:
    for name in ("pp_microbatches", "pp_chunks"):
        v = getattr(plan, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"ParallelPlan({name}=...) must be an integer >= 1, got {v!r}")
    if plan.p2p not in P2P_MODES:
        raise ValueError(f"ParallelPlan(p2p=...) must be one of {P2P_MODES}, got {plan.p2p!r}")
    if plan.loss_fn is not None and not callable(plan.loss_fn):
        raise TypeError(f"ParallelPlan(loss_fn=...) must be a callable (output, targets) -> scalar loss, "
                        f"got {plan.loss_fn!r}")
    split = plan.pp_split
    names_ok = (isinstance(split, Sequence) and not isinstance(split, str)
                and all(isinstance(n, str) for n in split))
    if split != "auto" and not names_ok:
        raise ValueError(f"ParallelPlan(pp_split=...) must be 'auto' or a list of segment names starting "
                         f"stages 1.. (e.g. ['layers.4']), got {split!r}")
    sched = plan.pp_schedule
    if sched not in SCHEDULES if isinstance(sched, str) else not isinstance(sched, (Schedule, Sequence)):
        raise ValueError(f"ParallelPlan(pp_schedule=...) must be one of {SCHEDULES}, a plait Schedule or "
                         f"per-rank action lists, got {sched!r}")


def parallelize(module: nn.Module, mesh: Mesh, plan: ParallelPlan) -> nn.Module | Pipeline:
    """Apply the plan in `ORDER`: with pp > 1 a `Pipeline` of this rank's stages (each tensor
    parallel, checkpointed, then DDP or FSDP), else the model with tensor parallelism, activation
    checkpointing, then DDP or FSDP.

    Every argument is checked before the first collective, so a bad plan fails on every rank
    with the same error instead of leaving some ranks waiting.
    """
    _check(module, mesh, plan)
    pipelined = mesh.size("pp") > 1
    # Steps 1b to 2b, one function for both paths: applied to the whole model, or by the pipeline
    # to each of this rank's stages (materialized and tensor parallel, as below).
    steps = _steps_after_tensor_parallel(module, mesh, plan, pipelined)
    if pipelined:  # 0. split; the pipeline applies 1 to 3 to each of this rank's stages
        return Pipeline(module, mesh, split=plan.pp_split, schedule=plan.pp_schedule,
                        microbatches=plan.pp_microbatches, loss_fn=plan.loss_fn, chunks=plan.pp_chunks,
                        seed=plan.seed, device=device(), tp_plan=plan.tp,
                        sequence_parallel=plan.sequence_parallel, p2p=plan.p2p,
                        stage_wrapper=_stage_wrapper(module, mesh, plan), stage_steps=steps)
    if plan.tp is not None:  # 1. tensor parallel
        module = tensor_parallel(module, mesh, plan.tp, sequence_parallel=plan.sequence_parallel,
                                 seed=plan.seed, strict=False, check=plan.tp_check)
    if is_meta(module) and plan.data != "fsdp":
        # Full replicas: materialized where a pipeline materializes its stages (FSDP materializes
        # only its shards itself). Not to_empty() + init_weights: to_empty makes a new tensor per
        # module, untying tied weights (an embedding shared with the LM head would train as two).
        materialize(module, plan.seed, keep_whole(device()))
    if steps is not None:  # 1b to 2b
        steps(module)
    if plan.data == "fsdp":  # 3. data parallel
        return FullyShardedDataParallel(module, mesh, **_fsdp_options(plan, plan.fsdp_units))
    if plan.data == "ddp" and mesh.size(("dp", "cp")) > 1:
        return DistributedDataParallel(module, mesh, **plan.ddp_options)
    return module


def _check(module: nn.Module, mesh: Mesh, plan: ParallelPlan) -> None:
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"parallelize(plan=...) expects a plait.ParallelPlan, got {type(plan).__name__}")
    plan.validate()  # again: its fields may have been changed since it was made
    if mesh.size("tp") > 1 and plan.tp is None:
        raise ValueError(f"parallelize: {mesh} has tp={mesh.size('tp')} but the plan has no tp styles")
    if mesh.size("cp") > 1:
        _check_cp(module, mesh, plan)
    split_experts = [p for p, st in (plan.tp or {}).items()
                     if ".experts." in p and isinstance(st, ParallelRegion)]
    if plan.sequence_parallel and split_experts:
        raise ValueError(f"parallelize: tensor-parallel experts ({split_experts[0]!r}) with "
                         "sequence parallelism: an expert's rows are the tokens routed to it, not a sequence "
                         "that SP's all-gather and reduce-scatter could cut; use "
                         "gpt_plan(experts='replicate') or sequence_parallel=False")
    _check_balance(module, mesh, plan)
    if mesh.ep > 1 and not moe_layers(module):
        raise ValueError(f"parallelize: {mesh} has ep={mesh.ep}, but {no_moe_reason(module)}")
    if plan.data == "ddp" and mesh.size("fsdp") > 1:
        raise ValueError(f"parallelize: data='ddp' uses the dp axis, but {mesh} has fsdp="
                         f"{mesh.size('fsdp')}; use data='fsdp' or put those ranks on dp")
    if plan.precision is not None and plan.data != "fsdp":
        check_castable(module)
    if plan.fsdp_units is not None:  # against the whole model: each stage holds only some units
        _check_units(module, plan.fsdp_units)
    if plan.ac is not None:
        select_blocks(module, plan.ac_blocks, plan.ac_every)  # raises when nothing is matched
    if mesh.size("pp") == 1:
        given = plan.pipeline_options()
        if given:
            listed = ", ".join(f"{k}={v!r}" for k, v in given.items())
            raise ValueError(f"ParallelPlan({listed}): pipeline options, read only when the mesh has pp > 1; "
                             f"{mesh} has pp=1: leave them unset or add a pp axis")
    elif plan.ddp_options.get("find_unused_parameters"):
        raise ValueError("ParallelPlan(ddp_options={'find_unused_parameters': True}) cannot be used with a "
                         "pipeline: DDP walks a forward's graph for unused parameters, but a stage's "
                         "microbatches run several forwards before the backward that reduces; every "
                         "parameter of a stage must get a gradient")
    elif plan.ddp_options.get("broadcast_buffers"):
        raise ValueError("ParallelPlan(ddp_options={'broadcast_buffers': True}) cannot be used with a "
                         "pipeline: the broadcast writes the buffers in place before every forward, while "
                         "earlier microbatches' graphs still hold them for their backward; pipeline stages "
                         "get their buffers broadcast once, when wrapped")


def _check_balance(module: nn.Module, mesh: Mesh, plan: ParallelPlan) -> None:
    """The MoE balancing loss's statistic can be honoured on this layout."""
    layers = [m for m in moe_layers(module) if m.aux_loss_coef]
    per_microbatch = [m for m in layers if m.balance_statistic == "microbatch"]
    if mesh.size("cp") > 1 and per_microbatch:
        raise ValueError("parallelize: an MoE balancing loss over each micro-batch "
                         "(balance_statistic='microbatch') with context parallelism: each cp rank would "
                         "count the assignments of its part of the sequence only; use "
                         "balance_statistic='global' (or aux_loss_coef=0 with bias balancing)")
    if mesh.size("pp") > 1 and len(per_microbatch) < len(layers):
        sched = resolve_schedule(plan.pp_schedule, mesh.size("pp"), plan.pp_microbatches, plan.pp_chunks)
        if not sched.forwards_first:
            raise ValueError(f"parallelize: the MoE balancing loss over the step's whole batch "
                             f"(balance_statistic='global') with the {sched.name!r} pipeline schedule: a "
                             "stage runs a microbatch's backward before the step's last forward, so the "
                             "statistic over every microbatch is not known when that backward needs it; use "
                             "pp_schedule='gpipe' (every forward first), or balance_statistic='microbatch' "
                             "(each microbatch's own statistic)")


def _check_cp(module: nn.Module, mesh: Mesh, plan: ParallelPlan) -> None:
    n = mesh.size("cp")
    if plan.cp is None:
        raise ValueError(f"parallelize: {mesh} has cp={n} but the plan names no context-parallel algorithm; "
                         f"set ParallelPlan(cp=...) to one of {tuple(ALGORITHMS)}")
    if plan.data == "none":
        raise ValueError(f"parallelize: cp={n} ranks hold the same parameters and see different tokens, so "
                         "their gradients must be averaged; data='none' would leave each rank with its own: "
                         "use data='ddp' or 'fsdp'")
    if mesh.size("pp") > 1 and not rotaries(module):
        raise ValueError("parallelize: context parallelism inside a pipeline gives positions only to modules "
                         "whose forward takes positions (plait GPT's rotary tables); "
                         f"{type(module).__name__} has none (its positions are computed in its forward, "
                         "which pipeline stages replay on local tokens)")


def _check_units(module: nn.Module, units: Sequence[type | str]) -> None:
    names = [n for n, _ in module.named_modules() if n]
    for u in units:
        if isinstance(u, str) and not any(matches(u, n) for n in names):
            raise ValueError(f"ParallelPlan(fsdp_units=...): {u!r} matches no submodule of "
                             f"{type(module).__name__}")


def _fsdp_options(plan: ParallelPlan, units: Sequence[type | str] | None) -> dict[str, Any]:
    return dict(zero_stage=plan.zero_stage, units=units, reshard_after_forward=plan.reshard_after_forward,
                backward_prefetch=plan.backward_prefetch, mixed_precision=plan.precision,
                offload=plan.offload, seed=plan.seed)


def _steps_after_tensor_parallel(module: nn.Module, mesh: Mesh, plan: ParallelPlan,
                                 pipelined: bool) -> Callable[[nn.Module], None] | None:
    """Steps 1b to 2b, in `ORDER`, for one part: the whole model, or (``pipelined``) each of this
    rank's materialized, tensor-parallel pipeline stages: context parallelism, expert parallelism,
    checkpointing of the blocks chosen in the whole model (``ac_every`` counts over all of them,
    so a stage checkpoints those it holds, under their names in the model), then mixed precision
    where FSDP does not cast (DDP, wrapped next, reads its reduce dtype). None: nothing to apply."""
    experts = bool(moe_layers(module))
    precision = plan.precision if plan.data != "fsdp" else None
    if plan.ac is None and plan.cp is None and not experts and precision is None:
        return None
    chosen = select_blocks(module, plan.ac_blocks, plan.ac_every) if plan.ac is not None else []
    policy, algorithm, sequence_parallel = plan.ac, plan.cp, plan.sequence_parallel
    # A stage does not hold the whole model, where "auto" looks for the kind of positions.
    positions = "rotary" if pipelined else "auto"

    def apply(part: nn.Module) -> None:
        if algorithm is not None and (not pipelined or has_attention(part)):  # 1b
            context_parallel(part, mesh, algorithm, positions=positions)
        if experts and moe_layers(part):  # 1c (ep=1: the experts are only marked)
            expert_parallel(part, mesh, sequence_parallel)
        if policy is not None:  # 2
            held = {n for n, _ in part.named_modules()}
            checkpoint_blocks(part, [n for n in chosen if n in held], policy)
        if precision is not None:  # 2b: fp32 masters, low-precision compute
            mixed_precision(part, precision)

    return apply


def _stage_wrapper(module: nn.Module, mesh: Mesh, plan: ParallelPlan) -> StageWrapper | None:
    """Step 3 for pipeline stages: what `Pipeline` wraps each stage in (None: no data parallelism)."""
    if plan.data == "fsdp":
        return _FSDPStages(mesh, plan, set(blocks(module)))
    if plan.data == "ddp" and mesh.size(("dp", "cp")) > 1:
        return _DDPStages(mesh, plan.ddp_options)
    return None


@dataclass
class _DDPStages:
    """Each stage a `DistributedDataParallel` over dp. Forwards never arm DDP's reduction (they run
    in ``no_sync``); the stage's last backward of the step is armed just before it runs."""

    mesh: Mesh
    options: dict[str, Any]
    materializes: bool = False
    keeps_parameters: bool = True
    split_backward_refusal: str | None = None

    def wrap(self, stage: nn.Module) -> nn.Module:
        # Buffers are broadcast once, here; not before every forward (see _check).
        return DistributedDataParallel(stage, self.mesh, **{"broadcast_buffers": False, **self.options})

    # `wrapped` is what `wrap` returned (the StageWrapper protocol hands it back as a module).
    def leaves(self, wrapped: nn.Module) -> list[torch.Tensor]:
        ddp = cast(DistributedDataParallel, wrapped)
        return [p for p in ddp.module.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def grad_sync(self, wrapped: nn.Module, reduce: bool) -> Iterator[None]:
        ddp = cast(DistributedDataParallel, wrapped)
        if reduce:
            ddp.prepare_for_backward()
            yield
        else:
            with ddp.no_sync():
                yield


class _FSDPStages:
    """Each stage a `FullyShardedDataParallel` over fsdp (hybrid with dp), sharding units as FSDP
    would choose them in the whole model; its hooks reduce only outside ``no_sync``."""

    materializes = True
    keeps_parameters = False

    def __init__(self, mesh: Mesh, plan: ParallelPlan, listed: set[str]) -> None:
        self.mesh, self.plan, self.listed = mesh, plan, listed
        self.split_backward_refusal = ZERO3_SPLIT_BACKWARD if plan.zero_stage == 3 else None

    def wrap(self, stage: nn.Module) -> nn.Module:
        mods = [(n, m) for n, m in stage.named_modules() if n]
        if self.plan.fsdp_units is None:
            units: list[type | str] = [n for n, _ in mods if n in self.listed]
        else:  # the entries that match in this stage (each matches somewhere in the model: checked)
            units = [u for u in self.plan.fsdp_units if any(
                matches(u, n) if isinstance(u, str) else isinstance(m, u) for n, m in mods)]
        return FullyShardedDataParallel(stage, self.mesh, **_fsdp_options(self.plan, units))

    # `wrapped` is what `wrap` returned (the StageWrapper protocol hands it back as a module).
    def leaves(self, wrapped: nn.Module) -> list[torch.Tensor]:
        fsdp = cast(FullyShardedDataParallel, wrapped)
        return [leaf for unit in fsdp.units for flat in unit.flats if flat.requires_grad
                for leaf in flat.leaves]

    def grad_sync(self, wrapped: nn.Module, reduce: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if reduce else cast(FullyShardedDataParallel, wrapped).no_sync()


make_callable(__name__)
