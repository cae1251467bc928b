"""plait pipeline schedules vs torch.distributed.pipelining, same model, stages and batch, one run.

World 2 (pp=2), 8 microbatches. For each schedule both implementations are built in the same
processes from identical weights and the same stage boundaries; after warm-up their training
steps alternate and each step's time is the slowest rank's. plait's timeline gives the measured
bubble (idle / step time, averaged over ranks and steps), compared with theory. Gantt charts of
plait's planned and measured schedules go to bench/pictures/pp_<schedule>.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist

from bench.common import BENCH_DIR, alternate, markdown_table, median, write_section
from plait import comm

# plait schedule -> (torch schedule class name, stages per rank)
PAIRS = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1),
         "interleaved": ("ScheduleInterleaved1F1B", 2), "zb-h1": ("ScheduleInterleavedZeroBubble", 1),
         "zbv": ("ScheduleZBVZeroBubble", 2), "dualpipev": ("ScheduleDualPipeV", 2),
         "zbv-measured": ("ScheduleZBVZeroBubble", 2)}
ADAPTED = {"zbv-measured": "zbv"}  # planned by the named generator at durations measured on its own plan
SINGLE = ("ScheduleGPipe", "Schedule1F1B")  # torch's schedules that take one stage, not a list


def _cfg(preset: str, seq: int, layers: int):
    from plait.models.gpt import PRESETS

    return dataclasses.replace(PRESETS[preset], seq_len=seq, n_layers=layers)


def _torch_side(cfg, plan_names: list[list[str]], mine: list[int], cls_name: str, m: int, loss_fn):
    import torch.distributed.pipelining as pl

    import plait
    from plait.models.gpt import GPT
    from plait.pipeline.split import Stage, segments

    full = plait.init_weights(GPT(cfg), seed=0)
    segs = dict(segments(full))
    stages = []
    for s in mine:  # the stages plait's schedule places on this rank (a V for zbv and dualpipev)
        mod = Stage(s, [(n, segs[n]) for n in plan_names[s]])
        stages.append(pl.PipelineStage(mod, s, len(plan_names), torch.device("cpu"), group=dist.group.WORLD))
    cls = getattr(pl, cls_name)
    sched = cls(stages[0] if cls_name in SINGLE else stages, m, loss_fn=loss_fn)
    params = [q for st in stages for q in st.submod.parameters()]
    return sched, params, stages


def _bench(preset: str, seq: int, layers: int, batch: int, m: int, warmup: int, iters: int,
           names: list[str], split: str | list[str]) -> dict:
    cfg = _cfg(preset, seq, layers)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    return {name: _one_or_error(name, cfg, x, y, m, warmup, iters, split) for name in names}


def _one_or_error(name: str, *args) -> dict:
    """`_one`, or the error that refused the schedule, so that the other schedules' figures are kept."""
    try:
        return _one(name, *args)
    except ValueError as e:  # a plan or pipeline refused (ScheduleError too): alike on every rank,
        # which plan from the same gathered durations and build from the same arguments
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0]}


