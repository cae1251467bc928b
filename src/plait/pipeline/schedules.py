"""Pipeline schedules as data: typed actions, validation and a timing simulator (the named
schedules are built in `plait.pipeline.generators`).

A schedule is, for every rank of the ``pp`` axis, the ordered list of what that rank does in
one training step. Its ``placement`` says where stages live: ``"loop"`` puts stage ``s`` on
rank ``s % p`` (with ``v`` chunks per rank, rank ``r`` holds stages ``r, r + p, ..., r + (v - 1) p``);
``"v"`` puts two stages on each rank, ``r`` and ``2p - 1 - r``, so the stages go down the ranks
and back up (ZB-V, DualPipeV).

Action kinds (each names a stage and a microbatch):

* ``F``  forward of the stage on the microbatch;
* ``BW`` full backward (input and weight gradients together), used by GPipe and 1F1B;
* ``B``  input-gradient half of the backward; ``W`` its weight-gradient half (zero bubble,
  Qi et al. 2023, "Zero Bubble Pipeline Parallelism");
* ``SEND_F`` / ``RECV_F`` the stage's output activation to / its input from the next /
  previous stage; ``SEND_B`` / ``RECV_B`` the gradient of the stage's input to the previous
  stage / of its output from the next stage. Neighbouring stages on the same rank hand data
  over locally, with no send or receive.

Execution model (what the runtime does and what `validate` checks): sends never block;
a receive blocks until the peer has issued the matching send; compute actions never block
but must find their inputs already produced on their rank. A ``W`` is a latest position:
while a rank waits for a receive, it runs its oldest pending ``W`` (one whose ``B`` has run)
instead of idling, and skips that ``W`` where the list names it. W needs nothing from other
ranks, so pulling it earlier cannot deadlock, and it only frees memory sooner; this is how
W fills bubbles whose size depends on real action durations. `validate` replays every rank
under that model and rejects, naming the first bad action: an action on a stage the rank
does not hold, a compute action before its input arrived, B/W before F, W without B,
duplicates, a send nobody receives, a receive nobody sends (a deadlock), and a missing F
or backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from plait.pipeline.actions import BACKWARD, PLACEMENTS, Action, Costs, Kind, Slot, rank_stages, stage_rank
from plait.pipeline.draw import draw_png, render_text


class ScheduleError(ValueError):
    """A schedule that cannot run correctly; the message names the first bad action."""


DEFAULT_COSTS: Mapping[Kind, float] = {Kind.F: 1.0, Kind.B: 1.0, Kind.W: 1.0, Kind.BW: 2.0}


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists for one step of ``microbatches`` over ``stages`` stages on ``ranks`` ranks."""

    name: str
    ranks: int
    stages: int
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    placement: str = "loop"  # see the module docstring

    @property
    def chunks(self) -> int:
        return self.stages // self.ranks

    @property
    def forward_only(self) -> bool:
        return not any(a.kind in (Kind.B, Kind.W, Kind.BW) for acts in self.actions for a in acts)

    @property
    def forwards_first(self) -> bool:
        """Every rank runs all its forwards before any backward (GPipe): a statistic over every
        microbatch of the step is known when the first backward runs."""
        for acts in self.actions:
            kinds = [a.kind for a in acts if a.kind.is_compute]
            last_forward = max((i for i, k in enumerate(kinds) if k is Kind.F), default=-1)
            if any(k is not Kind.F for k in kinds[:last_forward]):
                return False
        return True

    def stage_rank(self, stage: int) -> int:
        return stage_rank(self.placement, self.ranks, stage)

    def rank_stages(self, rank: int) -> list[int]:
        return rank_stages(self.placement, self.ranks, self.stages, rank)

    def chunk(self, stage: int) -> int:
        """Which of its rank's stages ``stage`` is (0 for the first), for labels and pictures."""
        return self.rank_stages(self.stage_rank(stage)).index(stage)

    def validate(self) -> Schedule:
        """Raise `ScheduleError` naming the first bad action; return ``self`` when valid."""
        self.simulate()
        return self

    def receive_order(self, rank: int) -> list[Action]:
        """``rank``'s receives in the order their senders send them (sender by sender).

        Gloo matches messages by tag, so any order works; NCCL ignores tags and matches
        point-to-point messages between two ranks in issue order. The runtime posts every receive
        of a step at its start in this order, so with one group per direction (NCCL) each receive
        meets its own send whatever order the list waits for them in.
        """
        position: dict[tuple[Kind, int, int], tuple[int, int]] = {}
        for r, row in enumerate(self.actions):
            for i, a in enumerate(row):
                if a.kind in (Kind.SEND_F, Kind.SEND_B):
                    to = a.stage + 1 if a.kind is Kind.SEND_F else a.stage - 1
                    recv = Kind.RECV_F if a.kind is Kind.SEND_F else Kind.RECV_B
                    position[(recv, to, a.mb)] = (r, i)
        mine = [a for a in self.actions[rank] if a.kind in (Kind.RECV_F, Kind.RECV_B)]
        missing = [a for a in mine if (a.kind, a.stage, a.mb) not in position]
        if missing:
            raise ScheduleError(f"schedule '{self.name}': rank {rank}'s {missing[0]} has no matching send")
        return sorted(mine, key=lambda a: position[(a.kind, a.stage, a.mb)])

    def forward_part(self) -> Schedule:
        """The same order restricted to forwards and activation transfers (eval mode)."""
        keep = (Kind.F, Kind.SEND_F, Kind.RECV_F)
        acts = tuple(tuple(a for a in row if a.kind in keep) for row in self.actions)
        acts = tuple(tuple(dataclasses.replace(a, overlap=False) for a in row) for row in acts)
        return Schedule(self.name + " (forward only)", self.ranks, self.stages, self.microbatches, acts,
                        self.placement)

    def simulate(self, costs: Costs | None = None, latency: float = 0.0) -> list[list[Slot]]:
        """Step every rank through its actions (sends free, receives wait for their send), each in time.

        ``costs`` maps kinds to durations (default F = B = W = 1, BW = 2) or is a function of the
        action (e.g. measured durations per stage). Doubles as the validator: any rule broken
        raises `ScheduleError`.
        """
        if not callable(costs):
            table = {**DEFAULT_COSTS, **(costs or {})}
            costs = lambda a: table[a.kind]  # noqa: E731
        _check_shape(self)
        return _Simulation(self, costs, latency).run()

    def bubble(self, costs: Costs | None = None, latency: float = 0.0) -> float:
        """Planned bubble: mean over ranks of idle time / makespan under ``costs`` (and ``latency``
        per transfer, as in `simulate`)."""
        slots = self.simulate(costs, latency)
        span = _makespan(slots)
        if span == 0:
            return 0.0
        busy = [sum(s.end - s.start for s in row if s.action.kind.is_compute) for row in slots]
        return sum(1 - b / span for b in busy) / self.ranks

    def makespan(self, costs: Costs | None = None, latency: float = 0.0) -> float:
        """When the last rank finishes under ``costs`` (and ``latency``), as in `simulate`."""
        return _makespan(self.simulate(costs, latency))

    def text(self, costs: Costs | None = None) -> str:
        """A text grid of the plan, one line per rank (`plait.pipeline.draw.render_text`)."""
        return render_text(self, costs)

    def draw(self, path: str, measured: Sequence[Sequence[Slot]] | None = None) -> str:
        """Save a Gantt chart of the plan, and of a measured step if given, to ``path``
        (`plait.pipeline.draw.draw_png`)."""
        return draw_png(self, path, measured)


