"""Language-modelling data: local text as bytes, pre-tokenized token files of any size, or text,
JSON Lines and Parquet tokenized through ``--tokenizer``.

``--data`` names one of:

* a **token file**: a flat array of token ids as nanoGPT's ``prepare.py`` and Megatron's
  ``preprocess_data.py`` write them. ``.npy`` carries its dtype; a raw ``.bin`` does not, so its
  dtype comes from ``--data-dtype`` (uint16 or uint32) or from the Megatron ``.idx`` beside it, and
  a ``.bin`` with neither is refused rather than guessed. Read through `numpy.memmap`: a batch
  touches only the pages its windows cover, whatever the file's size.
* **text**: a file, or a folder whose regular files are read in sorted order as bytes (vocabulary
  256). Hidden folders (``.git/``...) are skipped, and so are binary files (a NUL byte in their
  first 8000 bytes, git's test), which makes byte 0 free: it ends every document (one per file).
* with ``--tokenizer DIR``, **text, JSON Lines or Parquet** read through Hugging Face `datasets`
  and tokenized once into a cached token file, each document followed by the tokenizer's
  end-of-document token (`plait.app.hfdata`).

The default corpus is the Python standard library's own ``.py`` sources: real text present on
every machine with Python, so nothing is downloaded. Token files are already packed by the tool
that wrote them (nanoGPT appends its end-of-text token to each document).

Sampling is a pure function of ``(seed, step)``: the global batch at step k is the same
whatever the number of data-parallel ranks, and each rank takes its contiguous slice. That
makes the sampler resumable in any layout (its state is the step; the global batch size and the
data are part of the run's identity) and makes multi-rank runs comparable with a single-process
run on the same global batch.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

VOCAB_SIZE = 256  # text is byte-level
EOD_BYTE = 0  # ends each text document: binary files (those holding NUL) are skipped, so text has none
TOKEN_DTYPES = ("uint16", "uint32")  # --data-dtype's choices for a raw .bin
MIN_TOKENS = 1024  # a corpus smaller than this is refused
BINARY_PROBE = 8000  # bytes read to tell a binary file (git reads as many)
# Megatron's indexed dataset: the .idx header and its dtype codes (megatron/core/datasets/indexed_dataset.py).
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
TOKEN_SUFFIXES = (".bin", ".npy")


def default_corpus_path() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass
class DataInfo:
    """What `scan` learns of ``--data`` without reading it all: enough to check a run before it starts."""

    kind: str  # "text" | "tokens"
    source: str
    tokens: int  # the tokens a run reads (text: bytes plus one end-of-document byte per file)
    vocab: int  # the largest token id + 1 (text: 256)
    files: int = 1
    skipped: list[str] = field(default_factory=list)  # binary files left out of a text folder
    total_tokens: int = 0  # before --max-bytes; > tokens when the cap cut the corpus
    cache: str | None = None  # tokenized through --tokenizer: the cached token file
    eod: int | None = None  # ... the end-of-document token after each document
    documents: int | None = None
    reused: bool | None = None  # ... True: the cache was read, not written

    @property
    def truncated(self) -> bool:
        return self.total_tokens > self.tokens


@dataclass(frozen=True)
class Tokenizing:
    """``--tokenizer DIR`` (with ``--text-field`` and ``--data-cache``): ``--data`` is text, JSON Lines
    or Parquet read through Hugging Face datasets and tokenized once (`plait.app.hfdata`)."""

    tokenizer: str
    field: str = "text"
    cache: str | None = None

    def tokenized(self, path: str | Path) -> Any:
        from plait.app import hfdata  # datasets and transformers: only when asked for

        return hfdata.tokenized(path, self.tokenizer, self.cache, self.field)


@dataclass
class Corpus:
    train: np.ndarray  # 1-D token ids: a memory map for token files, uint8 bytes for text
    val: np.ndarray
    info: DataInfo

    @property
    def source(self) -> str:
        return self.info.source


def is_token_file(path: str | Path) -> bool:
    return Path(path).suffix in TOKEN_SUFFIXES


def load_tokens(path: str | Path, dtype: str | None = None) -> np.ndarray:
    """A token file as a read-only memory map (nothing read yet); ValueError naming what is wrong."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--data {p}: no such file")
    if p.suffix == ".npy":
        arr = np.load(p, mmap_mode="r")
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"--data {p}: a token file holds a 1-D array of integer token ids; this .npy "
                             f"holds a {arr.ndim}-D {arr.dtype} array")
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            raise ValueError(f"--data-dtype {dtype}: {p} is a .npy of {arr.dtype}; drop --data-dtype (a .npy "
                             "says its own dtype)")
        return arr
    own = _megatron_dtype(p.with_suffix(".idx"))
    if own is not None and dtype is not None and np.dtype(dtype) != own:
        raise ValueError(f"--data-dtype {dtype}: the Megatron index {p.with_suffix('.idx')} says {p} holds "
                         f"{np.dtype(own).name} tokens; drop --data-dtype")
    if own is None and dtype is None:
        raise ValueError(f"--data {p}: a raw .bin does not say how wide its tokens are; add --data-dtype "
                         "uint16 (nanoGPT's, vocabularies up to 65,536) or --data-dtype uint32")
    chosen = np.dtype(own if own is not None else dtype)
    size = p.stat().st_size
    if size % chosen.itemsize:
        raise ValueError(f"--data {p}: {size} bytes is not a whole number of {chosen.name} tokens "
                         f"({chosen.itemsize} bytes each): is --data-dtype right?")
    if size == 0:
        raise ValueError(f"--data {p}: the file is empty")
    return np.memmap(p, dtype=chosen, mode="r")


