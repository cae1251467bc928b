"""Data-parallel replicas that heal without a restart: a process group per membership epoch.

Each replica is a torch.distributed world of its own (`plait.init` in one process); what it
shares with its peers is one Gloo process group per epoch, built on the run's store
(``ProcessGroupGloo(PrefixStore("heal/group/<e>", store), rank, size, timeout)``). When a peer
dies its sockets close and the collective fails at once; when it hangs, the collective times out
after ``timeout_s``. Either way the survivors agree on the next epoch (`plait.runtime.heal.quorum`),
build its group and redo the step over the live replicas, splitting the same global batch among
them. Replicas that are behind (a joiner, or one that missed the last optimizer step) take the
state of the first replica that is ahead (`plait.runtime.heal.transfer`).

A replica may be several processes (HSDP: the processes that shard one copy of the model, a
world of their own). Then process ``i`` of each replica meets process ``i`` of the others in its
own group per epoch, and the replica's processes agree among themselves, over their world, on
whether each step and each epoch's start succeeded before any of them goes on: a replica moves as
one, or recovers as one.

The training loop calls `Replicas.share` before a step, `Replicas.reduce` for the step's gradients
(several processes per replica) and small statistics (which also carry the join count),
`Replicas.recover` when a collective failed and `Replicas.boundary` after the optimizer step.
"""

from __future__ import annotations

import datetime as _dt
import logging
import time
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

from plait.runtime import comm
from plait.runtime.comm.ops import all_reduce_coalesced
from plait.runtime.heal.quorum import Dropped, Epoch, Quorum
from plait.runtime.heal.transfer import LiveState, local, recv_state, send_state

# What a collective on a group whose peer died or hung raises: comm's error, Gloo's own, or the
# ValueError torch 2.13 raises while naming a group outside its world map (`ReplicaFailed` is a
# RuntimeError).
FAILURES: tuple[type[BaseException], ...] = (comm.CollectiveError, RuntimeError, ValueError)
MAX_RETRIES = 4  # failed attempts at one step before the error is taken for a bug, not a peer
SETTLE_S = 120.0  # the longest a state transfer may take (at least 10 x the collective timeout)

log = logging.getLogger("plait.runtime.heal")


