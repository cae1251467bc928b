"""Training checkpoints that resume on a different number of ranks, and that cannot lie.

Model and optimizer state are written with `torch.distributed.checkpoint` (each rank writes
what it holds; replicated tensors are stored once) under one key layout for every data
layout::

    {"model": {fqn: tensor}, "optim": {f"{fqn}.{state_key}": tensor}}

FSDP supplies DTensor shards of that layout, tensor parallelism DTensors of its shards (over
the tp group), pipeline ranks the entries of their own stages; DDP, DataParallel and
single-process models supply plain tensors. Because the keys and full shapes are the same, a
checkpoint written by one layout loads into another (ZeRO-3 on 4 ranks -> DDP on 2 -> one
process, or a 2-stage pipeline x tp 2 -> FSDP x tp 2 -> one process).

``plait.json`` beside the data says what the checkpoint is (step, sampler position, config, the
run's identity and layout, plait's version) and lists every file DCP wrote with its size and
sha256. Each rank hashes the files it wrote itself (no rank needs to see another's disk to
write its share); rank 0 gathers the lists and writes ``plait.json`` last, through a temporary
file and ``os.replace``, so a folder whose ``plait.json`` parses holds a finished save. A
checksum mismatch, a short or missing file, or a ``plait.json`` that does not parse makes the
checkpoint corrupt: `choose` skips it for the newest good one, and every rank loads what rank 0
chose. `choose` also refuses another run's checkpoint (by the identity the caller saved), and
`save` can prune older ``step_*`` folders and write in the background (``async_save``).

Loading executes no pickled code. DCP keeps its ``.metadata`` as a pickle and reads it with
``pickle.load``, so a crafted file runs whatever it names. `SafeReader` unpickles it allowing
only DCP's metadata classes, ``torch.Size``, dtypes, layouts and paths, and refuses "bytes"
entries, which DCP would read back with ``torch.load(weights_only=False)`` (plait writes
tensors only; DCP reads tensors with ``weights_only=True``).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import StorageMeta

from plait import comm
from plait.data_parallel import DataParallel
from plait.ddp import DistributedDataParallel
from plait.env import get_logger
from plait.fsdp import FullyShardedDataParallel
from plait.fsdp_state_dict import _state_layout
from plait.pipeline.api import Pipeline
from plait.tensor_parallel import tp_info, tp_module
from plait.tp_state import checkpoint_entry, restore_entry
from plait.zero import ZeroRedundancyOptimizer

__all__ = ["save", "load", "latest", "verify", "choose", "prune", "state_dict", "load_state_dict",
           "SaveHandle", "SafeReader", "CorruptCheckpoint", "UnsafeCheckpoint", "ForeignCheckpoint",
           "identity_differences", "digest"]

META = "plait.json"
FORMAT = 1  # version of plait.json's layout
_DCP_METADATA = ".metadata"


def _view(model: Any) -> tuple[nn.Module, Any, dict[str, str]]:
    """(module whose state_dict has the shared layout's names, its TPInfo or None, renames).

    ``renames`` maps a parameter name to the name its optimizer state is stored under: a weight
    tied across pipeline ranks is held as a copy per rank, named after the module using it there,
    but has one optimizer state in the shared layout (under its first owner's name).
    """
    if isinstance(model, Pipeline):
        return model.state_module(), model.tp_info, model.tied_names
    if isinstance(model, (DistributedDataParallel, DataParallel)):
        model = model.module
    tp = tp_module(model)
    if tp is not None:
        return tp, tp_info(tp), {}
    return model, None, {}


def _steps(optimizer: Any, p: nn.Parameter) -> bool:
    """Whether this rank's optimizer steps ``p``: a ZeRO-1 wrapper holds (and writes, and
    reads back) the optimizer state of its own share of the parameters only."""
    return p.requires_grad and (not isinstance(optimizer, ZeroRedundancyOptimizer) or optimizer.owns(p))


def state_dict(model: nn.Module | Pipeline, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's view of the model and optimizer in the shared layout (also a `load` template).

    Tensor-parallel shards appear as DTensors of the full tensors (see `plait.tp_state`), a
    pipeline rank contributes the entries of its own stages.
    """
    if isinstance(model, FullyShardedDataParallel):
        return model.sharded_state_dict(optimizer)
    module, info, renames = _view(model)
    specs = info.specs if info is not None else {}
    layout = _state_layout(optimizer)
    optim: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        if not _steps(optimizer, p):
            continue
        state = optimizer.state.get(p, {})
        for key, kind in layout.items():
            out = f"{renames.get(name, name)}.{key}"
            # A parameter not stepped yet has no state: zeros stand in (made only then, not per save).
            if kind == "elem":
                value = torch.as_tensor(state[key]) if key in state else torch.zeros_like(p)
                optim[out] = checkpoint_entry(value, specs.get(name), info, name)
            else:
                value = torch.as_tensor(state[key]) if key in state else torch.zeros((), dtype=torch.float32)
                optim[out] = value.detach().clone()
    model_sd = {k: checkpoint_entry(v, specs.get(k), info, k) for k, v in module.state_dict().items()}
    return {"model": model_sd, "optim": optim}


@torch.no_grad()
def load_state_dict(model: nn.Module | Pipeline, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any]) -> None:
    """Put a filled `state_dict` template back into the model and optimizer."""
    if isinstance(model, FullyShardedDataParallel):
        model.load_sharded_state_dict(state, optimizer)
        return
    module, info, renames = _view(model)
    specs = info.specs if info is not None else {}
    own = module.state_dict(keep_vars=True)
    for key, target in own.items():
        restore_entry(target, state["model"][key], specs.get(key))
    layout = _state_layout(optimizer)
    for name, p in module.named_parameters():
        if not _steps(optimizer, p):
            continue
        restored = {}
        for key, kind in layout.items():
            value = state["optim"][f"{renames.get(name, name)}.{key}"]
            if kind == "elem":
                restored[key] = torch.zeros_like(p)
                restore_entry(restored[key], value, specs.get(name))
            else:
                restored[key] = value.clone()
        optimizer.state[p] = restored



