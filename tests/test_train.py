"""`plait train` and `plait run` end to end, plus config validation."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from plait.launch import free_port
from plait.train import TrainConfig, lr_at


def _run(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "plait.cli", *args], capture_output=True, text=True,
                          timeout=300, **kw)


def test_train_ddp_two_ranks_loss_falls(tmp_path):
    metrics = tmp_path / "m.jsonl"
    res = _run(["train", "--nproc", "2", "--steps", "40", "--warmup", "5", "--eval-every", "20",
                "--batch-size", "8", "--max-bytes", "2000000", "--metrics", str(metrics), "--no-progress"])
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in rows if "step" in r]
    summary = rows[-1]["summary"]
    assert len(steps) == 40 and summary["world"] == 2
    # A byte-level model starts near ln(256) = 5.5 and quickly learns byte frequencies.
    assert summary["first_loss"] > 5.0
    assert sum(r["loss"] for r in steps[-5:]) / 5 < summary["first_loss"] - 1.5
    assert steps[-1]["eval_loss"] < summary["first_loss"] - 1.5
    assert all(r["tokens_per_s"] > 0 for r in steps)


def test_plait_run_launches_a_user_script(tmp_path):
    script = tmp_path / "job.py"
    out = tmp_path / "out"
    script.write_text(textwrap.dedent(f"""
        import torch, torch.distributed as dist, plait
        plait.init()
        t = torch.tensor([dist.get_rank() + 1.0])
        plait.comm.all_reduce(t)
        open("{out}" + str(dist.get_rank()), "w").write(str(t.item()))
    """))
    res = _run(["run", "--nproc-per-node", "2", "--master-port", str(free_port()), str(script)])
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "out0").read_text() == (tmp_path / "out1").read_text() == "3.0"


@pytest.mark.parametrize("kwargs,match", [
    (dict(strategy="fsdp3"), "--strategy"),
    (dict(batch_size=10, nproc=4), "divisible"),
    (dict(warmup=500, steps=100), "--warmup"),
    (dict(strategy="none", nproc=2), "one process"),
    (dict(model="huge"), "--model"),
    (dict(strategy="fsdp", nproc=4, tp=3), "not divisible"),
    (dict(strategy="ddp", nproc=4, pp=2, tp=2, grad_accum=2), "--pp combines"),
    (dict(strategy="ddp", nproc=2, pp=2, sequence_parallel=True), "needs --tp 2 or more"),
    (dict(strategy="fsdp", nproc=4, pp=2, tp=2), "pass --zero-stage 1"),
    (dict(strategy="fsdp", nproc=4, pp=2, zero_stage=1, offload=True), "got --zero-stage 1 --offload"),
    (dict(strategy="dp", nproc=2, pp=2), "--pp combines"),
    (dict(strategy="ddp", nproc=2, pp=2, batch_size=6, microbatches=4), "--microbatches"),
    (dict(resume=True, pp=2, nproc=2), "--resume needs --save-dir"),
])
def test_bad_config_is_rejected_before_launch(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)


def test_cli_reports_bad_flag():
    res = _run(["train", "--batch-size", "3", "--nproc", "2"])
    assert res.returncode == 2 and "divisible" in res.stderr


def test_lr_schedule_warmup_then_cosine():
    cfg = TrainConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) == pytest.approx(0.1, abs=1e-3)
