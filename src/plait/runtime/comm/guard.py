"""The desync guard: ranks agree on each collective before any data moves, and a failure says who.

* **Desync checks, on by default.** Before each collective the ranks compare a running
  fingerprint of everything they called on the group (one 16-byte all-reduce on a companion
  Gloo group: 16 bytes move per check, nothing of the data); a mismatch names every rank's
  collective, shape, operation and call site, before any data is exchanged. ``with
  comm.debug():`` compares full descriptions instead (an all-gather of each rank's record).
* **Failures that name the missing.** A collective that fails or times out raises
  `CollectiveError` naming the collective, the axis, the ranks that never arrived (each rank
  posts where it stopped to the default store and reads the others') and plait's operation and
  step (`scope`), and writes this rank's flight record (`plait.runtime.desync`) to the run directory.
* **Straggler waits.** The seconds this rank waited in the check for the others, by axis and
  phase of the step (`phase`, `waited`), for `plait.runtime.straggler`.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from plait._torch_compat import default_store
from plait.runtime.comm.groups import GroupInfo, configure, registered, settings
from plait.runtime.desync import CallRecord, GroupLog, first_divergence, write_flight_record
from plait.runtime.desync import scope as _scope

# How long a rank whose collective failed waits for its peers to say where they are.
_ARRIVAL_GRACE_S = 3.0


class CollectiveError(RuntimeError):
    """A collective failed, timed out or desynchronised; the message says where and who."""


# ------------------------------------------------------------------ modes and scopes
def desync_mode() -> str:
    """The desync check mode now in force: "off", "fast" or "full"."""
    return str(settings["mode"])


@contextmanager
def desync_check(mode: str) -> Iterator[None]:
    """Run the block with another desync check mode: "off", "fast" (the default) or "full"."""
    old = settings["mode"]
    configure(desync_check=mode)
    try:
        yield
    finally:
        settings["mode"] = old


def debug() -> contextlib.AbstractContextManager[None]:
    """``with comm.debug():`` compares every collective's full description across ranks."""
    return desync_check("full")


def scope(label: str) -> contextlib.AbstractContextManager[None]:
    """``with comm.scope("step 12"):`` names what the collectives inside belong to, in desync
    reports, timeout errors and flight records (scopes nest: "step 12 / DDP bucket 3")."""
    return _scope(label)


def operation(name: str) -> contextlib.AbstractContextManager[None]:
    """Like `scope`, and the name replaces the call site in what ranks compare: for an operation
    that ranks legitimately reach from different lines (a joined DDP rank mirroring buckets)."""
    return _scope(name, operation=True)


# ------------------------------------------------------------------ straggler waits
# Straggler blame (`plait.runtime.straggler`): the seconds this rank waited in the desync check for the
# other ranks to arrive, by the group's axis label and the phase of the step (`phase`). A rank
# that others wait for waits little itself; nothing is sent for it (the check meets anyway).
_waited: defaultdict[tuple[str, tuple[int, ...], str], float] = defaultdict(float)
_waited_lock = threading.Lock()
_phase: contextvars.ContextVar[str] = contextvars.ContextVar("plait_phase", default="step")


def phase(name: str) -> contextlib.AbstractContextManager[None]:
    """``with comm.phase("forward"):`` files the waits of the collectives inside under ``name``."""
    return _in_phase(name)


@contextmanager
def _in_phase(name: str) -> Iterator[None]:
    token = _phase.set(name)
    try:
        yield
    finally:
        _phase.reset(token)


def waited() -> dict[tuple[str, tuple[int, ...], str], float]:
    """Seconds this rank has waited for the others in each group (its axis label and global
    ranks) and phase, since the start."""
    with _waited_lock:
        return dict(_waited)


def _waiting(info: GroupInfo, seconds: float) -> None:
    with _waited_lock:
        _waited[(info.label, info.ranks, _phase.get())] += seconds


