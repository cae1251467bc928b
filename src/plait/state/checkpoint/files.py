"""Writing and reading checkpoint folders: DCP's files, then ``plait.json`` last.

Each rank hashes the files it wrote itself (no rank needs to see another's disk to write its
share); rank 0 gathers the lists and writes ``plait.json`` through a temporary file and
``os.replace``, so a folder whose ``plait.json`` parses holds a finished save. `save` can prune
older ``step_*`` folders and write in the background (``async_save``).

A full disk is named as such (`NoSpaceLeft`): torch's writer reports a short write as
"unexpected pos ...", so a failed save whose folder has less room left than this rank's share
counts as one too. The unfinished folder is removed (it holds nothing to resume and takes the
space a retry needs); the checkpoints before it are untouched.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from plait.runtime import comm
from plait.runtime.env import get_logger
from plait.state.checkpoint.integrity import (
    DCP_METADATA,
    FORMAT,
    META,
    CorruptCheckpoint,
    SafeReader,
    file_record,
    identity_differences,
    read_dcp_metadata,
    read_meta,
    verify,
)
from plait.state.checkpoint.protocol import Checkpointable, load_state_dict, state_dict
from plait.state.state_dict import buffers_of_first_data_rank


class NoSpaceLeft(OSError):
    """A checkpoint could not be written for want of disk space."""

    def __init__(self, path: Path, need: int, free: int) -> None:
        super().__init__(errno.ENOSPC, (
            f"No space left on device: checkpoint {path} could not be written (this rank's share is "
            f"{need / 1e6:.1f} MB, {free / 1e6:.1f} MB are free there); the unfinished folder was removed "
            "and earlier checkpoints are untouched: free some space or give another --save-dir"))
        self.path = path


def _state_bytes(state: Any) -> int:
    """Bytes of the tensors this rank writes (its shards of DTensors)."""
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


def _is_no_space(error: BaseException, path: Path, need: int) -> bool:
    """Whether ``error`` (any depth of causes, or DCP's per-rank failures) is a full disk."""
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or "No space left" in str(e):
            return True
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: exception}
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        wrapped = [getattr(x, "exception", x) for x in (failures or {}).values()]  # DCP wraps each
        todo += [x for x in wrapped if isinstance(x, BaseException)]
    return "unexpected pos" in str(error) + "".join(map(str, seen)) and _free(path) < max(need, 1 << 20)


def _free(path: Path) -> int:
    for folder in (path, *path.parents):
        if folder.exists():
            return shutil.disk_usage(folder).free
    return 0


@contextlib.contextmanager
def _naming_a_full_disk(path: Path, need: int) -> Iterator[None]:
    """Re-raise a full disk during a save of ``need`` bytes (this rank's) as `NoSpaceLeft`, the
    unfinished folder removed."""
    try:
        yield
    except (NoSpaceLeft, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if not _is_no_space(e, path, need):
            raise
        if rank() == 0 and not (path / META).exists():
            shutil.rmtree(path, ignore_errors=True)
        raise NoSpaceLeft(path, need, _free(path)) from e


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def version() -> str:
    from plait import __version__

    return __version__


class _RecordingWriter(dcp.FileSystemWriter):
    """DCP's file writer, remembering which files this rank wrote so that it hashes them itself."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.written: list[str] = []

    def write_data(self, plan: Any, planner: Any) -> torch.futures.Future:
        future = super().write_data(plan, planner)  # the files are complete when it returns
        self.written = sorted({r.storage_data.relative_path for r in future.wait()})
        return future


class SaveHandle:
    """A checkpoint being written. `wait()` returns its folder once ``plait.json`` is in place
    for every rank, and re-raises whatever failed in the background."""

    def __init__(self, path: Path, future: Future | None = None) -> None:
        self.path, self._future = path, future

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self) -> Path:
        if self._future is not None:
            self._future.result()
        return self.path


@dataclass
class _Background:
    """This process's background saves: their Gloo group and the one in flight."""

    world: Any
    group: dist.ProcessGroup | None = None
    pending: SaveHandle | None = None
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="plait-checkpoint"))

    def wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait()

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        """A CPU group of every rank for the background writer's collectives.

        The training loop keeps running collectives on its own groups meanwhile; on a group of
        their own the two streams of collectives cannot interleave (and with NCCL, DCP's
        background collectives need a CPU backend anyway). Made by every rank at its first
        background save, which every rank reaches at the same step.
        """
        if self.group is None and distributed():
            ranks = list(range(dist.get_world_size()))
            self.group = dist.new_group(ranks, timeout=comm.timeout(), backend="gloo")
            comm.register_group(self.group, "checkpoint", ranks)
        return self.group


