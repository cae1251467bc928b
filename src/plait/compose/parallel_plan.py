"""The plan `plait.parallelize` applies: what each mesh axis gets (`ParallelPlan`), checked on its
own when made (options its data strategy would ignore, malformed pipeline options), each refusal a
`LayoutError` naming its fields, as `plait.compose.rules`' are. Whether a plan fits a model and a mesh is
`plait.compose.rules`'."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from plait.compose.activation_checkpointing import check_options
from plait.compose.layout_error import LayoutError, LayoutTypeError
from plait.cp.apply import ALGORITHMS
from plait.pipeline.arguments import P2P_MODES
from plait.pipeline.generators import SCHEDULES
from plait.pipeline.schedules import Schedule
from plait.state.precision import MixedPrecision, parse_mixed_precision
from plait.tp.context import Style

DATA_STRATEGIES = ("ddp", "fsdp", "none")
# Pipeline options and their defaults: read only when the mesh has pp > 1.
PIPELINE_DEFAULTS: dict[str, Any] = {"pp_split": "auto", "pp_schedule": "1f1b", "pp_microbatches": 4,
                                     "pp_chunks": 1, "loss_fn": None, "p2p": "auto"}

@dataclass
class ParallelPlan:
    """What to apply on each mesh axis. The ``pp_*`` fields, ``loss_fn`` and ``p2p`` are
    `plait.pipeline`'s ``split``, ``schedule``, ``microbatches``, ``chunks``, ``loss_fn`` and
    ``p2p``, read when the mesh has pp > 1. ``ac``, ``ac_every`` and ``ac_blocks`` are
    `plait.activation_checkpointing`'s ``policy``, ``every`` and ``blocks``."""

    tp: Mapping[str, Style] | None = None  # module-name pattern -> style; None: no tensor parallel
    sequence_parallel: bool = False
    cp: str | None = None  # context parallel algorithm: "ring", "allgather", "ulysses"; None: off
    cp_check: bool = True  # `context_parallel(check=...)`: verified by its numbers on the first forward
    ep_check: bool = True  # `expert_parallel(check=...)`: each dispatch verified on its first forward
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
    tp_check: bool | str = True  # `tensor_parallel(check=...)`: layout trace + numeric check; "shapes"; False
    pp_split: str | Sequence[str] = "auto"  # "auto" or the segment names that start stages 1..
    pp_schedule: str | Schedule | Sequence[Sequence[Any]] = "1f1b"
    pp_microbatches: int = 4
    pp_chunks: int = 1  # stages per pp rank (interleaved schedules)
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None  # (last stage output, targets) -> scalar
    p2p: str = "auto"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> ParallelPlan:
        """Raise `LayoutError` on a plan that names an option its data strategy would ignore, or a
        malformed option (`LayoutTypeError`, also a TypeError, on a value of the wrong type); its
        ``fields`` name the fields the refusal is about. Return ``self``."""
        if self.data not in DATA_STRATEGIES:
            raise LayoutError(f"ParallelPlan(data=...) must be one of {DATA_STRATEGIES}, got {self.data!r}",
                              ("data",))
        # Options only FSDP reads: under DDP or no data parallelism they would change nothing,
        # so a run asked for bf16 or offloading would silently train in fp32 on the device.
        fsdp_only = {"zero_stage": self.zero_stage != 3, "offload": self.offload,
                     "reshard_after_forward": not self.reshard_after_forward,
                     "backward_prefetch": not self.backward_prefetch,
                     "fsdp_units": self.fsdp_units is not None}
        given = [k for k, on in fsdp_only.items() if on]
        if self.data != "fsdp" and given:
            listed = ", ".join(f"{k}={getattr(self, k)!r}" for k in given)
            verb, them = ("applies", "it") if len(given) == 1 else ("apply", "them")
            raise LayoutError(f"ParallelPlan({listed}) {verb} to data='fsdp' only (FSDP and HSDP read "
                              f"{them}); data={self.data!r} would ignore {them}: use data='fsdp' or leave "
                              f"{them} unset", (*given, "data"))
        if self.data != "ddp" and self.ddp_options:
            raise LayoutError(f"ParallelPlan(ddp_options={self.ddp_options!r}) applies to data='ddp'; "
                              f"got data={self.data!r}", ("ddp_options", "data"))
        if self.cp is not None and self.cp not in ALGORITHMS:
            raise LayoutError(f"ParallelPlan(cp=...) must be one of {tuple(ALGORITHMS)} or None, got "
                              f"{self.cp!r}", ("cp",))
        _check_precision(self)
        _check_pipeline_fields(self)
        check_options(self.ac, self.ac_every, self.ac_blocks, where="ParallelPlan",
                      names=("ac", "ac_every", "ac_blocks"))
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
    try:
        mp = plan.precision
    except ValueError as e:  # a value that names no precision
        raise LayoutError(str(e), ("mixed_precision",)) from None
    if mp is None or plan.data != "ddp":
        return
    asked = plan.ddp_options.get("gradient_compression")
    if mp.wire_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise LayoutError(f"ParallelPlan(mixed_precision={plan.mixed_precision!r}): DDP reduces the fp32 "
                          f"master gradients as they are or as a bf16 / fp16 copy, not in {mp.wire_dtype}",
                          ("mixed_precision", "data"))
    if asked is not None and _COMPRESSION_NAMES.get(mp.wire_dtype) != asked:
        raise LayoutError(f"ParallelPlan(ddp_options={{'gradient_compression': {asked!r}}}) disagrees with "
                          f"mixed_precision={plan.mixed_precision!r}, which reduces gradients in "
                          f"{mp.wire_dtype}; drop the option (it follows the precision's reduce dtype) or "
                          "change the reduce dtype", ("ddp_options", "mixed_precision"))


# DDP's gradient_compression for a reduce dtype (fp32: none; the master gradients are fp32).
_COMPRESSION_NAMES: dict[torch.dtype, str | None] = {torch.float32: None, torch.bfloat16: "bf16",
                                                     torch.float16: "fp16"}


def _check_pipeline_fields(plan: ParallelPlan) -> None:
    for name in ("pp_microbatches", "pp_chunks"):
        v = getattr(plan, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise LayoutError(f"ParallelPlan({name}=...) must be an integer >= 1, got {v!r}", (name,))
    if plan.p2p not in P2P_MODES:
        raise LayoutError(f"ParallelPlan(p2p=...) must be one of {P2P_MODES}, got {plan.p2p!r}", ("p2p",))
    if plan.loss_fn is not None and not callable(plan.loss_fn):
        raise LayoutTypeError(f"ParallelPlan(loss_fn=...) must be a callable (output, targets) -> scalar "
                              f"loss, got {plan.loss_fn!r}", ("loss_fn",))
    split = plan.pp_split
    names_ok = (isinstance(split, Sequence) and not isinstance(split, str)
                and all(isinstance(n, str) for n in split))
    if split != "auto" and not names_ok:
        raise LayoutError(f"ParallelPlan(pp_split=...) must be 'auto' or a list of segment names starting "
                          f"stages 1.. (e.g. ['layers.4']), got {split!r}", ("pp_split",))
    sched = plan.pp_schedule
    if sched not in SCHEDULES if isinstance(sched, str) else not isinstance(sched, (Schedule, Sequence)):
        raise LayoutError(f"ParallelPlan(pp_schedule=...) must be one of {SCHEDULES}, a plait Schedule or "
                          f"per-rank action lists, got {sched!r}", ("pp_schedule",))
