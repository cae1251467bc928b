"""Restarts that resume by themselves: one command that a launcher (torchrun's ``--max-restarts``,
``plait run``, Slurm's ``--requeue``, a Kubernetes Job) runs again after a failure starts fresh when
there is nothing to resume and continues from the newest checkpoint when there is one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from plait.runtime.env import free_port

# A tiny byte-level run: a step takes tens of milliseconds here, so a kill after the first
# checkpoint lands with most of the run still to go.
RUN = ["--model", "tiny", "--batch-size", "8", "--max-bytes", "200000", "--eval-every", "0", "--warmup", "1",
       "--no-progress", "--steps", "40", "--save-every", "10"]


def _ranks_of(launcher: int) -> list[int]:
    """The launcher's children: its ranks (torchrun starts them directly)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == launcher:
                found.append(int(stat.parent.name))
        except OSError:
            continue
    return sorted(found)


def _losses(metrics: Path) -> dict[int, float]:
    """Each step's loss; a step run twice (before a failure and again after the resume) counts as
    its last run."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "step" in r}


def _launch(tmp: Path, name: str, restarts: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "plait", "run", "--nproc-per-node", "2", "--max-restarts", str(restarts),
           "--master-port", str(free_port()), "-m", "plait", "train", "--nproc", "2",
           "--save-dir", str(tmp / name / "ckpt"), "--resume", "auto", "--run-dir", str(tmp), "--name", name,
           *RUN]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_a_rank_killed_under_max_restarts_resumes_from_the_newest_checkpoint_by_itself(tmp_path):
    """The recipe users run: ``plait run --max-restarts 1 ... plait train ... --resume auto``. Its first
    attempt has no checkpoint and starts from step 0 (plain ``--resume`` refused it); ``kill -9`` of one
    rank after the first save makes torchrun restart both, and the restart resumes from the newest
    intact checkpoint: every step after it has the loss of a run that was never interrupted."""
    job = _launch(tmp_path, "killed", restarts=1)
    # The uninterrupted run it is held against, beside it: the launches wait on process starts
    # more than on the two CPUs, and the two runs share nothing but the machine.
    clean = _launch(tmp_path, "clean", restarts=0)
    first = tmp_path / "killed" / "ckpt" / "step_000010" / "plait.json"
    deadline = time.monotonic() + 240
    while not first.exists():
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.02)
    ranks = _ranks_of(job.pid)
    assert len(ranks) == 2, ranks
    os.kill(ranks[1], signal.SIGKILL)
    _, err = job.communicate(timeout=300)
    assert job.returncode == 0, err[-3000:]
    assert "--resume auto: no checkpoint in" in err and "starting from step 0" in err
    resumed = [line for line in err.splitlines() if "resumed from" in line]
    assert len(resumed) == 1 and "step_0000" in resumed[0], err[-3000:]

    _, clean_err = clean.communicate(timeout=300)
    assert clean.returncode == 0, clean_err[-3000:]
    got, want = _losses(tmp_path / "killed" / "metrics.jsonl"), _losses(tmp_path / "clean" / "metrics.jsonl")
    assert sorted(got) == list(range(1, 41)) == sorted(want)
    assert got == want  # bit for bit: the same parameters, optimizer state and data stream


def test_resume_auto_is_parsed_beside_the_plain_switch():
    from plait.app.config import parse_args

    base = ["--save-dir", "somewhere"]
    assert parse_args([*base, "--resume"]).checkpoint.resume is True
    assert parse_args([*base, "--resume", "auto"]).checkpoint.resume == "auto"
    assert parse_args([*base, "--resume=auto"]).checkpoint.resume == "auto"
    assert parse_args([*base, "--resume", "--steps", "300"]).checkpoint.resume is True
    assert parse_args([*base, "--no-resume"]).checkpoint.resume is False
    assert parse_args(base).checkpoint.resume is False


STUCK_MODEL = '''
import time
from torch import nn


class Stuck(nn.Module):
    """Hangs in its third forward, outside any collective (as a stuck data read or a user loop would)."""

    def __init__(self):
        super().__init__()
        self.emb, self.head, self.calls = nn.Embedding(256, 8), nn.Linear(8, 256), 0

    def forward(self, x):
        self.calls += 1
        while self.calls == 3:
            time.sleep(0.05)
        return self.head(self.emb(x))


def build():
    return Stuck()
'''


def test_a_rank_stuck_outside_collectives_ends_itself_after_the_step_timeout_naming_it(tmp_path):
    """No collective waits on a rank stuck in its own code (one process here), so the collective timeout
    cannot fire: the step timeout does, with every thread's stack (the stuck line among them), and the
    process exits with the status a restarting launcher acts on."""
    from plait.app.watchdog import STEP_TIMEOUT_EXIT

    (tmp_path / "stuck.py").write_text(STUCK_MODEL)
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "plait", "train", *RUN, "--model", "stuck:build", "--strategy", "none",
         "--nproc", "1", "--timeout", "1", "--step-timeout", "2", "--run-dir", str(tmp_path), "--name", "s"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - began
    assert done.returncode == STEP_TIMEOUT_EXIT, done.stderr[-3000:]
    assert "step timeout fired (--step-timeout 2 s)" in done.stderr and "while running step 3" in done.stderr
    stacks = (tmp_path / "s" / "flight" / "rank0-stacks.txt").read_text()
    assert "stuck.py\", line 16 in forward" in stacks, stacks  # the sleeping line
    assert took < 60, took


def test_the_timeouts_nest_collective_step_rendezvous():
    """--step-timeout must be longer than --timeout (the collective timeout, which names the ranks that did
    not arrive, fires first); `plait run` gives the rendezvous a timeout longer than the default step
    timeout unless --rdzv-conf sets one."""
    from plait.app.config import parse_args
    from plait.app.run import RENDEZVOUS_TIMEOUT_S, with_rendezvous_timeout

    cfg = parse_args(["--timeout", "10", "--step-timeout", "11"])
    assert (cfg.run.timeout, cfg.run.step_timeout) == (10, 11)
    assert 3 * parse_args([]).run.timeout < RENDEZVOUS_TIMEOUT_S  # test_flags.py: the refusals
    assert with_rendezvous_timeout("", "c10d") == f"join_timeout={RENDEZVOUS_TIMEOUT_S}"
    assert with_rendezvous_timeout("", "static") == f"timeout={RENDEZVOUS_TIMEOUT_S}"
    assert with_rendezvous_timeout("join_timeout=30,last_call_timeout=2", "c10d") == \
        "join_timeout=30,last_call_timeout=2"
