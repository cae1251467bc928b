"""Healing replicas (`plait train --heal`): what a killed replica costs, and what healing costs when
nothing fails.

Recovery: ``plait train --heal --nproc 4`` (``--layout ddp``: 4 replicas; ``hsdp``: ``--strategy fsdp
--dp 2``, 2 replicas of 2 processes sharding the model), one process killed with SIGKILL after step
``--kill-at``, the run stopped by SIGTERM once the replacement trained ``--after-join`` steps in step;
repeated ``--repeats`` times. Read from the run's files (`plait.app.healing`): the time from the kill to the
survivors' failure, to their next epoch and to the next completed step; the steps whose work was
redone; the time from the standby's wake-up (and from its join request) to its admission with the
state.

Overhead (ddp): in the same 2 processes, plait's DDP step as ``plait train`` runs it (gradients all-reduced
over the mesh's dp group with the desync check, then the loss's all-reduce) and the healing step (the
same DDP regrouped onto an epoch's Gloo group, the step's one small all-reduce with the leader's read
of the store's join counter), alternating. (hsdp): ``plait train`` with HSDP 2x2 and the same with
``--heal``, whole runs alternating, their steps paired by number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import alternate, markdown_table, median, preset_gpt, rank_batch, rank_pool, write_section


def _overhead(preset: str, seq: int, batch: int, warmup: int, iters: int) -> dict:
    from plait import comm
    from plait.ddp.wrapper import DDP
    from plait.models.gpt import lm_loss
    from plait.runtime.heal import LiveState, Replicas
    from plait.state.clip import clip_grad_norm_
    from plait.testing import cached_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = rank_batch(batch, seq)
    mesh = cached_mesh(dp=world)
    plain, healed = DDP(preset_gpt(preset, seq), mesh), DDP(preset_gpt(preset, seq), mesh)
    opt_a = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    opt_b = torch.optim.AdamW(healed.parameters(), lr=1e-4)
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = comm.all_gather_object(host.port if host is not None else 0)[0]
    store = host if host is not None else dist.TCPStore("127.0.0.1", port, is_master=False)
    replicas = Replicas(store, rank, timeout_s=60.0)
    replicas.start(LiveState(healed, opt_b), initial=world)
    lo, hi = replicas.share(batch)

    def ddp_step() -> None:  # plait train's step (desync check on, as plait train runs)
        with comm.desync_check("fast"):
            opt_a.zero_grad(set_to_none=True)
            loss = lm_loss(plain(x), y)
            loss.backward()
            mean = loss.detach().to(torch.float64).reshape(1)
            comm.all_reduce(mean, mesh.group("dp"))
            float(mean[0])
            clip_grad_norm_(plain, 1.0)
            opt_a.step()

    def heal_step() -> None:  # plait.app.healing's step
        healed.regroup(replicas.group, replicas.size, batch / (hi - lo))
        opt_b.zero_grad(set_to_none=True)
        loss = lm_loss(healed(x), y)
        loss.backward()
        stats = torch.tensor([float(loss.detach()) * (hi - lo) / batch, hi - lo, 0.0], dtype=torch.float64)
        float(replicas.reduce(stats)[0])
        clip_grad_norm_(healed, 1.0)
        opt_b.step()

    times = alternate({"ddp": ddp_step, "heal": heal_step}, warmup, iters)
    replicas.close()
    return {"times": times, "n_params": sum(p.numel() for p in plain.parameters())}


@dataclass(frozen=True)
class Layout:
    """A healing run's layout: its flags, how many replicas of how many processes, the process killed
    or stopped (uid, index) and the standby's uid."""

    flags: tuple[str, ...]
    replicas: int
    per_replica: int
    victim: tuple[int, int]
    standby: int

    def events(self, heal: Path, uid: int) -> list[dict]:
        """Every membership event of replica ``uid``'s processes."""
        names = [f"uid{uid}.{i}.jsonl" for i in range(self.per_replica)] if self.per_replica > 1 else [
            f"uid{uid}.jsonl"]
        return [e for name in names for e in _rows(heal / name)]