# ------------------------------------------------------------------ errors
class CorruptCheckpoint(RuntimeError):
    """A checkpoint that must not be loaded: unfinished, truncated, altered or unreadable."""

    def __init__(self, path: Path, reason: str, message: str | None = None) -> None:
        self.path, self.reason = Path(path), reason
        super().__init__(message or f"checkpoint {path} is corrupt: {reason}")


class UnfinishedCheckpoint(CorruptCheckpoint):
    """A folder whose save never finished (no ``plait.json``): nothing was promised there."""


class UnsafeCheckpoint(CorruptCheckpoint):
    """DCP metadata that would run code or read outside its folder when loaded."""


class ForeignCheckpoint(ValueError):
    """The newest good checkpoint belongs to another run (``differences`` says how)."""

    def __init__(self, path: Path, differences: list[str]) -> None:
        self.path, self.differences = Path(path), differences
        super().__init__(
            f"{path} is a checkpoint of another run ({'; '.join(differences)}): refusing to resume it. "
            "Use another --save-dir, or --resume-anyway to continue it regardless")


# ------------------------------------------------------------------ metadata without pickled code
_ALLOWED_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # maps "torch.strided" to the layout object
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "str", "bytes",
                 "bytearray", "bool", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals DCP's metadata is made of: a crafted file cannot name
    ``os.system``, ``builtins.eval`` or a class whose construction has side effects."""

    def __init__(self, file: Any, source: Path) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED_GLOBALS.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        if name == "BytesStorageMetadata":
            raise UnsafeCheckpoint(self.source.parent, (
                f"{self.source.name} declares a non-tensor entry, which DCP would read back with "
                "torch.load(weights_only=False); plait checkpoints hold tensors only"))
        raise UnsafeCheckpoint(self.source.parent, (
            f"{self.source.name} refers to {module}.{name}, which is not one of DCP's metadata "
            "classes; loading it with pickle would run that code, so it was not unpickled"))


def read_dcp_metadata(path: Path) -> Any:
    """DCP's ``.metadata`` at ``path``, unpickled without running code and checked for entries
    that are not tensors or that point outside the checkpoint's folder."""
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f, path).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # a truncated or garbled pickle fails in many ways
        reason = f"{path.name} does not unpickle ({type(e).__name__}: {e})"
        raise CorruptCheckpoint(path.parent, reason) from e
    if not isinstance(md, dcp.Metadata):
        raise UnsafeCheckpoint(path.parent, f"{path.name} holds a {type(md).__name__}, not DCP metadata")
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(entry, dcp.TensorStorageMetadata):
            raise UnsafeCheckpoint(path.parent, f"{path.name}: entry {key!r} is not a tensor")
    for info in (md.storage_data or {}).values():
        _plain_name(path.parent, getattr(info, "relative_path", None))
    return md


