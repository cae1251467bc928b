"""Pipeline schedules as data: generation, validation (property-based) and rendering; no ranks."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.pipeline import Action, Kind, Schedule, ScheduleError, make_schedule, with_comms
from plait.pipeline.actions import COMM

NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")


@st.composite
def schedules(draw) -> Schedule:
    name = draw(st.sampled_from(NAMES))
    p = draw(st.integers(1, 6))
    chunks = draw(st.integers(1, 3)) if name in ("gpipe", "interleaved") else 1
    if name == "interleaved":
        m = p * draw(st.integers(1, 4))
    elif name == "dualpipev":
        m = draw(st.integers(2 * p, 2 * p + 8))
    else:
        m = draw(st.integers(1, 10))
    return make_schedule(name, p, m, chunks)


def _replace(s: Schedule, rank: int, row: list[Action]) -> Schedule:
    rows = list(s.actions)
    rows[rank] = tuple(row)
    return dataclasses.replace(s, actions=tuple(rows))


def _sends_in_order(s: Schedule, rank: int) -> bool:
    """Whether ``receive_order(rank)`` takes each sender's messages in the order it sends them."""
    got = s.receive_order(rank)
    listed = [a for a in s.actions[rank] if a.kind in (Kind.RECV_F, Kind.RECV_B)]
    if sorted(map(str, got)) != sorted(map(str, listed)):
        return False
    for src in range(s.ranks):
        sent = [(a.stage + 1 if a.kind is Kind.SEND_F else a.stage - 1, a.mb, a.kind is Kind.SEND_F)
                for a in s.actions[src] if a.kind in (Kind.SEND_F, Kind.SEND_B)
                and s.stage_rank(a.stage + 1 if a.kind is Kind.SEND_F else a.stage - 1) == rank]
        taken = [(a.stage, a.mb, a.kind is Kind.RECV_F) for a in got
                 if s.stage_rank(a.stage - 1 if a.kind is Kind.RECV_F else a.stage + 1) == src]
        if sent != taken:
            return False
    return True


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_generated_schedules_validate_and_are_complete(s):
    s.validate()
    s.forward_part().validate()
    for r in range(s.ranks):
        kinds = [a.kind for a in s.actions[r]]
        n = len(s.rank_stages(r)) * s.microbatches
        assert kinds.count(Kind.F) == n
        assert kinds.count(Kind.BW) + kinds.count(Kind.W) == n
    assert 0.0 <= s.bubble() < 1.0
    # Receives are posted in each sender's send order: safe where tags are ignored (NCCL).
    assert all(_sends_in_order(s, r) for r in range(s.ranks))


@settings(max_examples=150, deadline=None)
@given(schedules(), st.randoms(use_true_random=False))
def test_dropping_a_receive_is_rejected(s, rnd: random.Random):
    spots = [(r, i) for r in range(s.ranks) for i, a in enumerate(s.actions[r])
             if a.kind in (Kind.RECV_F, Kind.RECV_B)]
    if not spots:
        return  # one rank: everything is handed over locally
    r, i = rnd.choice(spots)
    row = list(s.actions[r])
    dropped = row.pop(i)
    with pytest.raises(ScheduleError, match="invalid|incomplete") as e:
        _replace(s, r, row).validate()
    assert f"stage={dropped.stage}" in str(e.value)


@settings(max_examples=150, deadline=None)
@given(schedules(), st.randoms(use_true_random=False))
def test_dropping_a_send_is_rejected(s, rnd: random.Random):
    spots = [(r, i) for r in range(s.ranks) for i, a in enumerate(s.actions[r])
             if a.kind in (Kind.SEND_F, Kind.SEND_B)]
    if not spots:
        return
    r, i = rnd.choice(spots)
    row = list(s.actions[r])
    row.pop(i)
    with pytest.raises(ScheduleError, match="deadlock"):
        _replace(s, r, row).validate()


