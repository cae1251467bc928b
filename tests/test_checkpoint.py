"""Checkpoints written by one layout resume on another and continue the same loss curve."""

from __future__ import annotations

import shutil

import pytest
from oracle import train_losses

from plait.train import TrainConfig


@pytest.fixture(scope="module")
def zero3_checkpoint(pools, tmp_path_factory):
    """ZeRO-3 on 4 ranks, saving every 3 steps; returns a folder holding only the step-3 save."""
    root = tmp_path_factory.mktemp("ckpt")
    losses = pools[4].run(train_losses, str(root), strategy="fsdp", nproc=4, save_dir=str(root / "all"),
                          save_every=3)[0]
    only3 = root / "only3"
    shutil.copytree(root / "all" / "step_000003", only3 / "step_000003")
    return only3, losses


def test_zero3_run_with_saves_matches_oracle(oracle, zero3_checkpoint):
    assert zero3_checkpoint[1] == pytest.approx(oracle, rel=1e-4)


@pytest.mark.parametrize("world,layout", [
    (2, dict(strategy="ddp", nproc=2)),
    (2, dict(strategy="fsdp", nproc=2, zero_stage=2)),
])
def test_resume_on_another_world_size_and_layout(pools, oracle, zero3_checkpoint, tmp_path, world, layout):
    folder, _ = zero3_checkpoint
    work = tmp_path / "resume"
    shutil.copytree(folder, work)
    losses = pools[world].run(train_losses, str(tmp_path), save_dir=str(work), resume=True, **layout)[0]
    # Steps 4-6 continue exactly where the 4-rank ZeRO-3 run stopped (Adam moments restored too).
    assert losses == pytest.approx(oracle[3:], rel=1e-4)


def test_resume_in_one_process(oracle, zero3_checkpoint, tmp_path):
    folder, _ = zero3_checkpoint
    work = tmp_path / "resume"
    shutil.copytree(folder, work)
    losses = train_losses(str(tmp_path), strategy="none", nproc=1, save_dir=str(work), resume=True)
    assert losses == pytest.approx(oracle[3:], rel=1e-4)


def test_resume_without_save_dir_is_rejected():
    with pytest.raises(ValueError, match="--resume needs --save-dir"):
        TrainConfig(resume=True)
