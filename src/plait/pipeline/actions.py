"""What a pipeline rank does, as data: action kinds, actions and timed slots.

Kept apart from the schedules that list them (`plait.pipeline.schedules`) so that everything
that only reads actions (drawing, the runtime) depends on this small module alone.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Kind", "Action", "Slot", "BACKWARD", "COMM"]


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
    kind: Kind
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind.value}(stage={self.stage}, mb={self.mb})"


@dataclass(frozen=True)
class Slot:
    """One action placed in time by `Schedule.simulate` (or measured by the runtime)."""

    action: Action
    start: float
    end: float