# ------------------------------------------------------------------ the check
@dataclass
class PendingCheck:
    """A fingerprint comparison in flight on the companion group, verified at the data's wait()."""

    info: GroupInfo
    fp: torch.Tensor
    work: Any
    what: str
    on_fail: Callable[[Exception], str]
    after: bool = False  # compared after the calls ran (`verify_history`), not before

    def verify(self) -> None:
        """Wait for the comparison; raise `CollectiveError` naming the first differing call if the
        ranks' fingerprints differ."""
        try:
            if self.work is not None:
                start = time.perf_counter()
                self.work.wait()
                _waiting(self.info, time.perf_counter() - start)
        except RuntimeError as e:
            raise CollectiveError(f"waiting for every rank to reach {self.what} failed{self.on_fail(e)}: "
                                  f"{e}") from e
        # max(h) == -max(-h) exactly when every rank's fingerprint is the same.
        if int(self.fp[0]) != -int(self.fp[1]):
            raise CollectiveError(_desync_report(self.info, self.after))


class Handle:
    """An in-flight collective. `wait()` blocks and turns failures into `CollectiveError`."""

    def __init__(self, work: dist.Work | None, what: str, on_fail: Callable[[Exception], str] | None = None,
                 check: PendingCheck | None = None) -> None:
        self._work, self._what, self._on_fail, self._check = work, what, on_fail, check

    def wait(self) -> None:
        """Wait for the desync verdict, then for the data; a failure raises `CollectiveError`."""
        if self._check is not None:  # the desync verdict comes before the result is used
            check, self._check = self._check, None
            check.verify()
        if self._work is None:
            return
        try:
            self._work.wait()
        except RuntimeError as e:
            detail = self._on_fail(e) if self._on_fail is not None else ""
            raise CollectiveError(f"waiting for {self._what} failed{detail}: {e}") from e
        self._work = None


def _send_fingerprint(info: GroupInfo, async_op: bool) -> tuple[torch.Tensor, Any]:
    """All-reduce (max) this rank's running fingerprint on ``info``'s companion group, with its
    negation: the pair the verdict reads (`PendingCheck`)."""
    fp = torch.tensor([info.log.fingerprint, -info.log.fingerprint], dtype=torch.int64)
    return fp, dist.all_reduce(fp, op=dist.ReduceOp.MAX, group=info.desync_group, async_op=async_op)


def check(info: GroupInfo, rec: CallRecord, on_fail: Callable[[Exception], str], what: str,
          defer: bool) -> PendingCheck | None:
    """Compare this call with the other ranks' before it runs (see `plait.runtime.desync`).

    A blocking collective is checked before it starts. An asynchronous one (a DDP bucket) is
    not held up: its check is sent alongside and verified in `Handle.wait`, before the result
    is used, so a rank that is ahead keeps computing instead of waiting for the slowest rank
    at every bucket. Returns the pending check for ``defer``.
    """
    mode = settings["mode"]
    if mode == "off" or info.desync_group is None:
        return None
    try:
        if mode == "full":
            start = time.perf_counter()
            gathered = _gather_records(info, [rec])
            _waiting(info, time.perf_counter() - start)
            if len({r.key() for r in gathered}) > 1:
                raise CollectiveError(_desync_report(info))
            return None
        start = time.perf_counter()
        fp, work = _send_fingerprint(info, async_op=defer)
        if not defer:  # this rank waited here for the last one to arrive
            _waiting(info, time.perf_counter() - start)
    except RuntimeError as e:
        raise CollectiveError(f"waiting for every rank to reach {what} failed{on_fail(e)}: {e}") from e
    pending = PendingCheck(info, fp, work, what, on_fail)
    if defer:
        return pending
    pending.verify()
    return None


