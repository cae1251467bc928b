"""Where a DDP step's time goes, plait vs torch DDP: `plait bench ddp --profile`.

Both wrappers run in the same processes, their steps alternating as in `bench.ddp`. Each step is
cut into phases by wall clock on every rank (forward with the loss, backward, optimizer step,
zero_grad), and the slowest rank's time is kept per phase. Inside plait's backward, its own
Python work is timed too: the gradient hooks (copying each gradient into its bucket, launching
buckets) and the end of backward (waiting for the buckets, pointing the gradients at them).
torch's reducer is C++ and cannot be cut the same way; its backward is the whole phase.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from bench.common import markdown_table, median, preset_gpt, rank_batch

PHASES = ("forward", "backward", "optimizer", "zero_grad")


def _slowest(xs: list[float]) -> list[float]:
    t = torch.tensor(xs, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _phased(model: Any, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
            inner: dict[str, float] | None) -> Callable[[], list[float]]:
    from plait.models.gpt import lm_loss

    def step() -> list[float]:
        if inner is not None:
            inner.update(hooks=0.0, finish=0.0)
        dist.barrier()
        t0, c0 = time.perf_counter(), _thread_use()
        loss = lm_loss(model(x), y)
        t1, c1 = time.perf_counter(), _thread_use()
        loss.backward()
        t2, c2 = time.perf_counter(), _thread_use()
        opt.step()
        t3, c3 = time.perf_counter(), _thread_use()
        opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        extra = [inner["hooks"], inner["finish"]] if inner is not None else [0.0, 0.0]
        use = [b[k] - a[k] for k in (0, 1) for a, b in ((c0, c1), (c1, c2), (c2, c3))]
        return _slowest([t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0, *extra, *use])

    return step


def _thread_use() -> tuple[float, float]:
    """(CPU seconds, minor page faults) of the training thread so far: a page faulted in costs the
    kernel's zeroing of it, which wall time alone cannot tell from computing."""
    import resource

    return time.thread_time(), float(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt)


def _instrument(inner: dict[str, float]) -> Callable[[], None]:
    """Time plait DDP's hook and end-of-backward methods (patched on the class, before the
    wrapper is built: its hooks hold the class's functions)."""
    from plait.ddp.wrapper import DistributedDataParallel as DDP

    saved = {name: getattr(DDP, name) for name in ("_on_grad_ready", "_finish_backward")}

    def timing(fn: Callable[..., None], key: str) -> Callable[..., None]:
        def wrapped(*a: Any) -> None:
            t0 = time.perf_counter()
            fn(*a)
            inner[key] += time.perf_counter() - t0
        return wrapped

    DDP._on_grad_ready = timing(saved["_on_grad_ready"], "hooks")  # type: ignore[method-assign]
    DDP._finish_backward = timing(saved["_finish_backward"], "finish")  # type: ignore[method-assign]

    def restore() -> None:
        for name, fn in saved.items():
            setattr(DDP, name, fn)
    return restore


def profile(preset: str, seq: int, global_batch: int, warmup: int, iters: int, bucket_mb: float) -> dict:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from plait import comm
    from plait.ddp.wrapper import DDP
    from plait.testing import cached_mesh

    x, y = rank_batch(global_batch, seq)
    inner: dict[str, float] = {"hooks": 0.0, "finish": 0.0}
    # Patched for the whole run: the hooks hold their function weakly, so restoring the class's
    # before the steps would let the timed wrapper be collected and the hooks do nothing.
    restore = _instrument(inner)
    ours = DDP(preset_gpt(preset, seq), cached_mesh(dp=dist.get_world_size()), bucket_cap_mb=bucket_mb)
    theirs = TorchDDP(preset_gpt(preset, seq), bucket_cap_mb=bucket_mb)
    steps = {"plait": _phased(ours, torch.optim.AdamW(ours.parameters(), lr=1e-4), x, y, inner),
             "torch": _phased(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-4), x, y, None)}
    load0 = os.getloadavg()[0]
    for _ in range(warmup):
        for fn in steps.values():
            fn()
    rows: dict[str, list[list[float]]] = {k: [] for k in steps}
    for _ in range(iters):
        for k, fn in steps.items():
            rows[k].append(fn())
    load1 = os.getloadavg()[0]
    with comm.counting() as counts:
        steps["plait"]()
    reduced = counts.total("all_reduce", "dp") / (4 * sum(p.numel() for p in ours.parameters()))
    restore()
    return {"reduced": reduced, "rows": rows, "load": (load0, load1), "buckets": len(ours._buckets),
            "params": len(list(ours.parameters()))}


def report(out: dict, args: Any) -> str:
    names = [*PHASES, "step"]
    col = {k: list(zip(*out["rows"][k])) for k in ("plait", "torch")}
    table = []
    for i, name in enumerate(names):
        a, b = col["plait"][i], col["torch"][i]
        paired = sorted(x / y for x, y in zip(a, b) if y > 0)
        spread = f"{paired[0]:.3f}-{paired[-1]:.3f}" if paired else ""
        table.append([name, median(list(a)), median(list(b)), median(list(a)) - median(list(b)),
                      median(paired) if paired else "", spread])
    hooks, finish = median(list(col["plait"][5])), median(list(col["plait"][6]))
    return (
        f"GPT `{args.model}`, world {args.world}, global batch {args.batch} x {args.seq}, bucket cap "
        f"{args.bucket_mb} MiB ({out['buckets']} plait buckets, {out['params']} parameters with hooks), "
        f"{args.iters} alternating steps after {args.warmup} warm-up; each phase the slowest rank's "
        f"wall time; 1-minute load average {out['load'][0]:.1f} at the start, {out['load'][1]:.1f} at "
        "the end (2 shared cores).\n\n"
        + markdown_table(["phase (median s)", "plait", "torch DDP", "plait - torch", "median paired ratio",
                          "ratio spread"], table)
        + f"\n\nInside plait's backward: gradient hooks (copy into the bucket, pre-divided, and launch) "
        f"{hooks:.4f} s, end of backward (wait for the buckets, gradients pointed at them) {finish:.4f} s "
        f"(medians per step). All-reduced bytes / (4 x parameters): {out['reduced']:.2f}.\n"
        + "\nThe training thread in each phase, the most of any rank (medians per step): CPU milliseconds "
        "and minor page faults (pages the kernel zeroed and mapped in). Other jobs on the machine "
        "stretch wall time but hardly these.\n\n"
        + markdown_table(["phase", "plait CPU ms", "torch CPU ms", "plait page faults", "torch page faults"],
                         _thread_rows(col)) + "\n"
    )


def _thread_rows(col: dict[str, list[tuple[float, ...]]]) -> list[list[object]]:
    """Per phase: each side's median training-thread CPU (ms) and page faults (columns 7-12)."""
    def med(side: str, k: int) -> float:
        return median(list(col[side][k]))

    return [[name, 1000 * med("plait", 7 + i), 1000 * med("torch", 7 + i), f"{med('plait', 10 + i):.0f}",
             f"{med('torch', 10 + i):.0f}"] for i, name in enumerate(PHASES[:3])]
