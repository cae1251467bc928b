"""Checkpoint save stall: how long `plait.checkpoint.save` blocks the training loop, blocking
(`async_save=False`) vs in the background (`async_save=True`), same model, ranks and saves.

The loop is `plait train`'s (same model building, AdamW, a save every few steps). A blocking
save stalls for the whole write: building the state dict, DCP's plan and write, hashing, the
``plait.json`` exchange. A background save stalls for the state dict and its copy into CPU
memory, plus any wait for the previous save still in flight; the rest overlaps the next steps,
which may run slower meanwhile (the writer thread shares the cores): both are reported. Phases
of each kind alternate (blocking, background, blocking, ...) in the same processes, so machine
noise lands on both.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import markdown_table, write_section


def _training_step(preset: str, seq: int, batch: int):
    """`plait train`'s model, optimizer and one step on a fixed random batch of this rank's."""
    import torch
    import torch.distributed as dist

    import plait
    from plait.app.step import build_model
    from plait.app.train import TrainConfig
    from plait.tp.apply import loss_fn_for

    cfg = TrainConfig.from_flags(model=preset, strategy="ddp", nproc=dist.get_world_size(), seq_len=seq,
                      batch_size=batch, steps=2, warmup=0, progress=False)
    model: Any = build_model(cfg, cfg.mesh(), plait.init())  # DDP here, never a pipeline
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = loss_fn_for(model)
    g = torch.Generator().manual_seed(dist.get_rank())
    data = torch.randint(0, 256, (batch // dist.get_world_size(), seq + 1), generator=g)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(data[:, :-1]), data[:, 1:]).backward()
        opt.step()

    return model, opt, step


def _loop(preset: str, seq: int, batch: int, saves: int, every: int, rounds: int, root: str) -> dict:
    """On every rank: the stall of each save, the steps' times, the checkpoint size."""
    from plait import checkpoint

    model, opt, step = _training_step(preset, seq, batch)
    step()  # warm-up: allocate Adam's state, so every checkpoint has the same size
    out: dict = {mode: {"stall": [], "steps": [], "drain": []} for mode in ("sync", "async")}
    n = 0
    for _ in range(rounds):
        for mode in ("sync", "async"):
            rec = out[mode]
            handle = None
            for _ in range(saves):
                for _ in range(every):
                    t0 = time.perf_counter()
                    step()
                    rec["steps"].append(time.perf_counter() - t0)
                n += 1
                t0 = time.perf_counter()
                handle = checkpoint.save(Path(root) / f"step_{n:06d}", model, opt, {"step": n}, keep=2,
                                         async_save=mode == "async")
                rec["stall"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert handle is not None
            handle.wait()  # the end of training waits for the last save
            rec["drain"].append(time.perf_counter() - t0)
    last = checkpoint.latest(root)
    out["bytes"] = sum(p.stat().st_size for p in last.iterdir()) if last is not None else 0
    return out


def _summary(per_rank: list[dict], mode: str) -> dict[str, float]:
    """Slowest rank per save (the loop waits for it), medians over saves and steps."""
    stalls = [max(r[mode]["stall"][i] for r in per_rank) for i in range(len(per_rank[0][mode]["stall"]))]
    steps = [max(r[mode]["steps"][i] for r in per_rank) for i in range(len(per_rank[0][mode]["steps"]))]
    drains = [max(r[mode]["drain"][i] for r in per_rank) for i in range(len(per_rank[0][mode]["drain"]))]
    return {"median": statistics.median(stalls), "max": max(stalls), "total": sum(stalls) + sum(drains),
            "step": statistics.median(steps), "drain": statistics.median(drains), "n": len(stalls)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="plait bench checkpoint")
    p.add_argument("--model", default="25m")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--saves", type=int, default=3, help="saves per phase")
    p.add_argument("--every", type=int, default=4, help="steps between saves")
    p.add_argument("--rounds", type=int, default=2, help="blocking/background phase pairs")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = p.parse_args(argv)

    from bench.common import rank_pool

    root = Path(args.dir or tempfile.mkdtemp(prefix="plait-bench-ckpt-"))
    load_before = os.getloadavg()[0]
    pool = rank_pool(args.world, timeout_s=900)
    try:
        per_rank = pool.run(_loop, args.model, args.seq, args.batch, args.saves, args.every, args.rounds,
                            str(root))
    finally:
        pool.close()
        shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()[0]
    s, a = _summary(per_rank, "sync"), _summary(per_rank, "async")
    rows = [
        ["median stall per save (s)", s["median"], a["median"], a["median"] / s["median"]],
        ["longest stall (s)", s["max"], a["max"], a["max"] / s["max"]],
        ["stall in all, with the last save's end (s)", s["total"], a["total"], a["total"] / s["total"]],
        ["median step time (s)", s["step"], a["step"], a["step"] / s["step"]],
    ]
    body = (
        f"GPT `{args.model}`, DDP on {args.world} ranks, global batch {args.batch} x {args.seq} tokens, "
        f"checkpoint {per_rank[0]['bytes'] / 2**20:.0f} MiB (model + AdamW state, sha256 of every file). "
        f"{args.rounds} rounds of {args.saves} blocking then {args.saves} background saves, one every "
        f"{args.every} steps ({s['n']} saves of each kind); each figure is the slowest rank's. A "
        "background save's stall is building the state dict and copying it to CPU memory (plus any "
        "wait for the previous save); writing, hashing and `plait.json` overlap the next steps. "
        f"1-minute load average {load_before:.1f} at the start, {load_after:.1f} at the end "
        f"({os.cpu_count()} cores, shared with other jobs).\n\n"
        + markdown_table(["", "blocking", "background", "background / blocking"], rows)
        + "\n"
    )
    print(body)
    write_section("checkpoint", "Checkpoint save stall", body)
    return 0
