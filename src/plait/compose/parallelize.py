"""Composition: one function that applies the strategies in one fixed order, for every layout.

    model = plait.parallelize(model, mesh, plait.ParallelPlan(tp=plait.gpt_plan(cfg), data="fsdp"))
    pipe = plait.parallelize(model, plait.Mesh(pp=2, fsdp=2, tp=2),
                             plait.ParallelPlan(tp=plait.gpt_plan(cfg), data="fsdp", pp_microbatches=8))

The module is callable: ``plait.parallelize(...)`` is `plait.parallelize.parallelize`
(`plait.runtime.callable_module`), and ``plait.parallelize.ORDER`` stays reachable.

The order, and why it is fixed (`ORDER`; torchtitan applies the same steps to every stage):

0. **Pipeline split** (``pp`` axis, when the mesh has pp > 1): the model is cut into stages
   first (`plait.pipeline.parts.split`, with the schedule `plait.compose.rules.check_layout` derived), so
   that every later step only ever sees this rank's layers; steps 1-3 then apply to each of this
   rank's parts, here, as to a whole model. The result is a `Pipeline` that schedules the built
   parts, trained with ``step(inputs, targets)`` instead of a forward call.
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from plait.compose.activation_checkpointing import checkpoint_blocks, select_blocks
from plait.compose.parallel_plan import ParallelPlan
from plait.compose.rules import ZERO3_SPLIT_BACKWARD, Layout, LayoutError, MeshShape, check_layout
from plait.cp.apply import context_parallel, has_attention
from plait.ddp.wrapper import DistributedDataParallel
from plait.ep.apply import expert_parallel, has_experts
from plait.fsdp.wrapper import FullyShardedDataParallel
from plait.models.moe import moe_layers
from plait.pipeline.api import Pipeline
from plait.pipeline.parts import split as split_stages
from plait.pipeline.wrapping import StageWrapper
from plait.runtime.callable_module import make_callable
from plait.runtime.env import device
from plait.runtime.mesh import Mesh
from plait.state.blocks import blocks
from plait.state.materialize import is_meta, keep_whole, materialize
from plait.state.names import matches
from plait.state.placement.records import tp_info
from plait.state.placement.tp_params import to_plain_parameters
from plait.state.precision import mixed_precision
from plait.tp.apply import assign_styles, loss_fn_for, tensor_parallel, validate_tied_splits
from plait.tp.styles import VocabParallelOutput

__all__ = ["ParallelPlan", "parallelize", "ORDER"]

ORDER = ("pipeline split", "tensor parallel", "context parallel", "expert parallel",
         "activation checkpointing", "mixed precision", "data parallel (DDP or FSDP)")


def parallelize(module: nn.Module, mesh: Mesh, plan: ParallelPlan) -> nn.Module | Pipeline:
    """Apply the plan in `ORDER`: with pp > 1 a `Pipeline` of this rank's stages (each tensor
    parallel, checkpointed, then DDP or FSDP), else the model with tensor parallelism, activation
    checkpointing, then DDP or FSDP.

    Every argument is checked before the first collective, so a bad plan fails on every rank
    with the same error instead of leaving some ranks waiting.
    """
    layout = _check(module, mesh, plan)  # the degrees and the schedule, derived once
    # Steps 1b to 2b, one function for both paths: applied to the whole model, or by the pipeline
    # to each of this rank's stages (materialized and tensor parallel, as below).
    steps = _steps_after_tensor_parallel(module, mesh, plan, layout)
    if layout.schedule is not None:  # 0. split, then 1 to 3 on each of this rank's parts
        return _pipeline(module, mesh, plan, layout, steps)
    if plan.tp is not None:  # 1. tensor parallel
        module = _tensor_parallel(module, mesh, plan)
    if is_meta(module) and plan.data != "fsdp":
        # Full replicas: materialized where a pipeline materializes its stages (FSDP materializes
        # only its shards itself). Not to_empty() + init_weights: to_empty makes a new tensor per
        # module, untying tied weights (an embedding shared with the LM head would train as two).
        materialize(module, plan.seed, keep_whole(device()))
    if steps is not None:  # 1b to 2b
        steps(module)
    if plan.data == "fsdp":  # 3. data parallel
        return FullyShardedDataParallel(module, mesh, **_fsdp_options(plan, plan.fsdp_units))
    if plan.data == "ddp" and layout.shape.dp * layout.shape.cp > 1:
        return DistributedDataParallel(module, mesh, **plan.ddp_options)
    return module


def _pipeline(module: nn.Module, mesh: Mesh, plan: ParallelPlan, layout: Layout,
              steps: Callable[[nn.Module], None] | None) -> Pipeline:
    """Step 0, then steps 1 to 3 on this rank's parts: tensor parallelism over all of them at once
    (one TPInfo; ties inside the rank stay ties), or materialization of all of them at once; then
    each part's steps 1b to 2b and its DDP or FSDP; the pipeline schedules what was built."""
    _check_pipeline_tp(module, layout.shape, plan)
    wrapper = _stage_wrapper(module, mesh, plan, layout.shape)
    assert layout.schedule is not None  # pp > 1: check_layout made it
    parts = split_stages(module, mesh, split=plan.pp_split, schedule=layout.schedule,
                         microbatches=plan.pp_microbatches, chunks=plan.pp_chunks, device=device(),
                         p2p=plan.p2p, wrapper=wrapper)
    loss_fn, tp_module = plan.loss_fn, None
    if plan.tp is not None:  # 1.
        if parts.ties:  # copies of a tied weight are summed per tp coordinate: each use split alike
            validate_tied_splits(module, plan.tp, tp=layout.shape.tp)
        # Under the original names: plan patterns match, and a meta module gets its init values
        # from the model under its own name, one module at a time, keeping its shard.
        tp_module = _tensor_parallel(parts.view(), mesh, plan, origin=module)
        to_plain_parameters(tp_module)  # stages' wrappers, ties and clipping work on plain shards
        loss_fn = loss_fn if loss_fn is not None else loss_fn_for(tp_module)
    elif is_meta(module) and not (wrapper is not None and wrapper.materializes):
        parts.materialize(plan.seed)
    parts.place(plan.seed, tp_info(tp_module) if tp_module is not None else None)
    if steps is not None:  # 1b to 2b
        for st in parts.stages.values():
            steps(st)
    stages = {s: wrapper.wrap(st) for s, st in sorted(parts.stages.items())} if wrapper else None  # 3.
    # A weight-gradient pass communicates under sequence parallelism (norms' gradients summed over
    # tp) and when it recomputes a checkpointed tensor-parallel block.
    w_communicates = plan.sequence_parallel or (plan.tp is not None and steps is not None)
    return Pipeline(parts, stages, microbatches=plan.pp_microbatches, loss_fn=cast(Any, loss_fn),
                    wrapper=wrapper, tp_module=tp_module, w_communicates=w_communicates)