LAYOUTS = {"ddp": Layout(("--nproc", "4"), 4, 1, (2, 0), 4),
           "hsdp": Layout(("--strategy", "fsdp", "--dp", "2", "--nproc", "4"), 2, 2, (1, 1), 2)}


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _event(heal: Path, kind: str, uid: int, index: int = 0) -> dict:
    return next(e for e in _rows(heal / "supervisor.jsonl")
                if e["event"] == kind and e["uid"] == uid and e.get("index", 0) == index)


def _joined(heal: Path, layout: Layout) -> dict | None:
    return next((e for e in layout.events(heal, layout.standby) if e["event"] == "epoch"), None)


def _wait(ready, job: subprocess.Popen, timeout: float = 600.0):
    deadline = time.monotonic() + timeout
    while not (found := ready()):
        if job.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the healing run ended or stalled: {job.communicate()[1][-2000:]}")
        time.sleep(0.005)
    return found


def _recovery(folder: Path, layout: Layout, train_args: list[str], kill_at: int, after_join: int) -> dict:
    """One killed-and-healed run; the figures read from its files."""
    heal, metrics = folder / "heal", folder / "metrics.jsonl"
    cmd = [sys.executable, "-m", "plait", "train", "--heal", *layout.flags, "--steps", "100000",
           "--min-lr-ratio", "1", "--warmup", "1", "--eval-every", "0", "--no-progress",
           "--run-dir", str(folder.parent), "--name", folder.name, *train_args]
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)

    def steps() -> dict[int, dict]:
        return {r["step"]: r for r in _rows(metrics) if "step" in r}

    try:
        _wait(lambda: max(steps(), default=0) >= kill_at, job)
        victim = _event(heal, "start", *layout.victim)["pid"]
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
        join = _wait(lambda: _joined(heal, layout), job)
        _wait(lambda: max(steps(), default=0) >= join["step"] + after_join, job)
        job.send_signal(signal.SIGTERM)
        job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    got = steps()
    survivors = [u for u in range(layout.replicas) if u != layout.victim[0]]
    events = [e for uid in survivors for e in layout.events(heal, uid)]
    failed = min(e["time"] for e in events if e["event"] == "failure")
    regrouped = min(e["time"] for e in events if e["event"] == "epoch" and e["epoch"] == 1)
    first = min(s for s, r in got.items() if r["replicas"] == layout.replicas - 1)
    before = [got[s]["step_time_s"] for s in range(max(2, first - 10), first)]
    redone = {e["step"] for e in events if e["event"] == "failure"}
    return {"detect": failed - killed, "regroup": regrouped - killed,
            "next_step": got[first]["time"] - killed, "redone": len(redone),
            "rejoin": join["time"] - _event(heal, "activate", layout.standby)["time"],
            "asked": join["time"] - join["asked_to_join"], "step_before": median(before),
            "joined_at": join["step"]}


def _hang(folder: Path, layout: Layout, train_args: list[str], timeout_s: float, stop_at: int) -> dict:
    """A process of replica 1 stopped with SIGSTOP (a hang: its sockets stay open) after step
    ``stop_at``, continued once the others dropped its replica: when the others went on, when it was
    back with the state."""
    heal, metrics = folder / "heal", folder / "metrics.jsonl"
    victim_at = (1, layout.per_replica - 1)
    cmd = [sys.executable, "-m", "plait", "train", "--heal", *layout.flags, "--steps", "100000",
           "--min-lr-ratio", "1", "--warmup", "1", "--eval-every", "0", "--no-progress",
           "--heal-timeout", str(timeout_s), "--run-dir", str(folder.parent), "--name", folder.name,
           *train_args]
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)

    def steps() -> dict[int, dict]:
        return {r["step"]: r for r in _rows(metrics) if "step" in r}

    def back(since: float) -> dict | None:
        epochs = [e for e in layout.events(heal, 1) if e["event"] == "epoch"]
        return next((e for e in epochs if e["time"] > since), None)

    fewer = layout.replicas - 1
    victim = None
    try:
        _wait(lambda: max(steps(), default=0) >= stop_at, job)
        victim = _event(heal, "start", *victim_at)["pid"]
        stopped = time.time()
        os.kill(victim, signal.SIGSTOP)
        first = _wait(lambda: min((s for s, r in steps().items() if r["replicas"] == fewer), default=None),
                      job)
        went_on = steps()[first]["time"] - stopped
        os.kill(victim, signal.SIGCONT)
        resumed = time.time()
        rejoined = _wait(lambda: back(resumed), job)
        job.send_signal(signal.SIGTERM)
        job.communicate(timeout=120)
    finally:
        if victim is not None:  # a stopped replica would not act on its parent's death
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGCONT)
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    finished = [e for uid in range(layout.replicas) for e in layout.events(heal, uid)
                if e["event"] == "finished"]
    # Bit-equal: one digest per process index (each index holds the same shards in every replica).
    digests = {e["params_sha256"] for e in finished}
    return {"went_on": went_on, "rejoined": rejoined["time"] - resumed,
            "received": rejoined["received_state"], "bit_equal": len(digests) == layout.per_replica}


