"""`split`: cut a model into pipeline stages and hand this rank its parts, unbuilt.

The pipeline package splits and schedules; it does not apply other strategies. `split` decides the
schedule, the stages and this rank's share of them, finds the weights tied across pp ranks and
keeps a meta skeleton of the model for the dataflow traces, all before any collective. What it
returns, `PipelineParts`, holds this rank's stages as modules under their names in the original
model. The composition (`plait.parallelize`) then builds every part the one way it builds a whole
model (tensor parallelism over all of this rank's parts at once, so ties inside the rank hold;
materialization once; then context and expert parallelism, checkpointing, mixed precision, DDP or
FSDP), and `plait.pipeline.Pipeline` schedules what it built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from plait._torch_compat import is_compiled
from plait.pipeline.actions import Kind
from plait.pipeline.arguments import CustomSchedule, resolve_p2p, resolve_schedule
from plait.pipeline.directed import direction_groups
from plait.pipeline.replay import Replay, ReplayStage
from plait.pipeline.schedules import Schedule
from plait.pipeline.split import Segment, above, named_view, plan_stages, segments
from plait.pipeline.ties import Tie, find_ties, tie_groups
from plait.pipeline.wrapping import StageWrapper, check_wrappable
from plait.runtime.mesh import Mesh
from plait.state.materialize import is_meta, keep_whole, materialize
from plait.state.placement.records import TPInfo, mark_part


@dataclass
class PipelineParts:
    """This rank's share of a pipelined model, before anything is applied to it."""

    module: nn.Module  # the model as given (names, init values of meta modules)
    schedule: Schedule
    rank: int  # this rank's pp coordinate
    group: dist.ProcessGroup  # the pp group
    pp_ranks: list[int]
    segments: list[Segment]  # every segment of the model, in order
    plan: list[list[int]]  # stage -> indices of its segments
    ties: list[Tie]  # weights shared by stages on different pp ranks
    device: torch.device
    replay: Replay  # the meta skeleton every stage replays the model's forward on
    stages: dict[int, ReplayStage]  # this rank's stages (the parts), by stage index
    tie_groups: list[dist.ProcessGroup | None]  # per tie: the group summing this rank's copy
    links: dict[tuple[int, int], dist.ProcessGroup] | None  # p2p="directed": a group per direction

    @property
    def stage_names(self) -> list[list[str]]:
        """Every stage's segment names."""
        return [[self.segments[i][0] for i in idx] for idx in self.plan]

    def my_segments(self) -> list[Segment]:
        """This rank's segments, in stage order."""
        return [seg for s in sorted(self.stages) for seg in self.stages[s].segments]

    def view(self) -> nn.Module:
        """This rank's segments as one module under their names in the model (never called): what a
        plan written for the whole model (tensor parallelism's patterns) matches."""
        return named_view(self.my_segments())

    def materialize(self, seed: int) -> None:
        """Give a meta-device model's parts their values, all of this rank's at once, so that ties
        between them stay ties (a tied copy takes its first owner's values, as in one process)."""
        materialize(self.my_segments(), seed, keep_whole(self.device), self.module)

    def place(self, seed: int, tp: TPInfo | None) -> None:
        """Put the parts on the device, with what every stage runs beside them: the parameter-free
        segments of other ranks' stages (rotary tables, dropout) and the buffers of the modules above
        the segments (a root's rotary table). ``tp``: the parts' tensor-parallel record, marked on each
        so that a wrapper sees its tp shards."""
        mine = {n for n, _ in self.my_segments()}
        glue = [g for g in self.replay.glue() if g[0] not in mine]
        if any(is_meta(m) for _, m in glue):
            materialize(glue, seed, keep_whole(self.device), self.module)
        for _, m in glue:
            m.to(self.device)
        materialize(above(self.module), seed, keep_whole(self.device), self.module, shallow=True)
        for st in self.stages.values():
            if tp is not None:
                mark_part(st, tp)
            if not is_meta(st):  # a wrapper that materializes places the stage itself
                st.to(self.device)