def _megatron_dtype(idx: Path) -> type | None:
    """The token dtype a Megatron ``.idx`` records, or None when there is no such file."""
    if not idx.is_file():
        return None
    with idx.open("rb") as f:
        head = f.read(len(MEGATRON_MAGIC) + 9)
    if not head.startswith(MEGATRON_MAGIC) or len(head) < len(MEGATRON_MAGIC) + 9:
        raise ValueError(f"{idx}: lies beside the .bin but is not a Megatron index (its header is not "
                         f"{MEGATRON_MAGIC!r}); move it away or give the tokens as .npy")
    code = head[len(MEGATRON_MAGIC) + 8]
    if code not in MEGATRON_DTYPES:
        raise ValueError(f"{idx}: dtype code {code} is not an integer token type")
    return MEGATRON_DTYPES[code]


def _text_files(root: Path) -> Iterator[Path]:
    """The files of a text corpus in sorted order, hidden folders (.git, .venv) and, in the default
    corpus, everything but the standard library's .py sources left out."""
    default = root == default_corpus_path()
    for folder, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not (default and d == "site-packages"))
        for name in sorted(files):
            if default and not name.endswith(".py"):
                continue
            path = Path(folder, name)
            if path.is_file():
                yield path


def _is_binary(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return b"\0" in f.read(BINARY_PROBE)
    except OSError:
        return True  # unreadable: left out like a binary file


def _text_plan(root: Path) -> tuple[list[tuple[Path, int]], list[str]]:
    """(file, size) of each text file in reading order, and the binary files skipped."""
    if root == default_corpus_path():
        return _default_plan()
    if root.is_file():
        if _is_binary(root):
            raise ValueError(f"--data {root}: holds NUL bytes, so it is not text; if it holds token ids, "
                             "name it .bin with --data-dtype, or save it as .npy")
        return [(root, root.stat().st_size)], []
    if not root.is_dir():
        raise FileNotFoundError(f"--data {root}: no such file or folder")
    plan, skipped = [], []
    for f in _text_files(root):
        if _is_binary(f):
            skipped.append(str(f))
        else:
            plan.append((f, f.stat().st_size))
    return plan, skipped


@functools.lru_cache(maxsize=1)
def _default_plan() -> tuple[list[tuple[Path, int]], list[str]]:
    """The standard library's .py sources (text by construction: not probed), listed once per process:
    every config checks the corpus, and the listing is the slow part."""
    return [(f, f.stat().st_size) for f in _text_files(default_corpus_path())], []


@functools.lru_cache(maxsize=8)
def _token_vocab(path: str, dtype: str | None, size: int, mtime: float) -> int:
    """The largest id + 1 of a token file (read in chunks of 64 MiB tokens; cached by size and time)."""
    arr = load_tokens(path, dtype)
    lo, hi = 0, 0
    step = 1 << 26
    for start in range(0, len(arr), step):
        part = arr[start:start + step]
        lo, hi = min(lo, int(part.min())), max(hi, int(part.max()))
    if lo < 0:
        raise ValueError(f"--data {path}: holds negative token ids (smallest {lo})")
    return hi + 1


def scan(path: str | Path | None, dtype: str | None = None, max_bytes: int | None = None,
         tokenizing: Tokenizing | None = None) -> DataInfo:
    """What ``--data`` holds, read as cheaply as possible: sizes, and for token files the vocabulary
    (one pass over the memory map, cached). With ``tokenizing`` the data is tokenized here, once
    (later calls read the cache), and its vocabulary is the tokenizer's."""
    if tokenizing is not None:
        if path is None:
            raise ValueError(f"--tokenizer {tokenizing.tokenizer} tokenizes --data: give --data FILE or "
                             "FOLDER (text, JSON Lines or Parquet)")
        done = tokenizing.tokenized(path)
        n = len(load_tokens(done.path))
        return DataInfo("tokenized", str(path), n, done.vocab, files=done.files, total_tokens=n,
                        cache=str(done.path), eod=done.eod, documents=done.documents, reused=done.reused)
    root = Path(path) if path is not None else default_corpus_path()
    if path is not None and is_token_file(root):
        arr = load_tokens(root, dtype)
        st = root.stat()
        vocab = _token_vocab(str(root), dtype, st.st_size, st.st_mtime)
        return DataInfo("tokens", str(root), len(arr), vocab, total_tokens=len(arr))
    if dtype is not None:
        raise ValueError(f"--data-dtype {dtype} gives the width of a raw .bin token file; --data "
                         f"{path or 'the standard library'} is read as text: drop --data-dtype")
    plan, skipped = _text_plan(root)
    total = sum(size + 1 for _, size in plan)  # each document ends with EOD_BYTE
    read = total if max_bytes is None else min(total, max_bytes)
    return DataInfo("text", str(root), read, VOCAB_SIZE, files=len(plan), skipped=skipped, total_tokens=total)


def _read_text(root: Path, max_bytes: int | None) -> np.ndarray:
    plan, _ = _text_plan(root)
    chunks, total = [], 0
    for f, _ in plan:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        chunks += [data, bytes([EOD_BYTE])]
        total += len(data) + 1
        if max_bytes is not None and total >= max_bytes:
            break
    blob = b"".join(chunks)
    return np.frombuffer(blob[:max_bytes] if max_bytes is not None else blob, dtype=np.uint8)


def _open(path: str | Path | None, dtype: str | None, max_bytes: int | None,
          tokenizing: Tokenizing | None = None) -> np.ndarray:
    if path is not None and tokenizing is not None:
        return load_tokens(tokenizing.tokenized(path).path)
    if path is not None and is_token_file(path):
        return load_tokens(path, dtype)
    return _read_text(Path(path) if path is not None else default_corpus_path(), max_bytes)


def load_corpus(path: str | Path | None = None, max_bytes: int | None = None, val_fraction: float = 0.05,
                dtype: str | None = None, eval_path: str | Path | None = None,
                info: DataInfo | None = None, tokenizing: Tokenizing | None = None) -> Corpus:
    """The training tokens and the held-out ones: ``eval_path``'s, or else the last ``val_fraction``
    of ``path``'s. Text is read into memory (up to ``max_bytes``, None: all); token files are mapped.
    ``info``: what `scan` found already (the config's), so that no rank reads a token file whole again.
    ``tokenizing``: both are read through datasets and tokenized (from the cache `scan` filled)."""
    info = info if info is not None else scan(path, dtype, max_bytes, tokenizing)
    tokens = _open(path, dtype, max_bytes, tokenizing)
    if len(tokens) < MIN_TOKENS:
        raise ValueError(f"corpus at {info.source} has only {len(tokens)} tokens; need at least {MIN_TOKENS}")
    if eval_path is not None:
        eval_dtype = dtype if is_token_file(eval_path) and tokenizing is None else None
        return Corpus(tokens, _open(eval_path, eval_dtype, max_bytes, tokenizing), info)
    split = int(len(tokens) * (1 - val_fraction))
    return Corpus(tokens[:split], tokens[split:], info)


def fingerprint(tokens: np.ndarray) -> str:
    """Names data by content in a run's identity: sha256 of the whole for up to 64 MiB, else of the
    length and 16 evenly spread MiB (hashing terabytes at every resume is not an option)."""
    raw = np.ascontiguousarray(tokens).view(np.uint8) if len(tokens) * tokens.itemsize <= 64 << 20 else None
    h = hashlib.sha256()
    if raw is not None:
        h.update(raw)  # type: ignore[arg-type]
        return h.hexdigest()
    h.update(struct.pack("<QQ", len(tokens), tokens.itemsize))
    per = (1 << 20) // tokens.itemsize
    for i in range(16):
        start = (len(tokens) - per) * i // 15
        h.update(np.ascontiguousarray(tokens[start:start + per]).view(np.uint8))  # type: ignore[arg-type]
    return h.hexdigest()


class BatchSampler:
    """Random windows of ``seq_len + 1`` tokens; batch k depends only on ``(seed, k)``.

    ``dp_rank``/``dp_size`` select this rank's contiguous slice of the global batch. ``tokens``
    may be a memory map: only the windows drawn are read. A sample's id is the offset of its
    window's first token: the global batch at step k is the same ids whatever the layout, so a
    run resumed with another data-parallel size, or other tp, pp or cp, reads on exactly where it
    stopped. Its state (`state_dict`) says where the stream is: the step, the samples consumed
    and the global batch they were drawn in; another global batch would draw other samples, so
    `load_state_dict` refuses one.
    """

    def __init__(self, tokens: np.ndarray | torch.Tensor, seq_len: int, global_batch: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0) -> None:
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by the {dp_size} "
                             "data-parallel ranks")
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"{len(tokens)} tokens cannot fill one window of {seq_len + 1}")
        self.tokens = tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens
        self.seq_len, self.global_batch = seq_len, global_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.step = 0

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp_size

    def global_ids(self, step: int) -> np.ndarray:
        """The sample ids (window offsets) of the whole global batch at ``step``, in rank order."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        high = len(self.tokens) - self.seq_len - 1
        return torch.randint(0, high, (self.global_batch,), generator=g).numpy()

    def local_ids(self, step: int) -> np.ndarray:
        """This rank's slice of `global_ids`: the samples it reads at ``step``."""
        lo = self.dp_rank * self.local_batch
        return self.global_ids(step)[lo : lo + self.local_batch]

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.windows(self.local_ids(step))

    def windows(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets of the samples ``ids`` (any of `global_ids`: healing
        replicas split a global batch unevenly, `plait.runtime.heal.split`)."""
        idx = ids[:, None] + np.arange(self.seq_len + 1)
        win = torch.from_numpy(np.asarray(self.tokens[idx]).astype(np.int64))
        return win[:, :-1], win[:, 1:]

    def __iter__(self) -> BatchSampler:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "seed": self.seed, "samples": self.step * self.global_batch,
                "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        saved = int(state.get("global_batch", self.global_batch))  # older checkpoints did not record it
        if saved != self.global_batch:
            raise ValueError(f"the checkpoint's data stream was drawn in global batches of {saved} sequences "
                             f"({state.get('samples')} samples consumed); this run's --batch-size is "
                             f"{self.global_batch}, which would read other samples: resume with --batch-size "
                             f"{saved}")
        self.step, self.seed = int(state["step"]), int(state["seed"])
