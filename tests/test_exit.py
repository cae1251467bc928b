"""A job whose ranks all finished exits with code 0 on every rank, launch after launch; a job
stopped by a signal leaves no rank behind.

Each rank's Gloo groups run on C++ threads; a process that ends right after its last
collective used to abort now and then at interpreter exit ("terminate called without an
active exception"). `plait.init` registers a teardown (barriers, then every group destroyed in
order, then plait's threads joined) that must make every launch end cleanly.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from plait.runtime.env import free_port

# Two here, side by side; the suite's other launches (plait train, plait run, plait check, the
# docs' scripts: dozens) assert exit code 0 as well, so each run of the suite exercises the exit
# many more times.
LAUNCHES = 2
AT_ONCE = 2  # launches running side by side (each is 2 processes)

# Ends right after its last collective: the moment the abort used to strike.
JOB = textwrap.dedent("""
    import torch
    from torch import nn

    import plait
    from plait import comm

    plait.init()
    mesh = plait.Mesh(dp=2)
    t = torch.ones(8)
    comm.all_reduce(t, mesh.group("dp"))
    assert t[0].item() == 2.0
    model = plait.DDP(nn.Linear(4, 2), mesh)
    model(torch.randn(3, 4)).sum().backward()
""")


def _start(script: Path) -> list[subprocess.Popen]:
    """Two ranks with the variables torchrun would set (a launcher process adds nothing here)."""
    env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for r in range(2)]


def test_every_rank_of_every_launch_exits_cleanly(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    failures = []
    for first in range(0, LAUNCHES, AT_ONCE):
        running = [(first + i, _start(script)) for i in range(AT_ONCE)]
        for launch, ranks in running:
            for rank, proc in enumerate(ranks):
                _, err = proc.communicate(timeout=180)
                if proc.returncode != 0 or "terminate called" in err:
                    failures.append(f"launch {launch} rank {rank}: exit {proc.returncode}\n{err[-2000:]}")
    assert not failures, f"{len(failures)} of {2 * LAUNCHES} ranks failed:\n" + "\n".join(failures)


# ------------------------------------------------------------------ signals to `plait train --nproc 2`
# From the signal to every rank gone. The stop itself takes one step (well under a second here);
# the rest is each rank's exit (barriers, teardown, the interpreter's finalization): about 4 s on
# this project's 2-core machine at a load average of 4. The bound is the one users are promised.
STOP_BOUND_S = 10.0


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (its ranks), from /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _launch_and_signal(tmp_path: Path, args: list[str], *signals: int) -> tuple[int, str, float, list[int]]:
    """Start `plait train`, send ``signals`` to the launcher alone once a step is logged; its exit
    code, stderr, the seconds from the first signal until no rank was left, and the ranks."""
    metrics = tmp_path / "run" / "metrics.jsonl"
    launcher = subprocess.Popen([sys.executable, "-m", "plait", "train", *args, "--run-dir", str(tmp_path),
                                 "--name", "run"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # a signal to this test's group never reaches it
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # the header, then a step
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1]
        time.sleep(0.05)
    ranks = descendants(launcher.pid)
    sent = time.monotonic()
    for sig in signals:
        launcher.send_signal(sig)
    _, err = launcher.communicate(timeout=120)
    while any(_alive(p) for p in ranks) and time.monotonic() < sent + 60:
        time.sleep(0.05)
    return launcher.returncode, err, time.monotonic() - sent, [p for p in ranks if _alive(p)]


def test_sigterm_stops_every_rank_after_a_step_with_a_checkpoint_resuming_bit_identically(pools, tmp_path):
    from oracle import TRAIN_ARGV, train_losses

    save = tmp_path / "ckpt"
    # Long enough that the signal, sent once a step is logged, lands mid-run even on a slow machine.
    args = [*TRAIN_ARGV, "--strategy", "ddp", "--nproc", "2", "--steps", "40", "--save-dir", str(save)]
    code, err, took, left = _launch_and_signal(tmp_path, args, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM and not left and took < STOP_BOUND_S, (code, took, left, err[-2000:])
    stopped = re.search(r"by SIGTERM after step (\d+) of 40; checkpoint (\S+) written. Resume with: (.*)",
                        err)
    assert stopped, err[-3000:]
    step = int(stopped[1])
    named = ["--run-dir", str(tmp_path), "--name", "run"]
    assert stopped[3] == "plait train " + shlex.join([*args, *named, "--resume"])
    assert [p.name for p in save.iterdir()] == [f"step_{step:06d}"] == [Path(stopped[2]).name]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    before = [r["loss"] for r in rows if "step" in r]
    # The rest of the run from its checkpoint, and the uninterrupted run: the same losses, exactly.
    run = dict(strategy="ddp", nproc=2, steps=40)
    after = pools[2].run(train_losses, str(tmp_path / "after"), save_dir=str(save), resume=True, **run)[0]
    whole = pools[2].run(train_losses, str(tmp_path / "whole"), **run)[0]
    assert len(before) == step < 40 and before + after == whole


def test_sigint_twice_ends_every_rank_at_once(tmp_path):
    from oracle import TRAIN_ARGV

    args = [*TRAIN_ARGV, "--strategy", "ddp", "--nproc", "2", "--steps", "1000"]
    code, err, took, left = _launch_and_signal(tmp_path, args, signal.SIGINT, signal.SIGINT)
    assert code == 128 + signal.SIGINT and not left and took < STOP_BOUND_S, (code, took, left, err[-3000:])
    assert "Traceback" not in err, err[-3000:]


def _rank1_refuses() -> None:
    import torch.distributed as dist

    import plait

    plait.init()
    if dist.get_rank() == 1:
        raise ValueError("--tp 3 does not divide the 4 heads:\ntry --tp 2")
    plait.comm.barrier()  # rank 0 waits for a peer that is gone


def test_an_error_on_a_rank_is_one_line_naming_the_rank_and_where_the_traces_are(tmp_path):
    from plait.app.launch import RanksFailed, spawn

    with pytest.raises(RanksFailed) as failed:
        spawn(_rank1_refuses, 2, trace_dir=tmp_path / "traces")
    message = str(failed.value)
    assert "\n" not in message and message.startswith(
        "rank 1: ValueError: --tp 3 does not divide the 4 heads: try --tp 2"), message
    assert message.endswith(f"full tracebacks in {tmp_path / 'traces'}/")
    assert "Traceback" in (tmp_path / "traces" / "rank1.txt").read_text()


def _signal_reaches_rank1_only(tmp: str) -> tuple[int, int]:
    import torch.distributed as dist
    from oracle import TRAIN_BASE

    from plait.app.stop import StopRequest
    from plait.app.train import TrainConfig, train

    stop = StopRequest()
    if dist.get_rank() == 1:  # as under srun when only one node's tasks were signalled so far
        stop.signum = signal.SIGTERM
    cfg = TrainConfig.from_flags(**{**TRAIN_BASE, "run_dir": tmp, "save_dir": f"{tmp}/ckpt",
                                    "strategy": "ddp", "nproc": 2})
    out = train(cfg, stop, "plait train ... --resume")
    return len(out["losses"]), out["stopped_by"]


def test_ranks_signalled_by_their_own_launcher_agree_on_the_step_to_stop_after(pools, tmp_path):
    """Under torchrun or srun each rank gets the signal itself, not necessarily at the same step:
    one that did not stops with the one that did."""
    assert pools[2].run(_signal_reaches_rank1_only, str(tmp_path)) == [(1, signal.SIGTERM)] * 2
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step_000001"]
