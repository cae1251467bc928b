"""The collectives: each one small named function that says what moves.

Every collective in plait goes through here (`plait.comm.all_reduce(...)`), so
that each is counted (`plait.runtime.comm.stats`), checked across ranks before it runs and named when it
fails (`plait.runtime.comm.guard`), and refused when its tensor is on another device than the group's (a
CPU bookkeeping tensor bound for NCCL fails the same way on CPU). Every group plait makes
(`plait.runtime.comm.groups`) gets `plait.init`'s timeout.

Under torch.compile every collective here runs eagerly between graphs (a clean graph break where
compiled code calls one): the bookkeeping above cannot be traced. Tensor parallelism's operators
trace torch's functional collectives instead (`plait.tp.collectives`), which also hold the
autograd-aware operators (Megatron's f and g and their sequence-parallel variants).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait._torch_compat import eager
from plait.runtime.comm import dryrun, guard
from plait.runtime.comm.groups import GroupInfo, describe, info_of
from plait.runtime.comm.guard import CollectiveError, Handle
from plait.runtime.comm.stats import add_wire, record
from plait.runtime.desync import GroupLog

ReduceOp = dist.ReduceOp
# torch 2.13 renamed the flat-tensor collectives (the old names warn); torch 2.6 has only those.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_REDUCE_NAMES = {ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.MAX: "max", ReduceOp.MIN: "min",
                 ReduceOp.PRODUCT: "product"}


def _what(op: str, t: torch.Tensor | None, group: dist.ProcessGroup | None) -> str:
    tensor = f" of a {tuple(t.shape)} {t.dtype} tensor" if t is not None else ""
    return f"{op}{tensor} on {describe(group)}"


def _run(op: str, t: torch.Tensor | None, group: dist.ProcessGroup | None, fn: Callable[[], Any],
         async_op: bool, detail: str = "", checked: bool = True) -> Handle | None:
    """Log the call on its group, check it across ranks (`guard.check`), run ``fn`` and name a
    failure: the path of every collective but point-to-point ones."""
    info = info_of(group)
    if t is not None:
        _refuse_wrong_device(op, t, group, info)
    rec = info.log.add(op, t, detail)
    what = f"{_what(op, t, group)}, call {rec.describe()}"
    on_fail = lambda e: guard.failure_report(info, rec, e)  # noqa: E731
    pending = guard.check(info, rec, on_fail, what, defer=async_op) if checked else None
    try:
        work = fn()
    except RuntimeError as e:
        raise CollectiveError(f"{what} failed{on_fail(e)}: {e}") from e
    return Handle(work, what, on_fail, pending) if async_op else None


def _refuse_wrong_device(op: str, t: torch.Tensor, group: dist.ProcessGroup | None, info: GroupInfo) -> None:
    """Refuse a tensor the group cannot carry (NCCL: device tensors only), before any rank waits.

    Under `plait.testing.DeviceAudit` a tensor made without ``device=`` carries where it was made
    (``_plait_made_without_device``):
    right on a CPU machine by accident, wrong on a GPU one.
    """
    made = getattr(t, "_plait_made_without_device", None)
    if t.device.type != info.device.type or made is not None:
        where = f" (made without device= at {made})" if made is not None else ""
        raise CollectiveError(
            f"{_what(op, t, group)}: the tensor is on {t.device}{where}, but this axis communicates "
            f"on {info.device}; make bookkeeping tensors with device=comm.device_of(group)")


def _reduce_name(op: dist.ReduceOp.RedOpType) -> str:
    return _REDUCE_NAMES.get(op, str(op))


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
    """In-place all-reduce of ``t`` across ``group``: every rank ends with the reduction of every
    rank's ``t``; under the ring algorithm each rank sends 2(n-1)/n of ``t``. A one-rank group
    neither launches nor counts anything: its all-reduce is the identity, and counting it would
    make the statistics claim collectives that never happen.

    ``checked=False`` records the call without comparing fingerprints now: for a run of
    collectives whose last one is checked, and whose results are used only after that check's
    verdict (DDP's buckets). The fingerprint chains every record, so the one comparison covers
    them all. Every rank must pass the same ``checked`` for the same call."""
    n = _n(group)
    if n == 1:
        return Handle(None, "") if async_op else None
    record("all_reduce", group, t.numel() * t.element_size(), 2 * (n - 1) / n)
    return _run("all_reduce", t, group,
                lambda: dist.all_reduce(t, op=op, group=group, async_op=async_op), async_op, _reduce_name(op),
                checked)


@eager
def all_gather_into(
    out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Handle | None:
    """Gather equal ``shard``s from every rank into the flat ``out`` (rank order, dim 0): each rank
    receives every other rank's shard, (n-1)/n of ``out``."""
    n = _n(group)
    record("all_gather", group, out.numel() * out.element_size(), (n - 1) / n)
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
    """Reduce ``full`` across ranks; rank i keeps chunk i (along dim 0) in ``out``: each rank sends
    (n-1)/n of ``full``."""
    n = _n(group)
    record("reduce_scatter", group, full.numel() * full.element_size(), (n - 1) / n)
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
    record("reduce_scatter", group, full.numel() * full.element_size(), (n - 1) / n)
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


def gathers_by_copy(group: dist.ProcessGroup | None = None) -> bool:
    """True where an all-gather lands in a flat buffer of the backend's own and is copied out of it
    into the outputs (torch's Gloo backend, even for ``all_gather_into_tensor``): a caller that
    wants the ranks' pieces in another order than rank-major passes the destinations to
    `all_gather_scattered` and spares its own reordering copy."""
    return _n(group) > 1 and dist.get_backend(group) == "gloo"


@eager
def all_gather_scattered(
    outs: Sequence[Sequence[torch.Tensor]], pieces: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None, async_op: bool = False,
) -> Handle | None:
    """Gather ``pieces[k]`` from every rank into ``outs[k][r]`` (rank r's), each a tensor of the
    piece's shape that may be a strided view into the caller's buffer: each rank receives (n-1)/n
    of the gathered bytes, as `all_gather_into`. One call for the counts and the desync check, one
    all-gather per piece on the wire (the backend copies each rank's piece to its place, a copy
    its flat all-gather makes anyway where `gathers_by_copy` holds)."""
    n = _n(group)
    record("all_gather", group, n * sum(p.numel() * p.element_size() for p in pieces), (n - 1) / n)
    if n == 1:
        for out, piece in zip(outs, pieces, strict=True):
            out[0].copy_(piece)
        return Handle(None, "") if async_op else None

    def gather() -> _Works | None:
        works = _Works([dist.all_gather(list(out), piece, group=group, async_op=True)
                        for out, piece in zip(outs, pieces, strict=True)])
        if async_op:
            return works
        works.wait()
        return None
    return _run("all_gather", pieces[0], group, gather, async_op, f"{len(pieces)} pieces")


@eager
def broadcast(
    t: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> Handle | None:
    """Broadcast ``t`` from global rank ``src`` to every rank of ``group`` (all of ``t`` moves)."""
    n = _n(group)
    record("broadcast", group, t.numel() * t.element_size(), 1.0 if n > 1 else 0.0)
    if n == 1:
        return Handle(None, "") if async_op else None
    return _run("broadcast", t, group,
                lambda: dist.broadcast(t, src=src, group=group, async_op=async_op), async_op,
                f"from rank {src}")


@eager
def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Gather a picklable object from every rank (used for metadata checks, not tensors): each rank's
    pickled object reaches every rank; counted as a call of no bytes."""
    n = _n(group)
    record("all_gather_object", group, 0, 0.0)
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    _run("all_gather_object", None, group,
         lambda: dist.all_gather_object(out, obj, group=group), False)
    return out


@eager
def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait until every rank of ``group`` has reached this call (no data moves); checked, not
    counted."""
    if _n(group) > 1:
        _run("barrier", None, group, lambda: dist.barrier(group=group), False)


# ------------------------------------------------------------------ point to point
@eager
def isend(t: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0,
          via: dist.ProcessGroup | None = None) -> Handle:
    """Asynchronously send ``t`` to global rank ``dst``; ``group`` names the axis for accounting,
    ``via`` is the process group that carries the message (default: the default group)."""
    record("send", group, t.numel() * t.element_size(), 1.0)
    what = f"send of a {tuple(t.shape)} {t.dtype} tensor to rank {dst} on {describe(group)}"
    return _point_to_point(what, t, dst, lambda: dist.isend(t, dst=dst, tag=tag, group=via))


@eager
def irecv(t: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, tag: int = 0,
          via: dist.ProcessGroup | None = None) -> Handle:
    """Asynchronously receive into ``t`` from global rank ``src`` (``via``: as in `isend`)."""
    record("recv", group, t.numel() * t.element_size(), 0.0)
    what = f"recv of a {tuple(t.shape)} {t.dtype} tensor from rank {src} on {describe(group)}"
    return _point_to_point(what, t, src, lambda: dist.irecv(t, src=src, tag=tag, group=via))


_p2p_log = GroupLog()  # sends and receives are not compared across ranks, only recorded


def _point_to_point(what: str, t: torch.Tensor | None, peer: int, fn: Callable[[], Any]) -> Handle:
    rec = _p2p_log.add(what.split(" of ")[0] + f" with rank {peer}", t, "")

    def on_fail(e: Exception) -> str:
        flight = guard.flight_record(rec, e, {"p2p": _p2p_log})
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
    info = info_of(group)
    for t in (send, recv):
        _refuse_wrong_device("exchange", t, group, info)
    record("send", group, send.numel() * send.element_size(), 1.0)
    record("recv", group, recv.numel() * recv.element_size(), 0.0)
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
    record("all_to_all", group, inp.numel() * inp.element_size(), (n - 1) / n)
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
    record("all_to_all", group, sent, 0.0)
    add_wire("all_to_all", group, (sum(in_splits) - in_splits[mine]) * row)
    if n == 1:
        out.copy_(inp)
        return
    info = info_of(group)
    for t in (inp, out):
        _refuse_wrong_device("all_to_all", t, group, info)
    # Logged without a shape: each rank's sizes are its own (the desync check compares records).
    _run("all_to_all", None, group, lambda: dist.all_to_all_single(
        out, inp, output_split_sizes=list(out_splits), input_split_sizes=list(in_splits), group=group), False,
        f"variable splits, {inp.dtype}")


@eager
def send_object(obj: Any, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Send a small picklable object (e.g. shapes and dtypes) to global rank ``dst``."""
    record("send_object", group, 0, 0.0)
    rehearsal = dryrun.current()
    if rehearsal is not None:  # kept for the rehearsal of rank dst (fake groups carry nothing)
        rehearsal.send(obj, dist.get_rank(), dst)
        return
    what = f"send of an object to rank {dst} on {describe(group)}"
    # On ``group``, not the default group: a message there could meet whatever else the program
    # (or torch: DCP, the exit barrier) runs on the default group meanwhile.
    _point_to_point(what, None, dst, lambda: dist.send_object_list([obj], dst=dst, group=group))


@eager
def recv_object(src: int, group: dist.ProcessGroup | None = None) -> Any:
    """Receive what `send_object` sent from global rank ``src``."""
    box: list[Any] = [None]
    record("recv_object", group, 0, 0.0)
    rehearsal = dryrun.current()
    if rehearsal is not None:
        return rehearsal.recv(src, dist.get_rank())
    what = f"recv of an object from rank {src} on {describe(group)}"
    _point_to_point(what, None, src, lambda: dist.recv_object_list(box, src=src, group=group))
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
def all_reduce_coalesced(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Sum many tensors over ``group`` in place, as one flat all-reduce per dtype."""
    _coalesced(tensors, lambda flat: all_reduce(flat, group))


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