def split(total: int, parts: int, index: int) -> tuple[int, int]:
    """The ``[lo, hi)`` share of ``total`` samples of part ``index`` out of ``parts``: as even as
    can be, the first ``total % parts`` parts one larger."""
    base, extra = divmod(total, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


class ReplicaFailed(RuntimeError):
    """Another process of this replica failed a collective of the step or of the epoch's start."""


class Replicas:
    """This replica's membership and process group; see the module's docstring.

    ``events``: called with a dict for each membership change (the app writes them to its log).
    ``index`` of ``per_replica``: this process's place in its replica (whose world is torch's
    default group when ``per_replica > 1``).
    """

    def __init__(self, store: dist.Store, uid: int, timeout_s: float,
                 events: Callable[[dict[str, Any]], None] | None = None, index: int = 0,
                 per_replica: int = 1) -> None:
        # Survivors wait twice the collective timeout for each other: a member whose collective
        # only times out (not a neighbour of the dead one in Gloo's ring) still answers in time.
        self.quorum = Quorum(store, uid, 2 * timeout_s)
        self.store, self.uid, self.timeout_s = store, uid, timeout_s
        self.index, self.per_replica = index, per_replica
        self.events = events or (lambda e: None)
        self.epoch: Epoch | None = None
        self.group: dist.ProcessGroup | None = None
        self._joins_seen = 0
        self._joining = False  # asked to join: takes a peer's state in the epoch that admits it

    # ------------------------------------------------------------------ membership
    def start(self, state: LiveState, initial: int | None, standby: bool = False) -> None:
        """Enter the run: epoch 0 with ``initial`` replicas started together, or (``None``) as a
        joiner, admitted at a step boundary and given the live state by a peer; a ``standby``
        joiner first waits until the supervisor wakes it."""
        if initial is not None:
            self._enter(self.quorum.initial(initial), state)
            return
        if standby:
            self.quorum.wait_activation()
        self._join(state)

    def _join(self, state: LiveState) -> None:
        asked = time.time()
        self._request_join()
        self._enter(self.quorum.wait_admission(), state, joined_at=asked)

    def _request_join(self) -> None:
        """Ask to be admitted: once per replica (by its first process), so the replica is one join."""
        if self.index == 0:
            self.quorum.request_join()
        self._joining = True

    def _enter(self, epoch: Epoch, state: LiveState, joined_at: float | None = None) -> None:
        """Build ``epoch``'s group and bring every member to the newest state; on a failure meanwhile,
        recover into the next epoch and try again."""
        while True:
            self._close()
            self.epoch = epoch
            error: str | None = None
            received = transferred = False
            try:
                self.group = self._build(epoch)
                received, transferred = self._synchronise(state)
            except FAILURES as e:
                error = comm_error_line(e)  # not the error itself: its frames would keep the group open
            error = self._agree(error)
            if error is None and transferred:
                error = self._settle()
            if error is None:
                self._joining = False
                break
            if self.index == 0:  # replicas waiting for this one's transfer need not wait for the bound
                self.quorum.abandon(epoch)
            log.warning("replica %d: epoch %d could not start (%s); recovering", self.uid, epoch.number,
                        error)
            self._close()
            epoch = self._next_epoch(epoch, state)
        self.events({"event": "epoch", "epoch": epoch.number, "members": list(epoch.members),
                     "step": state.step, "received_state": received,
                     **({"asked_to_join": joined_at} if joined_at is not None else {})})

    def _build(self, epoch: Epoch) -> dist.ProcessGroup:
        # The group's rendezvous waits on the store: for the replicas' start (imports, data) at epoch
        # 0, for peers that are up and waiting later, so a member that died meanwhile costs 4 x the
        # timeout, not the store's five minutes.
        if epoch.number > 0:
            self.store.set_timeout(_dt.timedelta(seconds=4 * self.timeout_s))
        # Process i of each replica meets process i of the others.
        name = f"heal/group/{epoch.number}" + (f"/{self.index}" if self.per_replica > 1 else "")
        prefix = dist.PrefixStore(name, self.store)
        # A Gloo backend used as the group itself (torch's collectives take it), as torchft does.
        pg = cast(dist.ProcessGroup, dist.ProcessGroupGloo(prefix, epoch.rank, epoch.size,
                                                           _dt.timedelta(seconds=self.timeout_s)))
        # Named for errors and counted; its one global rank is this process's own (each replica is a
        # world of its own), so a failure is reported without asking peers that have no global rank.
        part = f" (process {self.index} of each)" if self.per_replica > 1 else ""
        comm.register_group(pg, f"heal epoch {epoch.number} of replicas {list(epoch.members)}{part}",
                            [dist.get_rank()])
        return pg

    def _synchronise(self, state: LiveState) -> tuple[bool, bool]:
        """Each member's completed steps, gathered; those behind receive the state of the first member
        that is furthest ahead. Returns whether this replica received it, and whether any did."""
        assert self.epoch is not None and self.group is not None
        steps = torch.zeros(self.epoch.size, dtype=torch.float64)
        # 0: a joiner. Its state is taken whatever its step: one dropped for being late may have
        # applied a step its peers then redid without it (the same update, summed in another order).
        steps[self.epoch.rank] = 0 if self._joining else state.step + 1
        comm.all_reduce(steps, self.group)
        ahead = int(steps.argmax())
        behind = [r for r in range(self.epoch.size) if steps[r] < steps[ahead]]
        received = self.epoch.rank in behind
        if self.epoch.rank == ahead and behind:
            send_state(self.group, state, behind)
        elif received:
            recv_state(self.group, state, ahead)
        return received, bool(behind)

    def _agree(self, error: str | None) -> str | None:
        """Whether every process of this replica succeeded: ``error`` (this process's failure, or
        None), else a sibling's. Over the replica's own world, which holds while the replica lives
        (one that lost a process is killed whole by the supervisor)."""
        if self.per_replica == 1:
            return error
        failed = torch.tensor([0.0 if error is None else 1.0], dtype=torch.float64)
        comm.all_reduce(failed, None)
        if error is None and failed[0] > 0:
            return "another process of this replica failed"
        return error

    def _settle(self) -> str | None:
        """After a state transfer, wait until every replica is done with it (`Quorum.settle`): those
        not in it must not wait in a collective that times out while a large model moves."""
        assert self.epoch is not None
        try:
            self.quorum.settle(self.epoch, max(SETTLE_S, 10 * self.timeout_s), count=self.index == 0)
        except RuntimeError as e:
            return comm_error_line(e)
        return None

    def _next_epoch(self, epoch: Epoch, state: LiveState) -> Epoch:
        try:
            return self.quorum.recover(epoch)
        except Dropped as e:
            log.warning("%s; joining again", e)
            self._close()
            self._request_join()
            return self.quorum.wait_admission()

    def _close(self) -> None:
        if self.group is not None:
            comm.destroy_group(self.group)
            self.group = None

    # ------------------------------------------------------------------ steps
    @property
    def size(self) -> int:
        assert self.epoch is not None
        return self.epoch.size

    @property
    def leader(self) -> bool:
        """The first process of the first replica: it reads the join requests and writes the metrics."""
        return self.epoch is not None and self.epoch.leader and self.index == 0

    def share(self, global_batch: int) -> tuple[int, int]:
        """This process's ``[lo, hi)`` of the global batch in the current epoch: its replica's share,
        split again among the replica's processes."""
        assert self.epoch is not None
        if global_batch < self.epoch.size * self.per_replica:
            raise RuntimeError(f"plait.runtime.heal: {self.epoch.size} replicas of {self.per_replica} "
                               f"processes cannot share a global batch of {global_batch} samples")
        lo, hi = split(global_batch, self.epoch.size, self.epoch.rank)
        a, b = split(hi - lo, self.per_replica, self.index)
        return lo + a, lo + b

    def reduce(self, values: torch.Tensor, grads: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Sum ``values`` (float64, 1-D) over every process of every replica, with one more slot: the
        join requests the leader saw in the store, so that every replica learns them at the same step.

        With several processes per replica, ``grads`` (this process's gradient shards, each replica's
        own reduction done) are summed over the replicas first, one flat all-reduce; then the
        replica's processes agree that all of it succeeded (`ReplicaFailed` when a sibling's failed),
        so that no process of a replica steps its optimizer unless all of them do."""
        assert self.group is not None
        joins = self.quorum.pending_joins() if self.leader else 0
        out = torch.cat([values.to(torch.float64), torch.tensor([float(joins)], dtype=torch.float64)])
        if self.per_replica == 1:
            comm.all_reduce(out, self.group)
        else:
            error = None
            try:
                if grads:
                    all_reduce_coalesced([local(g) for g in grads], self.group)
                comm.all_reduce(out, self.group)
            except FAILURES as e:
                error = comm_error_line(e)
            error = self._agree(error)
            if error is not None:
                raise ReplicaFailed(error)
            comm.all_reduce(out, None)  # the replicas' sums of each process index, over the replica
        self._joins_seen = int(out[-1])
        return out[:-1]

    def recover(self, state: LiveState, error: str) -> None:
        """A collective of this step failed (``error``: what it said, `comm_error_line`): agree on the
        live replicas and carry on with them (the caller redoes the step). The replicas that missed
        the last optimizer step catch up. Nothing may hold the failed group any more (the caller's
        DDP regrouped): freeing it closes its connections, so peers still waiting in a collective
        on it fail at once instead of at their timeout."""
        assert self.epoch is not None
        log.warning("replica %d: step %d failed in epoch %d (%s); agreeing on the live replicas",
                    self.uid, state.step + 1, self.epoch.number, error)
        self._close()
        self.events({"event": "failure", "epoch": self.epoch.number, "step": state.step, "error": error})
        self._enter(self._next_epoch(self.epoch, state), state)

    def boundary(self, state: LiveState) -> None:
        """After a step: admit the replicas that asked to join (every member saw the same count in
        `reduce`), and hand them the state."""
        assert self.epoch is not None
        if self._joins_seen > self.epoch.joins:
            self._enter(self.quorum.admit(self.epoch, self._joins_seen), state)

    def close(self) -> None:
        self._close()


def comm_error_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"
