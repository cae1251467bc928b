"""What makes a checkpoint trustworthy: checksums, a run's identity, and metadata read without
running pickled code.

``plait.json`` lists every file DCP wrote with its size and sha256; `verify` checks them all.
DCP keeps its ``.metadata`` as a pickle and reads it with ``pickle.load``, so a crafted file runs
whatever it names: `read_dcp_metadata` (and `SafeReader`, which DCP's loader calls) unpickles it
allowing only DCP's metadata classes, ``torch.Size``, dtypes, layouts and paths, and refuses
"bytes" entries, which DCP would read back with ``torch.load(weights_only=False)``.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import StorageMeta

META = "plait.json"
FORMAT = 1  # version of plait.json's layout
DCP_METADATA = ".metadata"


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
        plain_name(path.parent, getattr(info, "relative_path", None))
    return md


def plain_name(folder: Path, name: Any) -> str:
    """``name`` if it is a file name inside ``folder`` (no separators, not '..')."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name:
        raise UnsafeCheckpoint(folder, f"file name {name!r} points outside the checkpoint's folder")
    return name


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader whose `read_metadata` executes no pickled code (`read_dcp_metadata`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp.Metadata:
        rank = kwargs.get("rank")
        name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
        md = read_dcp_metadata(Path(self.path) / name)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


# ------------------------------------------------------------------ checksums
def sha256(path: Path) -> str:
    """sha256 of a file, read in 4 MiB chunks (at disk speed, never whole in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    """A file's entry in ``plait.json``'s list: its size and sha256."""
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


def digest(t: torch.Tensor) -> str:
    """sha256 of a CPU tensor's bytes: names data by content in a run's identity."""
    data: Any = t.detach().contiguous().view(torch.uint8).numpy()  # hashed in place, not copied
    return hashlib.sha256(data).hexdigest()


def read_meta(path: Path) -> dict[str, Any]:
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
    if not isinstance(files, dict) or DCP_METADATA not in files or not all(
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
    meta = read_meta(path)
    files: dict[str, dict[str, Any]] = meta["files"]
    for name, record in sorted(files.items()):
        file = path / plain_name(path, name)
        if not file.is_file():
            raise CorruptCheckpoint(path, f"{name} is missing")
        size = file.stat().st_size
        if size != record["bytes"]:
            short = " (truncated)" if size < record["bytes"] else ""
            raise CorruptCheckpoint(path, f"{name} has {size} bytes, {record['bytes']} were written{short}")
    for name, record in sorted(files.items()):
        if sha256(path / name) != record["sha256"]:
            raise CorruptCheckpoint(path, f"{name} does not match its sha256 (changed after writing)")
    md = read_dcp_metadata(path / DCP_METADATA)
    unlisted = sorted({info.relative_path for info in md.storage_data.values()} - set(files))
    if unlisted:
        raise CorruptCheckpoint(path, f"{DCP_METADATA} names files {META} does not list: {unlisted}")
    return meta


# ------------------------------------------------------------------ a run's identity
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
