"""What a pipeline rank does, as data: action kinds, actions and timed slots.

Kept apart from the schedules that list them (`plait.pipeline.schedules`) so that everything
that only reads actions (drawing, the runtime) depends on this small module alone.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass


class Kind(enum.Enum):
    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in (Kind.F, Kind.B, Kind.W, Kind.BW)


BACKWARD = (Kind.B, Kind.BW)
COMM = (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)


@dataclass(frozen=True)
class Action:
    """One thing a rank does. ``overlap`` (a forward only) pairs it with the backward listed right
    after it: DualPipe's overlapped chunk pair (DeepSeek-AI 2024), one microbatch's forward running
    alongside another's backward so that each one's communication hides behind the other's compute.
    The pair runs one after the other here (CPU); the plan and the pictures show it as one slot."""

    kind: Kind
    stage: int
    mb: int
    overlap: bool = False

    def __str__(self) -> str:
        paired = ", overlapped with the next backward" if self.overlap else ""
        return f"{self.kind.value}(stage={self.stage}, mb={self.mb}{paired})"


# How long actions take, for the simulator and the pictures: a duration per kind, or per action
# (e.g. measured durations per stage).
Costs = Mapping[Kind, float] | Callable[[Action], float]


@dataclass(frozen=True)
class Slot:
    """One action placed in time by `Schedule.simulate` (or measured by the runtime)."""

    action: Action
    start: float
    end: float


# Where stage s of S = v * p stages lives on p ranks. "loop": rank s % p, so rank r holds r, r + p,
# ... (interleaved 1F1B). "v": two stages per rank, the first p going down the ranks and the last p
# coming back up (rank r holds r and 2p - 1 - r), so the rank that starts a microbatch also ends it
# and the stages p - 1 and p meet on the last rank with no transfer (ZB-V, DualPipeV).
PLACEMENTS = ("loop", "v")


def stage_rank(placement: str, ranks: int, stage: int) -> int:
    """The rank holding ``stage`` under ``placement``."""
    if placement == "v" and stage >= ranks:
        return 2 * ranks - 1 - stage
    return stage % ranks


def rank_stages(placement: str, ranks: int, stages: int, rank: int) -> list[int]:
    """The stages ``rank`` holds, ascending."""
    if placement == "v":
        return [rank, 2 * ranks - 1 - rank]
    return list(range(rank, stages, ranks))
