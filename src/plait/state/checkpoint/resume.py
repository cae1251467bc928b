"""Which checkpoint a resuming run loads: the newest intact one of this run, the same on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plait.runtime import comm
from plait.runtime.env import get_logger
from plait.state.checkpoint.files import distributed, rank, step_folders, version
from plait.state.checkpoint.integrity import (
    CorruptCheckpoint,
    ForeignCheckpoint,
    UnfinishedCheckpoint,
    identity_differences,
    verify,
)


class NoCheckpoint(FileNotFoundError):
    """A resume from a folder that does not exist or holds no ``step_*`` folder at all: most
    often a mistyped ``--save-dir``, which must not silently train from step 0."""

    def __init__(self, root: Path, missing: bool) -> None:
        self.path = root
        what = "does not exist" if missing else "holds no checkpoint (no step_* folder)"
        super().__init__(f"--resume: {root} {what}; check --save-dir (the folder the run saved into), or "
                         "leave out --resume to train from step 0")


def check_resumable(directory: str | Path) -> None:
    """Raise `NoCheckpoint` unless ``directory`` holds a ``step_*`` folder (not a collective:
    the launcher calls it before any rank starts; `choose` refuses the same on every rank)."""
    root = Path(directory)
    if not step_folders(root):
        raise NoCheckpoint(root, missing=not root.is_dir())


def choose(directory: str | Path, identity: dict[str, Any] | None = None, *,
           resume_anyway: bool = False, missing_ok: bool = False) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint to resume from and its ``plait.json``, the same on every rank (a collective).

    A ``directory`` that does not exist or holds no ``step_*`` folder raises `NoCheckpoint`, or,
    with ``missing_ok`` (a job that a launcher or a scheduler restarts with the same command:
    the first attempt has nothing to resume), returns None, as it does when no save ever finished.

    Rank 0 takes the newest ``step_*`` folder that `verify` passes, warning about each newer one
    it skips and why; one all_gather_object hands its answer to every rank, so no two ranks load
    different checkpoints. None when there is nothing to resume: only saves that never finished
    (the job ended during its first save). When finished checkpoints exist but none is intact this raises
    `CorruptCheckpoint` instead of starting over: restarting from step 0 would silently throw
    the run's progress away, so the user decides. When ``identity`` differs from the one saved
    this raises `ForeignCheckpoint` listing the differences, or warns if ``resume_anyway``.
    """
    root = Path(directory)
    answer: Any = _survey(root, identity) if rank() == 0 else None
    if distributed():
        answer = comm.all_gather_object(answer)[0]  # rank 0's view, on every rank
    if missing_ok and answer.get("empty"):
        return None
    return _decide(root, answer, resume_anyway)


def _survey(root: Path, identity: dict[str, Any] | None) -> dict[str, Any]:
    """Rank 0's part of `choose`: plain data, to be sent to every rank."""
    if not step_folders(root):
        return {"path": None, "meta": None, "skipped": [], "differences": [], "missing": not root.is_dir(),
                "empty": True}
    skipped: list[tuple[str, str, bool]] = []
    for path in reversed(step_folders(root)):
        try:
            meta = verify(path)
        except CorruptCheckpoint as e:
            skipped.append((str(path), e.reason, isinstance(e, UnfinishedCheckpoint)))
            continue
        differences = identity_differences(identity, meta.get("identity", {})) if identity is not None else []
        return {"path": str(path), "meta": meta, "skipped": skipped, "differences": differences}
    return {"path": None, "meta": None, "skipped": skipped, "differences": []}


def _decide(root: Path, answer: dict[str, Any], resume_anyway: bool) -> tuple[Path, dict[str, Any]] | None:
    """Every rank's part of `choose`: warn, refuse or accept the same way."""
    log = get_logger("plait.state.checkpoint")
    if answer.get("empty"):
        raise NoCheckpoint(root, missing=answer["missing"])
    for path, reason, _ in answer["skipped"]:
        log.warning("skipping checkpoint %s: %s", path, reason)
    if answer["path"] is None:
        corrupt = [f"{Path(p).name}: {r}" for p, r, unfinished in answer["skipped"] if not unfinished]
        if corrupt:
            raise CorruptCheckpoint(root, "; ".join(corrupt), message=(
                f"no intact checkpoint in {root} ({'; '.join(corrupt)}). Starting from step 0 would "
                "throw the run's progress away, so nothing was started: repair or move these folders "
                "aside (or pick another --save-dir) to train from scratch"))
        return None
    path, meta = Path(answer["path"]), answer["meta"]
    if answer["differences"]:
        if not resume_anyway:
            raise ForeignCheckpoint(path, answer["differences"])
        log.warning("resuming %s although it belongs to another run (%s)", path,
                    "; ".join(answer["differences"]))
    if answer["skipped"]:
        log.warning("falling back to checkpoint %s (step %s)", path, meta["step"])
    if meta.get("plait_version") != version():
        log.warning("%s was written by plait %s; this is plait %s", path, meta.get("plait_version"),
                    version())
    return path, meta
