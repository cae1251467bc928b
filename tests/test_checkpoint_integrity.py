"""Checkpoints that cannot lie: damage is caught and skipped, other runs are refused, loading
runs no pickled code, old checkpoints are pruned, and background saves resume like blocking ones."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from oracle import TRAIN_ARGV, TRAIN_BASE

from plait import checkpoint
from plait.app.train import TrainConfig

RUN = {**TRAIN_BASE, "save_every": 3}  # 6 steps, saved at steps 3 and 6
TWO_RANKS = dict(strategy="ddp", nproc=2)
ONE_PROCESS = dict(strategy="none", nproc=1)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run(tmp: str, **overrides) -> dict:
    """`plait train`'s loop (on each rank of a pool, or here); its losses and the warnings of
    `plait.checkpoint` (rank 0 emits them)."""
    from plait.app.train import train

    collect = _Collect()
    logger = logging.getLogger("plait.state.checkpoint")
    logger.addHandler(collect)
    try:
        losses = train(TrainConfig.from_flags(**{**RUN, "run_dir": tmp, **overrides}))["losses"]
    finally:
        logger.removeHandler(collect)
    return {"losses": losses, "warnings": "\n".join(collect.lines)}


@dataclass
class Saved:
    folder: Path  # step_000003 and step_000006 of an uninterrupted 2-rank run
    losses: list[float]  # its 6 losses


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory) -> Saved:
    root = tmp_path_factory.mktemp("saved")
    out = pools[2].run(run, str(root), save_dir=str(root / "ckpt"), **TWO_RANKS)[0]
    return Saved(root / "ckpt", out["losses"])


def _copy(saved: Saved, tmp_path: Path, only: str | None = None) -> Path:
    work = tmp_path / "ckpt"
    if only is None:
        shutil.copytree(saved.folder, work)
    else:
        shutil.copytree(saved.folder / only, work / only)
    return work


def _largest_shard(folder: Path) -> Path:
    return max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)


def flip_64_bytes(folder: Path) -> None:
    shard = _largest_shard(folder)
    data = bytearray(shard.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    shard.write_bytes(bytes(data))


def truncate_shard(folder: Path) -> None:
    shard = _largest_shard(folder)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def delete_shard(folder: Path) -> None:
    _largest_shard(folder).unlink()


def truncate_plait_json(folder: Path) -> None:
    meta = folder / checkpoint.META
    meta.write_text(meta.read_text()[:200])


# ------------------------------------------------------------------ what a checkpoint carries
def test_plait_json_lists_every_file_every_rank_wrote(saved):
    folder = saved.folder / "step_000006"
    meta = json.loads((folder / checkpoint.META).read_text())
    on_disk = {p.name for p in folder.iterdir()} - {checkpoint.META}
    assert set(meta["files"]) == on_disk
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= on_disk  # both ranks' shards
    assert meta["identity"]["seed"] == 0 and meta["identity"]["lr"] == RUN["lr"]
    assert meta["identity"]["data"]["bytes"] > 0 and meta["layout"]["world_size"] == 2
    assert meta["plait_version"] and meta["step"] == 6
    assert checkpoint.verify(folder)["step"] == 6


# ------------------------------------------------------------------ damage
@pytest.mark.parametrize("fault,reason", [
    (flip_64_bytes, "does not match its sha256"),
    (truncate_shard, "(truncated)"),
    (delete_shard, "is missing"),
    (truncate_plait_json, "plait.json does not parse"),
], ids=["flipped_bytes", "truncated_shard", "missing_shard", "truncated_plait_json"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(pools, saved, tmp_path,
                                                              fault: Callable[[Path], None], reason: str):
    folder = _copy(saved, tmp_path)
    fault(folder / "step_000006")
    out = pools[2].run(run, str(tmp_path), save_dir=str(folder), resume=True, **TWO_RANKS)[0]
    assert "step_000006" in out["warnings"] and reason in out["warnings"], out["warnings"]
    assert "falling back to checkpoint" in out["warnings"] and "step_000003" in out["warnings"]
    # Steps 4-6 continue the uninterrupted run, and step 6 is written again, whole.
    assert out["losses"] == pytest.approx(saved.losses[3:], rel=1e-5)
    assert checkpoint.verify(folder / "step_000006")["step"] == 6


def test_when_every_checkpoint_is_damaged_resume_refuses_to_start_over(pools, saved, tmp_path):
    folder = _copy(saved, tmp_path)
    flip_64_bytes(folder / "step_000006")
    delete_shard(folder / "step_000003")
    errors = pools[2].errors(run, str(tmp_path), save_dir=str(folder), resume=True, **TWO_RANKS)
    for text in errors.values():
        assert "no intact checkpoint" in text and "step_000006: " in text and "step_000003: " in text


def test_saves_that_never_finished_are_skipped_and_training_starts_over(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    for step in ("step_000003", "step_000006"):
        (folder / step / checkpoint.META).unlink()  # as if the job died before writing it
    out = run(str(tmp_path), save_dir=str(folder), resume=True, **ONE_PROCESS)
    assert "the save did not finish" in out["warnings"]
    assert out["losses"] == pytest.approx(saved.losses, rel=1e-4)


# ------------------------------------------------------------------ another run
def test_checkpoint_of_another_run_is_refused_with_the_differences(pools, saved, tmp_path):
    folder = _copy(saved, tmp_path)
    errors = pools[2].errors(run, str(tmp_path), save_dir=str(folder), resume=True, seed=1,
                             **{**TWO_RANKS, "lr": 3e-3})
    for text in errors.values():
        assert "seed: 1 here, 0 in checkpoint" in text and "lr: 0.003 here, 0.01 in checkpoint" in text
        assert "--resume-anyway" in text


def test_resume_anyway_continues_another_runs_checkpoint(saved, tmp_path):
    folder = _copy(saved, tmp_path, only="step_000003")
    out = run(str(tmp_path), save_dir=str(folder), resume=True, resume_anyway=True, seed=1, **ONE_PROCESS)
    assert "belongs to another run (seed: 1 here, 0 in checkpoint)" in out["warnings"]
    assert len(out["losses"]) == 3


def test_other_world_size_and_layout_resume_the_same_run(saved, tmp_path):
    folder = _copy(saved, tmp_path, only="step_000003")
    out = run(str(tmp_path), save_dir=str(folder), resume=True, **ONE_PROCESS)
    assert out["warnings"] == ""
    assert out["losses"] == pytest.approx(saved.losses[3:], rel=1e-4)


# ------------------------------------------------------------------ no pickled code
class _Touch:
    """Unpickling this runs ``touch PATH``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _plant_metadata(folder: Path, payload: bytes) -> None:
    """Replace DCP's .metadata and fix plait.json's checksum for it, as an attacker would."""
    (folder / ".metadata").write_bytes(payload)
    meta = json.loads((folder / checkpoint.META).read_text())
    meta["files"][".metadata"] = checkpoint.file_record(folder / ".metadata")
    (folder / checkpoint.META).write_text(json.dumps(meta))


