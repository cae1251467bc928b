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
import statistics
import time

import torch
import torch.distributed as dist

from bench.common import BENCH_DIR, alternate, markdown_table, median, write_section

# plait schedule -> (torch schedule class name, chunks)
PAIRS = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1),
         "interleaved": ("ScheduleInterleaved1F1B", 2), "zb-h1": ("ScheduleInterleavedZeroBubble", 1)}


def _cfg(preset: str, seq: int, layers: int):
    from plait.models.gpt import PRESETS

    return dataclasses.replace(PRESETS[preset], seq_len=seq, n_layers=layers)


def _torch_side(cfg, plan_names: list[list[str]], rank: int, p: int, cls_name: str, m: int, loss_fn):
    import torch.distributed.pipelining as pl

    import plait
    from plait.models.gpt import GPT
    from plait.pipeline.split import Stage, segments

    full = plait.init_weights(GPT(cfg), seed=0)
    segs = dict(segments(full))
    stages = []
    for s in range(rank, len(plan_names), p):
        mod = Stage(s, [(n, segs[n]) for n in plan_names[s]])
        stages.append(pl.PipelineStage(mod, s, len(plan_names), torch.device("cpu"), group=dist.group.WORLD))
    cls = getattr(pl, cls_name)
    sched = cls(stages if len(stages) > 1 or "Interleaved" in cls_name else stages[0], m, loss_fn=loss_fn)
    params = [q for st in stages for q in st.submod.parameters()]
    return sched, params, stages


def _bench(preset: str, seq: int, layers: int, batch: int, m: int, warmup: int, iters: int,
           names: list[str], split: str | list[str]) -> dict:
    cfg = _cfg(preset, seq, layers)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    return {name: _one(name, cfg, x, y, m, warmup, iters, split) for name in names}


