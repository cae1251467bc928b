"""``--data FILES --tokenizer DIR``: text, JSON Lines or Parquet read through Hugging Face
`datasets`, tokenized once by a `transformers` tokenizer, cached as a token file.

The files are local (nothing is downloaded): a file, or a folder of files of one kind (``.txt``,
``.jsonl``/``.json``, ``.parquet``; hidden ones skipped). A ``.txt`` file is one document; a
JSON Lines record or a Parquet row is one document, its text under ``--text-field`` (``"text"``).
Each document's tokens are followed by the tokenizer's end-of-document token (its ``eos_token``),
so packing them into the fixed-length windows the sampler draws keeps documents apart.

The tokens are written once, as a ``.npy`` token file (uint16 when the vocabulary fits, else
uint32), to ``CACHE/tokens/<key>.npy``, ``CACHE`` being ``--data-cache`` (default
``~/.cache/plait``); `datasets`' own working files go to ``CACHE/datasets``. The key is a hash of
each file's path, size and modification time, of the tokenizer folder's files (their contents),
of the text field and of this format's version: change any and the data is tokenized again. The
file is written under a temporary name and renamed when complete, so a run stopped while
tokenizing leaves no half file a later run would take, and ranks that tokenize at the same time
(each rank under torchrun checks its config) end with the same file.

`datasets` and `transformers` are imported here only, when ``--tokenizer`` is given
(``pip install 'plait[data]'``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1  # bump when the cached layout changes: old caches are then not read
# file suffix -> the `datasets` builder that reads it
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
BATCH = 1000  # documents tokenized per call (a fast tokenizer batches them)


@dataclass(frozen=True)
class Tokenized:
    """A tokenized corpus: the cached token file and what the run needs to know of it."""

    path: Path  # the .npy token file
    vocab: int  # the tokenizer's vocabulary (with its added tokens)
    eod: int  # the end-of-document token id
    documents: int
    files: int
    reused: bool  # True: read from the cache, not tokenized in this call


def cache_root(given: str | None) -> Path:
    return Path(given).expanduser() if given is not None else Path.home() / ".cache" / "plait"


def data_files(path: Path) -> tuple[str, list[Path]]:
    """(builder, files) of ``--data``: one file, or a folder's files of one kind in sorted order."""
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in BUILDERS
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise ValueError(f"--data {path}: holds no {', '.join(BUILDERS)} files for --tokenizer to read")
    else:
        raise FileNotFoundError(f"--data {path}: no such file or folder")
    kinds = {BUILDERS.get(p.suffix) for p in files}
    if None in kinds:
        raise ValueError(f"--data {path}: with --tokenizer, --data is text (.txt), JSON Lines (.jsonl, "
                         f".json) or Parquet (.parquet); got {path.suffix or 'a file without a suffix'}")
    if len(kinds) > 1:
        raise ValueError(f"--data {path}: mixes {' and '.join(sorted(str(k) for k in kinds))} files; "
                         "give a folder of one kind")
    return str(kinds.pop()), files


def _key(files: list[Path], tokenizer: Path, field: str) -> str:
    h = hashlib.sha256(json.dumps({"version": FORMAT_VERSION, "field": field}).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    for f in sorted(p for p in tokenizer.rglob("*") if p.is_file()):
        content = hashlib.sha256(f.read_bytes()).digest()
        h.update(f.relative_to(tokenizer).as_posix().encode() + b"\0" + content)
    return h.hexdigest()[:32]


def load_tokenizer(directory: str | Path) -> Any:
    """A `transformers` tokenizer from a local folder (never the Hub); ValueError naming what is wrong."""
    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"--tokenizer {d}: no such folder (a folder a transformers tokenizer was saved to "
                         "with save_pretrained)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError("--tokenizer needs transformers and datasets: pip install 'plait[data]'") from None
    try:
        return AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"--tokenizer {d}: transformers cannot load a tokenizer from it: {e}") from None


def tokenized(data: str | Path, tokenizer: str | Path, cache: str | None = None,
              field: str = "text") -> Tokenized:
    """``data`` tokenized by the tokenizer in ``tokenizer``: from the cache, or tokenized now and cached."""
    builder, files = data_files(Path(data))
    tok = load_tokenizer(tokenizer)
    eod = tok.eos_token_id
    if eod is None:
        raise ValueError(f"--tokenizer {tokenizer}: has no end-of-document token (eos_token), which ends "
                         "each document; set one (tokenizer.eos_token = ...) and save it again")
    vocab = len(tok)
    root = cache_root(cache)
    out = root / "tokens" / f"{_key(files, Path(tokenizer), field)}.npy"
    meta = out.with_suffix(".json")
    if out.is_file() and meta.is_file():
        return Tokenized(out, vocab, eod, json.loads(meta.read_text())["documents"], len(files), True)
    documents = _write(builder, files, tok, eod, field, root, out)
    part = meta.with_name(f".{meta.name}.{os.getpid()}")  # renamed whole: a reader never sees half of it
    part.write_text(json.dumps({"documents": documents, "files": [str(f) for f in files],
                                "tokenizer": str(Path(tokenizer).resolve()), "field": field, "eod": eod}))
    os.replace(part, meta)
    return Tokenized(out, vocab, eod, documents, len(files), False)


def _write(builder: str, files: list[Path], tok: Any, eod: int, field: str, root: Path, out: Path) -> int:
    """Tokenize every document into ``out`` (written whole under another name, then renamed)."""
    try:
        import datasets
    except ImportError:
        raise ValueError("--tokenizer reads --data through Hugging Face datasets, which is not installed: "
                         "pip install 'plait[data]'") from None
    datasets.disable_progress_bars()
    options = {"sample_by": "document"} if builder == "text" else {}  # a .txt file is one document
    ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                               cache_dir=str(root / "datasets"), **options)
    if field not in ds.column_names:
        raise ValueError(f"--text-field {field}: the records of {files[0]} have no such field; they have "
                         f"{', '.join(ds.column_names)}")

    def encode(batch: dict[str, list]) -> dict[str, list]:
        ids = tok([t or "" for t in batch[field]], add_special_tokens=False)["input_ids"]
        return {"ids": [doc + [eod] for doc in ids], "n": [len(doc) + 1 for doc in ids]}

    ds = ds.map(encode, batched=True, batch_size=BATCH, remove_columns=ds.column_names)
    total = int(sum(ds["n"]))
    dtype = np.uint16 if len(tok) <= 1 << 16 else np.uint32
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(f".{out.stem}.{os.getpid()}.npy")
    arr = np.lib.format.open_memmap(part, mode="w+", dtype=dtype, shape=(total,))
    at = 0
    for batch in ds.iter(batch_size=BATCH):
        flat = np.fromiter((i for doc in batch["ids"] for i in doc), dtype=dtype)
        arr[at:at + len(flat)] = flat
        at += len(flat)
    arr.flush()
    del arr
    os.replace(part, out)
    return len(ds)
