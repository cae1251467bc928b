"""Memory and step time of a layout, from its rehearsals and a cluster.

Memory is the rehearsal's own: the peak of live storage on each pipeline stage's rank, broken
down by what holds it. Time is a model over the rehearsal's counts:

* compute: the step's FLOPs (recomputation included) at the cluster's rate, plus the host time
  of its ops where the device does not hide it (CPUs);
* communication, axis by axis, alpha-beta: each collective's calls times the link's latency
  (one small collective's time, as `calibrate` measures it) plus the bytes one rank sends
  (`plait.comm`'s wire bytes) over the link's bandwidth. An axis whose ranks fit in one node
  uses the node's links, else the network's (ranks are laid out pp, dp, fsdp, cp, tp from
  outermost to innermost, as `plait.Mesh` does). Data-parallel traffic (dp, fsdp, edp) overlaps
  compute by the cluster's ``overlap``; tensor-, context- and expert-parallel traffic sits on
  the critical path;
* the pipeline: the schedule's own replay (`Schedule.simulate`) with each stage's forward and
  backward durations and the transfer time of its activations, so the bubble is the schedule's;
* the optimizer step: memory-bound, the bytes it reads and writes at the memory bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from plait.app.config import TrainConfig
from plait.app.plan.cluster import Cluster
from plait.app.plan.rehearse import CATEGORIES, Rehearsal
from plait.runtime.mesh import AXES

DATA_PARALLEL = ("dp", "fsdp", "edp")
# Backward's share of a block's compute (forward = 1): 2 without recomputation, 3 with full
# recomputation (the forward runs again), in between for selective.
_BACKWARD = {"none": 2.0, "selective": 2.3, "full": 3.0}


@dataclass
class Prediction:
    """One layout on one cluster: per-stage memory (bytes) and the step's time (seconds) by part."""

    flags: dict[str, Any]
    world: int
    peak_bytes: int  # the largest rank's
    memory: list[dict[str, Any]]  # per pp stage: peak, breakdown, state sizes, activations per block
    step_s: float
    time: dict[str, float]  # where the step's time goes
    comm_bytes: dict[str, float]  # axis -> wire bytes one rank sends per step (the largest stage's)
    tokens_per_s: float
    fits: bool
    reasons: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _axis_names(label: str) -> list[str]:
    return [a for a in label.replace("+", ",").split(",") if a in AXES or a in ("ep", "edp")]