def _makespan(slots: Sequence[Sequence[Slot]]) -> float:
    return max((s.end for row in slots for s in row), default=0.0)


# ---------------------------------------------------------------------------- communication
def with_comms(name: str, ranks: int, stages: int, microbatches: int,
               compute: Sequence[Iterable[Action]], placement: str = "loop") -> Schedule:
    """Add the sends and receives that per-rank *compute* orders imply, and build the schedule.

    Each receive goes right before the compute that needs it, each send right after the
    compute that produced it (the runtime posts receives early, so this costs no overlap). An
    overlapped pair (a forward with ``overlap`` and the backward after it) is kept together: both
    receives first, then the pair, then both sends.
    """
    where = lambda st: stage_rank(placement, ranks, st)  # noqa: E731
    rows = []
    for r, acts in enumerate(compute):
        row: list[Action] = []
        for group in _pairs(list(acts)):
            before: list[Action] = []
            after: list[Action] = []
            for a in group:
                s = a.stage
                remote_prev = s > 0 and where(s - 1) != r
                remote_next = s < stages - 1 and where(s + 1) != r
                if a.kind is Kind.F and remote_prev:
                    before.append(Action(Kind.RECV_F, s, a.mb))
                if a.kind in BACKWARD and remote_next:
                    before.append(Action(Kind.RECV_B, s, a.mb))
                if a.kind is Kind.F and remote_next:
                    after.append(Action(Kind.SEND_F, s, a.mb))
                if a.kind in BACKWARD and remote_prev:
                    after.append(Action(Kind.SEND_B, s, a.mb))
            row += [*before, *group, *after]
        rows.append(tuple(row))
    return Schedule(name, ranks, stages, microbatches, tuple(rows), placement)