def _train_overhead(layout: Layout, args: argparse.Namespace, folder: Path) -> dict:
    """``plait train`` with the layout and the same with ``--heal``, whole runs alternating; each run's
    steps after the warm-up, paired by step number."""
    steps = args.warmup + args.iters
    times: dict[str, list[float]] = {"ddp": [], "heal": []}
    for i in range(args.overhead_runs):
        for kind in ("ddp", "heal"):
            name = f"{kind}{i}"
            cmd = [sys.executable, "-m", "plait", "train", *(("--heal",) if kind == "heal" else ()),
                   *layout.flags, "--steps", str(steps), "--model", args.model, "--seq-len", str(args.seq),
                   "--batch-size", str(args.batch), "--max-bytes", "2000000", "--eval-every", "0",
                   "--warmup", "1", "--min-lr-ratio", "1", "--no-progress", "--run-dir", str(folder),
                   "--name", name]
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if done.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}")
            rows = [r for r in _rows(folder / name / "metrics.jsonl") if "step" in r]
            times[kind] += [r["step_time_s"] for r in rows if r["step"] > args.warmup]
    return {"times": times, "n_params": None}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="plait bench heal")
    p.add_argument("--model", default="25m", help="the overhead's GPT preset (plait bench ddp's)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="the overhead's global batch (sequences)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3, help="killed-and-healed runs")
    p.add_argument("--kill-at", type=int, default=20)
    p.add_argument("--after-join", type=int, default=20)
    p.add_argument("--train-args", default="--model tiny --batch-size 8 --max-bytes 200000",
                   help="the healing runs' model and data flags")
    p.add_argument("--hang-timeout", type=float, default=2.0, help="--heal-timeout of the hang's run")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="ddp",
                   help="ddp: 4 replicas; hsdp: 2 replicas of 2 processes (--strategy fsdp --dp 2)")
    p.add_argument("--overhead-runs", type=int, default=3, help="hsdp: plait train runs per side")
    args = p.parse_args(argv)

    layout = LAYOUTS[args.layout]
    load0 = os.getloadavg()[0]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            runs.append(_recovery(Path(tmp) / f"healed{i}", layout, args.train_args.split(), args.kill_at,
                                  args.after_join))
        hang = _hang(Path(tmp) / "hung", layout, args.train_args.split(), args.hang_timeout, args.kill_at)
        if args.layout == "hsdp":
            out = _train_overhead(layout, args, Path(tmp) / "overhead")
        else:
            pool = rank_pool(2, timeout_s=900)
            try:
                out = pool.run(_overhead, args.model, args.seq, args.batch, args.warmup, args.iters)[0]
            finally:
                pool.close()
    load1 = os.getloadavg()[0]
    body = _report(args, layout, runs, hang, out, load0, load1)
    print(body)
    if args.layout == "hsdp":
        write_section("heal_hsdp", "Healing HSDP replicas: a killed process's cost, and healing's when "
                      "nothing fails", body)
    else:
        write_section("heal", "Healing replicas: a killed replica's cost, and healing's when nothing fails",
                      body)
    return 0


