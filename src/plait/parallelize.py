"""Composition: one function that applies the strategies in one fixed order.

    model = plait.parallelize(model, mesh, plait.ParallelPlan(tp=plait.gpt_plan(cfg), data="ddp"))

Order, and why it is fixed:

1. **Pipeline** (``pp`` axis) splits the model into stages first, so that every later step
   only ever sees this rank's layers. It returns a `Pipeline` (a schedule runner) rather than
   a module, so tensor parallelism is applied by `plait.pipeline(..., tp_plan=...)` to each
   rank's stages (pp x tp), and data parallelism by averaging the pipeline's gradients over
   ``dp`` (as `plait train` does).
2. **Tensor parallel** (``tp`` axis) shards single layers next. It must come before the data
   axes: DDP and FSDP then treat each rank's tensor-parallel shards as ordinary parameters,
   and the data-parallel groups (which differ only in the ``dp``/``fsdp`` coordinate) hold
   shards of identical shape.
3. **Data parallel** last, on the ``dp`` axis (DDP) or the ``fsdp`` axis with optional ``dp``
   replication (FSDP / HSDP): it only needs the final local parameters. FSDP over tensor
   parallelism (2-D fsdp x tp, or 3-D dp x fsdp x tp) flattens and shards each rank's tp
   shards across its fsdp group; a meta-device model is materialized by TP as tp shards (1/tp
   of each split layer, replicated norms in full), which FSDP then cuts down to its slice.
   Gradient hooks TP put on parameters (sequence parallelism) move to FSDP's leaves, and
   `plait.clip_grad_norm_` counts tp-sharded gradients across tp and replicated ones once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from plait.ddp import DistributedDataParallel
from plait.env import device
from plait.fsdp import FullyShardedDataParallel
from plait.materialize import init_weights, is_meta
from plait.mesh import Mesh
from plait.tensor_parallel import tensor_parallel
from plait.tp_styles import Style

__all__ = ["ParallelPlan", "parallelize"]

DATA_STRATEGIES = ("ddp", "fsdp", "none")


@dataclass
class ParallelPlan:
    """What to apply on each mesh axis (the ``pp`` axis is `plait.pipeline`'s)."""

    tp: Mapping[str, Style] | None = None  # module-name pattern -> style; None: no tensor parallel
    sequence_parallel: bool = False
    data: str = "ddp"  # "ddp" over dp, "fsdp" over fsdp (hybrid with dp), or "none"
    zero_stage: int = 3
    mixed_precision: str | None = None
    offload: bool = False
    reshard_after_forward: bool = True
    backward_prefetch: bool = True
    fsdp_units: Sequence[type | str] | None = None
    ddp_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0  # init seed for modules still on the meta device

    def __post_init__(self) -> None:
        if self.data not in DATA_STRATEGIES:
            raise ValueError(f"ParallelPlan(data=...) must be one of {DATA_STRATEGIES}, got {self.data!r}")


def parallelize(module: nn.Module, mesh: Mesh, plan: ParallelPlan) -> nn.Module:
    """Apply tensor parallelism, then DDP or FSDP, as ``plan`` says; return the model to train."""
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"parallelize(plan=...) expects a plait.ParallelPlan, got {type(plan).__name__}")
    if mesh.size("tp") > 1 and plan.tp is None:
        raise ValueError(f"parallelize: {mesh} has tp={mesh.size('tp')} but the plan has no tp styles")
    if plan.data == "ddp" and mesh.size("fsdp") > 1:
        raise ValueError(f"parallelize: data='ddp' uses the dp axis, but {mesh} has fsdp="
                         f"{mesh.size('fsdp')}; use data='fsdp' or put those ranks on dp")
    if plan.tp is not None:
        module = tensor_parallel(module, mesh, plan.tp, sequence_parallel=plan.sequence_parallel,
                                 seed=plan.seed, strict=False)
    if plan.data == "fsdp":
        return FullyShardedDataParallel(
            module, mesh, plan.zero_stage, units=plan.fsdp_units,
            reshard_after_forward=plan.reshard_after_forward, backward_prefetch=plan.backward_prefetch,
            mixed_precision=plan.mixed_precision,
            offload=plan.offload, seed=plan.seed)
    if is_meta(module):  # DDP keeps full replicas: materialize with the same per-module init
        module = init_weights(module.to_empty(device=device()), plan.seed)
    if plan.data == "ddp" and mesh.size("dp") > 1:
        return DistributedDataParallel(module, mesh, **plan.ddp_options)
    return module