@settings(max_examples=150, deadline=None)
@given(schedules(), st.randoms(use_true_random=False))
def test_swapping_an_action_with_what_it_needs_is_rejected(s, rnd: random.Random):
    """Swap a compute action with the action producing its input (a receive, the forward before a
    backward, B before W, the compute before a send)."""
    spots = []
    for r in range(s.ranks):
        row = s.actions[r]
        where = {(a.kind, a.stage, a.mb): i for i, a in enumerate(row)}
        for i, a in enumerate(row):
            needs = {Kind.F: [(Kind.RECV_F, a.stage, a.mb)],
                     Kind.BW: [(Kind.F, a.stage, a.mb), (Kind.RECV_B, a.stage, a.mb)],
                     Kind.B: [(Kind.F, a.stage, a.mb), (Kind.RECV_B, a.stage, a.mb)],
                     Kind.W: [(Kind.B, a.stage, a.mb)],
                     Kind.SEND_F: [(Kind.F, a.stage, a.mb)],
                     Kind.SEND_B: [(Kind.B, a.stage, a.mb), (Kind.BW, a.stage, a.mb)]}.get(a.kind, [])
            spots += [(r, where[n], i) for n in needs if n in where]
    r, i, j = rnd.choice(spots)
    row = list(s.actions[r])
    row[i], row[j] = row[j], row[i]
    with pytest.raises(ScheduleError, match="invalid"):
        _replace(s, r, row).validate()


def test_deadlock_names_the_blocked_action():
    s = make_schedule("1f1b", 2, 2)
    # Rank 0 waits for a gradient before sending the activations that produce it.
    row = [Action(Kind.RECV_B, 0, 0), *[a for a in s.actions[0] if a != Action(Kind.RECV_B, 0, 0)]]
    with pytest.raises(ScheduleError, match=r"rank 0, action #0 RECV_B\(stage=0, mb=0\): deadlock"):
        _replace(s, 0, row).validate()


def test_rule_errors_name_the_action():
    s = make_schedule("gpipe", 2, 2)
    with pytest.raises(ScheduleError, match=r"rank 1, action #0 F\(stage=0, mb=0\): stage 0 lives on rank 0"):
        _replace(s, 1, [Action(Kind.F, 0, 0)]).validate()
    row = [*s.actions[0], Action(Kind.F, 0, 1)]
    with pytest.raises(ScheduleError, match="duplicate"):
        _replace(s, 0, row).validate()
    w = make_schedule("zb-h1", 2, 2)
    row = [a for a in w.actions[1] if a.kind is not Kind.W or a.mb != 1]
    with pytest.raises(ScheduleError, match=r"never runs W\(stage=1, mb=1\)"):
        _replace(w, 1, row).validate()


def test_fewer_microbatches_than_stages():
    assert make_schedule("1f1b", 4, 2).validate().microbatches == 2
    assert make_schedule("zb-h1", 4, 1).validate()
    with pytest.raises(ValueError, match="microbatches=2 < pp=4"):
        make_schedule("interleaved", 4, 2, 2)
    with pytest.raises(ValueError, match="multiple of pp"):
        make_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="chunks=2"):
        make_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="schedule must be one of"):
        make_schedule("pipedream", 2, 4)


def test_theoretical_bubbles_and_zero_bubble_ratio():
    p, m, v = 4, 8, 2
    assert make_schedule("gpipe", p, m).bubble() == pytest.approx((p - 1) / (m + p - 1))
    assert make_schedule("1f1b", p, m).bubble() == pytest.approx((p - 1) / (m + p - 1))
    assert make_schedule("interleaved", p, m, v).bubble() == pytest.approx((p - 1) / (v * m + p - 1))
    # ZB-H1: makespan 3m + p - 1 units (1F1B: 3m + 3(p - 1)).
    zb = make_schedule("zb-h1", p, m)
    assert max(s.end for row in zb.simulate() for s in row) == 3 * m + p - 1
    assert zb.bubble() / make_schedule("1f1b", p, m).bubble() < 0.45