def _within_node(cfg: TrainConfig, axes: list[str], cluster: Cluster) -> bool:
    """Whether the ranks of one group over ``axes`` share a node."""
    par = cfg.parallel
    data = par.nproc // (par.pp * par.cp * par.tp)
    shape = {"pp": par.pp, "dp": par.dp if par.strategy == "fsdp" else data,
             "fsdp": data // par.dp if par.strategy == "fsdp" else 1, "cp": par.cp, "tp": par.tp}
    span = 1
    for a in axes:
        if a in ("ep", "edp"):  # folded out of the data axes: at most their span
            a = "fsdp" if par.strategy == "fsdp" else "dp"
        inner = math.prod(shape[b] for b in AXES[AXES.index(a) + 1:])
        span = max(span, inner * shape[a])
    return span <= cluster.devices_per_node


def axis_time(cfg: TrainConfig, comm: dict[str, dict[str, float]], cluster: Cluster) -> dict[str, float]:
    """Seconds each axis's collectives take on this rank (alpha-beta, ring)."""
    out: dict[str, float] = {}
    for key, s in comm.items():
        op, _, label = key.partition("@")
        axes = _axis_names(label)
        if not axes or op.startswith("recv"):  # a receive's time is its sender's
            continue
        latency, bandwidth = cluster.link(_within_node(cfg, axes, cluster))
        out[label] = out.get(label, 0.0) + s["calls"] * latency + s["wire_bytes"] / bandwidth
    return out


def _stage_times(cfg: TrainConfig, r: Rehearsal, cluster: Cluster) -> dict[str, float]:
    per_axis = axis_time(cfg, r.comm, cluster)
    compute = r.flops / cluster.flops_per_s() + r.ops * cluster.op_overhead_us * 1e-6
    dp = sum(t for label, t in per_axis.items() if set(_axis_names(label)) <= set(DATA_PARALLEL))
    blocking = sum(t for label, t in per_axis.items()
                   if not set(_axis_names(label)) <= set(DATA_PARALLEL) and "pp" not in _axis_names(label))
    # Adam reads parameters, gradients and both moments and writes parameters and moments.
    optimizer = (2 * r.parameters + r.gradients + 2 * r.optimizer) / (cluster.memory_gbps * 1e9)
    exposed = max(0.0, dp - cluster.overlap * compute)
    return {"compute": compute, "blocking": blocking, "dp": dp, "dp_exposed": exposed, "optimizer": optimizer}


def predict(cfg: TrainConfig, stages: list[Rehearsal], cluster: Cluster) -> Prediction:
    """The prediction for ``cfg``'s layout from one rehearsal per pipeline stage (in stage order)."""
    par = cfg.parallel
    times = [_stage_times(cfg, r, cluster) for r in stages]
    time: dict[str, float]
    if par.pp > 1:
        span, busy = _pipeline_span(cfg, stages, times, cluster)
        last = max(t["dp_exposed"] + t["optimizer"] for t in times)
        compute = max(t["compute"] for t in times)
        blocking = max(t["blocking"] for t in times)
        time = {"compute": compute, "tp/cp/ep communication": blocking, "pipeline bubble": span - busy,
                "pipeline transfers": max(0.0, busy - compute - blocking),
                "data-parallel communication (exposed)": max(t["dp_exposed"] for t in times),
                "optimizer step": max(t["optimizer"] for t in times)}
        step = span + last
    else:
        t = times[0]
        time = {"compute": t["compute"], "tp/cp/ep communication": t["blocking"],
                "data-parallel communication (exposed)": t["dp_exposed"], "optimizer step": t["optimizer"]}
        step = t["compute"] + t["blocking"] + t["dp_exposed"] + t["optimizer"]
    memory = [{"stage": r.stage, "rank": r.rank, "peak": r.peak, "at_peak": r.at_peak,
               "parameters": r.parameters, "gradients": r.gradients, "optimizer": r.optimizer,
               "activations_per_block": r.block_activations,
               "microbatches_in_flight": r.microbatches_in_flight}
              for r in stages]
    peak = max(r.peak for r in stages)
    comm_bytes: dict[str, float] = {}
    for r in stages:
        for key in r.comm:
            label = key.partition("@")[2]
            comm_bytes[label] = max(comm_bytes.get(label, 0.0), _sent(r, label))
    fits = peak <= cluster.memory_bytes
    reasons = [] if fits else [f"needs {size(peak)} per rank, the device has {cluster.memory_gib:g} GiB"]
    tokens = cfg.data.batch_size * cfg.seq_len
    return Prediction(flags=layout_flags(cfg), world=par.nproc, peak_bytes=peak, memory=memory, step_s=step,
                      time=time, comm_bytes=comm_bytes, tokens_per_s=tokens / step if step > 0 else math.inf,
                      fits=fits, reasons=reasons)


def size(n: float) -> str:
    """Bytes for people: GiB, or MiB below one."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def _sent(r: Rehearsal, label: str) -> float:
    return sum(s["wire_bytes"] for key, s in r.comm.items() if key.partition("@")[2] == label)


def layout_flags(cfg: TrainConfig) -> dict[str, Any]:
    par = cfg.parallel
    flags: dict[str, Any] = {"strategy": par.strategy, "nproc": par.nproc}
    if par.strategy == "fsdp":
        flags["zero_stage"] = par.zero_stage
        if par.dp > 1:
            flags["dp"] = par.dp
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(par, name) > 1:
            flags[name] = getattr(par, name)
    if par.sequence_parallel:
        flags["sequence_parallel"] = True
    if par.pp > 1:
        flags.update(schedule=par.schedule, microbatches=par.microbatches)
    if par.ac != "none":
        flags["ac"] = par.ac
    if par.mixed_precision:
        flags["mixed_precision"] = par.mixed_precision
    return flags


def _pipeline_span(cfg: TrainConfig, stages: list[Rehearsal], times: list[dict[str, float]],
                   cluster: Cluster) -> tuple[float, float]:
    """The schedule's makespan and the busiest rank's busy time, replayed with each stage's
    durations (`Schedule.simulate`)."""
    from plait.pipeline import make_schedule
    from plait.pipeline.actions import Kind

    par = cfg.parallel
    sched = make_schedule(par.schedule, par.pp, cfg.pipeline_microbatches, par.chunks)
    m = cfg.pipeline_microbatches
    back = _BACKWARD[par.ac]
    per_rank = len(stages)
    chunks = sched.stages // sched.ranks  # stages per rank: each action is one chunk's share
    unit = [(t["compute"] + t["blocking"]) / m / chunks / (1 + back) for t in times]

    def cost(a: Any) -> float:
        u = unit[sched.stage_rank(a.stage) % per_rank]
        if a.kind == Kind.F:
            return u
        if a.kind == Kind.BW:
            return back * u
        if a.kind == Kind.B:
            return (back - 1) * u  # the input gradient, with any recomputation
        return 1.0 * u  # W: the weight gradient

    r0 = stages[0]
    sends = r0.comm.get("send@pp", {"calls": 0, "wire_bytes": 0.0})
    per_send = sends["wire_bytes"] / sends["calls"] if sends["calls"] else 0.0
    latency, bandwidth = cluster.link(_within_node(cfg, ["pp"], cluster))
    slots = sched.simulate(cost, latency=latency + per_send / bandwidth)
    span = max(s.end for row in slots for s in row)
    busy = max(sum(s.end - s.start for s in row if s.action.kind.is_compute) for row in slots)
    return span, busy


def breakdown_rows(p: Prediction) -> list[tuple[str, list[int]]]:
    """(category, bytes at the peak per stage) for the table and the picture."""
    return [(c, [m["at_peak"][c] for m in p.memory]) for c in CATEGORIES]
