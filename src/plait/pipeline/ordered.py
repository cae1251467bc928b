"""Point-to-point in issue order: what a schedule needs to run on NCCL.

The default executor posts every receive of a step when it starts and matches messages by tag
(Gloo). NCCL ignores tags: between two ranks, the k-th send meets the k-th receive, and the
operations of one rank run one after another on its communication stream, so a send waits
until the peer has posted the matching receive. The *ordered* executor therefore posts each
run of consecutive sends and receives of an action list as one batch (``batch_isend_irecv``,
which NCCL runs as a group, so two ranks sending to each other do not deadlock) and waits for
the batch before the next compute action.

`check_ordered` proves a schedule safe under that model before anything runs: the receives of
every rank pair come in the order of the sends (`Schedule.order_mismatch`), and replaying the
batches, where a batch finishes only once each of its messages meets its counterpart in the
peer's current batch, never gets stuck. Its error names the first batch that would hang.
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.pipeline.schedules import COMM, Action, Kind, Schedule, ScheduleError

__all__ = ["batches", "check_ordered", "message"]

Message = tuple[str, int, int]  # ("F" or "B", receiving stage, microbatch)


def message(a: Action) -> Message:
    """The message a send or receive action moves, named the same on both sides."""
    if a.kind is Kind.SEND_F:
        return ("F", a.stage + 1, a.mb)
    if a.kind is Kind.SEND_B:
        return ("B", a.stage - 1, a.mb)
    return (a.kind.value[-1], a.stage, a.mb)


def batches(row: Sequence[Action]) -> dict[int, list[Action]]:
    """Index of the first action of each run of consecutive sends and receives -> the run."""
    out: dict[int, list[Action]] = {}
    start = None
    for i, a in enumerate(row):
        if a.kind in COMM:
            if start is None:
                start = i
                out[i] = []
            out[start].append(a)
        else:
            start = None
    return out


def check_ordered(s: Schedule) -> Schedule:
    """Raise `ScheduleError` unless ``s`` runs with ordered, batched point-to-point; return ``s``."""
    why = s.order_mismatch()
    if why is not None:
        raise ScheduleError(f"schedule '{s.name}' cannot run with ordered point-to-point (NCCL): {why}")
    runs = [list(batches(row).values()) for row in s.actions]
    ptr = [0] * s.ranks
    done: list[set[tuple[Kind, Message]]] = [set() for _ in range(s.ranks)]

    def current(r: int) -> list[Action]:
        return runs[r][ptr[r]] if ptr[r] < len(runs[r]) else []

    def peer(r: int, a: Action) -> int:
        msg = message(a)
        sender_stage = msg[1] - 1 if msg[0] == "F" else msg[1] + 1
        return s.stage_rank(msg[1]) if a.kind in (Kind.SEND_F, Kind.SEND_B) else s.stage_rank(sender_stage)

    while any(ptr[r] < len(runs[r]) for r in range(s.ranks)):
        progressed = False
        for r in range(s.ranks):
            for a in current(r):
                mine = (a.kind, message(a))
                if mine in done[r]:
                    continue
                other = Kind.RECV_F if a.kind is Kind.SEND_F else Kind.RECV_B if a.kind is Kind.SEND_B \
                    else Kind.SEND_F if a.kind is Kind.RECV_F else Kind.SEND_B
                q = peer(r, a)
                if any(b.kind is other and message(b) == message(a) for b in current(q)):
                    done[r].add(mine)
                    done[q].add((other, message(a)))
                    progressed = True
            if current(r) and all((a.kind, message(a)) in done[r] for a in current(r)):
                ptr[r] += 1
                progressed = True
        if not progressed:
            r = min(r for r in range(s.ranks) if ptr[r] < len(runs[r]))
            waiting = next(a for a in current(r) if (a.kind, message(a)) not in done[r])
            q = peer(r, waiting)
            raise ScheduleError(
                f"schedule '{s.name}' would hang with ordered point-to-point (NCCL): rank {r} waits in "
                f"the batch {[str(a) for a in current(r)]} for {waiting} to meet its counterpart, which "
                f"is not in rank {q}'s current batch {[str(a) for a in current(q)]}")
    return s