def _pairs(acts: list[Action]) -> Iterator[list[Action]]:
    """The compute actions one by one, an overlapped forward together with the backward after it."""
    i = 0
    while i < len(acts):
        n = 2 if acts[i].overlap and i + 1 < len(acts) else 1
        yield acts[i:i + n]
        i += n



# ---------------------------------------------------------------------------- validation
def _check_shape(s: Schedule) -> None:
    if s.ranks < 1 or s.stages < 1 or s.microbatches < 1:
        raise ScheduleError(f"schedule '{s.name}': ranks, stages and microbatches must be >= 1, got "
                            f"ranks={s.ranks}, stages={s.stages}, microbatches={s.microbatches}")
    if s.stages % s.ranks:
        raise ScheduleError(f"schedule '{s.name}': stages={s.stages} is not a multiple of ranks={s.ranks}")
    if s.placement not in PLACEMENTS:
        raise ScheduleError(f"schedule '{s.name}': placement must be one of {PLACEMENTS}, got "
                            f"{s.placement!r}")
    if s.placement == "v" and s.stages != 2 * s.ranks:
        raise ScheduleError(f"schedule '{s.name}': the V placement holds two stages per rank, so stages must "
                            f"be 2 x ranks = {2 * s.ranks}, got {s.stages}")
    if len(s.actions) != s.ranks:
        raise ScheduleError(f"schedule '{s.name}': expected one action list per rank ({s.ranks}), "
                            f"got {len(s.actions)}")