def _one(name: str, cfg, x: torch.Tensor, y: torch.Tensor, m: int, warmup: int, iters: int,
         split: str | list[str]) -> dict:
    from plait.models.gpt import GPT, lm_loss
    from plait.pipeline import pipeline
    from plait.testing import cached_mesh

    p, rank = dist.get_world_size(), dist.get_rank()
    cls_name, chunks = PAIRS[name]
    with torch.device("meta"):
        model = GPT(cfg)
    pipe = pipeline(model, cached_mesh(pp=p), split=split if chunks == 1 else "auto", schedule=name,
                    microbatches=m, loss_fn=lm_loss, chunks=chunks)
    opt_a = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    sched_t, params_t, _ = _torch_side(cfg, pipe.stage_names, rank, p, cls_name, m, lm_loss)
    opt_b = torch.optim.AdamW(params_t, lr=1e-4)
    bubbles: list[float] = []
    losses: dict[str, list[float]] = {"plait": [], "torch": []}

    opt_times: list[float] = []

    def step_plait() -> None:
        opt_a.zero_grad(set_to_none=True)
        losses["plait"].append(float(pipe.step(x, y)))
        t0 = time.perf_counter()
        opt_a.step()
        opt_times.append(time.perf_counter() - t0)
        bubbles.append(pipe.bubble_fraction)

    def step_torch() -> None:
        opt_b.zero_grad(set_to_none=True)
        got: list = []
        if rank == 0:
            sched_t.step(x)
        else:
            sched_t.step(target=y, losses=got)
        if got:
            losses["torch"].append(float(torch.stack(got).detach().mean()))
        opt_b.step()

    times = alternate({"plait": step_plait, "torch": step_torch}, warmup, iters)
    per_rank = torch.zeros(2, p, dtype=torch.float64)
    per_rank[0, rank] = statistics.mean(bubbles[warmup:])
    per_rank[1, rank] = statistics.median(opt_times[warmup:])
    dist.all_reduce(per_rank)
    return {"times": times, "bubble": float(per_rank[0].mean()), "opt": float(per_rank[1].max()),
            "timelines": pipe.gather_timelines(),
            "loss0": (losses["plait"][:1], losses["torch"][:1]), "torch_cls": cls_name,
            "sched": pipe.schedule, "split": [s[0] for s in pipe.stage_names]}


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

    from plait.testing import RankPool

    pool = RankPool(args.world, timeout_s=900)
    try:
        per_rank = pool.run(_bench, args.model, args.seq, args.layers, args.batch, args.microbatches,
                            args.warmup, args.iters, names,
                            args.split if args.split == "auto" else args.split.split(","))
    finally:
        pool.close()
    res = per_rank[0]
    p, m = args.world, args.microbatches
    rows, pics = [], []
    for name in names:
        r = res[name]
        chunks = PAIRS[name][1]
        t_a, t_b = median(r["times"]["plait"]), median(r["times"]["torch"])
        # ZB-H1 has no closed form here: its theory is the unit-cost plan (F = B = W).
        theory = r["sched"].bubble() if name == "zb-h1" else (p - 1) / (chunks * m + p - 1)
        costs = _measured_costs(r["timelines"])
        r["replayed"] = r["sched"].bubble(costs)
        ideal = max(sl.end for row in r["sched"].simulate(costs) for sl in row) + r["opt"]
        first = f"{r['loss0'][0][0]:.5f} / {per_rank[-1][name]['loss0'][1][0]:.5f}"
        rows.append([name, r["torch_cls"], t_a, t_b, t_a / t_b, ideal, t_b / ideal, r["bubble"], theory,
                     r["bubble"] / theory - 1, r["replayed"], first])
        path = BENCH_DIR / "pictures" / f"{args.section}_{name}.png"
        path.parent.mkdir(exist_ok=True)
        r["sched"].draw(str(path), measured=r["timelines"])
        pics.append(f"![{name}](pictures/{path.name})")
    zb = ""
    if "zb-h1" in res and "1f1b" in res:
        ratio = res["zb-h1"]["bubble"] / res["1f1b"]["bubble"]
        planned = res["zb-h1"]["sched"].bubble() / res["1f1b"]["sched"].bubble()
        replayed = res["zb-h1"]["replayed"] / res["1f1b"]["replayed"]
        zb = (f"\n\nZB-H1 measured bubble / 1F1B measured bubble: **{ratio:.2f}** (planned with "
              f"F = B = W: {planned:.2f}; plan replayed with the measured action durations: {replayed:.2f}; "
              "target <= 0.4).")
    cfg = _cfg(args.model, args.seq, args.layers)
    body = (
        f"GPT `{args.model}` with {args.layers} layers (d_model {cfg.d_model}, seq {args.seq}), pp={p}, "
        f"global batch {args.batch}, {m} microbatches, split {args.split!r} "
        f"(first segment of each stage: {res[names[0]]['split']}); {args.iters} alternating timed steps "
        f"after {args.warmup} warm-up steps each, 1 thread per rank.\n\n"
        + markdown_table(["plait schedule", "torch schedule", "plait step (s)", "torch step (s)",
                          "plait / torch", "ideal step (s)", "torch / ideal", "measured bubble", "theory",
                          "bubble vs theory", "plan at measured durations", "first loss plait / torch"],
                         rows)
        + zb
        + "\n\nTheory: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) interleaved (v=2); for ZB-H1 "
        "the unit-cost plan. Measured bubble = 1 - compute time / step time per rank, averaged over "
        "ranks and timed steps, where a rank's step time runs from its first action until the whole "
        "pipeline is done (the closing loss all-reduce), so a rank that finishes early counts its idle "
        "tail; idle is waiting for receives, the loss all-reduce and Python between actions. "
        "'Plan at measured durations' replays the schedule (W's pulled into waits, as the runtime "
        "does) with each (stage, action kind)'s median measured duration and free communication: the "
        "bubble the schedule itself implies for this model and split. 'Ideal step' is that replay's "
        "makespan plus the optimizer step (the timed steps include it): the step time of the same "
        "schedule with zero runtime overhead, and 'torch / ideal' "
        "how close torch's measured step is to it (plait / torch can only go below torch / ideal "
        "by running the same kernels faster).\n\n"
        + "\n".join(pics) + "\n"
    )
    print(body)
    title = "Pipeline parallelism: plait schedules vs torch.distributed.pipelining"
    if args.section != "pp":
        title += f" ({args.model}, {args.layers} layers)"
    write_section(args.section, title, body, command=" ".join(["plait bench pp", *argv]))
    return 0
