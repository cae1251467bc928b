"""V-shape schedules: two stages per rank, placed down the ranks and back up (``placement="v"``).

Rank ``r`` of ``p`` holds stage ``r`` (its first chunk) and stage ``2p - 1 - r`` (its second), so
stages ``p - 1`` and ``p`` meet on the last rank and hand over locally, and rank 0 both starts
and ends every microbatch. With the backward split into B and W (Qi et al. 2023), that is what
lets a rank's second-chunk backwards fill the wait before its first-chunk ones: the plans here
reach a near-zero bubble at F = B = W once ``m >= 2p``, which ZB-H1's one stage per rank cannot
(its first stage has no B to run until the first gradient comes back).

* `zbv` (ZB-V, Qi et al. 2023, sec. 6): greedy list scheduling at unit (or given) costs, bounded to 1F1B's
  peak activation memory (``2p`` chunk activations per rank), W's listed as late as the bound
  allows so that the runtime's pulled W's fill whatever waits real durations produce; at given
  costs never slower than the unit-cost plan replayed at them.
* `dualpipev` (DeepSeek-AI 2024, DualPipe folded onto one V): after a warm-up, each step pairs a
  forward of one chunk with a full backward of the other chunk, overlapped (``Action.overlap``),
  so that on GPUs each one's communication hides behind the other's compute; the cool-down
  splits backwards into B and W to fill the drain.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from math import inf, isfinite

from plait.pipeline.actions import Action, Costs, Kind, rank_stages, stage_rank
from plait.pipeline.schedules import Schedule, ScheduleError, with_comms

Key = tuple[int, int]  # (stage, microbatch)
Choice = tuple[Kind, Key, bool]  # what to run, and whether it is a W that only fills a wait


class _Planner:
    """Places F, B and W on p ranks with the V placement, greedily, in time: each action takes
    ``cost(action)`` (one unit each by default, zero allowed), communication is free.

    It cannot get stuck, whatever the costs. Memory is the only thing that can refuse an action,
    and only a forward: B and W free it. A rank holds at most ``limit`` chunk activations, and a
    first-chunk forward must leave one slot free for the second-chunk forwards of the microbatches
    it has started (``opened``): at most ``limit - 1`` of them are open at once. Suppose no rank
    can run anything. Take the oldest microbatch j whose forward is unfinished: every older one
    finished its forward, so their B's and W's could run, so they have, and the ranks hold only
    microbatches >= j. Its next forward is ready (stages forward microbatches in order). On its
    first chunk, the rank holds nothing of j or later, so the forward is admitted; on its second
    chunk, the rank holds only open first-chunk activations, at most ``limit - 1``, so it is
    admitted too. A contradiction: some rank always has something to run.
    """

    def __init__(self, p: int, m: int, cost: Callable[[Action], float]) -> None:
        self.p, self.m, self.S, self.cost = p, m, 2 * p, cost
        self.f_end: dict[Key, float] = {}
        self.b_end: dict[Key, float] = {}
        self.w_done: set[Key] = set()
        self.next_f = [0] * self.S  # the next microbatch each stage forwards (in order)
        self.free = [0.0] * p  # when each rank is done with what it runs
        self.rows: list[list[Action]] = [[] for _ in range(p)]
        self.deferred: list[list[Key]] = [[] for _ in range(p)]  # W's that filled a wait, not listed yet
        self.limit = 2 * p  # chunk activations a rank may hold: 1F1B's peak (p stages of two chunks)
        self.held = [0] * p  # chunk activations held: forwarded, weight gradient not yet computed
        self.opened = [0] * p  # microbatches past the rank's first chunk, not yet through its second
        self.listed_held = [0] * p  # forwards listed minus W's listed, per rank

    def stages(self, r: int) -> list[int]:
        return rank_stages("v", self.p, self.S, r)

    def rank(self, stage: int) -> int:
        return stage_rank("v", self.p, stage)

    def ready_f(self, r: int, t: float) -> list[Key]:
        """Forwards whose input is there and that the memory bound admits (see the class docstring)."""
        if self.held[r] >= self.limit:
            return []
        out = []
        for s in self.stages(r):
            mb = self.next_f[s]
            if s < self.p and self.opened[r] >= self.limit - 1:
                continue  # the last slot stays free for a second-chunk forward
            if mb < self.m and (s == 0 or self.f_end.get((s - 1, mb), inf) <= t):
                out.append((s, mb))
        return out

    def ready_b(self, r: int, t: float) -> list[Key]:
        return [k for k, e in self.f_end.items() if self.rank(k[0]) == r and e <= t and k not in self.b_end
                and (k[0] == self.S - 1 or self.b_end.get((k[0] + 1, k[1]), inf) <= t)]

    def pending_w(self, r: int, t: float) -> list[Key]:
        return [k for k, e in self.b_end.items() if self.rank(k[0]) == r and e <= t and k not in self.w_done]

    def run(self, pick: Callable[[_Planner, int, float], Choice | None]) -> list[list[Action]]:
        t, total = 0.0, self.S * self.m
        while len(self.w_done) < total:
            placed = True
            while placed:  # until nothing more starts at t (a zero-cost action ends where it starts)
                placed = False
                for r in range(self.p):
                    choice = pick(self, r, t) if self.free[r] <= t else None
                    if choice is not None:
                        self.place(r, t, *choice)
                        placed = True
            # Nothing changes before the next action ends: jump there.
            later = [e for e in (*self.free, *self.f_end.values(), *self.b_end.values()) if e > t]
            if not later and len(self.w_done) < total:
                raise ScheduleError(f"zbv: no rank can run anything at t={t} with {total - len(self.w_done)} "
                                    f"W's left (held per rank {self.held}, open {self.opened}); the class "
                                    f"docstring proves this unreachable")
            t = min(later, default=t)
        for r in range(self.p):
            self.flush(r)
        return self.rows

    def place(self, r: int, t: float, kind: Kind, key: Key, fills_wait: bool = False) -> None:
        end = t + self.cost(Action(kind, *key))
        self.free[r] = end
        if kind is Kind.F:
            self.f_end[key] = end
            self.next_f[key[0]] += 1
            self.held[r] += 1
            self.opened[r] += 1 if key[0] < self.p else -1
            # A deferred W runs where it is listed unless a wait pulls it earlier: list enough of
            # them before this forward to keep the listed order within the memory bound too.
            while self.listed_held[r] >= self.limit and self.deferred[r]:
                self.rows[r].append(Action(Kind.W, *self.deferred[r].pop(0)))
                self.listed_held[r] -= 1
            self.listed_held[r] += 1
        elif kind is Kind.B:
            self.b_end[key] = end
        else:
            self.w_done.add(key)
            self.held[r] -= 1
            if fills_wait:
                self.deferred[r].append(key)
                return
            self.flush(r)
            self.listed_held[r] -= 1
        self.rows[r].append(Action(kind, *key))

    def flush(self, r: int) -> None:
        self.rows[r] += [Action(Kind.W, *k) for k in self.deferred[r]]
        self.listed_held[r] -= len(self.deferred[r])
        self.deferred[r] = []


def _zbv_pick(pl: _Planner, r: int, t: float) -> Choice | None:
    """ZB-V's priorities: W when too many are pending (memory), then the oldest ready B (the
    second chunk first), then a forward within 1F1B's memory (the second chunk first: it reaches
    the loss sooner), else a pending W filling the wait."""
    p = pl.p
    pend = pl.pending_w(r, t)
    if len(pend) > p:  # each pending W holds its activations: bounded like the forwards
        return Kind.W, min(pend, key=lambda k: (k[1], -k[0])), False
    ready_b = pl.ready_b(r, t)
    if ready_b:
        return Kind.B, min(ready_b, key=lambda k: (k[1], -k[0])), False
    ready_f = pl.ready_f(r, t)
    if ready_f:
        return Kind.F, max(ready_f, key=lambda k: k[0]), False
    if pend:
        return Kind.W, min(pend, key=lambda k: (k[1], -k[0])), True
    return None


def zbv(p: int, m: int, costs: Costs | None = None) -> Schedule:
    """ZB-V (Qi et al. 2023, sec. 6): two stages per rank in a V, backward split into B and W.

    Planned by list scheduling with ZB-V's priorities within 1F1B's activation memory per rank
    (``2p`` chunk activations, i.e. ``p`` microbatches of a 1F1B stage), at unit costs (F = B = W
    per chunk) or at ``costs`` (as `Schedule.simulate` takes them: per kind, or a function of the
    action, e.g. measured durations per stage, which plans around a heavy last stage or a first
    stage whose B is nearly free). A W that only fills a wait is listed where the memory bound or
    the end of the step forces it, as for ZB-H1: the runtime pulls W's into the waits real
    durations produce.

    Every ``p, m >= 1`` and every table of finite costs >= 0 has a plan (the planner cannot get
    stuck, see `_Planner`); a negative or non-finite cost raises `ScheduleError` naming the action.
    A greedy plan can still lose to the unit-cost one at the very costs it was made for, so with
    ``costs`` the unit-cost plan is returned instead whenever its replay at ``costs`` ends sooner:
    the result is never slower than the plain ``zbv(p, m)`` at those costs.
    """
    if p < 1 or m < 1:
        raise ScheduleError(f"zbv needs pp >= 1 and microbatches >= 1, got pp={p}, microbatches={m}")
    unit = _plan(p, m, lambda a: 1.0, "zbv")
    if costs is None:
        return unit
    cost = _checked(costs)
    planned = _plan(p, m, cost, "zbv (planned at given costs)")
    if unit.makespan(cost) < planned.makespan(cost):
        return dataclasses.replace(unit, name="zbv (the unit-cost plan, faster at the given costs)")
    return planned


def _plan(p: int, m: int, cost: Callable[[Action], float], name: str) -> Schedule:
    rows = _Planner(p, m, cost).run(_zbv_pick)
    return with_comms(name, p, 2 * p, m, rows, placement="v")


def _checked(costs: Costs) -> Callable[[Action], float]:
    """``costs`` as a function of the action that refuses durations the planner cannot place."""
    if callable(costs):
        given = costs
    else:
        table = {Kind.F: 1.0, Kind.B: 1.0, Kind.W: 1.0, **costs}
        given = lambda a: table[a.kind]  # noqa: E731

    def cost(a: Action) -> float:
        c = given(a)
        try:
            ok = isfinite(c) and c >= 0
        except TypeError:  # not a number
            ok = False
        if not ok:
            raise ScheduleError(f"zbv: the cost of {a} must be a finite number >= 0, got {c!r}")
        return float(c)
    return cost


def dualpipev(p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek-AI 2024): DualPipe's two directions folded onto one V of 2p stages.

    Per rank ``r`` with chunks ``c0 = r`` and ``c1 = 2p - 1 - r``, in phases:
    warm-up forwards of c0; forwards of c0 and c1 alternating; B + W of c1 interleaved with c1
    forwards (zero-bubble style, while the pipe fills); the steady state of overlapped pairs
    (forward of one chunk beside the full backward of the other, ``Action.overlap``); and a
    cool-down of backwards whose second half is split into B and W, W's filling the drain.
    Needs ``m >= 2p`` microbatches (the steady state needs every stage busy).
    """
    if p < 1:
        raise ScheduleError(f"dualpipev needs pp >= 1, got pp={p}")
    if m < 2 * p:
        raise ScheduleError(f"dualpipev needs at least 2 x pp = {2 * p} microbatches (one per stage), "
                            f"got microbatches={m}; use zbv for fewer")
    rows = [_DualPipeRank(p, m, r).actions() for r in range(p)]
    return with_comms("dualpipev", p, 2 * p, m, rows, placement="v")