class _Simulation:
    """One run of `Schedule.simulate`: every rank's actions placed in time, each rule checked."""

    def __init__(self, s: Schedule, costs: Callable[[Action], float], latency: float) -> None:
        self.s, self.costs, self.latency = s, costs, latency
        self.done: list[set[tuple[Kind, int, int]]] = [set() for _ in range(s.ranks)]
        self.sent: dict[tuple[Kind, int, int], float] = {}  # send -> time issued
        self.received: set[tuple[Kind, int, int]] = set()
        self.pulled: list[set[tuple[int, int]]] = [set() for _ in range(s.ranks)]  # W's run early

    def fail(self, rank: int, i: int, a: Action, why: str) -> None:
        raise ScheduleError(f"schedule '{self.s.name}' is invalid at rank {rank}, action #{i} {a}: {why}")

    def run(self) -> list[list[Slot]]:
        s = self.s
        ptr, clock = [0] * s.ranks, [0.0] * s.ranks
        slots: list[list[Slot]] = [[] for _ in range(s.ranks)]
        while True:
            progressed = False
            for r in range(s.ranks):
                row = s.actions[r]
                while ptr[r] < len(row):
                    a = row[ptr[r]]
                    if a.kind is Kind.W and (a.stage, a.mb) in self.pulled[r]:
                        self.pulled[r].discard((a.stage, a.mb))  # ran early; a second listing is a duplicate
                        ptr[r] += 1
                        progressed = True
                        continue
                    if a.kind in (Kind.RECV_F, Kind.RECV_B):
                        clock[r] = self.fill(r, ptr[r], a, clock[r], slots[r])
                    start = self.ready(r, ptr[r], a, clock[r])
                    if start is None:
                        break  # blocked on a receive
                    end = start + (self.costs(a) if a.kind.is_compute else 0.0)
                    self.done[r].add((a.kind, a.stage, a.mb))
                    if a.kind in (Kind.SEND_F, Kind.SEND_B):
                        self.sent[(a.kind, a.stage, a.mb)] = end
                    slots[r].append(Slot(a, start, end))
                    clock[r] = end
                    ptr[r] += 1
                    progressed = True
            if all(ptr[r] == len(s.actions[r]) for r in range(s.ranks)):
                break
            if not progressed:
                r = min(r for r in range(s.ranks) if ptr[r] < len(s.actions[r]))
                a = s.actions[r][ptr[r]]
                peer = self.peer_send(a)
                self.fail(r, ptr[r], a, f"deadlock: it waits for {peer} on rank "
                          f"{s.stage_rank(peer.stage)}, which never comes (every rank is blocked)")
        self.finish()
        return slots

    def fill(self, r: int, i: int, a: Action, now: float, out: list[Slot]) -> float:
        """Run rank r's oldest pending W's while receive ``a`` (action #i) has not arrived."""
        peer = self.peer_send(a)
        sent = self.sent.get((peer.kind, peer.stage, a.mb))
        if sent is None:
            return now  # the send's time is not known yet: come back when it is
        done = self.done[r]
        for w in self.s.actions[r][i + 1:]:
            if now >= sent + self.latency:
                break
            if (w.kind is Kind.W and (Kind.B, w.stage, w.mb) in done
                    and (Kind.W, w.stage, w.mb) not in done):
                end = now + self.costs(w)
                out.append(Slot(w, now, end))
                done.add((Kind.W, w.stage, w.mb))
                self.pulled[r].add((w.stage, w.mb))
                now = end
        return now

    @staticmethod
    def peer_send(a: Action) -> Action:
        if a.kind is Kind.RECV_F:
            return Action(Kind.SEND_F, a.stage - 1, a.mb)
        return Action(Kind.SEND_B, a.stage + 1, a.mb)

    def ready(self, r: int, i: int, a: Action, now: float) -> float | None:
        """Start time of ``a`` on rank ``r``, None if blocked; raises on a broken rule."""
        s, done = self.s, self.done[r]
        if not isinstance(a, Action) or not isinstance(a.kind, Kind):
            raise ScheduleError(f"schedule '{s.name}': rank {r}, action #{i} is {a!r}, not an Action")
        if not (0 <= a.stage < s.stages and 0 <= a.mb < s.microbatches):
            self.fail(r, i, a, f"stage must be in 0..{s.stages - 1} and mb in 0..{s.microbatches - 1}")
        if s.stage_rank(a.stage) != r:
            self.fail(r, i, a, f"stage {a.stage} lives on rank {s.stage_rank(a.stage)}, not {r}")
        if (a.kind, a.stage, a.mb) in done:
            self.fail(r, i, a, "duplicate action")
        if a.overlap:
            self.check_pair(r, i, a)
        last, first = a.stage == s.stages - 1, a.stage == 0
        nxt_local = not last and s.stage_rank(a.stage + 1) == r
        prv_local = not first and s.stage_rank(a.stage - 1) == r
        k = a.kind
        if k is Kind.F and not first:
            need = (Kind.F, a.stage - 1, a.mb) if prv_local else (Kind.RECV_F, a.stage, a.mb)
            if need not in done:
                self.fail(r, i, a, f"its input is not there yet: {Action(*need)} must come first")
        elif k in BACKWARD:
            if (Kind.F, a.stage, a.mb) not in done:
                self.fail(r, i, a, f"backward before {Action(Kind.F, a.stage, a.mb)}")
            if (Kind.B, a.stage, a.mb) in done or (Kind.BW, a.stage, a.mb) in done:
                self.fail(r, i, a, "this stage and microbatch already ran its backward")
            if not last:
                if nxt_local:
                    ok = any((kk, a.stage + 1, a.mb) in done for kk in BACKWARD)
                    need_s = str(Action(Kind.B, a.stage + 1, a.mb)) + " (or BW)"
                else:
                    ok = (Kind.RECV_B, a.stage, a.mb) in done
                    need_s = str(Action(Kind.RECV_B, a.stage, a.mb))
                if not ok:
                    self.fail(r, i, a, f"the output gradient is not there yet: {need_s} must come first")
        elif k is Kind.W:
            if (Kind.B, a.stage, a.mb) not in done:
                self.fail(r, i, a, f"weight gradient before its input gradient "
                          f"{Action(Kind.B, a.stage, a.mb)}")
        elif k in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B):
            toward_next = k in (Kind.SEND_F, Kind.RECV_B)
            if (last if toward_next else first) or (nxt_local if toward_next else prv_local):
                where = "next" if toward_next else "previous"
                self.fail(r, i, a, f"there is no remote {where} stage to talk to (no stage, or it is on "
                          "the same rank and data is handed over locally)")
            if k is Kind.SEND_F and (Kind.F, a.stage, a.mb) not in done:
                self.fail(r, i, a, f"sends an activation before computing it in "
                          f"{Action(Kind.F, a.stage, a.mb)}")
            if k is Kind.SEND_B and not any((kk, a.stage, a.mb) in done for kk in BACKWARD):
                self.fail(r, i, a, f"sends a gradient before computing it in {Action(Kind.B, a.stage, a.mb)}")
            if k in (Kind.RECV_F, Kind.RECV_B):
                sent = self.sent.get((self.peer_send(a).kind, self.peer_send(a).stage, a.mb))
                if sent is None:
                    return None
                self.received.add((a.kind, a.stage, a.mb))
                return max(now, sent + self.latency)
        return now

    def check_pair(self, r: int, i: int, a: Action) -> None:
        """An overlapped forward is followed at once by the backward it runs beside, of another
        microbatch (a backward that needs this forward's result could not run alongside it)."""
        row = self.s.actions[r]
        nxt = row[i + 1] if i + 1 < len(row) else None
        if a.kind is not Kind.F:
            self.fail(r, i, a, "only a forward can be overlapped with the backward after it")
        if nxt is None or nxt.kind not in BACKWARD:
            self.fail(r, i, a, f"an overlapped forward must be followed at once by a backward (B or BW), "
                      f"found {nxt}")
        elif nxt.mb == a.mb:
            self.fail(r, i, a, f"it is paired with {nxt} of the same microbatch, which depends on it")

    def finish(self) -> None:
        s = self.s
        for (k, st, mb) in sorted(self.sent, key=lambda x: (x[1], x[2], x[0].value)):
            recv = (Kind.RECV_F, st + 1, mb) if k is Kind.SEND_F else (Kind.RECV_B, st - 1, mb)
            if recv not in self.received:
                a = Action(k, st, mb)
                raise ScheduleError(f"schedule '{s.name}' is invalid at rank {s.stage_rank(st)}, {a}: "
                                    f"nobody receives it ({Action(*recv)} is missing)")
        training = any(k in (Kind.B, Kind.BW, Kind.W) for d in self.done for (k, _, _) in d)
        for st in range(s.stages):
            r = s.stage_rank(st)
            d = self.done[r]
            for mb in range(s.microbatches):
                if (Kind.F, st, mb) not in d:
                    raise ScheduleError(f"schedule '{s.name}' is incomplete: rank {r} never runs "
                                        f"{Action(Kind.F, st, mb)}")
                if training and (Kind.BW, st, mb) not in d and (Kind.W, st, mb) not in d:
                    missing = Action(Kind.W if (Kind.B, st, mb) in d else Kind.BW, st, mb)
                    raise ScheduleError(f"schedule '{s.name}' is incomplete: rank {r} never runs {missing}")