_BACKGROUND: dict[int, _Background] = {}  # by default group: a re-initialised job starts afresh


def _background() -> _Background:
    world = dist.group.WORLD if distributed() else None
    bg = _BACKGROUND.get(id(world))
    if bg is None or bg.world is not world:
        bg = _BACKGROUND[id(world)] = _Background(world)
    return bg


def save(directory: str | Path, model: Checkpointable | nn.Module, optimizer: Any, meta: dict[str, Any], *,
         keep: int | None = None, async_save: bool = False,
         extra: dict[str, dict[str, torch.Tensor]] | None = None) -> SaveHandle:
    """Write a checkpoint (a collective: every rank calls it) and, last, its ``plait.json``.

    ``model`` is any layout `plait.checkpoint.state_dict` takes. ``meta`` (JSON) goes into
    ``plait.json`` with the file checksums and plait's version. ``extra``: more tensors saved,
    checksummed and resharded with the model, by name (``{"ema": {name: tensor}}``: DTensors
    as each rank holds them, plain tensors alike on every rank); `load` takes the same dict
    and fills its tensors, in any layout. ``keep``: once this checkpoint is
    complete, rank 0 deletes the ``step_*`` folders beside it beyond the ``keep`` newest (never
    this one). ``async_save``: return once this rank's state is copied to CPU memory; DCP writes
    it in the background and the returned handle's `wait` waits for the end. Every save first
    waits for the previous one, so at most one is in flight.
    """
    path = Path(directory)
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 (the number of newest checkpoints kept), got {keep}")
    bg = _background()
    bg.wait()
    if rank() == 0:  # rewriting a folder: it is not a finished checkpoint meanwhile
        for stale in (META, DCP_METADATA):
            (path / stale).unlink(missing_ok=True)
    writer = _RecordingWriter(path)
    state = _with_extra(state_dict(model, optimizer), extra)
    # DCP writes an entry several ranks hold from whichever rank balances the bytes: a buffer that
    # differs across data ranks (BatchNorm's running statistics) is made rank 0's first, in this
    # copy of the state only (the ranks keep their own), as `plait.full_state_dict` gives it.
    buffers_of_first_data_rank(model, state["model"])
    need = _state_bytes(state)
    if not async_save:
        with _naming_a_full_disk(path, need):
            dcp.save(state, storage_writer=writer)
            return SaveHandle(_finish(path, writer, meta, keep, None))
    group = bg.checkpoint_group()
    with _naming_a_full_disk(path, need):
        written = dcp.async_save(state, storage_writer=writer, process_group=group)
    upload: Any = getattr(written, "upload_completion", written)  # newer torch may return two futures
    bg.pending = SaveHandle(path, bg.executor.submit(_finish_after, upload, path, writer, meta, keep, group,
                                                     need))
    return bg.pending


def _finish_after(upload: Future, path: Path, writer: _RecordingWriter, meta: dict[str, Any],
                  keep: int | None, group: dist.ProcessGroup | None, need: int) -> Path:
    with _naming_a_full_disk(path, need):
        upload.result()
        return _finish(path, writer, meta, keep, group)


def _finish(path: Path, writer: _RecordingWriter, meta: dict[str, Any], keep: int | None,
            group: dist.ProcessGroup | None) -> Path:
    """Once DCP returned on every rank (so every data file and ``.metadata`` is written): hash,
    gather the lists on rank 0, write ``plait.json``, prune, and let every rank know."""
    mine = {name: file_record(path / name) for name in writer.written}
    if rank() == 0:  # DCP's coordinator wrote .metadata before any rank's save returned
        mine[DCP_METADATA] = file_record(path / DCP_METADATA)
    parts = comm.all_gather_object(mine, group) if distributed() else [mine]
    failed: OSError | None = None
    if rank() == 0:
        files = {name: record for part in parts for name, record in part.items()}
        try:
            _write_meta(path, {**meta, "format": FORMAT, "plait_version": version(), "files": files})
        except OSError as e:  # every rank learns of it below, rather than waiting at a barrier
            failed = e
        else:
            for stale in path.glob("*.distcp"):  # left by an earlier save into this folder
                if stale.name not in files:
                    stale.unlink()
            if keep is not None:
                prune(path.parent, keep, newest=path, identity=meta.get("identity"))
    report = None if failed is None else (failed.errno, str(failed))
    if distributed():
        report = comm.all_gather_object(report, group)[0]  # rank 0's, on every rank (the old barrier)
    if failed is not None:
        raise failed
    if report is not None:
        raise OSError(report[0], f"rank 0 could not write {path / META}: {report[1]}")
    return path