def test_waiting_rank_runs_pending_w_in_the_replay():
    # Stage 1's B is slow: rank 0 waits for gradients and fills the wait with its pending W's,
    # which the list places later (W's are latest positions).
    s = make_schedule("zb-h1", 2, 4)
    cost = {(0, Kind.F): 1, (0, Kind.B): 1, (0, Kind.W): 1, (1, Kind.F): 1, (1, Kind.B): 3, (1, Kind.W): 1}
    ran = [(sl.action, sl.start) for sl in s.simulate(lambda a: cost[(a.stage, a.kind)])[0]]
    order = [a for a, _ in ran]
    w0, recv = Action(Kind.W, 0, 0), Action(Kind.RECV_B, 0, 1)
    assert s.actions[0].index(w0) > s.actions[0].index(recv)
    assert order.index(w0) < order.index(recv) and dict(ran)[w0] == 7
    assert sorted(map(str, order)) == sorted(map(str, s.actions[0]))
    # Listing a W twice is still a duplicate, even when its first listing ran early.
    row = [*s.actions[0], w0]
    with pytest.raises(ScheduleError, match=r"W\(stage=0, mb=0\): duplicate"):
        _replace(s, 0, row).simulate(lambda a: cost[(a.stage, a.kind)])


@pytest.mark.parametrize("name,chunks", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2),
                                         ("gpipe", 2), ("zbv", 2), ("dualpipev", 2)])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (3, 6), (4, 4), (4, 12), (8, 16)])
def test_built_in_schedules_talk_only_to_neighbours(name, chunks, p, m):
    from plait.pipeline.directed import directions

    if name == "dualpipev" and m < 2 * p:
        m = 2 * p
    s = make_schedule(name, p, m, chunks)
    assert (0, 1 % p) in directions(s) and all(0 <= a < p and 0 <= b < p and a != b for a, b in directions(s))
    assert all(abs(a - b) == 1 or {a, b} == {0, p - 1} for a, b in directions(s))


def test_custom_compute_order_gets_its_communication():
    # Two ranks, all forwards then backwards in reverse order: a valid GPipe variant.
    rows = [[Action(Kind.F, r, 0), Action(Kind.F, r, 1), Action(Kind.BW, r, 1), Action(Kind.BW, r, 0)]
            for r in range(2)]
    s = with_comms("custom", 2, 2, 2, rows).validate()
    assert Action(Kind.SEND_F, 0, 1) in s.actions[0] and Action(Kind.RECV_B, 0, 1) in s.actions[0]


def test_text_and_png(tmp_path):
    s = make_schedule("interleaved", 2, 4, 2)
    text = s.text()
    assert text.splitlines()[1].startswith("rank 0: F0a F1a F0b F1b")
    assert "planned bubble" in text
    path = s.draw(str(tmp_path / "s.png"))
    assert (tmp_path / "s.png").stat().st_size > 1000 and path.endswith("s.png")


def test_receives_are_posted_in_the_order_of_the_sends():
    # Rank 1 takes microbatch 1 before microbatch 0: fine with Gloo's tags; for NCCL, which matches
    # a direction's messages by order, the receives are posted in the order rank 0 sends them.
    rows = [[Action(Kind.F, 0, 0), Action(Kind.F, 0, 1), Action(Kind.BW, 0, 0), Action(Kind.BW, 0, 1)],
            [Action(Kind.F, 1, 1), Action(Kind.F, 1, 0), Action(Kind.BW, 1, 0), Action(Kind.BW, 1, 1)]]
    s = with_comms("custom", 2, 2, 2, rows).validate()
    listed = [a for a in s.actions[1] if a.kind is Kind.RECV_F]
    assert listed == [Action(Kind.RECV_F, 1, 1), Action(Kind.RECV_F, 1, 0)]
    assert s.receive_order(1) == [Action(Kind.RECV_F, 1, 0), Action(Kind.RECV_F, 1, 1)]
    assert _sends_in_order(s, 0) and _sends_in_order(s, 1)


def _peak_activations(s: Schedule, rank: int, costs=None) -> int:
    """Most chunk activations ``rank`` holds at once in the replay at ``costs`` (unit costs by
    default), from a forward to its W or BW, counted in the order the rank runs them (so that
    zero-cost actions at one instant and overlapped pairs count in their order)."""
    held = peak = 0
    for sl in s.simulate(costs)[rank]:
        if sl.action.kind is Kind.F:
            held += 1
            peak = max(peak, held)
        elif sl.action.kind in (Kind.W, Kind.BW):
            held -= 1
    return peak