def _one(name: str, cfg, x: torch.Tensor, y: torch.Tensor, m: int, warmup: int, iters: int,
         split: str | list[str]) -> dict:
    from plait.models.gpt import GPT, lm_loss
    from plait.pipeline import pipeline, zbv
    from plait.testing import cached_mesh

    p, rank = dist.get_world_size(), dist.get_rank()
    cls_name, chunks = PAIRS[name]

    def build(schedule):
        with torch.device("meta"):
            model = GPT(cfg)
        return pipeline(model, cached_mesh(pp=p), split=split if chunks == 1 else "auto", schedule=schedule,
                        microbatches=m, loss_fn=lm_loss, chunks=chunks)

    pipe = build(ADAPTED.get(name, name))
    if name in ADAPTED:  # plan again at the durations a few steps of the unit-cost plan measure
        pipe = build(zbv(p, m, costs=_measured_costs(_probe(pipe, x, y, steps=warmup + 2))))
    opt_a = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    sched_t, params_t, _ = _torch_side(cfg, pipe.stage_names, pipe.schedule.rank_stages(rank), cls_name, m,
                                       lm_loss)
    opt_b = torch.optim.AdamW(params_t, lr=1e-4)
    bubbles: list[float] = []
    losses: dict[str, list[float]] = {"plait": [], "torch": []}

    opt_times: list[float] = []
    where: list[dict[str, float]] = []  # per step: where this rank's pipeline time went
    steps_seen: list = []  # per step: this rank's timeline (the ideal uses every timed step's durations)

    def step_plait() -> None:
        opt_a.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        losses["plait"].append(float(pipe.step(x, y)))
        t1 = time.perf_counter()
        opt_a.step()
        opt_times.append(time.perf_counter() - t1)
        bubbles.append(pipe.bubble_fraction)
        # Outside the executor's run: splitting the batch, the cached dry run and metadata lookups.
        where.append({**_where_time_went(pipe.timeline, pipe.step_time),
                      "outside the schedule": (t1 - t0) - pipe.step_time})
        steps_seen.append(pipe.timeline)

    def step_torch() -> None:
        opt_b.zero_grad(set_to_none=True)
        got: list = []
        mine = pipe.schedule.rank_stages(rank)  # a V's rank 0 holds the first stage and the last
        last = {"target": y, "losses": got} if pipe.schedule.stages - 1 in mine else {}
        sched_t.step(*((x,) if 0 in mine else ()), **last)
        if got:
            losses["torch"].append(float(torch.stack(got).detach().mean()))
        opt_b.step()

    times = alternate({"plait": step_plait, "torch": step_torch}, warmup, iters)
    per_rank = torch.zeros(2 + len(PARTS), p, dtype=torch.float64)
    per_rank[0, rank] = statistics.mean(bubbles[warmup:])
    per_rank[1, rank] = statistics.median(opt_times[warmup:])
    for i, part in enumerate(PARTS):
        per_rank[2 + i, rank] = statistics.median(w[part] for w in where[warmup:])
    dist.all_reduce(per_rank)
    return {"times": times, "bubble": float(per_rank[0].mean()), "opt": float(per_rank[1].max()),
            "where": {part: float(per_rank[2 + i].mean()) for i, part in enumerate(PARTS)},
            "timelines": pipe.gather_timelines(),
            "all_timelines": [row for rows in comm.all_gather_object(steps_seen[warmup:], pipe.group)
                              for row in rows],
            "latency": _p2p_latency(x.shape[0] // m, cfg),
            "loss0": (losses["plait"][:1], losses["torch"][:1]), "torch_cls": cls_name,
            "sched": pipe.schedule, "split": [s[0] for s in pipe.stage_names]}


# Bubbles with no closed form: their theory is the unit-cost plan.
UNIT_PLAN = ("zb-h1", "zbv", "dualpipev", "zbv-measured")
OVERHEAD_NOTE = (
    "Compute: the actions themselves (forward, backward, weight gradient). Receive waits: blocked "
    "in a receive, i.e. waiting for a peer (its compute, the transfer, and any overhead of its own). "
    "Sends: posting them (contiguous copies, the backend's launch). Between actions: the executor's "
    "Python from the start of the step to its last action, outside the actions (posting every "
    "receive at the start, bookkeeping, the W-filling helper). After the last action: waiting for "
    "this rank's sends and the closing loss all-reduce, i.e. for the slowest rank. Outside the "
    "schedule: the step's work before and after the executor runs (splitting the batch, the cached "
    "dry run, tied-weight sums). The executor's own share is sends + between actions + outside the "
    "schedule over the step: what plait's runtime costs by itself; receive waits beyond the plan's "
    "idle are the transfers' latency and the peers' variations in compute time.")
PARTS = ("compute", "receive waits", "sends", "between actions", "after the last action",
         "outside the schedule")


def _where_time_went(timeline, step_time: float) -> dict[str, float]:
    """One rank's pipeline step split into: compute actions; blocking in receives; posting sends
    (copies to contiguous buffers, the backend's launch); Python between actions (the executor's
    own work); and from its last action to the end of the step (waiting for its sends and the
    closing loss all-reduce, i.e. for the slowest rank)."""
    kinds = {"compute": 0.0, "receive waits": 0.0, "sends": 0.0}
    for sl in timeline:
        k = sl.action.kind
        part = "compute" if k.is_compute else "sends" if k.name.startswith("SEND") else "receive waits"
        kinds[part] += sl.end - sl.start
    last = max((sl.end for sl in timeline), default=0.0)
    kinds["between actions"] = last - sum(kinds.values())  # from the step's start: posting receives too
    kinds["after the last action"] = step_time - last
    return kinds


def _probe(pipe, x: torch.Tensor, y: torch.Tensor, steps: int) -> list:
    """Every rank's timelines of ``steps`` training steps (gradients dropped): the same on every rank,
    so a plan made from them is the same everywhere."""
    rows = []
    for _ in range(steps):
        pipe.step(x, y)
        rows.append(pipe.timeline)
    for prm in pipe.parameters():
        prm.grad = None
    return [row for ranks in comm.all_gather_object(rows[1:], pipe.group) for row in ranks]


def _p2p_latency(mb: int, cfg, rounds: int = 20) -> float:
    """One-way time of an activation-sized message between pp ranks 0 and 1 (median of ping-pongs
    on the default group, as the pipeline's tagged transfers run): what the replay with
    communication adds to every transfer."""
    rank = dist.get_rank()
    buf = torch.zeros(mb, cfg.seq_len, cfg.d_model)
    times = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        times.append((time.perf_counter() - t0) / 2)
    out = torch.tensor([statistics.median(times) if rank == 0 else 0.0], dtype=torch.float64)
    dist.all_reduce(out)
    return float(out)


def _measured_costs(timelines):
    """Median measured duration per (stage, kind), as a cost function for `Schedule.simulate`."""
    seen: dict[tuple[int, object], list[float]] = {}
    for row in timelines:
        for sl in row:
            if sl.action.kind.is_compute:
                seen.setdefault((sl.action.stage, sl.action.kind), []).append(sl.end - sl.start)
    med = {k: median(v) for k, v in seen.items()}
    return lambda a: med[(a.stage, a.kind)]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="plait bench pp")
    ap.add_argument("--model", default="small")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--schedules", default=",".join(PAIRS))
    ap.add_argument("--section", default="pp",
                    help="results section to write (bench/results/SECTION.md; pictures pp_<schedule> for "
                         "'pp', SECTION_<schedule> otherwise)")
    ap.add_argument("--split", default="auto",
                    help="'auto' (balanced by parameter count) or comma-separated segment names starting "
                         "stages 1.. (used for the one-chunk schedules)")
    args = ap.parse_args(argv)
    names = args.schedules.split(",")

    from bench.common import rank_pool

    load0 = os.getloadavg()[0]  # other jobs share the cores: the figures are only as quiet as this
    pool = rank_pool(args.world, timeout_s=900)
    try:
        per_rank = pool.run(_bench, args.model, args.seq, args.layers, args.batch, args.microbatches,
                            args.warmup, args.iters, names,
                            args.split if args.split == "auto" else args.split.split(","))
    finally:
        pool.close()
    load1 = os.getloadavg()[0]
    res = per_rank[0]
    p, m = args.world, args.microbatches
    rows, costs_rows, pics = [], [], []
    ok = [n for n in names if "error" not in res[n]]
    for name in names:
        r = res[name]
        if name not in ok:  # its row says why; the figures of the others are still written
            rows.append([name, PAIRS[name][0], "failed: " + r["error"].replace("|", "\\|"), *[""] * 12])
            continue
        chunks = PAIRS[name][1]
        t_a, t_b = median(r["times"]["plait"]), median(r["times"]["torch"])
        # The zero-bubble schedules have no closed form here: their theory is the unit-cost plan.
        theory = r["sched"].bubble() if name in UNIT_PLAN else (p - 1) / (chunks * m + p - 1)
        costs = _measured_costs(r["all_timelines"])  # medians over every timed step and rank
        r["replayed"] = r["sched"].bubble(costs)
        r["replayed_comm"] = r["sched"].bubble(costs, r["latency"])
        ideal = max(sl.end for row in r["sched"].simulate(costs) for sl in row) + r["opt"]
        # torch's loss is on the rank holding the last stage (rank 0 in a V)
        torch_first = next(pr[name]["loss0"][1][0] for pr in per_rank if pr[name]["loss0"][1])
        first = f"{r['loss0'][0][0]:.5f} / {torch_first:.5f}"
        rows.append([name, r["torch_cls"], t_a, t_b, t_a / t_b, ideal, t_a / ideal, t_b / ideal, r["bubble"],
                     theory, r["replayed"], r["bubble"] / r["replayed"] - 1,
                     r["replayed_comm"], r["bubble"] / r["replayed_comm"] - 1, first])
        w = r["where"]
        own = w["sends"] + w["between actions"] + w["outside the schedule"]  # the executor's own time
        costs_rows.append([name, t_a, ideal, t_a / ideal, *(1000 * w[part] for part in PARTS),
                           1000 * r["opt"], own / t_a])
        path = BENCH_DIR / "pictures" / f"{args.section}_{name}.png"
        path.parent.mkdir(exist_ok=True)
        r["sched"].draw(str(path), measured=r["timelines"])
        pics.append(f"![{name}](pictures/{path.name})")
    zb = ""
    for name in (n for n in UNIT_PLAN if n in ok and "1f1b" in ok):
        ratio = res[name]["bubble"] / res["1f1b"]["bubble"]
        planned = res[name]["sched"].bubble() / res["1f1b"]["sched"].bubble()
        replayed = res[name]["replayed"] / res["1f1b"]["replayed"]
        zb += (f"\n\n{name} measured bubble / 1F1B measured bubble: **{ratio:.2f}** (planned with "
               f"F = B = W: {planned:.2f}; plan replayed with the measured action durations: {replayed:.2f}; "
               f"target <= 0.4{' for zbv' if name.startswith('zbv') else ''}).")
    overhead = ("\n\n### Where plait's step goes\n\nMedians over the timed steps, averaged over ranks, "
                "in ms. 'Ideal' is the plan replayed at the measured action durations with free "
                "communication, plus the optimizer step: what the same schedule would take with no "
                "runtime overhead.\n\n"
                + markdown_table(["schedule", "plait step (s)", "ideal (s)", "plait / ideal",
                                  *(f"{part} (ms)" for part in PARTS), "optimizer (ms)",
                                  "executor's own / step"], costs_rows)
                + "\n\n" + OVERHEAD_NOTE)
    cfg = _cfg(args.model, args.seq, args.layers)
    ref = res[ok[0]] if ok else {"split": "none: no schedule ran", "latency": float("nan")}
    body = (
        f"GPT `{args.model}` with {args.layers} layers (d_model {cfg.d_model}, seq {args.seq}), pp={p}, "
        f"global batch {args.batch}, {m} microbatches, split {args.split!r} "
        f"(first segment of each stage: {ref['split']}); {args.iters} alternating timed steps "
        f"after {args.warmup} warm-up steps each, 1 thread per rank; 1-minute load average {load0:.1f} at "
        f"the start, {load1:.1f} at the end (the bench's own {p} ranks count for about {p}).\n\n"
        + markdown_table(["plait schedule", "torch schedule", "plait step (s)", "torch step (s)",
                          "plait / torch", "ideal step (s)", "plait / ideal", "torch / ideal",
                          "measured bubble", "theory", "plan at measured durations", "measured vs plan",
                          "plan with measured latency", "measured vs that plan", "first loss plait / torch"],
                         rows)
        + zb
        + "\n\nTheory: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) interleaved (v=2); for ZB-H1, "
        "ZB-V and DualPipeV the unit-cost plan (the V schedules hold two stages per rank, rank r stages r "
        "and 2p-1-r, in plait and in torch). Measured bubble = 1 - compute time / step time per rank, "
        "averaged over ranks and timed steps, where a rank's step time runs from its first action until "
        "the whole pipeline is done (the closing loss all-reduce), so a rank that finishes early counts "
        "its idle tail; idle is waiting for receives, the loss all-reduce and Python between actions. "
        "'Plan at measured durations' replays the schedule (W's pulled into waits, as the runtime "
        "does) with each (stage, action kind)'s median measured duration and free communication: the "
        "bubble the schedule itself implies for this model and split; 'plan with measured latency' "
        "adds to every transfer the one-way time of an activation-sized message between the two ranks "
        f"(measured by ping-pong: {1000 * ref['latency']:.2f} ms). "
        "'Ideal step' is the free-communication replay's "
        "makespan plus the optimizer step (the timed steps include it): the step time of the same "
        "schedule with zero runtime overhead, and 'torch / ideal' "
        "how close torch's measured step is to it (plait / torch can only go below torch / ideal "
        "by running the same kernels faster).\n\n"
        + "\n".join(pics) + overhead + "\n"
    )
    print(body)
    title = "Pipeline parallelism: plait schedules vs torch.distributed.pipelining"
    if args.section != "pp":
        title += f" ({args.model}, {args.layers} layers)"
    write_section(args.section, title, body, command=" ".join(["plait bench pp", *argv]))
    return 0 if len(ok) == len(names) else 1
