"""`plait plan`'s predictions against real runs on this machine: memory, bytes and step time.

For each world size (1, 2 and 4 CPU ranks) this machine is first calibrated with one short job
(`plait.app.plan.cluster.calibrate`: a matmul rate, the host time per op, an all-reduce's latency
and bandwidth, the memory bandwidth, all with every rank running at once). Then every layout in
`LAYOUTS` runs for real on a pool of Gloo ranks (`plait.app.plan.rehearse.measured`: plait train's
build and step, the peak of live tensor storage of every tensor in the process, `plait.comm`'s
counts, then timed steps between barriers) at two model sizes, and is predicted by `plait plan`
(the rehearsal on the meta device, `predict` with the calibrated cluster). Reported per layout:
predicted / measured peak per rank (the larger stage), whether every collective's bytes per axis
agree exactly, and predicted / measured step time (median of the timed steps; their spread).

Run: ``plait bench plan`` (options: ``python -m bench.plan --help``; about 15 minutes on 2 CPUs).
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.common import markdown_table, median, spread, write_section

MIB = 2**20
MODELS: dict[str, dict[str, Any]] = {"tiny-4": {"model": "tiny", "layers": 4}, "small": {"model": "small"}}
LAYOUTS: dict[int, list[dict[str, Any]]] = {
    1: [{"strategy": "none"}, {"strategy": "none", "ac": "full"}, {"strategy": "none", "ac": "selective"}],
    2: [{"strategy": "ddp"}, {"strategy": "ddp", "ac": "full"},
        {"strategy": "fsdp", "zero_stage": 1}, {"strategy": "fsdp", "zero_stage": 2},
        {"strategy": "fsdp"}, {"strategy": "fsdp", "ac": "full"},
        {"tp": 2}, {"tp": 2, "sequence_parallel": True}, {"tp": 2, "ac": "selective"},
        {"pp": 2, "schedule": "gpipe"}, {"pp": 2, "schedule": "1f1b"},
        {"pp": 2, "schedule": "1f1b", "ac": "full"},
        {"pp": 2, "schedule": "zb-h1"}, {"pp": 2, "schedule": "interleaved", "chunks": 2},
        {"pp": 2, "schedule": "dualpipev"}, {"cp": 2}],
    4: [{"strategy": "ddp"}, {"strategy": "fsdp"}, {"strategy": "fsdp", "zero_stage": 2},
        {"tp": 4}, {"tp": 2}, {"tp": 2, "strategy": "fsdp"}, {"tp": 2, "strategy": "fsdp", "ac": "full"},
        {"pp": 2}, {"pp": 2, "ac": "full"}, {"pp": 2, "tp": 2},
        {"pp": 2, "strategy": "fsdp", "zero_stage": 2},
        {"cp": 2, "tp": 2}],
}


def _layout(extra: dict[str, Any]) -> str:
    return " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in extra.items())


def run_world(world: int, models: list[str], timed: int, batch: int) -> list[dict[str, Any]]:
    from bench.common import rank_pool
    from plait.app.config import TrainConfig
    from plait.app.plan.calibrate import calibrate, reference_flags
    from plait.app.plan.predict import predict
    from plait.app.plan.rehearse import measured, rehearse_layout

    cluster = calibrate(world)
    print(f"world {world}: {cluster}", flush=True)
    rows: list[dict[str, Any]] = []
    ref_flags = reference_flags(world)
    ref_cfg = TrainConfig.from_flags(**ref_flags)
    ref_pred = predict(ref_cfg, rehearse_layout(ref_cfg), cluster).step_s
    pool = rank_pool(world, timeout_s=900)
    try:
        for model in models:
            for extra in LAYOUTS[world]:
                flags = {**MODELS[model], "nproc": world, "batch_size": batch, **extra}
                cfg = TrainConfig.from_flags(**flags)
                # The calibration's step again, just before: how much faster or slower the machine
                # is now than when it was calibrated (other jobs share its cores).
                ref_now = median(pool.run(measured, {"flags": ref_flags, "timed": 3})[0]["times"])
                real = pool.run(measured, {"flags": flags, "timed": timed})
                stages = rehearse_layout(cfg)
                pred = predict(cfg, stages, cluster)
                worst = max(pred.memory, key=lambda m: m["peak"] / real[m["rank"]]["peak"])
                exact = all({k: round(v["bytes"]) for k, v in r.comm.items()} ==
                            {k: v["bytes"] for k, v in real[r.rank]["comm"].items()}
                            for r in stages)
                times = real[0]["times"]
                ref = flags == reference_flags(world)  # the step the calibration fitted
                rows.append({"world": world, "model": model, "calibration": ref,
                             "layout": _layout(extra) + (" (calibration)" if ref else ""),
                             "predicted_mib": worst["peak"] / MIB,
                             "measured_mib": real[worst["rank"]]["peak"] / MIB,
                             "memory_ratio": worst["peak"] / real[worst["rank"]]["peak"],
                             "bytes_exact": exact, "predicted_ms": pred.step_s * 1e3,
                             "measured_ms": median(times) * 1e3, "spread": spread([t * 1e3 for t in times]),
                             "time_ratio": pred.step_s / median(times),
                             "drift": ref_now / ref_pred,
                             "corrected_ratio": pred.step_s * (ref_now / ref_pred) / median(times),
                             "cluster": cluster.as_dict()})
                r = rows[-1]
                print(f"  {model} {r['layout']}: memory {r['memory_ratio']:.3f} bytes "
                      f"{'exact' if exact else 'DIFFER'} time {r['time_ratio']:.3f} "
                      f"(drift-corrected {r['corrected_ratio']:.3f})", flush=True)
    finally:
        pool.close()
    return rows


def report(rows: list[dict[str, Any]]) -> str:
    table = [[r["world"], r["model"], r["layout"], f"{r['predicted_mib']:.2f}", f"{r['measured_mib']:.2f}",
              f"{r['memory_ratio']:.3f}", "yes" if r["bytes_exact"] else "NO", f"{r['predicted_ms']:.1f}",
              f"{r['measured_ms']:.1f} ({r['spread'].p25:.1f}-{r['spread'].p75:.1f})",
              f"{r['time_ratio']:.2f}", f"{r['drift']:.2f}", f"{r['corrected_ratio']:.2f}"]
             for r in rows]
    n = len(rows)
    mem_ok = sum(abs(r["memory_ratio"] - 1) <= 0.05 for r in rows)
    bytes_ok = sum(r["bytes_exact"] for r in rows)
    timed = [r for r in rows if not r["calibration"]]  # the calibration's own step is not a prediction
    time_ok = sum(abs(r["time_ratio"] - 1) <= 0.15 for r in timed)
    ratios = sorted(r["time_ratio"] for r in timed)
    corrected_ok = sum(abs(r["corrected_ratio"] - 1) <= 0.15 for r in timed)
    corrected = sorted(r["corrected_ratio"] for r in timed)
    drifts = sorted(r["drift"] for r in rows)
    calib = {r["world"]: r["cluster"] for r in rows}
    cal_rows = [[w, f"{c['peak_tflops'] * 1e3:.1f}", f"{c['op_overhead_us']:.1f}",
                 f"{c['intra_latency_us']:.0f}", f"{c['intra_gbps']:.2f}", f"{c['memory_gbps']:.1f}"]
                for w, c in sorted(calib.items())]
    return "\n\n".join([
        f"{n} layouts. Peak memory within 5%: **{mem_ok}/{n}**; collective bytes per axis exact: "
        f"**{bytes_ok}/{n}**; step time within 15%: **{time_ok}/{len(timed)}** (predicted / measured median "
        f"{median(ratios):.2f}, range {ratios[0]:.2f}-{ratios[-1]:.2f}); corrected for the machine's drift "
        f"since calibration: **{corrected_ok}/{len(timed)}** (median {median(corrected):.2f}, range "
        f"{corrected[0]:.2f}-{corrected[-1]:.2f}). The drift (the calibration's step measured again "
        f"just before each layout, over its predicted time) ranged {drifts[0]:.2f}-{drifts[-1]:.2f}: "
        "other jobs share this machine's two cores.",
        "Calibration (one short job per world size, every rank at once: probes, then the compute figures "
        "scaled so that one training step, marked (calibration) below and left out of the count, is "
        "predicted as measured):\n\n" + markdown_table(
            ["world", "matmul GFLOP/s per rank", "host µs per op", "all-reduce latency µs", "GB/s sent",
             "memory GB/s"], cal_rows),
        markdown_table(["world", "model", "layout", "predicted peak MiB", "measured peak MiB", "ratio",
                        "bytes exact", "predicted step ms", "measured step ms (IQR)", "time ratio", "drift",
                        "drift-corrected ratio"], table),
        "Memory: the rehearsal runs plait train's own code on the meta device, so the peak of live "
        "storage is the same number (where it differs, Gloo's run-time choices differ from the "
        "listed order: a zero-bubble W pulled into a receive's wait frees memory sooner). Time: a "
        "model over counts (FLOPs at the calibrated rate, host time per op, alpha-beta per "
        "collective, the schedule's replay), so it is only as good as those figures on a machine "
        "whose cores every rank shares."])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="plait bench plan", description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="1,2,4", help="comma-separated world sizes among 1, 2, 4")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated among {', '.join(MODELS)}")
    p.add_argument("--timed", type=int, default=5, help="timed steps per layout")
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    p.add_argument("--no-write", action="store_true", help="print only; do not update bench/results")
    ns = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for w in (int(x) for x in ns.worlds.split(",")):
        if w not in LAYOUTS:
            p.error(f"--worlds: {w} is not one of {sorted(LAYOUTS)}")
        rows += run_world(w, ns.models.split(","), ns.timed, ns.batch)
    body = report(rows)
    print(body)
    if not ns.no_write:
        write_section("plan", "plait plan: predicted against measured (memory, bytes, step time)", body,
                      command=" ".join(["plait bench plan", *argv]))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