def test_v_placement_goes_down_the_ranks_and_back_up():
    s = make_schedule("zbv", 3, 6)
    assert s.placement == "v" and s.chunks == 2 and s.stages == 6
    assert [s.rank_stages(r) for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    assert [s.stage_rank(st) for st in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [s.chunk(st) for st in range(6)] == [0, 0, 0, 1, 1, 1]
    # Stages 2 and 3 meet on the last rank: handed over locally, in both directions.
    assert not any(a.kind in COMM and a.stage in (2, 3) and a.kind in {
        2: (Kind.SEND_F, Kind.RECV_B), 3: (Kind.RECV_F, Kind.SEND_B)}[a.stage] for a in s.actions[2])
    # chunks=1 is the default (the schedule's own two); more is refused.
    assert make_schedule("dualpipev", 2, 4, 2) == make_schedule("dualpipev", 2, 4, 1)
    with pytest.raises(ValueError, match="two stages per rank in a V"):
        make_schedule("zbv", 2, 4, 3)
    with pytest.raises(ValueError, match="at least 2 x pp = 8 microbatches"):
        make_schedule("dualpipev", 4, 6)
    with pytest.raises(ScheduleError, match="stages must be 2 x ranks"):
        dataclasses.replace(s, stages=9).validate()


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16)])
def test_v_plans_reach_near_zero_bubble_within_1f1b_memory(p, m):
    zbv, dpv, one = (make_schedule(n, p, m) for n in ("zbv", "dualpipev", "1f1b"))
    # Each rank runs 6m units (2 chunks x F, B, W); ZB-V adds at most p units to that, the fill.
    span = max(sl.end for row in zbv.simulate() for sl in row)
    assert 6 * m + p - 1 <= span <= 6 * m + p
    assert zbv.bubble() == pytest.approx(1 - 6 * m / span)
    assert zbv.bubble() / one.bubble() <= 0.3 + 1e-12  # at pp=2, m=8: 0.18 (the target is <= 0.4)
    assert dpv.bubble() < one.bubble() / 2
    # 1F1B's rank 0 holds p microbatches of one stage (2p chunks); no V rank holds more.
    assert max(_peak_activations(one, r) for r in range(p)) * 2 == 2 * p
    assert all(_peak_activations(s, r) <= 2 * p + 1 for s in (zbv, dpv) for r in range(p))
    assert all(_peak_activations(zbv, r) <= 2 * p for r in range(p))


def test_dualpipev_overlaps_one_chunks_forward_with_the_others_backward():
    p, m = 4, 8
    s = make_schedule("dualpipev", p, m)
    for r in range(p):
        row = s.actions[r]
        pairs = [(a, row[i + 1]) for i, a in enumerate(row) if a.overlap]
        # Steady state: two pairs per step, less the turn of the V on the last rank; then the drain.
        assert len(pairs) == 2 * (m - 2 * p + r + 1) - (r == p - 1) + (p - r - 1)
        for f, b in pairs:
            assert f.kind is Kind.F and b.kind is Kind.BW and f.mb != b.mb
            assert {f.stage, b.stage} == set(s.rank_stages(r))  # one of each chunk
    assert "+" in s.text() and "+" not in make_schedule("zbv", p, m).text()
    # Forward-only runs drop the pairing (there is no backward to pair with).
    assert not any(a.overlap for row in s.forward_part().validate().actions for a in row)
    row = list(s.actions[0])
    i = next(i for i, a in enumerate(row) if a.overlap)
    f, b = row[i], row[i + 1]
    with pytest.raises(ScheduleError, match="only a forward can be overlapped"):
        _replace(s, 0, [*row[:i], dataclasses.replace(f, overlap=False),
                        dataclasses.replace(b, overlap=True), *row[i + 2:]]).validate()
    with pytest.raises(ScheduleError, match="must be followed at once by a backward"):
        _replace(s, 0, [*row[:i + 1], Action(Kind.SEND_F, 9, 9), *row[i + 1:]]).validate()
    same = [Action(Kind.F, 0, 0, overlap=True), Action(Kind.BW, 0, 0)]
    with pytest.raises(ScheduleError, match="same microbatch, which depends on it"):
        with_comms("custom", 1, 1, 1, [same]).validate()