def _tiny_model_and_optimizer():
    import torch

    from plait.models.gpt import GPT

    model = GPT(TrainConfig.from_flags(**RUN).gpt_config())
    return model, torch.optim.AdamW(model.parameters())


def test_crafted_metadata_executes_nothing(saved, tmp_path):
    folder = _copy(saved, tmp_path, only="step_000003") / "step_000003"
    marker = tmp_path / "pwned"
    _plant_metadata(folder, pickle.dumps(_Touch(marker)))
    with pytest.raises(checkpoint.UnsafeCheckpoint, match=r"refers to (posix|os|nt)\.system"):
        checkpoint.verify(folder)
    model, opt = _tiny_model_and_optimizer()
    with pytest.raises(checkpoint.UnsafeCheckpoint, match=r"refers to (posix|os|nt)\.system"):
        checkpoint.load(folder, model, opt, check=False)  # the reader itself refuses, not only verify
    assert not marker.exists()


def test_metadata_with_bytes_entries_or_paths_outside_the_folder_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    tmp_path.joinpath(".metadata").write_bytes(pickle.dumps(dcp.Metadata({"x": dcp.BytesStorageMetadata()})))
    with pytest.raises(checkpoint.UnsafeCheckpoint, match="torch.load\\(weights_only=False\\)"):
        checkpoint.read_dcp_metadata(tmp_path / ".metadata")
    escape = dcp.Metadata({}, storage_data={MetadataIndex("x"): _StorageInfo("../../etc/passwd", 0, 8)})
    tmp_path.joinpath(".metadata").write_bytes(pickle.dumps(escape))
    with pytest.raises(checkpoint.UnsafeCheckpoint, match="outside the checkpoint's folder"):
        checkpoint.read_dcp_metadata(tmp_path / ".metadata")


