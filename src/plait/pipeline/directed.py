"""One process group per direction between neighbouring pipeline ranks: what NCCL needs.

Gloo matches a receive to its send by tag, so the executor can post every receive of a step
at once on one group. NCCL ignores tags: on a communicator, the k-th send from A to B meets
B's k-th receive from A, and a communicator's operations run one after another on its stream.
Giving every direction (A to B, B to A) its own two-rank group makes both rules harmless:

* within a direction, messages are matched by order: the executor posts a rank's receives in
  the order their senders send them (`Schedule.receive_order`), whatever order its action list
  waits for them in, so every valid schedule runs;
* a receive waiting on one direction never holds up a send in the other, so the validator's
  model (sends never block, receives wait for their send) is what the devices do.

Every rank creates every group, in the same order (group creation is collective over the
world): for each coordinate of the other mesh axes, one group per direction the schedule uses.
"""

from __future__ import annotations

import torch.distributed as dist

from plait.pipeline.actions import Kind
from plait.pipeline.schedules import Schedule
from plait.runtime import comm


def directions(sched: Schedule) -> list[tuple[int, int]]:
    """(sending pp rank, receiving pp rank) of every message the schedule sends, sorted."""
    out = set()
    for r, row in enumerate(sched.actions):
        for a in row:
            if a.kind is Kind.SEND_F:
                out.add((r, sched.stage_rank(a.stage + 1)))
            elif a.kind is Kind.SEND_B:
                out.add((r, sched.stage_rank(a.stage - 1)))
    return sorted(out)


def direction_groups(sched: Schedule, lines: list[list[int]]) -> dict[tuple[int, int], dist.ProcessGroup]:
    """(sender, receiver) global ranks -> the two-rank group carrying that direction, for the
    directions that involve this rank; ``lines``: every pp group's global ranks."""
    links: dict[tuple[int, int], dist.ProcessGroup] = {}
    for line in lines:
        for src, dst in directions(sched):
            pair = (line[src], line[dst])
            group = comm.new_group(pair, "pp", checked=False)
            if group is not None:  # this rank is in the pair
                links[pair] = group
    return links
