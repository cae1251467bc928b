"""Straggler blame: which rank the others wait for, on which axis, in which phase, and how long.

Every collective plait runs is preceded by the desync check, where the ranks of its group meet
(`plait.comm`). Each rank adds up how long it waited there, by the group's axis and the phase of
the step (``with comm.phase("forward")``). A rank that is slow waits little, while the others wait
for it: `Blame` compares the ranks' waits over a window of steps (one small gather of everyone's
totals, every N steps) and names the rank whose peers waited clearly longer than it did.

    tracker = StragglerTracker()
    for step in range(steps):
        ...
        if (step + 1) % 20 == 0:
            for b in tracker.blame():   # collective: every rank calls it
                log.warning("%s", b)

Nothing is measured with the desync check off (``plait.init(desync_check="off")``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from plait.runtime import comm

__all__ = ["Blame", "StragglerTracker"]


@dataclass(frozen=True)
class Blame:
    """Over ``steps`` steps, the other ranks of ``rank``'s group on ``axis`` waited ``waited_s``
    seconds more on average than it did (``share`` of the window's wall time), most of it in
    ``phase``."""

    rank: int
    axis: str
    phase: str
    waited_s: float
    steps: int
    share: float

    def __str__(self) -> str:
        return (f"straggler: rank {self.rank} on {self.axis} (mostly in {self.phase}): the others waited "
                f"{self.waited_s:.2f} s more than it over the last {self.steps} steps "
                f"({100 * self.share:.0f}% of the time)")


class StragglerTracker:
    """Windows of the desync check's waits. ``min_s`` and ``min_share``: the excess wait that counts
    as a straggler, in seconds and as a share of the window's wall time; a rank is named when it
    passes both in two windows in a row, so an even run's jitter (a rank descheduled now and then
    on a busy host) raises no alarm."""

    def __init__(self, min_s: float = 0.1, min_share: float = 0.2) -> None:
        if comm.desync_mode() == "off":  # no wait would be measured: blame would name no one, ever
            raise ValueError("StragglerTracker: straggler blame measures the waits of the desync check, "
                             "which is off; plait.init(desync_check='fast') (the default) turns it on")
        self.min_s, self.min_share = min_s, min_share
        self.restart()
        # The rank each group's peers waited for in the last window: named once it repeats.
        self._suspects: dict[tuple[str, tuple[int, ...]], int] = {}

    def step(self) -> None:
        """Count a step in the current window."""
        self._steps += 1

    def restart(self) -> None:
        """Start the window afresh, e.g. after a first step whose one-time work (rank 0 writing
        the run's files, first allocations) is no rank's slowness."""
        self._start, self._base, self._steps = time.perf_counter(), comm.waited(), 0

    def blame(self) -> list[Blame]:
        """Collective over the default group: every rank's waits since the last call, compared.
        Returns the stragglers found in this window and the one before (the same list on every
        rank) and starts a new window."""
        now, totals = time.perf_counter(), comm.waited()
        mine = {k: v - self._base.get(k, 0.0) for k, v in totals.items()}
        wall, steps = now - self._start, self._steps
        self._start, self._base, self._steps = now, totals, 0
        everyone: list[dict[tuple[str, tuple[int, ...], str], float]] = comm.all_gather_object(mine)
        # Per group: the rank whose peers waited clearly longer than it did over the whole window
        # (all phases together: a rank late in one phase and early in another is not a straggler),
        # named with the phase where they waited most.
        groups: dict[tuple[str, tuple[int, ...]], dict[str, dict[int, float]]] = {}
        for rank, waits in enumerate(everyone):
            for (axis, ranks, phase), w in waits.items():
                groups.setdefault((axis, ranks), {}).setdefault(phase, {})[rank] = w
        found = []
        suspects: dict[tuple[str, tuple[int, ...]], int] = {}
        for (axis, ranks), phases in sorted(groups.items()):
            members = [r for r in ranks if r < len(everyone)]
            if len(members) < 2:
                continue
            total = {r: sum(p.get(r, 0.0) for p in phases.values()) for r in members}
            slow = min(members, key=total.__getitem__)
            others = [r for r in members if r != slow]
            over = _excess(total, slow, others)
            if over > self.min_s and over > self.min_share * wall:
                suspects[(axis, ranks)] = slow
                if self._suspects.get((axis, ranks)) != slow:
                    continue  # once may be noise (a rank descheduled on a busy host): twice in a row
                phase = max(phases, key=lambda ph: _excess(phases[ph], slow, others))
                found.append(Blame(rank=slow, axis=axis, phase=phase, waited_s=over, steps=steps,
                                   share=over / wall if wall else 0.0))
        self._suspects = suspects
        return found


def _excess(waits: dict[int, float], slow: int, others: list[int]) -> float:
    """How much longer ``others`` waited on average than ``slow``."""
    return sum(waits.get(r, 0.0) for r in others) / len(others) - waits.get(slow, 0.0)