# ------------------------------------------------------------------ pruning and background saves
def test_keep_leaves_exactly_the_newest_and_no_other_runs_checkpoint_is_deleted(saved, tmp_path):
    with pytest.raises(ValueError, match="--keep must be >= 1"):
        TrainConfig.from_flags(keep=0)
    other = tmp_path / "ckpt" / "step_000000"  # another run's, older than every save below
    shutil.copytree(saved.folder / "step_000003", other)
    meta = json.loads((other / checkpoint.META).read_text())
    meta["identity"]["seed"] = 7
    (other / checkpoint.META).write_text(json.dumps(meta))
    run(str(tmp_path), save_dir=str(tmp_path / "ckpt"), save_every=1, keep=2, **ONE_PROCESS)
    kept = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert kept == ["step_000000", "step_000005", "step_000006"]
    assert checkpoint.verify(tmp_path / "ckpt" / "step_000005")["step"] == 5


def test_async_save_resumes_like_a_blocking_one(pools, saved, tmp_path):
    # Every step saves in the background (each save waits for the one before), ZeRO-3's DTensor
    # shards are copied to CPU memory before the loop moves on, and pruning runs in the background.
    out = pools[2].run(run, str(tmp_path), save_dir=str(tmp_path / "async"), save_every=1, keep=4,
                       async_save=True, strategy="fsdp", nproc=2)[0]
    assert out["losses"] == pytest.approx(saved.losses, rel=1e-4)
    kept = sorted(p.name for p in (tmp_path / "async").iterdir())
    assert kept == ["step_000003", "step_000004", "step_000005", "step_000006"]
    for name in kept:
        checkpoint.verify(tmp_path / "async" / name)
    only3 = tmp_path / "only3"
    shutil.copytree(tmp_path / "async" / "step_000003", only3 / "step_000003")
    resumed = pools[2].run(run, str(tmp_path), save_dir=str(only3), resume=True, **TWO_RANKS)[0]
    assert resumed["losses"] == pytest.approx(saved.losses[3:], rel=1e-4)


# ------------------------------------------------------------------ a full disk
def _can_mount_tmpfs() -> bool:
    probe = "mkdir -p /tmp/plait-probe && mount -t tmpfs -o size=16k tmpfs /tmp/plait-probe"
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "sh", "-c", probe], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs `unshare -rm` to mount a small tmpfs")
def test_a_full_disk_says_so_and_the_next_resume_starts_from_the_last_good_checkpoint(tmp_path):
    """A real full disk: `plait train` (one process) saving every step into a tmpfs with room for
    one checkpoint of the tiny model (1.8 MB). The second save fails; the run says "No space left on
    device" with the folder, in one line, and leaves no step_000002 behind."""
    disk = tmp_path / "disk"
    train = shlex.join([sys.executable, "-m", "plait", "train", *TRAIN_ARGV, "--strategy", "none", "--nproc",
                        "1", "--save-every", "1", f"--save-dir={disk}/ckpt", f"--run-dir={tmp_path}",
                        "--name", "run"])
    script = (f"mkdir -p {disk} && mount -t tmpfs -o size=2600k tmpfs {disk} && {{ {train}; echo rc=$?; }}; "
              f"cp -r {disk}/ckpt {tmp_path}/ckpt")
    res = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    errors = [line for line in res.stderr.splitlines() if line.startswith("plait train: error:")]
    assert "rc=1" in res.stdout and len(errors) == 1, res.stderr[-3000:]
    assert "No space left on device" in errors[0] and f"{disk}/ckpt/step_000002" in errors[0], errors[0]
    assert "Traceback" not in res.stderr and (tmp_path / "run" / "traces" / "rank0.txt").is_file()
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step_000001"]
    found = checkpoint.choose(tmp_path / "ckpt")
    assert found is not None and found[1]["step"] == 1
