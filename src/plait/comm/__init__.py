"""Every collective in plait goes through this module.

Why one place:

* **Accounting.** Each call records its count, its *logical* bytes (the size of the full
  tensor being reduced or gathered) and its *wire* bytes (what one rank sends under the ring
  algorithm), per collective type and per mesh axis. Benchmarks compare these with theory:
  DDP all-reduces Ψ·4 logical bytes per step; ZeRO-3 moves 1.5× the wire bytes of DDP.
* **Timeouts that hold.** Every group plait makes (`new_group`) gets `plait.init`'s timeout.
  A collective that fails or times out raises `CollectiveError` naming the collective, the
  axis, the ranks that never arrived (learnt through the store) and plait's operation and
  step (`scope`), and writes this rank's flight record (`plait.desync`) to the run directory.
* **Desync checks, on by default.** Before each collective the ranks compare a running
  fingerprint of everything they called on the group (one 16-byte all-reduce on a companion
  Gloo group); a mismatch names every rank's collective, shape, operation and call site,
  before any data is exchanged. `with comm.debug():` compares full descriptions instead.
* **Device checks.** A tensor on another device than the group's is refused by name, so a CPU
  bookkeeping tensor bound for NCCL fails the same way on CPU.

Under torch.compile every collective here runs eagerly between graphs (a clean graph break where
compiled code calls one): the bookkeeping above cannot be traced. Tensor parallelism's operators
trace torch's functional collectives instead (`plait.tp.collectives`).

The autograd-aware tensor-parallel operators (Megatron's f and g and their sequence-parallel
variants) belong to tensor parallelism: `plait.tp.collectives`.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as _dt
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait._torch_compat import default_store, eager
from plait.desync import MODES, CallRecord, GroupLog, first_divergence, write_flight_record
from plait.desync import scope as _scope

ReduceOp = dist.ReduceOp
# torch 2.13 renamed the flat-tensor collectives (the old names warn); torch 2.6 has only those.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_REDUCE_NAMES = {ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.MAX: "max", ReduceOp.MIN: "min",
                 ReduceOp.PRODUCT: "product"}
# How long a rank whose collective failed waits for its peers to say where they are.
_ARRIVAL_GRACE_S = 3.0


# ------------------------------------------------------------------ group registry
@dataclass
class GroupInfo:
    """What plait knows about a process group: its axis name, ranks, device and history."""

    label: str
    ranks: tuple[int, ...]
    device: torch.device
    checker: dist.ProcessGroup | None  # companion Gloo group for fingerprint checks
    log: GroupLog = field(default_factory=GroupLog)


_groups: dict[int, GroupInfo] = {}
_made: list[dist.ProcessGroup] = []  # every group plait created, in creation order (for teardown)

# Straggler blame (`plait.straggler`): the seconds this rank waited in the desync check for the
# other ranks to arrive, by the group's axis label and the phase of the step (`phase`). A rank
# that others wait for waits little itself; nothing is sent for it (the check meets anyway).
_waited: defaultdict[tuple[str, tuple[int, ...], str], float] = defaultdict(float)
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
    with _lock:
        return dict(_waited)


def _waiting(info: GroupInfo, seconds: float) -> None:
    with _lock:
        _waited[(info.label, info.ranks, _phase.get())] += seconds


def new_group(ranks: Sequence[int], label: str, checked: bool = True) -> dist.ProcessGroup | None:
    """Create a process group with `init`'s timeout, plus its companion check group.

    Collective over the whole world: every rank calls it with the same ``ranks`` in the same
    order. Returns the group on its members and None elsewhere. ``checked=False`` (groups that
    carry only point-to-point messages, which are not compared across ranks) skips the
    companion.
    """
    ranks = sorted(ranks)
    pg = dist.new_group(ranks, timeout=timeout())
    # A dry run's fake groups carry nothing to compare (and a Gloo companion would wait for peers).
    with_checker = checked and len(ranks) > 1 and _settings["device"].type != "meta"
    checker = dist.new_group(ranks, timeout=timeout(), backend="gloo") if with_checker else None
    if dist.get_rank() not in ranks:
        return None
    _made.extend(g for g in (pg, checker) if g is not None)
    register_group(pg, label, ranks, checker=checker)
    return pg


def new_local_group(rank: int, label: str) -> dist.ProcessGroup:
    """A group of this rank alone, made by this rank only (no other rank takes part, so nothing
    can deadlock and no rank pays for the others' one-rank groups). Collectives on it are local."""
    pg = dist.new_group([rank], timeout=timeout(), use_local_synchronization=True)
    _made.append(pg)
    register_group(pg, label, [rank])
    return pg


_on_destroy: list[Callable[[dist.ProcessGroup], None]] = []


def on_destroy(forget: Callable[[dist.ProcessGroup], None]) -> None:
    """Call ``forget(group)`` before each `destroy_group`: what keeps a group (a cache keyed on it)
    must let it go, or its Gloo threads and connections outlive it."""
    _on_destroy.append(forget)


def destroy_group(pg: dist.ProcessGroup) -> None:
    """Destroy a group `new_group` made, with its companion, and forget it. Local to this rank:
    call it where no collective on the group is in flight on any of its ranks."""
    for forget in _on_destroy:
        forget(pg)
    info = _groups.pop(id(pg), None)
    for g in (pg, None if info is None else info.checker):
        if g is None:
            continue
        if g in _made:
            _made.remove(g)
        with contextlib.suppress(ValueError):  # destroyed already
            dist.destroy_process_group(g)


def is_registered(pg: dist.ProcessGroup) -> bool:
    """Whether ``pg`` is a group `new_group` made (or `register_group` named), not a companion."""
    return id(pg) in _groups


def created_groups() -> list[dist.ProcessGroup]:
    """Every group `new_group` made on this rank, oldest first."""
    return list(_made)


def register_group(group: dist.ProcessGroup, label: str, ranks: Sequence[int],
                   checker: dist.ProcessGroup | None = None) -> None:
    """Name a process group (its mesh axis) for accounting, checks and error messages.

    Without a ``checker`` (a group made outside `new_group`), the fast desync check runs on the
    group itself when it is a Gloo group, and not at all otherwise.
    """
    _groups[id(group)] = GroupInfo(label, tuple(ranks), _settings["device"], checker)


def _info(group: dist.ProcessGroup | None) -> GroupInfo:
    group = dist.group.WORLD if group is None else group
    info = _groups.get(id(group))
    if info is None:
        label = "world" if group is dist.group.WORLD else "unnamed"
        ranks = tuple(dist.get_process_group_ranks(group))
        gloo = dist.get_backend(group) == "gloo"
        info = _groups[id(group)] = GroupInfo(label, ranks, _settings["device"], group if gloo else None)
    return info


def group_label(group: dist.ProcessGroup | None) -> str:
    """The mesh-axis name of ``group`` ("world" for an unregistered default group)."""
    return _info(group).label


def device_of(group: dist.ProcessGroup | None) -> torch.device:
    """The device whose tensors ``group`` carries: where bookkeeping tensors must be made."""
    return _info(group).device


def describe(group: dist.ProcessGroup | None) -> str:
    """"axis 'dp' (global ranks [0, 1])": how errors name a group."""
    info = _info(group)
    return f"axis '{info.label}' (global ranks {list(info.ranks)})"


# ------------------------------------------------------------------ accounting
@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0  # logical payload: the full tensor reduced / gathered / sent
    wire_bytes: float = 0.0  # bytes one rank sends under the ring algorithm


@dataclass
class CommStats:
    """Counts per (collective, axis label). Read with `stats()`, clear with `reset_stats()`."""

    ops: dict[tuple[str, str], OpStats] = field(default_factory=lambda: defaultdict(OpStats))

    def total(self, op: str | None = None, axis: str | None = None, key: str = "bytes") -> float:
        return sum(
            getattr(s, key)
            for (o, a), s in self.ops.items()
            if (op is None or o == op) and (axis is None or a == axis)
        )

    def calls(self, op: str | None = None, axis: str | None = None) -> int:
        return int(self.total(op, axis, key="calls"))

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {f"{o}@{a}": vars(s).copy() for (o, a), s in sorted(self.ops.items())}


_stats = CommStats()
_lock = threading.Lock()
# Set by `plait.init` through `configure`: comm reads no environment of its own.
_settings: dict[str, Any] = {"mode": "fast", "run_dir": "runs", "timeout_s": 300.0,
                             "device": torch.device("cpu")}


def stats() -> CommStats:
    """The live statistics object (counts since the last `reset_stats()`)."""
    return _stats


def reset_stats() -> CommStats:
    """Return a snapshot of the counts so far and start counting from zero."""
    global _stats
    with _lock:
        old, _stats = _stats, CommStats()
    return old


_saved: list[tuple[dict[str, Any], dict[int, GroupInfo], list[dist.ProcessGroup], CommStats]] = []


class MailNotSent(RuntimeError):
    """A dry run's `recv_object` of an object its sender's dry run has not sent yet: rehearse the
    sender, then this rank again (a pipeline whose stages alternate between ranks needs rounds)."""


def _next_mail(key: tuple[str, int, int]) -> int:
    """How many objects this dry run has sent or received so far on this (direction, src, dst)."""
    counts = _settings.setdefault("mail_counts", {})
    counts[key] = counts.get(key, -1) + 1
    return counts[key]


def enter_dry_run(mailbox: dict[tuple[int, int], list[Any]]) -> None:
    """`plait.env.dry_run`'s side: meta-device groups without desync checks, counts from zero,
    objects sent kept in ``mailbox`` (source, destination) -> objects for the rehearsal of their
    destination, and this process's real groups and settings put aside until `leave_dry_run`."""
    global _stats
    _saved.append((dict(_settings), dict(_groups), list(_made), _stats))
    _groups.clear()
    _made.clear()
    _stats = CommStats()
    _settings.update(mode="off", device=torch.device("meta"), mailbox=mailbox, mail_counts={})


def leave_dry_run() -> None:
    global _stats
    settings, groups, made, _stats = _saved.pop()
    _settings.clear()
    _settings.update(settings)
    _groups.clear()
    _groups.update(groups)
    _made[:] = made


def configure(desync_check: str | None = None, run_dir: str | None = None, timeout_s: float | None = None,
              device: torch.device | None = None) -> None:
    """Process-wide settings, from `plait.init`: the desync check mode, the folder for flight
    records, the timeout of every group plait makes and the device collectives carry."""
    if timeout_s is not None:
        _settings["timeout_s"] = float(timeout_s)
    if device is not None:
        _settings["device"] = device
    if desync_check is not None:
        if desync_check not in MODES:
            raise ValueError(f"desync_check must be one of {MODES}, got {desync_check!r}")
        _settings["mode"] = desync_check
    if run_dir is not None:
        _settings["run_dir"] = run_dir


def desync_mode() -> str:
    """The desync check mode now in force: "off", "fast" or "full"."""
    return str(_settings["mode"])


@contextmanager
def desync_check(mode: str) -> Iterator[None]:
    """Run the block with another desync check mode: "off", "fast" (the default) or "full"."""
    old = _settings["mode"]
    configure(desync_check=mode)
    try:
        yield
    finally:
        _settings["mode"] = old


def scope(label: str) -> contextlib.AbstractContextManager[None]:
    """``with comm.scope("step 12"):`` names what the collectives inside belong to, in desync
    reports, timeout errors and flight records (scopes nest: "step 12 / DDP bucket 3")."""
    return _scope(label)


def operation(name: str) -> contextlib.AbstractContextManager[None]:
    """Like `scope`, and the name replaces the call site in what ranks compare: for an operation
    that ranks legitimately reach from different lines (a joined DDP rank mirroring buckets)."""
    return _scope(name, operation=True)


def debug() -> contextlib.AbstractContextManager[None]:
    """``with comm.debug():`` compares every collective's full description across ranks."""
    return desync_check("full")


def _record(op: str, group: dist.ProcessGroup | None, nbytes: int, wire_factor: float) -> None:
    with _lock:
        s = _stats.ops[(op, group_label(group))]
        s.calls += 1
        s.bytes += nbytes
        s.wire_bytes += nbytes * wire_factor


class CollectiveError(RuntimeError):
    """A collective failed, timed out or desynchronised; the message says where and who."""


def _what(op: str, t: torch.Tensor | None, group: dist.ProcessGroup | None) -> str:
    tensor = f" of a {tuple(t.shape)} {t.dtype} tensor" if t is not None else ""
    return f"{op}{tensor} on {describe(group)}"


class Handle:
    """An in-flight collective. `wait()` blocks and turns failures into `CollectiveError`."""

    def __init__(self, work: dist.Work | None, what: str, on_fail: Callable[[Exception], str] | None = None,
                 check: _PendingCheck | None = None) -> None:
        self._work, self._what, self._on_fail, self._check = work, what, on_fail, check

    def wait(self) -> None:
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


def _run(op: str, t: torch.Tensor | None, group: dist.ProcessGroup | None, fn: Callable[[], Any],
         async_op: bool, detail: str = "", checked: bool = True) -> Handle | None:
    info = _info(group)
    if t is not None:
        _check_device(op, t, group, info)
    rec = info.log.add(op, t, detail)
    what = f"{_what(op, t, group)}, call {rec.describe()}"
    on_fail = lambda e: _failure_report(info, rec, e)  # noqa: E731
    pending = _check(info, rec, on_fail, what, defer=async_op) if checked else None
    try:
        work = fn()
    except RuntimeError as e:
        raise CollectiveError(f"{what} failed{on_fail(e)}: {e}") from e
    return Handle(work, what, on_fail, pending) if async_op else None


def _check_device(op: str, t: torch.Tensor, group: dist.ProcessGroup | None, info: GroupInfo) -> None:
    """Refuse a tensor the group cannot carry (NCCL: device tensors only), before any rank waits.

    ``_plait_unplaced`` marks a tensor made without ``device=`` under `plait.testing.DeviceAudit`:
    right on a CPU machine by accident, wrong on a GPU one.
    """
    made = getattr(t, "_plait_unplaced", None)
    if t.device.type != info.device.type or made is not None:
        where = f" (made without device= at {made})" if made is not None else ""
        raise CollectiveError(
            f"{_what(op, t, group)}: the tensor is on {t.device}{where}, but this axis communicates "
            f"on {info.device}; make bookkeeping tensors with device=comm.device_of(group)")


def _reduce_name(op: dist.ReduceOp.RedOpType) -> str:
    return _REDUCE_NAMES.get(op, str(op))


@dataclass
class _PendingCheck:
    """A fingerprint comparison in flight on the companion group, verified at the data's wait()."""

    info: GroupInfo
    fp: torch.Tensor
    work: Any
    what: str
    on_fail: Callable[[Exception], str]
    after: bool = False  # compared after the calls ran (`verify_history`), not before

    def verify(self) -> None:
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


def _send_fingerprint(info: GroupInfo, async_op: bool) -> tuple[torch.Tensor, Any]:
    """All-reduce (max) this rank's running fingerprint on ``info``'s companion group, with its
    negation: the pair the verdict reads (`_PendingCheck`)."""
    fp = torch.tensor([info.log.fingerprint, -info.log.fingerprint], dtype=torch.int64)
    return fp, dist.all_reduce(fp, op=ReduceOp.MAX, group=info.checker, async_op=async_op)


def _check(info: GroupInfo, rec: CallRecord, on_fail: Callable[[Exception], str], what: str,
           defer: bool) -> _PendingCheck | None:
    """Compare this call with the other ranks' before it runs (see `plait.desync`).

    A blocking collective is checked before it starts. An asynchronous one (a DDP bucket) is
    not held up: its check is sent alongside and verified in `Handle.wait`, before the result
    is used, so a rank that is ahead keeps computing instead of waiting for the slowest rank
    at every bucket. Returns the pending check for ``defer``.
    """
    mode = _settings["mode"]
    if mode == "off" or info.checker is None:
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
    pending = _PendingCheck(info, fp, work, what, on_fail)
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
    infos = sorted(_groups.values(), key=lambda i: (i.label, i.ranks))
    pending = [_PendingCheck(info, *_send_fingerprint(info, async_op=True), what="the end of its history",
                             on_fail=lambda e: "", after=True)
               for info in infos if info.checker is not None and len(info.ranks) > 1]
    for check in pending:
        check.verify()


def _gather_records(info: GroupInfo, mine: list[CallRecord]) -> list[CallRecord]:
    out: list[Any] = [None] * len(info.ranks)
    dist.all_gather_object(out, mine, group=info.checker)
    return [r for recs in out for r in recs]


def _desync_report(info: GroupInfo, after: bool = False) -> str:
    """Gather every rank's recent calls on the group and name the first that differs."""
    out: list[Any] = [None] * len(info.ranks)
    dist.all_gather_object(out, list(info.log.last), group=info.checker)
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


def _failure_report(info: GroupInfo, rec: CallRecord, error: Exception) -> str:
    """Write the flight record and learn, through the store, which ranks never arrived."""
    rank = dist.get_rank()
    flight = write_flight_record(_settings["run_dir"], rank, {g.label: g.log for g in _groups.values()},
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


def _n(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


# ------------------------------------------------------------------ collectives
@eager
def all_reduce(
    t: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = ReduceOp.SUM,
    async_op: bool = False,
    checked: bool = True,
) -> Handle | None:
    """In-place all-reduce of ``t`` across ``group``. A one-rank group neither launches nor counts
    anything: its all-reduce is the identity, and counting it would make the statistics claim
    collectives that never happen.

    ``checked=False`` records the call without comparing fingerprints now: for a run of
    collectives whose last one is checked, and whose results are used only after that check's
    verdict (DDP's buckets). The fingerprint chains every record, so the one comparison covers
    them all. Every rank must pass the same ``checked`` for the same call."""
    n = _n(group)
    if n == 1:
        return Handle(None, "") if async_op else None
    _record("all_reduce", group, t.numel() * t.element_size(), 2 * (n - 1) / n)
    return _run("all_reduce", t, group,
                lambda: dist.all_reduce(t, op=op, group=group, async_op=async_op), async_op, _reduce_name(op),
                checked)


@eager
def all_gather_into(
    out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Handle | None:
    """Gather equal ``shard``s from every rank into the flat ``out`` (rank order, dim 0)."""
    n = _n(group)
    _record("all_gather", group, out.numel() * out.element_size(), (n - 1) / n)
    if n == 1:
        out.copy_(shard)
        return Handle(None, "") if async_op else None
    return _run("all_gather", shard, group,
                lambda: _ALL_GATHER(out, shard, group=group, async_op=async_op),
                async_op)


@eager
def reduce_scatter_into(
    out: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = ReduceOp.SUM, async_op: bool = False,
) -> Handle | None:
    """Reduce ``full`` across ranks; rank i keeps chunk i (along dim 0) in ``out``."""
    n = _n(group)
    _record("reduce_scatter", group, full.numel() * full.element_size(), (n - 1) / n)
    if n == 1:
        out.copy_(full)
        return Handle(None, "") if async_op else None
    return _run("reduce_scatter", full, group,
                lambda: _REDUCE_SCATTER(out, full, op=op, group=group, async_op=async_op), async_op,
                _reduce_name(op))


def reduces_in_place(group: dist.ProcessGroup | None = None) -> bool:
    """True where `reduce_scatter_consuming` sums the whole of ``full`` in place (Gloo, or one
    rank): every element of ``full`` then holds its sum over ranks, whatever its layout, so a
    caller may lay ``full`` out as it likes and read its own chunks from it afterwards."""
    return _n(group) == 1 or dist.get_backend(group) == "gloo"


@eager
def reduce_scatter_consuming(
    full: torch.Tensor, group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = ReduceOp.SUM, async_op: bool = False,
) -> tuple[Handle | None, torch.Tensor]:
    """Reduce-scatter that may overwrite ``full``: returns (handle, this rank's reduced chunk).

    For callers that drop ``full`` afterwards (FSDP's flat gradient). Gloo has no reduce-scatter
    of its own: torch's Gloo backend clones the input, all-reduces the clone and copies one
    chunk out, so two full-size buffers live until the wait. Here Gloo all-reduces ``full`` in
    place instead (the same algorithm and bytes on the wire, without the clone) and the chunk is
    a view of ``full``; other backends reduce-scatter into a new tensor. Counted as a
    reduce-scatter, like `reduce_scatter_into`.
    """
    n = _n(group)
    if full.numel() % n:
        raise ValueError(f"reduce_scatter_consuming: {full.numel()} elements do not split into {n} chunks")
    _record("reduce_scatter", group, full.numel() * full.element_size(), (n - 1) / n)
    size = full.numel() // n
    if n == 1:
        return (Handle(None, "") if async_op else None), full
    if dist.get_backend(group) == "gloo":
        chunk = full.narrow(0, dist.get_rank(group) * size, size)
        work = _run("reduce_scatter", full, group,
                    lambda: dist.all_reduce(full, op=op, group=group, async_op=async_op), async_op,
                    _reduce_name(op))
        return work, chunk
    out = torch.empty(size, dtype=full.dtype, device=full.device)
    work = _run("reduce_scatter", full, group,
                lambda: _REDUCE_SCATTER(out, full, op=op, group=group, async_op=async_op), async_op,
                _reduce_name(op))
    return work, out


@eager
def broadcast(
    t: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> Handle | None:
    """Broadcast ``t`` from global rank ``src`` to every rank of ``group``."""
    n = _n(group)
    _record("broadcast", group, t.numel() * t.element_size(), 1.0 if n > 1 else 0.0)
    if n == 1:
        return Handle(None, "") if async_op else None
    return _run("broadcast", t, group,
                lambda: dist.broadcast(t, src=src, group=group, async_op=async_op), async_op,
                f"from rank {src}")


@eager
def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Gather a picklable object from every rank (used for metadata checks, not tensors)."""
    n = _n(group)
    _record("all_gather_object", group, 0, 0.0)
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    _run("all_gather_object", None, group,
         lambda: dist.all_gather_object(out, obj, group=group), False)
    return out


@eager
def barrier(group: dist.ProcessGroup | None = None) -> None:
    if _n(group) > 1:
        _run("barrier", None, group, lambda: dist.barrier(group=group), False)


# ------------------------------------------------------------------ point to point
@eager
def isend(t: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0,
          via: dist.ProcessGroup | None = None) -> Handle:
    """Asynchronously send ``t`` to global rank ``dst``; ``group`` names the axis for accounting,
    ``via`` is the process group that carries the message (default: the default group)."""
    _record("send", group, t.numel() * t.element_size(), 1.0)
    what = f"send of a {tuple(t.shape)} {t.dtype} tensor to rank {dst} on {describe(group)}"
    return _point_to_point(what, t, dst, lambda: dist.isend(t, dst=dst, tag=tag, group=via))


@eager
def irecv(t: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, tag: int = 0,
          via: dist.ProcessGroup | None = None) -> Handle:
    """Asynchronously receive into ``t`` from global rank ``src`` (``via``: as in `isend`)."""
    _record("recv", group, t.numel() * t.element_size(), 0.0)
    what = f"recv of a {tuple(t.shape)} {t.dtype} tensor from rank {src} on {describe(group)}"
    return _point_to_point(what, t, src, lambda: dist.irecv(t, src=src, tag=tag, group=via))


_p2p_log = GroupLog()  # sends and receives are not compared across ranks, only recorded


def _point_to_point(what: str, t: torch.Tensor | None, peer: int, fn: Callable[[], Any]) -> Handle:
    rec = _p2p_log.add(what.split(" of ")[0] + f" with rank {peer}", t, "")

    def on_fail(e: Exception) -> str:
        logs = {**{g.label: g.log for g in _groups.values()}, "p2p": _p2p_log}
        flight = write_flight_record(_settings["run_dir"], dist.get_rank(), logs, f"{rec.describe()}: {e}")
        return f" (rank {peer} never completed its side; this rank's last collectives are in {flight})"

    try:
        return Handle(fn(), what, on_fail)
    except RuntimeError as e:
        raise CollectiveError(f"{what} failed{on_fail(e)}: {e}") from e


class _Works:
    """Several in-flight point-to-point operations, awaited as one."""

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


@eager
def exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int,
             group: dist.ProcessGroup | None = None, tag: int = 0) -> Handle:
    """Send ``send`` to global rank ``dst`` while receiving ``recv`` from global rank ``src``, on
    ``group`` (one step of a ring). Both go in one batch, so on NCCL a ring of ranks that all send
    first cannot deadlock; ``tag`` tells apart exchanges in flight together on Gloo (NCCL matches
    them in the order they are issued, the same on every rank)."""
    info = _info(group)
    for t in (send, recv):
        _check_device("exchange", t, group, info)
    _record("send", group, send.numel() * send.element_size(), 1.0)
    _record("recv", group, recv.numel() * recv.element_size(), 0.0)
    what = (f"exchange on {describe(group)}: send of a {tuple(send.shape)} {send.dtype} tensor to rank "
            f"{dst}, recv of a {tuple(recv.shape)} from rank {src}")
    if send.is_meta:  # a dry run: the fake backend cannot batch point-to-point work; nothing moves anyway
        return Handle(None, what)
    ops = [dist.P2POp(dist.isend, send, dst, group, tag), dist.P2POp(dist.irecv, recv, src, group, tag)]
    return _point_to_point(what, send, dst, lambda: _Works(dist.batch_isend_irecv(ops)))


@eager
def all_to_all_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Rank i sends chunk j (along dim 0, equal chunks) of ``inp`` to rank j, which stores it as
    chunk i of ``out``. Counted: the full tensor logically, all chunks but one's own on the wire."""
    n = _n(group)
    _record("all_to_all", group, inp.numel() * inp.element_size(), (n - 1) / n)
    if n == 1:
        out.copy_(inp)
        return
    _run("all_to_all", inp, group, lambda: dist.all_to_all_single(out, inp, group=group), False)


@eager
def all_to_all_v(out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
                 group: dist.ProcessGroup | None = None) -> None:
    """Rank i sends rows ``in_splits[j]`` (along dim 0, in order) of ``inp`` to rank j, and stores
    what rank j sends it as the ``out_splits[j]`` rows of ``out`` in rank order (split sizes
    agreed beforehand). Counted: ``inp`` logically, the rows sent to other ranks on the wire."""
    n = _n(group)
    row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
    mine = dist.get_rank(group) if n > 1 else 0
    sent = inp.numel() * inp.element_size()
    _record("all_to_all", group, sent, 0.0)
    with _lock:
        _stats.ops[("all_to_all", group_label(group))].wire_bytes += (sum(in_splits) - in_splits[mine]) * row
    if n == 1:
        out.copy_(inp)
        return
    info = _info(group)
    for t in (inp, out):
        _check_device("all_to_all", t, group, info)
    # Logged without a shape: each rank's sizes are its own (the desync check compares records).
    _run("all_to_all", None, group, lambda: dist.all_to_all_single(
        out, inp, output_split_sizes=list(out_splits), input_split_sizes=list(in_splits), group=group), False,
        f"variable splits, {inp.dtype}")


@eager
def send_object(obj: Any, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Send a small picklable object (e.g. shapes and dtypes) to global rank ``dst``."""
    _record("send_object", group, 0, 0.0)
    mail = _settings.get("mailbox")
    if mail is not None:  # a dry run: kept for the rehearsal of rank dst (fake groups carry nothing)
        key = (dist.get_rank(), dst)
        sent, i = mail.setdefault(key, []), _next_mail(("send", *key))
        if i == len(sent):  # a rank rehearsed again sends the same objects again: kept once
            sent.append(obj)
        return
    what = f"send of an object to rank {dst} on {describe(group)}"
    _point_to_point(what, None, dst, lambda: dist.send_object_list([obj], dst=dst))


@eager
def recv_object(src: int, group: dist.ProcessGroup | None = None) -> Any:
    """Receive what `send_object` sent from global rank ``src``."""
    box: list[Any] = [None]
    _record("recv_object", group, 0, 0.0)
    mail = _settings.get("mailbox")
    if mail is not None:
        key = (src, dist.get_rank())
        sent, i = mail.get(key, []), _next_mail(("recv", *key))
        if i >= len(sent):
            raise MailNotSent(f"dry run of rank {dist.get_rank()}: rank {src} has not sent it object {i + 1} "
                              f"yet; rehearse rank {src} (with the same mailbox) first")
        return sent[i]
    what = f"recv of an object from rank {src} on {describe(group)}"
    _point_to_point(what, None, src, lambda: dist.recv_object_list(box, src=src))
    return box[0]


# ------------------------------------------------------------------ coalesced
@eager
def average_gradients(params: Iterable[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Average ``.grad`` over ``group`` after backward, in one flat all-reduce per dtype.

    For loops that cannot use DDP's overlapping hooks (e.g. a pipeline, whose microbatches
    run their own backward passes): correct, but without overlap.
    """
    world = dist.get_world_size(group)
    grads = [p.grad for p in params if p.grad is not None]
    if world > 1:
        _coalesced(grads, lambda flat: all_reduce(flat.div_(world), group))


@eager
def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int, group: dist.ProcessGroup | None) -> None:
    """Broadcast many tensors as one flat buffer per dtype (one collective instead of hundreds)."""
    _coalesced(tensors, lambda flat: broadcast(flat, src, group))


@torch.no_grad()
def _coalesced(tensors: Sequence[torch.Tensor], collective: Callable[[torch.Tensor], object]) -> None:
    """Run an in-place ``collective`` on one flat copy of ``tensors`` per (dtype, device)."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    seen: set[int] = set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            groups.setdefault((t.dtype, t.device), []).append(t)
    for ts in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        collective(flat)
        offset = 0
        for t in ts:
            t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def timeout() -> _dt.timedelta:
    """The collective timeout `plait.init` was given (for every group plait creates)."""
    return _dt.timedelta(seconds=_settings["timeout_s"])