def _report(args: argparse.Namespace, layout: Layout, runs: list[dict], hang: dict, out: dict, load0: float,
            load1: float) -> str:
    def cell(key: str, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
        xs = [r[key] * scale for r in runs]
        return f"{fmt.format(median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"

    n, hsdp = layout.replicas, layout.per_replica > 1
    rows = [["kill -> the survivors' collective fails (s)", cell("detect")],
            ["kill -> the next epoch agreed and its group built (s)", cell("regroup")],
            [f"kill -> the next completed step, over {n - 1} replica{'s' if n > 2 else ''} (s)",
             cell("next_step")],
            [f"a step before the kill, {n} replicas (s)", cell("step_before")],
            ["steps redone (the one in flight) / steps lost", f"{cell('redone', fmt='{:.0f}')} / 0"],
            ["standby woken (at the kill) -> admitted with the state (s)", cell("rejoin")],
            ["replacement's join request -> admitted (s)", cell("asked")]]
    paired = [a / b for a, b in zip(out["times"]["heal"], out["times"]["ddp"])]
    t_ddp, t_heal = median(out["times"]["ddp"]), median(out["times"]["heal"])
    side = "HSDP" if hsdp else "DDP"
    cost = [["median step time (s)", t_ddp, t_heal, t_heal / t_ddp],
            ["median of paired step ratios (spread)", "", "",
             f"{median(paired):.3f} ({min(paired):.3f}-{max(paired):.3f})"]]
    killed = (f"process {layout.victim[1]} of replica uid {layout.victim[0]} killed with SIGKILL (the "
              "supervisor then ends its replica's other process)" if hsdp
              else f"replica uid {layout.victim[0]} killed with SIGKILL")
    standby = ("the standby replica the supervisor started with the others (2 processes" if hsdp
               else "the standby process the supervisor started with the others (")
    stopped = "a process of replica uid 1" if hsdp else "replica uid 1"
    if hsdp:
        overhead = (f"Per-step cost when nothing fails: `plait train {' '.join(layout.flags)} "
                    f"--model {args.model} --seq-len {args.seq} --batch-size {args.batch}` and the same with "
                    f"`--heal`, {args.overhead_runs} runs each, alternating, {args.iters} steps of each "
                    f"after {args.warmup} warm-up, paired by step number. With --heal each replica's "
                    "gradient shards are summed over the replicas after backward (one flat all-reduce "
                    "per process, not overlapped with backward as HSDP's own all-reduce is), then the "
                    "replica's processes agree that the step succeeded (one small all-reduce).")
    else:
        overhead = (f"Per-step cost when nothing fails: GPT `{args.model}` ({out['n_params'] / 1e6:.1f}M "
                    f"parameters), 2 processes, global batch {args.batch} x {args.seq} tokens, {args.iters} "
                    f"alternating timed steps after {args.warmup} warm-up steps each; plait train's DDP step "
                    "against the healing step in the same processes.")
    return (f"Recovery: `plait train --heal {' '.join(layout.flags)} {args.train_args}`, {killed} after step "
            f"{args.kill_at}, {args.repeats} runs (median, min-max), --heal-timeout 5 (a killed "
            "process's peers see its sockets close: the timeout is not waited for). The replacement is "
            f"{standby}: Python, torch, data and model loaded); woken at the death, it takes the "
            "parameters, optimizer state, step and RNG state from a peer at the next step boundary"
            + (", process i from process i of a live replica (the same shards)" if hsdp else "") + ".\n\n"
            + markdown_table(["", "measured"], rows)
            + f"\n\nA hang: {stopped} stopped with SIGSTOP after step {args.kill_at} (its sockets "
            f"stay open), with --heal-timeout {args.hang_timeout:g} (bound: 3 x that, the collective's "
            f"timeout then twice it for the others' answers). The others' next step completed "
            f"{hang['went_on']:.2f} s after the SIGSTOP; continued, the stopped replica found itself "
            f"dropped and was back {hang['rejoined']:.2f} s later (state received: {hang['received']}); "
            f"every replica ended bit-equal{' (shard by shard)' if hsdp else ''}: {hang['bit_equal']}."
            + f"\n\n{overhead} 1-minute load average {load0:.1f} before, {load1:.1f} after, on 2 cores.\n\n"
            + markdown_table(["", side, f"{side} --heal", f"heal / {side}"], cost))
