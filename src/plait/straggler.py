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

from plait import comm

__all__ = ["Blame", "StragglerTracker"]


@dataclass(frozen=True)
class Blame:
    """Over ``steps`` steps, the ranks of ``axis`` waited ``waited_s`` seconds more on average
    than ``rank`` did in ``phase``: ``share`` of the window's wall time."""

    rank: int
    axis: str
    phase: str
    waited_s: float
    steps: int
    share: float

    def __str__(self) -> str:
        return (f"straggler: rank {self.rank} on {self.axis} ({self.phase}): the others waited "
                f"{self.waited_s:.2f} s more than it over the last {self.steps} steps "
                f"({100 * self.share:.0f}% of the time)")


class StragglerTracker:
    """Windows of the desync check's waits. ``min_s`` and ``min_share``: the excess wait that counts
    as a straggler, in seconds and as a share of the window's wall time (both must be passed, so
    an even run's jitter raises no alarm)."""

    def __init__(self, min_s: float = 0.05, min_share: float = 0.1) -> None:
        self.min_s, self.min_share = min_s, min_share
        self._start = time.perf_counter()
        self._base = comm.waited()
        self._steps = 0

    def step(self) -> None:
        """Count a step in the current window."""
        self._steps += 1

    def blame(self) -> list[Blame]:
        """Collective over the default group: every rank's waits since the last call, compared.
        Returns the stragglers found (the same list on every rank) and starts a new window."""
        now, totals = time.perf_counter(), comm.waited()
        mine = {k: v - self._base.get(k, 0.0) for k, v in totals.items()}
        wall, steps = now - self._start, self._steps
        self._start, self._base, self._steps = now, totals, 0
        everyone: list[dict[tuple[str, tuple[int, ...], str], float]] = comm.all_gather_object(mine)
        found = []
        for axis, ranks, phase in sorted({k for waits in everyone for k in waits}):
            waits = {r: everyone[r].get((axis, ranks, phase), 0.0) for r in ranks if r < len(everyone)}
            if len(waits) < 2:
                continue
            slow = min(waits, key=waits.__getitem__)
            others = [w for r, w in waits.items() if r != slow]
            excess = sum(others) / len(others) - waits[slow]
            if excess > self.min_s and excess > self.min_share * wall:
                found.append(Blame(rank=slow, axis=axis, phase=phase, waited_s=excess, steps=steps,
                                   share=excess / wall if wall else 0.0))
        return found
