"""Who is alive: the data-parallel replicas agree on their members through a key-value store.

The store is a `torch.distributed.TCPStore` hosted by the process that started the replicas
(`plait.runtime.heal.supervisor`), so it outlives every replica. Nothing else is needed: no new service.

A replica has a *uid* that no other replica of the run ever has (its processes, several under
HSDP, share it and speak for it alike). Members are listed per *epoch*; a replica's place in the
list is its rank in that epoch's process groups. The keys:

``heal/epoch/<e>``
    epoch ``e``'s record, JSON: its members (uids) and how many join requests it admitted.
    Written with compare-and-set: the first proposal wins and every replica reads the winner, so
    all agree even when several propose at once.
``heal/joins``, ``heal/join/<n>``
    a counter of join requests and the uid of the ``n``-th. The leader (the first member) reads
    the counter once per step; that is the only store traffic of a step without failures.
``heal/admit/<uid>``
    the epoch a joining replica was admitted to.
``heal/alive/<e>/<uid>``
    posted by a member of epoch ``e`` after a collective of ``e`` failed.
``heal/dead/<uid>``
    posted by the supervisor when a replica's process ended (a ``kill -9`` is known at once, so
    the survivors do not wait for the bound).
``heal/settled/<e>``, ``heal/settled/<e>/abandoned``
    how many replicas of epoch ``e`` are done with its state transfer; set when one could not
    start the epoch, so the others stop waiting for it.
``heal/activate/<uid>``
    posted by the supervisor to wake its standby process when a replica died.
``heal/done``
    posted by the supervisor once a replica finished the run: replicas still waiting to join stop.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch.distributed as dist

_POLL_S = 0.01  # between two looks at the store while waiting for peers


class Dropped(RuntimeError):
    """This replica was left out of the next epoch (it answered after the bound): it must join again."""


class RunOver(RuntimeError):
    """The run finished while this replica was waiting to join."""


@dataclass(frozen=True)
class Epoch:
    """One membership of the data-parallel replicas: its number, its members' uids (in rank order)
    and how many join requests it has admitted so far."""

    number: int
    members: tuple[int, ...]
    joins: int
    me: int

    @property
    def rank(self) -> int:
        """This replica's rank in the epoch's process group."""
        return self.members.index(self.me)

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def leader(self) -> bool:
        """The first member: it reads the join counter and writes the run's metrics."""
        return self.members[0] == self.me

    def record(self) -> str:
        return json.dumps({"members": list(self.members), "joins": self.joins})

    @classmethod
    def parse(cls, number: int, text: bytes | str, me: int) -> Epoch:
        data = json.loads(text)
        return cls(number, tuple(int(u) for u in data["members"]), int(data["joins"]), me)


