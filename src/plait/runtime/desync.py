"""What every rank is doing on every group: call records, desync checks and flight records.

Ranks that call collectives in different orders (a skipped all-reduce, two same-size
all-reduces swapped, a transposed shape, another reduce op) either hang or, worse, silently
mix unrelated data. `plait.comm` describes each collective as a `CallRecord` before running it
and keeps, per process group:

* a **running fingerprint**: a CRC chained over every record so far on the group, so one
  number summarises the group's whole history on this rank;
* a **flight record**: the last `FLIGHT_LEN` records, written to the run directory when a
  collective fails or times out, so the hang can be read after the fact.

The default check (``"fast"``) compares the running fingerprints before each collective with a
single 16-byte all-reduce on a companion Gloo group of the same ranks (CPU-side, so a GPU stream
is never synchronised, and independent of the data group, so it never queues behind an
in-flight bucket). A run of asynchronous collectives whose results are used together may share
one comparison, made with its last call (DDP's buckets: `comm.all_reduce(checked=False)`), since
the fingerprint chains every record. Only when fingerprints differ does it gather the records
themselves and name both sides: the collectives, their shapes, plait's operation and the user's
line of code.
``"full"`` gathers and compares the records before every collective (for debugging), ``"off"``
keeps records only.
"""

from __future__ import annotations

import json
import os
import sysconfig
import threading
import zlib
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType

import torch

from plait._torch_compat import caller_frame

MODES = ("off", "fast", "full")
FLIGHT_LEN = 64

_PLAIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package, above runtime/
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]
_APP_FILES = ("train.py", "cli.py", "run.py")
# Scopes only label messages, so they are process-wide: autograd may run hooks (and their
# collectives) on its own threads, which should still say "step 12". Operation names are part of
# what ranks compare, so they are per thread: a background thread (an asynchronous checkpoint)
# must not pick up the name of whatever the training thread is doing at that moment.
_scopes: list[str] = []
_local = threading.local()


def _operations() -> list[str]:
    if not hasattr(_local, "operations"):
        _local.operations = []
    return _local.operations
_scopes_lock = threading.Lock()


@dataclass(frozen=True)
class CallRecord:
    """One collective as this rank called it."""

    seq: int  # 1-based position among the collectives on this group
    op: str
    shape: tuple[int, ...]
    dtype: str
    detail: str  # the reduce op ("sum", "max", ...), a broadcast's source, or ""
    label: str  # the scopes it ran in, e.g. "step 12 / DDP bucket 3 of 4"
    operation: str  # the innermost `operation` name, "" outside any
    site: str  # the user's call site, file:line

    def key(self) -> str:
        """What must agree across ranks. Where plait named the operation, the name stands for the
        call site: the same operation may legitimately be reached from different lines (a DDP
        rank that joined mirrors the others' all-reduces). Elsewhere the user's line counts, so
        two same-size collectives reached in swapped order differ."""
        where = self.operation or self.site
        return f"{self.op}|{self.shape}|{self.dtype}|{self.detail}|{where}"

    def describe(self) -> str:
        shape = f" of a {self.shape} {self.dtype} tensor" if self.dtype else ""
        detail = f" ({self.detail})" if self.detail else ""
        label = f" [{self.label}]" if self.label else ""
        return f"#{self.seq} {self.op}{shape}{detail}{label} called at {self.site}"


class GroupLog:
    """This rank's history on one process group: sequence number, fingerprint, last calls."""

    def __init__(self) -> None:
        self.seq = 0
        self.fingerprint = 0
        self.last: deque[CallRecord] = deque(maxlen=FLIGHT_LEN)

    def add(self, op: str, t: torch.Tensor | None, detail: str) -> CallRecord:
        self.seq += 1
        rec = CallRecord(self.seq, op, tuple(t.shape) if t is not None else (),
                         str(t.dtype).removeprefix("torch.") if t is not None else "", detail,
                         current_label(), (_operations() or [""])[-1], call_site())
        self.fingerprint = zlib.crc32(rec.key().encode(), self.fingerprint)
        self.last.append(rec)
        return rec


@contextmanager
def scope(label: str, operation: bool = False) -> Iterator[None]:
    """Name what the collectives inside belong to ("step 12", "DDP bucket 3"); nests with " / ".

    ``operation=True`` also makes the name part of what ranks compare, in place of the call site.
    """
    with _scopes_lock:
        _scopes.append(label)
    if operation:
        _operations().append(label)
    try:
        yield
    finally:
        with _scopes_lock:
            _scopes.remove(label)
        if operation:
            _operations().pop()


def current_label() -> str:
    return " / ".join(_scopes)


def call_site() -> str:
    """file:line of the innermost frame outside plait's library and torch: the user's line that
    led here (plait's own applications, such as `plait train`, count as the user's code)."""
    frame: FrameType | None = caller_frame(1)
    while frame is not None:
        path = frame.f_code.co_filename
        library = path.startswith((_TORCH_DIR, _STDLIB_DIR)) or (
            path.startswith(_PLAIT_DIR) and os.path.basename(path) not in _APP_FILES)
        if not library and not path.startswith("<"):
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def first_divergence(histories: list[list[CallRecord]]) -> tuple[int, list[CallRecord | None]]:
    """(index into the histories, each rank's record there) of the first call that differs.

    Histories end at each rank's current call and may differ in length (a rank that skipped a
    collective has one fewer); they are aligned by sequence number.
    """
    by_seq = [{r.seq: r for r in h} for h in histories]
    seqs = sorted(set().union(*by_seq))
    for s in seqs:
        recs = [h.get(s) for h in by_seq]
        keys = {r.key() if r is not None else None for r in recs}
        if len(keys) > 1:
            return s, recs
    return seqs[-1] if seqs else 0, [h.get(seqs[-1]) if seqs else None for h in by_seq]


def write_flight_record(run_dir: str | Path, rank: int, logs: dict[str, GroupLog], reason: str) -> Path:
    """Write this rank's last calls on every group as JSON lines; returns the file."""
    folder = Path(run_dir) / "flight"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}.jsonl"
    with path.open("w") as f:
        f.write(json.dumps({"rank": rank, "reason": reason}) + "\n")
        for axis, log in logs.items():
            for rec in log.last:
                f.write(json.dumps({"axis": axis, **asdict(rec)}) + "\n")
    return path
