"""Checking and normalising `plait.pipeline`'s arguments, before any collective runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plait.pipeline.actions import COMM, Action
from plait.pipeline.generators import make_schedule
from plait.pipeline.runtime import as_tuple
from plait.pipeline.schedules import Schedule, ScheduleError, with_comms

CustomSchedule = Schedule | Sequence[Sequence[Action]]


def split_batch(x: Any, m: int, what: str) -> list:
    if x is None:
        raise ValueError(f"pipeline: {what} must be given (a tensor or tuple of tensors), got None")
    ts = as_tuple(x, what)
    n = ts[0].shape[0] if ts[0].dim() else 0
    for t in ts:
        if t.dim() == 0 or t.shape[0] != n:
            raise ValueError(f"pipeline: every tensor of {what} needs the batch as dim 0 of one size; got "
                             f"shapes {[tuple(u.shape) for u in ts]}")
    if n % m:
        raise ValueError(f"pipeline: {what} batch size {n} is not divisible by microbatches={m}")
    parts = [t.chunk(m) for t in ts]
    out = [tuple(p[i] for p in parts) for i in range(m)]
    return out if isinstance(x, tuple) or what == "inputs" else [o[0] for o in out]


P2P_MODES = ("auto", "tagged", "directed")


def resolve_p2p(p2p: str, backend: str) -> bool:
    """Whether to send on one group per direction (see `plait.pipeline.directed`)."""
    if p2p not in P2P_MODES:
        raise ValueError(f"pipeline: p2p must be one of {P2P_MODES}, got {p2p!r}")
    if p2p == "tagged" and backend != "gloo":
        raise ValueError(f"pipeline: p2p='tagged' matches messages by tag, which only Gloo does; this "
                         f"process group uses {backend!r}: use p2p='directed' (or 'auto')")
    return p2p == "directed" or (p2p == "auto" and backend != "gloo")


def resolve_schedule(schedule: Any, p: int, m: int, chunks: int) -> Schedule:
    if isinstance(schedule, str):
        return make_schedule(schedule, p, m, chunks)
    if isinstance(schedule, Schedule):
        sched = schedule
    elif isinstance(schedule, Sequence):
        rows = [list(r) for r in schedule]
        stages = 1 + max((a.stage for r in rows for a in r if isinstance(a, Action)), default=0)
        stages = max(p, -(-stages // p) * p)
        has_comm = any(isinstance(a, Action) and a.kind in COMM for r in rows for a in r)
        sched = (Schedule("custom", p, stages, m, tuple(tuple(r) for r in rows)) if has_comm
                 else with_comms("custom", p, stages, m, rows))
    else:
        raise TypeError(f"pipeline: schedule must be a name, a Schedule or per-rank lists of Actions, "
                        f"got {type(schedule).__name__}")
    if sched.ranks != p or sched.microbatches != m:
        raise ScheduleError(f"pipeline: the schedule is for ranks={sched.ranks}, microbatches="
                            f"{sched.microbatches}, but pp={p} and microbatches={m}")
    return sched.validate()