def _plain_name(folder: Path, name: Any) -> str:
    """``name`` if it is a file name inside ``folder`` (no separators, not '..')."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name:
        raise UnsafeCheckpoint(folder, f"file name {name!r} points outside the checkpoint's folder")
    return name


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader whose `read_metadata` executes no pickled code (`read_dcp_metadata`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp.Metadata:
        rank = kwargs.get("rank")
        name = _DCP_METADATA if rank is None else f"__{rank}{_DCP_METADATA}"
        md = read_dcp_metadata(Path(self.path) / name)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


# ------------------------------------------------------------------ writing
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _version() -> str:
    from plait import __version__

    return __version__


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def digest(t: torch.Tensor) -> str:
    """sha256 of a CPU tensor's bytes: names data by content in a run's identity."""
    data: Any = t.detach().contiguous().view(torch.uint8).numpy()  # hashed in place, not copied
    return hashlib.sha256(data).hexdigest()


def _file_record(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


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
        if self.group is None and _distributed():
            ranks = list(range(dist.get_world_size()))
            self.group = dist.new_group(ranks, timeout=comm.timeout(), backend="gloo")
            comm.register_group(self.group, "checkpoint", ranks)
        return self.group


_BACKGROUND: dict[int, _Background] = {}  # by default group: a re-initialised job starts afresh


def _background() -> _Background:
    world = dist.group.WORLD if _distributed() else None
    bg = _BACKGROUND.get(id(world))
    if bg is None or bg.world is not world:
        bg = _BACKGROUND[id(world)] = _Background(world)
    return bg


def save(directory: str | Path, model: nn.Module | Pipeline, optimizer: torch.optim.Optimizer,
         meta: dict[str, Any], *, keep: int | None = None, async_save: bool = False) -> SaveHandle:
    """Write a checkpoint (a collective: every rank calls it) and, last, its ``plait.json``.

    ``meta`` (JSON) goes into ``plait.json`` with the file checksums and plait's version.
    ``keep``: once this checkpoint is complete, rank 0 deletes the ``step_*`` folders beside it
    beyond the ``keep`` newest (never this one). ``async_save``: return once this rank's state
    is copied to CPU memory; DCP writes it in the background and the returned handle's `wait`
    waits for the end. Every save first waits for the previous one, so at most one is in flight.
    """
    path = Path(directory)
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 (the number of newest checkpoints kept), got {keep}")
    bg = _background()
    bg.wait()
    if _rank() == 0:  # rewriting a folder: it is not a finished checkpoint meanwhile
        for stale in (META, _DCP_METADATA):
            (path / stale).unlink(missing_ok=True)
    writer = _RecordingWriter(path)
    state = state_dict(model, optimizer)
    if not async_save:
        dcp.save(state, storage_writer=writer)
        return SaveHandle(_finish(path, writer, meta, keep, None))
    group = bg.checkpoint_group()
    written = dcp.async_save(state, storage_writer=writer, process_group=group)
    upload: Any = getattr(written, "upload_completion", written)  # newer torch may return two futures
    bg.pending = SaveHandle(path, bg.executor.submit(_finish_after, upload, path, writer, meta, keep, group))
    return bg.pending


def _finish_after(upload: Future, path: Path, writer: _RecordingWriter, meta: dict[str, Any],
                  keep: int | None, group: dist.ProcessGroup | None) -> Path:
    upload.result()
    return _finish(path, writer, meta, keep, group)


def _finish(path: Path, writer: _RecordingWriter, meta: dict[str, Any], keep: int | None,
            group: dist.ProcessGroup | None) -> Path:
    """Once DCP returned on every rank (so every data file and ``.metadata`` is written): hash,
    gather the lists on rank 0, write ``plait.json``, prune, and let every rank know."""
    mine = {name: _file_record(path / name) for name in writer.written}
    if _rank() == 0:  # DCP's coordinator wrote .metadata before any rank's save returned
        mine[_DCP_METADATA] = _file_record(path / _DCP_METADATA)
    parts = comm.all_gather_object(mine, group) if _distributed() else [mine]
    if _rank() == 0:
        files = {name: record for part in parts for name, record in part.items()}
        _write_meta(path, {**meta, "format": FORMAT, "plait_version": _version(), "files": files})
        for stale in path.glob("*.distcp"):  # left by an earlier save into this folder
            if stale.name not in files:
                stale.unlink()
        if keep is not None:
            prune(path.parent, keep, newest=path, identity=meta.get("identity"))
    if _distributed():
        comm.barrier(group)
    return path


def _write_meta(path: Path, meta: dict[str, Any]) -> None:
    """Write ``plait.json`` so that it is either absent or whole: a crash never leaves half of it."""
    tmp = path / f"{META}.tmp"
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / META)


def _step_folders(root: str | Path) -> list[Path]:
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
    folders = [p for p in _step_folders(root) if identity is None or _same_run(p, identity)]
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


# ------------------------------------------------------------------ reading
def _read_meta(path: Path) -> dict[str, Any]:
    """``plait.json`` of a finished save, checked for the fields `verify` relies on."""
    file = path / META
    if not file.is_file():
        raise UnfinishedCheckpoint(path, f"no {META}: the save did not finish")
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError) as e:  # ValueError covers bad JSON and bad UTF-8
        raise CorruptCheckpoint(path, f"{META} does not parse ({e})") from e
    if not isinstance(meta, dict):
        raise CorruptCheckpoint(path, f"{META} holds a {type(meta).__name__}, not an object")
    missing = [k for k in ("format", "step", "files") if k not in meta]
    if missing:
        raise CorruptCheckpoint(path, f"{META} is incomplete: no {', '.join(missing)}")
    if meta["format"] != FORMAT:
        raise CorruptCheckpoint(path, f"{META} has format {meta['format']!r}; this plait reads {FORMAT}")
    files = meta["files"]
    if not isinstance(files, dict) or _DCP_METADATA not in files or not all(
            isinstance(r, dict) and isinstance(r.get("bytes"), int) and isinstance(r.get("sha256"), str)
            for r in files.values()):
        raise CorruptCheckpoint(path, f"{META} is incomplete: its file list lacks sizes or checksums")
    return meta


def verify(directory: str | Path) -> dict[str, Any]:
    """The ``plait.json`` of a finished, intact checkpoint; else raise `CorruptCheckpoint` saying
    which file is missing, short or altered, or what is wrong with the metadata.

    Reads every file once (sha256 runs at disk speed); not a collective.
    """
    path = Path(directory)
    meta = _read_meta(path)
    files: dict[str, dict[str, Any]] = meta["files"]
    for name, record in sorted(files.items()):
        file = path / _plain_name(path, name)
        if not file.is_file():
            raise CorruptCheckpoint(path, f"{name} is missing")
        size = file.stat().st_size
        if size != record["bytes"]:
            short = " (truncated)" if size < record["bytes"] else ""
            raise CorruptCheckpoint(path, f"{name} has {size} bytes, {record['bytes']} were written{short}")
    for name, record in sorted(files.items()):
        if _sha256(path / name) != record["sha256"]:
            raise CorruptCheckpoint(path, f"{name} does not match its sha256 (changed after writing)")
    md = read_dcp_metadata(path / _DCP_METADATA)
    unlisted = sorted({info.relative_path for info in md.storage_data.values()} - set(files))
    if unlisted:
        raise CorruptCheckpoint(path, f"{_DCP_METADATA} names files {META} does not list: {unlisted}")
    return meta


def load(directory: str | Path, model: nn.Module | Pipeline, optimizer: torch.optim.Optimizer, *,
         check: bool = True) -> dict[str, Any]:
    """Load a checkpoint written by `save`, on any number of ranks and layout; return its metadata.

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
            get_logger("plait.checkpoint").warning("%s lists no checksums: loading unverified", path / META)
        else:
            verify(path)
    read_dcp_metadata(path / _DCP_METADATA)  # refuses a crafted file here, with its own error
    template = state_dict(model, optimizer)
    dcp.load(template, storage_reader=SafeReader(path))
    load_state_dict(model, optimizer, template)
    return json.loads((path / META).read_text())