def verify_history() -> None:
    """Compare each group's whole history across its ranks now; raise `CollectiveError` naming
    the first call that differed (as the per-call check would have).

    Collective over the world: every rank calls it, between collectives. The running fingerprint
    chains every call a rank made on a group, so one comparison per group proves that every call
    so far matched on every rank: the per-call check (``desync_check="fast"``) would have passed
    at each of them. With ``desync_check="off"`` (which saves a round trip per collective), a
    call now and then (each epoch, at the end of a job) still finds a desync that did not hang.
    """
    # Launched together, then awaited; in one order on every rank (a group registered at its
    # first use is registered at different times on different ranks), as are the reports.
    infos = sorted(registered(), key=lambda i: (i.label, i.ranks))
    pending = [PendingCheck(info, *_send_fingerprint(info, async_op=True), what="the end of its history",
                            on_fail=lambda e: "", after=True)
               for info in infos if info.desync_group is not None and len(info.ranks) > 1]
    for p in pending:
        p.verify()


def _gather_records(info: GroupInfo, mine: list[CallRecord]) -> list[CallRecord]:
    out: list[Any] = [None] * len(info.ranks)
    dist.all_gather_object(out, mine, group=info.desync_group)
    return [r for recs in out for r in recs]


# ------------------------------------------------------------------ reports
def _desync_report(info: GroupInfo, after: bool = False) -> str:
    """Gather every rank's recent calls on the group and name the first that differs."""
    out: list[Any] = [None] * len(info.ranks)
    dist.all_gather_object(out, list(info.log.last), group=info.desync_group)
    seq, recs = first_divergence(out)
    # Every rank of the group is here and nothing was exchanged: start the group's history
    # afresh, so a caller that handles the error can go on using the group.
    info.log = GroupLog()
    sides = "\n".join(f"  rank {r}: " + (rec.describe() if rec is not None else "no collective (skipped)")
                      for r, rec in zip(info.ranks, recs))
    moved = ("found afterwards: the calls ran, with the per-call check off, and what they returned is wrong"
             if after else "nothing was exchanged")
    return (f"collective desync on axis '{info.label}' (global ranks {list(info.ranks)}) at call #{seq} "
            f"of that axis; {moved}. Each rank's collective there:\n{sides}")


def flight_record(rec: CallRecord, error: Exception, extra: dict[str, GroupLog] | None = None) -> str:
    """Write this rank's flight record (every group's recent calls, and ``extra`` logs) for a
    failure of ``rec``; return the file's path."""
    logs = {**{g.label: g.log for g in registered()}, **(extra or {})}
    return str(write_flight_record(settings["run_dir"], dist.get_rank(), logs, f"{rec.describe()}: {error}"))


def failure_report(info: GroupInfo, rec: CallRecord, error: Exception) -> str:
    """Write the flight record and learn, through the store, which ranks never arrived."""
    rank = dist.get_rank()
    flight = write_flight_record(settings["run_dir"], rank, {g.label: g.log for g in registered()},
                                 f"{rec.describe()} on axis '{info.label}': {error}")
    where = _arrivals(info, rec)
    return f" ({where}; this rank's last collectives are in {flight})"


def _arrivals(info: GroupInfo, rec: CallRecord) -> str:
    """Post where this rank is, wait briefly for the group's other ranks to do the same."""
    try:
        store = default_store()
        prefix = f"plait/at/{info.label}/{'-'.join(map(str, info.ranks))}/"
        store.set(prefix + str(dist.get_rank()), rec.describe())
        others = [r for r in info.ranks if r != dist.get_rank()]
        deadline = time.monotonic() + _ARRIVAL_GRACE_S
        while time.monotonic() < deadline and not store.check([prefix + str(r) for r in others]):
            time.sleep(0.05)
        missing, elsewhere = [], []
        for r in others:
            if not store.check([prefix + str(r)]):
                missing.append(r)
                continue
            theirs = store.get(prefix + str(r)).decode()
            if not theirs.startswith(f"#{rec.seq} "):
                elsewhere.append(f"rank {r} is at {theirs}")
    except Exception as e:  # the store itself may be gone with the failed rank
        return f"could not learn where the other ranks are: {e}"
    parts = [f"ranks {missing} did not arrive" if missing else "every rank arrived"] + elsewhere
    return "; ".join(parts)
