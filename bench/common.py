"""Shared benchmark machinery: alternating timing, per-rank aggregation, results files.

Every benchmark compares plait with PyTorch's own implementation *in one run*: both are
built in the same processes, warmed up, and then their steps alternate (A, B, A, B, ...), so
machine noise lands on both. Absolute times on shared machines are noise; ratios and byte
counts are the result.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"


def timed(step: Callable[[], object], group: dist.ProcessGroup | None = None) -> float:
    """Run one step; return the slowest rank's wall time (the step is as slow as its slowest rank)."""
    if dist.is_initialized():
        dist.barrier(group=group)
    t0 = time.perf_counter()
    step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
    return float(dt.item())


def alternate(steps: dict[str, Callable[[], object]], warmup: int, iters: int,
              group: dist.ProcessGroup | None = None) -> dict[str, list[float]]:
    """Warm every implementation up, then time them in strict alternation."""
    for _ in range(warmup):
        for fn in steps.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(iters):
        for name, fn in steps.items():
            times[name].append(timed(fn, group))
    return times


def cpu_timed(step: Callable[[], object], into: list[float]) -> Callable[[], None]:
    """``step``, appending the CPU seconds this process spent in it (every thread: the training
    thread and Gloo's) to ``into``. Other jobs on the machine stretch wall time, not this."""
    def run() -> None:
        start = time.process_time()
        step()
        into.append(time.process_time() - start)
    return run


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def paired_ratios(a: list[float], b: list[float]) -> list[float]:
    """Step i of ``a`` over step i of ``b``: alternated steps ran back to back, so each pair saw
    the same machine load, and the spread of these ratios is what noise did to the comparison."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_ratios needs two equally long, non-empty series, got {len(a)} and {len(b)}")
    return [x / y for x, y in zip(a, b)]


class Spread(NamedTuple):
    """Median and percentiles of a series (inclusive method: they stay inside the observed range)."""

    median: float
    p10: float
    p25: float
    p75: float
    p90: float
    n: int


def spread(xs: list[float]) -> Spread:
    if len(xs) < 2:
        return Spread(xs[0], xs[0], xs[0], xs[0], xs[0], len(xs))
    pct = statistics.quantiles(xs, n=20, method="inclusive")  # 5 %, 10 %, ..., 95 %
    return Spread(statistics.median(xs), pct[1], pct[4], pct[14], pct[17], len(xs))


def gpt_config(a: dict, **overrides: object):
    """plait's GPT preset ``a["model"]`` at ``a["seq_len"]``, with ``overrides`` (e.g. dropout)."""
    from plait.models.gpt import PRESETS, GPTConfig

    base = vars(PRESETS[a["model"]]).copy()
    base.update(seq_len=a["seq_len"], **overrides)
    return GPTConfig(**base)


def rank_pool(world: int, timeout_s: float = 900.0):
    """``world`` Gloo ranks for a benchmark: the test suite's pool without its `DeviceAudit`, whose
    torch-function mode taxes every Python-level torch call, a wrapper's Python side more than
    torch's C++ one, and never runs in a user's program."""
    from plait.testing import RankPool

    return RankPool(world, timeout_s=timeout_s, device_audit=False)


def run_on_ranks(world: int, job: Callable[[dict], object], args: dict) -> tuple[list, float]:
    """``job(args)`` on every rank of a fresh ``world``-rank pool: (each rank's result, wall
    seconds). Records the 1-minute load before and after in ``args["load"]``: other jobs share the
    cores, so times are relative."""
    t0, load0 = time.time(), os.getloadavg()[0]
    pool = rank_pool(world)
    try:
        res = pool.run(job, args)
    finally:
        pool.close()
    args["load"] = (load0, os.getloadavg()[0])
    return res, time.time() - t0


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    def fmt(x: object) -> str:
        return f"{x:.3f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> str:
    """"2 CPUs (AMD EPYC), Linux x86_64": what the figures were measured on."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        model = names[0] if names else model
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs ({model}), {platform.system()} {platform.machine()}"


def write_section(name: str, title: str, body: str, command: str | None = None) -> Path:
    """Write one benchmark's section to bench/results/<name>.md and rebuild bench/RESULTS.md."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    command = command or "plait " + " ".join(sys.argv[1:])  # argv: plait bench NAME ...
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    env = f"torch {torch.__version__}, {'CUDA' if torch.cuda.is_available() else 'CPU/Gloo'}, {machine()}"
    text = f"## {title}\n\nCommand: `{command}` ({stamp}, {env})\n\n{body.strip()}\n"
    path = RESULTS_DIR / f"{name}.md"
    path.write_text(text)
    assemble_results()
    return path


def assemble_results() -> Path:
    parts = [p.read_text() for p in sorted(RESULTS_DIR.glob("*.md"))]
    head = ("# Benchmark results\n\nplait against PyTorch's own implementation, both measured in "
            "the same run with alternating steps. Ratios below 1.0 mean plait is faster or smaller.\n"
            "Regenerate a section with the command shown under it.\n\n")
    out = BENCH_DIR / "RESULTS.md"
    out.write_text(head + "\n".join(parts))
    return out


def preset_gpt(preset: str, seq: int):
    """plait's GPT of a preset at sequence length ``seq``, initialised with seed 0."""
    import dataclasses

    import plait
    from plait.models.gpt import GPT, PRESETS

    return plait.init_weights(GPT(dataclasses.replace(PRESETS[preset], seq_len=seq)), seed=0)


def rank_batch(global_batch: int, seq: int, split: bool = True):
    """This rank's share of a seeded global batch of byte tokens: (inputs, next tokens).
    ``split=False``: the whole batch on every rank (tensor parallelism's ranks share theirs)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (global_batch, seq + 1), generator=g)
    mine = data.chunk(world)[rank] if split else data
    return mine[:, :-1], mine[:, 1:]
