"""The named schedules, generated as per-rank action lists: GPipe, 1F1B, interleaved 1F1B and
ZB-H1, and the V-shape ZB-V and DualPipeV (generated in `plait.pipeline.vshape`)."""

from __future__ import annotations

from plait.pipeline.actions import Action, Kind
from plait.pipeline.schedules import Schedule, ScheduleError, with_comms
from plait.pipeline.vshape import dualpipev, zbv


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward."""
    rows = []
    for r in range(p):
        st = [c * p + r for c in range(v)]
        row = [Action(Kind.F, s, mb) for s in st for mb in range(m)]
        row += [Action(Kind.BW, s, mb) for s in reversed(st) for mb in range(m)]
        rows.append(row)
    return with_comms("gpipe", p, p * v, m, rows)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): p-r-1 warm-up forwards, then alternate.

    Rank r never holds more than p - r microbatches' activations (GPipe holds m).
    """
    rows = []
    for r in range(p):
        warm = min(p - r - 1, m)
        row = [Action(Kind.F, r, mb) for mb in range(warm)]
        for i in range(m - warm):
            row += [Action(Kind.F, r, warm + i), Action(Kind.BW, r, i)]
        row += [Action(Kind.BW, r, mb) for mb in range(m - warm, m)]
        rows.append(row)
    return with_comms("1f1b", p, p, m, rows)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, sec. 2.2): v chunks per rank, bubble / v.

    Microbatches go through the chunks in groups of p (Megatron's order), so m must be a
    multiple of p.
    """
    if m % p:
        raise ScheduleError(f"interleaved 1F1B needs microbatches to be a multiple of pp: got "
                            f"microbatches={m}, pp={p}")
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        mb = (k // (p * v)) * p + k % p
        return (chunk if forward else v - 1 - chunk), mb

    rows = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        fwd = [Action(Kind.F, unit(k, True)[0] * p + r, unit(k, True)[1]) for k in range(total)]
        bwd = [Action(Kind.BW, unit(k, False)[0] * p + r, unit(k, False)[1]) for k in range(total)]
        row = fwd[:warm]
        for i in range(total - warm):
            row += [fwd[warm + i], bwd[i]]
        row += bwd[total - warm:]
        rows.append(row)
    return with_comms(f"interleaved-1f1b(v={v})", p, p * v, m, rows)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023): 1F1B with the backward split into B and W, W filling bubbles.

    Built by list scheduling under unit costs (F = B = W): a rank runs the oldest pending W if
    more than p - 1 are pending (bounded memory), else a ready B, else a forward while it holds
    fewer than p - r microbatches between F and B (1F1B's limit), else it waits, running pending
    W's meanwhile. Its makespan is 3m + p - 1 units against 1F1B's 3m + 3(p - 1): the bubble
    shrinks from (p - 1)(F + B + W) to (p - 1)(F + B - W), the paper's figure.

    A W that only fills a wait is listed as late as the memory bound allows, not where the unit
    plan ran it: the runtime pulls W's into whatever waits real durations produce (see the module
    docstring), so a W listed early would be spent on a unit-cost wait that may not exist.
    """
    f_end: list[dict[int, int]] = [{} for _ in range(p)]
    b_end: list[dict[int, int]] = [{} for _ in range(p)]
    w_done: list[set[int]] = [set() for _ in range(p)]
    deferred: list[list[int]] = [[] for _ in range(p)]  # W's run in a wait, not listed yet
    listed_pending = [0] * p  # B's listed without their W
    rows: list[list[Action]] = [[] for _ in range(p)]
    free, nxt, t = [0] * p, [0] * p, 0
    while any(len(w) < m for w in w_done):
        for r in range(p):
            if free[r] > t:
                continue
            ready_b = [mb for mb, e in f_end[r].items() if e <= t and mb not in b_end[r]
                       and (r == p - 1 or b_end[r + 1].get(mb, t + 1) <= t)]
            held = sum(1 for mb in f_end[r] if mb not in b_end[r])
            pend_w = [mb for mb, e in b_end[r].items() if e <= t and mb not in w_done[r]]
            listed = True
            if len(pend_w) > p - 1:  # bounds the saved weight-gradient work (memory)
                mb, kind = min(pend_w), Kind.W
                w_done[r].add(mb)
            elif ready_b:
                mb, kind = min(ready_b), Kind.B
                b_end[r][mb] = t + 1
                while listed_pending[r] > p - 1 and deferred[r]:
                    rows[r].append(Action(Kind.W, r, deferred[r].pop(0)))
                    listed_pending[r] -= 1
            elif nxt[r] < m and held < p - r and (r == 0 or f_end[r - 1].get(nxt[r], t + 1) <= t):
                mb, kind = nxt[r], Kind.F
                f_end[r][mb] = t + 1
                nxt[r] += 1
            elif pend_w:
                mb, kind = min(pend_w), Kind.W
                w_done[r].add(mb)
                listed = len(b_end[r]) == m  # after the last B nothing is left to wait for
            else:
                continue
            if kind is Kind.W and not listed:
                deferred[r].append(mb)
            else:
                if kind is Kind.W:
                    rows[r] += [Action(Kind.W, r, d) for d in deferred[r]]
                    listed_pending[r] -= len(deferred[r]) + 1
                    deferred[r] = []
                elif kind is Kind.B:
                    listed_pending[r] += 1
                rows[r].append(Action(kind, r, mb))
            free[r] = t + 1
        t += 1
    return with_comms("zb-h1", p, p, m, rows)


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")  # two stages per rank, placed in a V (`plait.pipeline.vshape`)
SPLIT_BACKWARD = ("zb-h1", "zbv", "dualpipev")  # schedules that run backwards as B then a deferred W


def stages_per_rank(name: str, chunks: int) -> int:
    """How many stages each rank holds under the named schedule and ``chunks``."""
    return 2 if name in V_SCHEDULES else chunks


def make_schedule(name: str, pp: int, microbatches: int, chunks: int = 1) -> Schedule:
    """Generate and validate a named schedule; clear errors for unsupported combinations.

    The V schedules always hold two stages per rank: ``chunks`` must be 2, or 1 (the default,
    read as "the schedule's own").
    """
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES} or a custom action list, got {name!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    if name in ("1f1b", "zb-h1") and chunks != 1:
        raise ValueError(f"schedule {name!r} runs one stage per rank (chunks=1), got chunks={chunks}; "
                         "use schedule='interleaved' for several chunks per rank")
    if name in V_SCHEDULES and chunks > 2:
        raise ValueError(f"schedule {name!r} holds two stages per rank in a V (chunks=2), got "
                         f"chunks={chunks}; use schedule='interleaved' for more chunks per rank")
    if name == "gpipe":
        sched = gpipe(pp, microbatches, chunks)
    elif name == "1f1b":
        sched = one_f_one_b(pp, microbatches)
    elif name == "zb-h1":
        sched = zb_h1(pp, microbatches)
    elif name == "zbv":
        sched = zbv(pp, microbatches)
    elif name == "dualpipev":
        if microbatches < 2 * pp:
            raise ValueError(f"dualpipev needs at least 2 x pp = {2 * pp} microbatches (one per stage), got "
                             f"microbatches={microbatches} with pp={pp}; use 'zbv' for fewer")
        sched = dualpipev(pp, microbatches)
    else:
        if microbatches < pp:
            raise ValueError(f"interleaved 1F1B needs at least as many microbatches as pipeline ranks: "
                             f"got microbatches={microbatches} < pp={pp} (GPipe and 1F1B accept fewer)")
        sched = interleaved_1f1b(pp, microbatches, chunks)
    return sched.validate()
