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

from plait.env import free_port

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

    clean = _launch(tmp_path, "clean", restarts=0)
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