class Quorum:
    """This replica's side of the membership protocol (see the module's docstring).

    ``bound_s``: how long survivors wait for a member to say it is alive after a failure; a
    member silent that long (hung, or too slow) is left out.
    """

    def __init__(self, store: dist.Store, uid: int, bound_s: float) -> None:
        self.store, self.uid, self.bound_s = store, uid, bound_s

    def initial(self, size: int) -> Epoch:
        """Epoch 0: the replicas the supervisor started together, uids ``0 .. size-1`` (known to
        every one of them without a word)."""
        return Epoch(0, tuple(range(size)), 0, self.uid)

    def pending_joins(self) -> int:
        """How many join requests there have been in the whole run (one store round trip)."""
        return int(self.store.add("heal/joins", 0))

    def request_join(self) -> None:
        """Ask to be admitted at the next step boundary."""
        n = int(self.store.add("heal/joins", 1))
        self.store.set(f"heal/join/{n}", str(self.uid))

    def wait_activation(self) -> None:
        """A standby: block until the supervisor wakes it (or the run is over: `RunOver`)."""
        self._wait_for(f"heal/activate/{self.uid}")

    def _wait_for(self, key: str) -> None:
        while not self.store.check([key]):
            if self.store.check(["heal/done"]):
                raise RunOver("the run finished before this replica was needed")
            time.sleep(_POLL_S)

    def wait_admission(self) -> Epoch:
        """Block until an epoch admits this replica (or the run is over: `RunOver`)."""
        key = f"heal/admit/{self.uid}"
        self._wait_for(key)
        number = int(self.store.get(key))
        return Epoch.parse(number, self.store.get(f"heal/epoch/{number}"), self.uid)

    def admit(self, epoch: Epoch, joins: int) -> Epoch:
        """The next epoch: ``epoch``'s members and the join requests up to ``joins``, in request
        order. Every member computes the same record; the first written is the one that counts."""
        new = [int(self.store.get(f"heal/join/{n}")) for n in range(epoch.joins + 1, joins + 1)]
        members = tuple(dict.fromkeys([*epoch.members, *new]))  # a uid asking twice is one member
        proposal = Epoch(epoch.number + 1, members, joins, self.uid)
        decided = self._decide(proposal)
        for uid in new:  # by every member (the same value): a leader that dies here loses nothing
            self.store.set(f"heal/admit/{uid}", str(decided.number))
        return decided

    def recover(self, epoch: Epoch) -> Epoch:
        """After a collective of ``epoch`` failed: say this replica is alive, wait until every other
        member is alive or dead (or the bound passed), and return the next epoch of the live ones.
        Raises `Dropped` when the decided epoch left this replica out."""
        next_key = f"heal/epoch/{epoch.number + 1}"
        self.store.set(f"heal/alive/{epoch.number}/{self.uid}", "1")
        deadline = time.monotonic() + self.bound_s
        others = [m for m in epoch.members if m != self.uid]
        while time.monotonic() < deadline and not self.store.check([next_key]):
            if all(self._answered(epoch.number, m) for m in others):
                break
            time.sleep(_POLL_S)
        live = tuple(m for m in epoch.members
                     if m == self.uid or self.store.check([f"heal/alive/{epoch.number}/{m}"]))
        decided = self._decide(Epoch(epoch.number + 1, live, epoch.joins, self.uid))
        if self.uid not in decided.members:
            raise Dropped(f"replica {self.uid} was left out of epoch {decided.number} (members "
                          f"{list(decided.members)}): it answered after the {self.bound_s:g} s bound")
        return decided

    def settle(self, epoch: Epoch, bound_s: float, count: bool = True) -> None:
        """Wait, through the store, until every member of ``epoch`` is done with the state transfer: the
        members not in it must not wait in a collective that times out while a large model moves.
        ``count``: this process speaks for its replica (one per replica does). Raises when a member
        died or gave the epoch up meanwhile, or after ``bound_s``."""
        key = f"heal/settled/{epoch.number}"
        if count:
            self.store.add(key, 1)
        deadline = time.monotonic() + bound_s
        while int(self.store.add(key, 0)) < epoch.size:
            dead = [m for m in epoch.members if self.store.check([f"heal/dead/{m}"])]
            left = self.store.check([f"{key}/abandoned"])
            if dead or left or time.monotonic() > deadline:
                why = (f"replicas {dead} died" if dead else "a replica could not start it" if left
                       else f"not within {bound_s:g} s")
                raise RuntimeError(f"plait.runtime.heal: the state transfer of epoch {epoch.number} did not "
                                   f"finish on every member ({why})")
            time.sleep(_POLL_S)

    def abandon(self, epoch: Epoch) -> None:
        """This replica could not start ``epoch``: the members waiting in `settle` stop waiting."""
        self.store.set(f"heal/settled/{epoch.number}/abandoned", "1")

    def _answered(self, number: int, member: int) -> bool:
        return bool(self.store.check([f"heal/alive/{number}/{member}"])
                    or self.store.check([f"heal/dead/{member}"]))

    def _decide(self, proposal: Epoch) -> Epoch:
        """Propose an epoch; whichever proposal for its number was written first is returned."""
        key = f"heal/epoch/{proposal.number}"
        self.store.compare_set(key, "", proposal.record())
        return Epoch.parse(proposal.number, self.store.get(key), self.uid)