def _tensor_parallel(target: nn.Module, mesh: Mesh, plan: ParallelPlan,
                     origin: nn.Module | None = None) -> nn.Module:
    """Step 1 on the whole model, or on a view of all of a pipeline rank's parts (``origin``: the
    whole model, whose names and init values the parts keep)."""
    assert plan.tp is not None
    return tensor_parallel(target, mesh, plan.tp, sequence_parallel=plan.sequence_parallel, seed=plan.seed,
                           strict=False, check=plan.tp_check, origin=origin)


def _check_pipeline_tp(module: nn.Module, shape: MeshShape, plan: ParallelPlan) -> None:
    """Refuse tensor-parallel arguments that do not fit a pipeline's mesh, or a loss that does not
    fit the plan (no collective)."""
    tp = shape.tp
    if plan.tp is None:
        if tp > 1:
            raise ValueError(f"parallelize: the mesh has tp={tp} but no ParallelPlan(tp=...) was given; "
                             "pass tp=plait.gpt_plan(cfg) (or a plan for your model) to shard the stages")
        if plan.loss_fn is None:
            raise TypeError("parallelize: a pipeline needs ParallelPlan(loss_fn=...): a callable "
                            "(last stage output, targets) -> scalar")
        return
    # Against the whole model, so a typo in a pattern is still an error although each rank's
    # stages hold only some of the matched modules.
    assigned = assign_styles(module, plan.tp, strict=True)
    sharded = any(isinstance(s, VocabParallelOutput) and not s.gather_output for s in assigned.values())
    if sharded and plan.loss_fn is not None:
        raise ValueError("parallelize: the tp plan leaves the logits split by vocabulary ("
                         "VocabParallelOutput(gather_output=False)), so the loss must be the vocab-parallel "
                         "cross-entropy: leave loss_fn unset (the pipeline then uses it), or gather the "
                         "logits; got "
                         f"loss_fn={plan.loss_fn!r}")


