"""What the collectives moved, counted for as long as a block asks: ``with comm.counting() as c:``.

Each collective in `plait.runtime.comm.ops` records its count, its *logical* bytes (the size of the full
tensor reduced or gathered) and its *wire* bytes (what one rank sends under the ring algorithm),
per collective and mesh axis, into every counter open at that moment. Benchmarks compare these
with theory: DDP all-reduces Ψ·4 logical bytes per step; ZeRO-3 moves 1.5× the wire bytes of DDP.

Counters are scoped, not a process-wide tally that callers clear: a block counts what ran inside
it, whatever ran before or beside it, and nested blocks each see their own part. They are open
for the process, not one thread: DDP's gradient hooks may run on autograd's device threads.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

from plait.runtime.comm.groups import group_label


@dataclass
class OpStats:
    """One collective's counts on one axis."""

    calls: int = 0
    bytes: int = 0  # logical payload: the full tensor reduced / gathered / sent
    wire_bytes: float = 0.0  # bytes one rank sends under the ring algorithm


@dataclass(eq=False)
class CommStats:
    """Counts per (collective, axis label), of the collectives run inside a `counting` block."""

    ops: dict[tuple[str, str], OpStats] = field(default_factory=lambda: defaultdict(OpStats))

    def total(self, op: str | None = None, axis: str | None = None, key: str = "bytes") -> float:
        """The sum of ``key`` ("bytes", "wire_bytes" or "calls") over the collective ``op`` and the
        axis ``axis`` (None: every one)."""
        return sum(
            getattr(s, key)
            for (o, a), s in self.ops.items()
            if (op is None or o == op) and (axis is None or a == axis)
        )

    def calls(self, op: str | None = None, axis: str | None = None) -> int:
        """How many calls of ``op`` on ``axis`` (None: every one)."""
        return int(self.total(op, axis, key="calls"))

    def as_dict(self) -> dict[str, dict[str, float]]:
        """{"all_reduce@dp": {"calls": ..., "bytes": ..., "wire_bytes": ...}, ...}, sorted."""
        return {f"{o}@{a}": vars(s).copy() for (o, a), s in sorted(self.ops.items())}


_open: list[CommStats] = []  # the counters of the `counting` blocks open now, outermost first
_lock = threading.Lock()


@contextmanager
def counting() -> Iterator[CommStats]:
    """``with comm.counting() as c:`` counts every collective that runs inside the block, in ``c``
    (live: readable inside the block, and after it with the block's totals)."""
    counter = CommStats()
    with _lock:
        _open.append(counter)
    try:
        yield counter
    finally:
        with _lock:
            _open[:] = [c for c in _open if c is not counter]


def record(op: str, group: dist.ProcessGroup | None, nbytes: int, wire_factor: float) -> None:
    """Count one call of ``op`` on ``group`` moving ``nbytes`` logically, ``nbytes * wire_factor``
    on the wire, in every open counter."""
    key = (op, group_label(group))
    with _lock:
        for counter in _open:
            s = counter.ops[key]
            s.calls += 1
            s.bytes += nbytes
            s.wire_bytes += nbytes * wire_factor


def add_wire(op: str, group: dist.ProcessGroup | None, wire_bytes: float) -> None:
    """Add wire bytes to the last `record` of ``op`` on ``group`` (for a collective whose wire
    bytes are not a factor of its logical ones: uneven all-to-all splits)."""
    if not _open:
        return
    key = (op, group_label(group))
    with _lock:
        for counter in _open:
            counter.ops[key].wire_bytes += wire_bytes


def set_aside() -> list[CommStats]:
    """Close the open counters for a while (a dry run's collectives are not this process's) and
    return them for `restore`."""
    with _lock:
        saved = list(_open)
        _open.clear()
    return saved


def restore(saved: list[CommStats]) -> None:
    """Reopen the counters `set_aside` closed, dropping any opened since."""
    with _lock:
        _open[:] = saved