def latest(directory: str | Path) -> Path | None:
    """The newest ``step_*`` checkpoint under ``directory`` whose save finished (its checksums are
    not read: `choose` does that)."""
    for path in reversed(_step_folders(directory)):
        try:
            _read_meta(path)
        except CorruptCheckpoint:
            continue
        return path
    return None


# ------------------------------------------------------------------ resuming
def choose(directory: str | Path, identity: dict[str, Any] | None = None, *,
           resume_anyway: bool = False) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint to resume from and its ``plait.json``, the same on every rank (a collective).

    Rank 0 takes the newest ``step_*`` folder that `verify` passes, warning about each newer one
    it skips and why; one all_gather_object hands its answer to every rank, so no two ranks load
    different checkpoints. None when there is nothing to resume: no ``step_*`` folder, or only
    saves that never finished. When finished checkpoints exist but none is intact this raises
    `CorruptCheckpoint` instead of starting over: restarting from step 0 would silently throw
    the run's progress away, so the user decides. When ``identity`` differs from the one saved
    this raises `ForeignCheckpoint` listing the differences, or warns if ``resume_anyway``.
    """
    root = Path(directory)
    answer: Any = _survey(root, identity) if _rank() == 0 else None
    if _distributed():
        answer = comm.all_gather_object(answer)[0]  # rank 0's view, on every rank
    return _decide(root, answer, resume_anyway)


def _survey(root: Path, identity: dict[str, Any] | None) -> dict[str, Any]:
    """Rank 0's part of `choose`: plain data, to be sent to every rank."""
    skipped: list[tuple[str, str, bool]] = []
    for path in reversed(_step_folders(root)):
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
    log = get_logger("plait.checkpoint")
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
    if meta.get("plait_version") != _version():
        log.warning("%s was written by plait %s; this is plait %s", path, meta.get("plait_version"),
                    _version())
    return path, meta


_ABSENT = object()


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def identity_differences(here: dict[str, Any], saved: dict[str, Any]) -> list[str]:
    """``"seed: 1 here, 0 in checkpoint"`` for every field in which two run identities differ
    (nested fields dotted: ``model.d_model``). ``here`` goes through JSON first, as ``saved`` did,
    so a tuple equals the list it was saved as."""
    mine, theirs = _flatten(json.loads(json.dumps(here))), _flatten(saved)
    differences = []
    for key in list(mine) + [k for k in theirs if k not in mine]:
        a, b = mine.get(key, _ABSENT), theirs.get(key, _ABSENT)
        if a != b:
            show = ["absent" if v is _ABSENT else repr(v) for v in (a, b)]
            differences.append(f"{key}: {show[0]} here, {show[1]} in checkpoint")
    return differences