def _check(module: nn.Module, mesh: Mesh, plan: ParallelPlan) -> Layout:
    """`plait.compose.rules.check_layout`, the one rule set ``plait train``, ``plait check`` and
    ``plait plan`` also run. The tensor-parallel plan's layout trace is left to `tensor_parallel`,
    which runs it (with its numeric check) as step 1, still before any collective."""
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"parallelize(plan=...) expects a plait.ParallelPlan, got {type(plan).__name__}")
    try:
        return check_layout(module, mesh, plan, tp_trace=False)
    except LayoutError as e:
        e.message = f"parallelize: {e.message}"
        raise


def _fsdp_options(plan: ParallelPlan, units: Sequence[type | str] | None) -> dict[str, Any]:
    return dict(zero_stage=plan.zero_stage, units=units, reshard_after_forward=plan.reshard_after_forward,
                backward_prefetch=plan.backward_prefetch, mixed_precision=plan.precision,
                offload=plan.offload, seed=plan.seed)


def _steps_after_tensor_parallel(module: nn.Module, mesh: Mesh, plan: ParallelPlan,
                                 layout: Layout) -> Callable[[nn.Module], None] | None:
    """Steps 1b to 2b, in `ORDER`, for one part: the whole model, or (``pipelined``) each of this
    rank's materialized, tensor-parallel pipeline stages: context parallelism, expert parallelism,
    checkpointing of the blocks chosen in the whole model (``ac_every`` counts over all of them,
    so a stage checkpoints those it holds, under their names in the model), then mixed precision
    where FSDP does not cast (DDP, wrapped next, reads its reduce dtype). None: nothing to apply."""
    pipelined, shape = layout.schedule is not None, layout.shape
    experts = bool(moe_layers(module)) or (shape.ep > 1 and has_experts(module))
    precision = plan.precision if plan.data != "fsdp" else None
    if plan.ac is None and plan.cp is None and not experts and precision is None:
        return None
    chosen = select_blocks(module, plan.ac_blocks, plan.ac_every) if plan.ac is not None else []
    policy, algorithm, sequence_parallel = plan.ac, plan.cp, plan.sequence_parallel
    # Under sequence parallelism a stage's inputs or outputs are tp's shards of the cp ranks'
    # tokens, which the cp check cannot set against whole sequences (a whole model's are not).
    cp_check = plan.cp_check and not (pipelined and sequence_parallel and shape.tp > 1)
    # A stage does not hold the whole model, where "auto" looks for the kind of positions.
    positions = "rotary" if pipelined else "auto"

    def apply(part: nn.Module) -> None:
        if algorithm is not None and (not pipelined or has_attention(part)):  # 1b
            context_parallel(part, mesh, algorithm, positions=positions, check=cp_check)
        if experts and has_experts(part):  # 1c (ep=1: plait's experts are only marked)
            expert_parallel(part, mesh, sequence_parallel, check=plan.ep_check)
        if policy is not None:  # 2
            held = {n for n, _ in part.named_modules()}
            checkpoint_blocks(part, [n for n in chosen if n in held], policy)
        if precision is not None:  # 2b: fp32 masters, low-precision compute
            mixed_precision(part, precision)

    return apply


def _stage_wrapper(module: nn.Module, mesh: Mesh, plan: ParallelPlan,
                   shape: MeshShape) -> StageWrapper | None:
    """Step 3 for pipeline stages: what `Pipeline` wraps each stage in (None: no data parallelism)."""
    if plan.data == "fsdp":
        return _FSDPStages(mesh, plan, set(blocks(module)))
    if plan.data == "ddp" and shape.dp * shape.cp > 1:
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
        # The flat shards' leaves, and the experts FSDP keeps whole (plait.expert_parallel): a
        # backward restricted to leaves that left them out would give the experts no gradient.
        fsdp = cast(FullyShardedDataParallel, wrapped)
        return [*(leaf for unit in fsdp.units for flat in unit.flats if flat.requires_grad
                  for leaf in flat.leaves), *fsdp.experts]

    def grad_sync(self, wrapped: nn.Module, reduce: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if reduce else cast(FullyShardedDataParallel, wrapped).no_sync()


make_callable(__name__)