def test_zbv_planned_at_given_costs_beats_the_unit_plan_at_those_costs():
    from plait.pipeline import zbv

    units = {Kind.F: 1.0, Kind.B: 1.0, Kind.W: 1.0}
    assert zbv(3, 6, costs=units).actions == make_schedule("zbv", 3, 6).actions

    # A heavy last stage (the LM head and loss) and a first stage with almost no input gradient.
    def cost(a: Action) -> float:
        base = {Kind.F: 1.0, Kind.B: 1.1, Kind.W: 0.7}[a.kind] * (1.8 if a.stage == 3 else 1.0)
        return base * (0.1 if (a.stage, a.kind) == (0, Kind.B) else 1.0)

    for p, m in [(2, 8), (2, 4)]:
        unit, planned = make_schedule("zbv", p, m), zbv(p, m, costs=cost).validate()
        assert planned.bubble(cost) <= unit.bubble(cost) + 1e-12
        assert all(_peak_activations(planned, r) <= 2 * p for r in range(p))
    assert zbv(2, 8, costs=cost).bubble(cost) < make_schedule("zbv", 2, 8).bubble(cost)


# A cost: zero (a stage with nothing to do, e.g. the first stage's input gradient), or anything from
# a microsecond-scale measurement to a thousand units.
_COST = st.one_of(st.just(0.0), st.floats(0.0, 1e3, allow_nan=False, allow_infinity=False))
_SPLIT = (Kind.F, Kind.B, Kind.W)


@st.composite
def _zbv_costs(draw) -> tuple[int, int, object]:
    """p, m and a cost table for zbv: per kind, or per action (stage and kind, scaled per microbatch)."""
    p, m = draw(st.integers(1, 6)), draw(st.integers(1, 16))
    if draw(st.booleans()):
        return p, m, {k: draw(_COST) for k in _SPLIT}
    table = {(k, s): draw(_COST) for k in _SPLIT for s in range(2 * p)}
    scale = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=m, max_size=m))
    return p, m, lambda a: table[(a.kind, a.stage)] * scale[a.mb]


@settings(max_examples=50, deadline=None)
@given(_zbv_costs())
def test_zbv_plans_every_cost_table_within_memory_and_no_slower_than_the_unit_plan(case):
    from plait.pipeline import zbv

    p, m, costs = case
    s = zbv(p, m, costs=costs).validate()
    assert all(_peak_activations(s, r, costs) <= 2 * p for r in range(p))
    # The margin is zero: zbv returns the unit-cost plan where that one is faster at these costs.
    assert s.makespan(costs) <= make_schedule("zbv", p, m).makespan(costs)


def test_zbv_plans_the_cost_tables_that_made_the_greedy_planner_deadlock():
    from plait.pipeline import zbv

    # Its first-chunk forwards used to fill every activation slot, so no microbatch reached the loss.
    per_kind = {Kind.F: 2.134, Kind.B: 2.355, Kind.W: 1.876}
    f, b, w = (0.5, 2.0, 0.5, 1.0), (0.5, 1.0, 1.0, 1.0), (2.0, 1.0, 0.5, 0.5)
    per_stage = {Kind.F: f, Kind.B: b, Kind.W: w}

    def per_action(a: Action) -> float:
        return per_stage[a.kind][a.stage]

    for p, m, costs in [(4, 16, per_kind), (2, 4, per_action)]:
        s = zbv(p, m, costs=costs).validate()
        assert all(_peak_activations(s, r, costs) <= 2 * p for r in range(p))
    zeros = zbv(3, 5, costs={k: 0.0 for k in _SPLIT}).validate()
    assert zeros.makespan({k: 0.0 for k in _SPLIT}) == 0.0


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "1"])
def test_zbv_refuses_costs_it_cannot_place(bad):
    from plait.pipeline import zbv

    with pytest.raises(ScheduleError, match=r"the cost of W\(stage=.* must be a finite number >= 0"):
        zbv(2, 4, costs={Kind.W: bad})
    with pytest.raises(ScheduleError, match=r"the cost of F\(stage=1, mb=0\) must be a finite number"):
        zbv(2, 4, costs=lambda a: bad if a.stage == 1 else 1.0)
