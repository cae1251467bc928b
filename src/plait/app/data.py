"""Byte-level language-modelling data from local text.

The default corpus is the Python standard library's own ``.py`` sources: real text that is
present on every machine with Python, so nothing is downloaded. ``path`` may instead name a
file or a folder (every regular file under it, sorted, is read as bytes).

Sampling is a pure function of ``(seed, step)``: the global batch at step k is the same
whatever the number of data-parallel ranks, and each rank takes its contiguous slice. That
makes the sampler trivially resumable (its state is the step) and makes multi-rank runs
comparable with a single-process run on the same global batch.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["load_corpus", "Corpus", "BatchSampler", "default_corpus_path"]

VOCAB_SIZE = 256


def default_corpus_path() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        pattern = "*.py" if path == default_corpus_path() else "*"
        return sorted(p for p in path.rglob(pattern) if p.is_file() and "site-packages" not in p.parts)
    raise FileNotFoundError(f"--data {str(path)!r}: no such file or folder")


@dataclass
class Corpus:
    train: torch.Tensor  # uint8 bytes
    val: torch.Tensor
    source: str


def load_corpus(path: str | Path | None = None, max_bytes: int = 32 * 2**20,
                val_fraction: float = 0.05) -> Corpus:
    """Read up to ``max_bytes`` of text as bytes; the last ``val_fraction`` is held out."""
    root = Path(path) if path is not None else default_corpus_path()
    chunks, total = [], 0
    for f in _files(root):
        try:
            data = f.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    if len(blob) < 1024:
        raise ValueError(f"corpus at {root} has only {len(blob)} bytes; need at least 1024")
    tokens = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    split = int(len(tokens) * (1 - val_fraction))
    return Corpus(tokens[:split], tokens[split:], str(root))


class BatchSampler:
    """Random windows of ``seq_len + 1`` bytes; batch k depends only on ``(seed, k)``.

    ``dp_rank``/``dp_size`` select this rank's contiguous slice of the global batch.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0) -> None:
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by the {dp_size} "
                             "data-parallel ranks")
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"{len(tokens)} tokens cannot fill one window of {seq_len + 1}")
        self.tokens, self.seq_len, self.global_batch = tokens, seq_len, global_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.step = 0

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp_size

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.global_batch,), generator=g)
        lo = self.dp_rank * self.local_batch
        mine = starts[lo : lo + self.local_batch]
        idx = mine[:, None] + torch.arange(self.seq_len + 1)
        win = self.tokens[idx].long()
        return win[:, :-1], win[:, 1:]

    def __iter__(self) -> BatchSampler:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.seed = int(state["step"]), int(state["seed"])