class _DualPipeRank:
    """One rank's DualPipeV order, built by counters per (stage, kind)."""

    def __init__(self, p: int, m: int, r: int) -> None:
        self.p, self.m, self.r = p, m, r
        self.c0, self.c1 = r, 2 * p - 1 - r
        self.count: dict[tuple[int, str], int] = {}
        self.w_queue: list[Key] = []  # B's whose W is still to be listed, oldest first
        self.out: list[Action] = []

    def _next(self, stage: int, what: str) -> int:
        mb = self.count.get((stage, what), 0)
        self.count[(stage, what)] = mb + 1
        return mb

    def f(self, stage: int, overlap: bool = False) -> None:
        self.out.append(Action(Kind.F, stage, self._next(stage, "F"), overlap))

    def b(self, stage: int, split: bool) -> None:
        mb = self._next(stage, "B")
        self.out.append(Action(Kind.B if split else Kind.BW, stage, mb))
        if split:
            self.w_queue.append((stage, mb))

    def w(self) -> None:
        if self.w_queue:
            self.out.append(Action(Kind.W, *self.w_queue.pop(0)))

    def pair(self, forward: int, backward: int) -> None:
        self.f(forward, overlap=True)
        self.b(backward, split=False)

    def actions(self) -> list[Action]:
        p, m, r, c0, c1 = self.p, self.m, self.r, self.c0, self.c1
        for _ in range(2 * (p - r - 1)):  # fill the pipe's first half
            self.f(c0)
        for _ in range(r + 1):
            self.f(c0)
            self.f(c1)
        for _ in range(p - r - 1):  # the second half drains back up: zero-bubble B, W, then F
            self.b(c1, split=True)
            self.w()
            self.f(c1)
        for i in range(m - 2 * p + r + 1):  # steady state: overlapped chunk pairs
            if i == 0 and r == p - 1:  # the turn of the V: c1's first backward follows c0's forward
                self.f(c0)
                self.b(c1, split=False)
            else:
                self.pair(c0, c1)
            self.pair(c1, c0)
        for _ in range(p - r - 1):
            self.b(c1, split=False)
            self.pair(c1, c0)
        split = False
        for i in range(r + 1):  # cool-down: the later half of the backwards split into B and W
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            self.b(c1, split)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            self.b(c0, split)
        for _ in range(p - r - 1):
            self.w()
            self.b(c0, split)
        while self.w_queue:
            self.w()
        return self.out