def _write_meta(path: Path, meta: dict[str, Any]) -> None:
    """Write ``plait.json`` so that it is either absent or whole: a crash never leaves half of it."""
    tmp = path / f"{META}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path / META)
    # The rename itself is durable once the folder's entry is on disk (POSIX leaves that to the folder).
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def step_folders(root: str | Path) -> list[Path]:
    """The ``step_N`` folders under ``root``, oldest (smallest N) first."""
    found = [(int(p.name[5:]), p) for p in Path(root).glob("step_*") if p.name[5:].isdigit() and p.is_dir()]
    return [p for _, p in sorted(found)]


def prune(root: str | Path, keep: int, newest: Path | None = None,
          identity: dict[str, Any] | None = None) -> list[Path]:
    """Delete the ``step_*`` folders under ``root`` beyond the ``keep`` newest, never ``newest``.

    Rank 0's job, after a save is complete. With ``identity``, finished checkpoints of another
    run (another identity in their ``plait.json``) are neither counted nor deleted: pruning
    never throws away someone else's work. Each folder loses its ``plait.json`` first, so one
    whose deletion is interrupted reads as unfinished, not as a checkpoint.
    """
    folders = [p for p in step_folders(root) if identity is None or _same_run(p, identity)]
    doomed = [p for p in folders[:max(0, len(folders) - keep)]
              if newest is None or p.resolve() != Path(newest).resolve()]
    for p in doomed:
        (p / META).unlink(missing_ok=True)
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def _same_run(folder: Path, identity: dict[str, Any]) -> bool:
    """Whether ``folder`` may be pruned as this run's: its ``plait.json`` names the same run, or
    is missing or unreadable (an unfinished or broken save, which holds nothing to resume)."""
    try:
        saved = json.loads((folder / META).read_text()).get("identity")
    except (OSError, ValueError, AttributeError):
        return True
    return not identity_differences(identity, saved or {})


def load(directory: str | Path, model: Checkpointable | nn.Module, optimizer: Any, *,
         check: bool = True, extra: dict[str, dict[str, torch.Tensor]] | None = None) -> dict[str, Any]:
    """Load a checkpoint written by `save`, on any number of ranks and layout; return its metadata.

    ``extra``: tensors saved with ``save(..., extra=...)``, the same names, filled in place (each a
    DTensor of this layout or a plain tensor, whichever layout wrote them).

    With ``check``, every rank first runs `verify` when ``plait.json`` lists checksums (pass
    ``check=False`` after `choose`, which verified on rank 0). A ``plait.json`` without a file
    list (written by hand beside a plain DCP checkpoint) loads unverified, with a warning. The
    DCP metadata is always read through `SafeReader`, whatever ``check`` says.
    """
    path = Path(directory)
    if not (path / META).exists():
        raise FileNotFoundError(f"no plait checkpoint at {path} (missing {META})")
    if check:
        try:
            meta = json.loads((path / META).read_text())
        except ValueError as e:
            raise CorruptCheckpoint(path, f"{META} does not parse ({e})") from e
        if isinstance(meta, dict) and "files" not in meta:
            get_logger("plait.state.checkpoint").warning("%s lists no checksums: loading unverified",
                                                         path / META)
        else:
            verify(path)
    read_dcp_metadata(path / DCP_METADATA)  # refuses a crafted file here, with its own error
    template = _with_extra(state_dict(model, optimizer), extra)
    dcp.load(template, storage_reader=SafeReader(path))
    load_state_dict(model, optimizer, template)
    return json.loads((path / META).read_text())


def _with_extra(state: dict[str, Any], extra: dict[str, dict[str, torch.Tensor]] | None) -> dict[str, Any]:
    """The checkpoint's state with the caller's ``extra`` tensors beside the model and optimizer."""
    if not extra:
        return state
    taken = sorted(set(extra) & set(state))
    if taken:
        raise ValueError(f"checkpoint extra={{...}}: {taken} would replace the checkpoint's own "
                         f"{taken} state; name the extra state otherwise (e.g. 'ema')")
    for name, tensors in extra.items():
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise TypeError(f"checkpoint extra={{{name!r}: ...}} must map names to tensors")
    return {**state, **extra}


def latest(directory: str | Path) -> Path | None:
    """The newest ``step_*`` checkpoint under ``directory`` whose save finished (its checksums are
    not read: `choose` does that)."""
    for path in reversed(step_folders(directory)):
        try:
            read_meta(path)
        except CorruptCheckpoint:
            continue
        return path
    return None