def split(module: nn.Module, mesh: Mesh, *, split: str | Sequence[str] = "auto",
          schedule: str | CustomSchedule = "1f1b", microbatches: int, chunks: int = 1,
          device: torch.device | str | None = None, p2p: str = "auto",
          wrapper: StageWrapper | None = None) -> PipelineParts:
    """This rank's parts of ``module`` pipelined over the mesh's ``pp`` axis (see `plait.pipeline`
    for ``split``, ``schedule``, ``chunks`` and ``p2p``). ``wrapper``: the data parallelism each
    stage will get, whose limits (shared parameters, split backward) are refused here, on every rank
    alike. Every check runs before the pipeline's groups are made (the only collectives here)."""
    _check_arguments(module, mesh, microbatches)
    sched = resolve_schedule(schedule, mesh.size("pp"), microbatches, chunks)
    refusal = wrapper.split_backward_refusal if wrapper is not None else None
    if refusal and _splits_backward(sched):
        raise ValueError(f"pipeline: schedule {sched.name!r} splits backward into B and W; {refusal}")
    segs = segments(module)
    plan = plan_stages(segs, sched.stages, split)
    _refuse_split_backward_of_compiled(sched, segs)
    ties = find_ties(segs, plan, sched)
    for r in range(mesh.size("pp")):  # every rank's stages, so that all ranks refuse alike
        check_wrappable(wrapper, r, {s: [p for i in plan[s] for p in segs[i][1].parameters()]
                                     for s in sched.rank_stages(r)}, ties)
    rank = mesh.rank("pp")
    where = torch.device(device) if device is not None else _default_device()
    # Made before other strategies change this rank's modules in place: the meta skeleton of the
    # model as given serves the dataflow traces and the stand-ins of other ranks' stages.
    replay = Replay(module, segs, plan, where)
    stages = {s: ReplayStage(s, replay, [segs[i] for i in plan[s]]) for s in sched.rank_stages(rank)}
    directed = resolve_p2p(p2p, dist.get_backend())
    # The pipeline's groups, read from the mesh here once: the pp line, a group per weight tied
    # across pp ranks, and with directed p2p a group per direction between neighbours.
    lines = mesh.all_group_ranks("pp")
    return PipelineParts(module, sched, rank, mesh.group("pp"), mesh.group_ranks("pp"), segs, plan, ties,
                         where, replay, stages, tie_groups(ties, lines),
                         direction_groups(sched, lines) if directed else None)


def _check_arguments(module: nn.Module, mesh: Mesh, microbatches: int) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"pipeline: module must be a torch.nn.Module, got {type(module).__name__}")
    if not (hasattr(mesh, "size") and hasattr(mesh, "group_ranks")):
        raise TypeError(f"pipeline: mesh must be a plait.Mesh, got {type(mesh).__name__}")
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"pipeline: microbatches must be a positive integer, got {microbatches!r}")


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _splits_backward(sched: Schedule) -> bool:
    return any(a.kind is Kind.W for row in sched.actions for a in row)


def _refuse_split_backward_of_compiled(sched: Schedule, segs: Sequence[Segment]) -> None:
    """A schedule that splits backward into B (input gradients) and W (weight gradients) cuts
    the autograd graph between them; a compiled block's backward is one node computing both (AOT
    autograd), so its W could not be deferred. Measured: zb-h1 over blocks compiled with
    aot_eager hung at pp=2."""
    if not _splits_backward(sched):
        return
    compiled = [f"{n}.{k}" if k else n for n, seg in segs for k, m in seg.named_modules() if is_compiled(m)]
    if compiled:
        raise ValueError(
            f"pipeline: schedule {sched.name!r} splits backward into input- and weight-gradient passes, "
            f"which a torch.compile'd module's backward cannot be cut into (one graph computes both): "
            f"{', '.join(compiled[:4])}{' ...' if len(compiled) > 4 else ''}. Use a schedule without "
            "split backward ('1f1b', 'gpipe', 'interleaved') or leave the blocks uncompiled")
