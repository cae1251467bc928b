"""The process that starts healing replicas, hosts their store and replaces the ones that die.

torchrun's agent (and `plait.app.launch.spawn`) ends every rank when one fails: right for a job
that restarts from a checkpoint, wrong for replicas that heal. Here the parent process

* hosts the run's `torch.distributed.TCPStore`, which outlives every replica;
* starts ``replicas`` replicas (uids ``0 .. replicas-1``, epoch 0), each of ``per_replica`` processes
  (HSDP: a replica is the group of processes that shard one copy of the model among them);
* when a process ends with a failure (``kill -9`` included) kills the rest of its replica (which
  holds an incomplete model without it), posts ``heal/dead/<uid>`` at once, so the survivors need
  not wait for the bound, and, with ``replacements``, wakes the *standby*: a replica started with
  the others that has loaded Python, torch, the data and the model and waits for
  ``heal/activate/<uid>``; it joins the survivors at the next step boundary, and a new standby is
  started behind it (with none left, a fresh replica joins instead);
* when one finishes the run posts ``heal/done`` and starts no more;
* forwards SIGINT and SIGTERM to the replicas (a second signal kills them).

Each replica asks the kernel to stop it when the supervisor dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from plait.runtime.env import die_with_parent

STORE_TIMEOUT_S = 300.0  # a replica's blocking store reads (the protocol's own waits are bounded)


class ReplicasFailed(RuntimeError):
    """No replica finished the run."""


@dataclass(frozen=True)
class Membership:
    """What a replica process is given: where the run's store is, its replica's uid, and ``initial``,
    the number of replicas started together (None: it joins a running epoch); ``index`` of
    ``per_replica``: its place among its replica's processes (its rank in the replica's own world)."""

    host: str
    port: int
    uid: int
    initial: int | None
    standby: bool = False  # waits for ``heal/activate/<uid>`` before it asks to join
    index: int = 0
    per_replica: int = 1

    def connect(self) -> dist.Store:
        return dist.TCPStore(self.host, self.port, is_master=False,
                             timeout=_dt.timedelta(seconds=STORE_TIMEOUT_S))


def _entry(fn: Callable[..., Any], member: Membership, args: tuple[Any, ...], threads: int | None,
           parent: int) -> None:
    os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the supervisor only; it forwards the signal
    die_with_parent(signal.SIGTERM, parent)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    fn(member, *args)


@dataclass
class Supervisor:
    """Run ``fn(membership, *args)`` in ``replicas`` replicas of ``per_replica`` processes each and keep
    the run going.

    ``replacements``: how many new replicas may be started for replicas that died (0: none).
    ``events``: called with a dict for each start and end of a process. ``grace_s``: once a replica
    finished the run, how long the others get to finish too before they are killed (one that hung
    and was dropped would otherwise keep the run from ending).
    """

    fn: Callable[..., Any]
    replicas: int
    args: tuple[Any, ...] = ()
    replacements: int = 0
    threads: int | None = None
    grace_s: float = 30.0
    events: Callable[[dict[str, Any]], None] = field(default=lambda e: None)
    per_replica: int = 1
    codes: dict[int, int] = field(default_factory=dict)  # uid -> exit code, of the ended replicas

    def run(self) -> int:
        """Returns 0 when a replica finished the run (others may have died: they were healed
        around), or the replicas' common stop code after a signal; raises `ReplicasFailed` when
        none finished."""
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=_dt.timedelta(seconds=STORE_TIMEOUT_S))
        self._ctx = multiprocessing.get_context("spawn")
        self._procs: dict[tuple[int, int], multiprocessing.process.BaseProcess] = {}  # (uid, index)
        self._signals: list[int] = []
        self._finished = False
        self._standby: int | None = None
        self._exits: set[tuple[int, int]] = set()  # the processes whose end was handled
        old = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for uid in range(self.replicas):
                self._start(uid, self.replicas)
            self._start_standby()
            self._watch()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            self._send(signal.SIGKILL)  # only when the supervisor itself fails: none outlives it
        if self._signals:
            return 0 if self._finished else 128 + self._signals[0]
        if not self._finished:
            raise ReplicasFailed(f"no replica finished the run; exit codes by uid: {self.codes}")
        return 0

    def _start(self, uid: int, initial: int | None, standby: bool = False) -> None:
        """Start replica ``uid``'s processes."""
        for index in range(self.per_replica):
            member = Membership("127.0.0.1", self._store.port, uid, initial, standby, index, self.per_replica)
            name = f"plait-replica{uid}" + (f".{index}" if self.per_replica > 1 else "")
            p = self._ctx.Process(target=_entry, name=name,
                                  args=(self.fn, member, self.args, self.threads, os.getpid()))
            p.start()
            self._procs[uid, index] = p
            self.events({"event": "start", "uid": uid, "index": index, "pid": p.pid, "time": time.time(),
                         "joining": initial is None, "standby": standby})

    def _next_uid(self) -> int:
        return max(uid for uid, _ in self._procs) + 1

    def _start_standby(self) -> None:
        if self.replacements > 0:
            self.replacements -= 1
            self._standby = self._next_uid()
            self._start(self._standby, None, standby=True)

    def _replace(self) -> None:
        """Wake the standby (and start the next one), or start a fresh joiner when there is none."""
        if self._standby is not None:
            uid, self._standby = self._standby, None
            self._store.set(f"heal/activate/{uid}", "1")
            self.events({"event": "activate", "uid": uid, "time": time.time()})
            self._start_standby()
        elif self.replacements > 0:
            self.replacements -= 1
            self._start(self._next_uid(), None)

    def _watch(self) -> None:
        deadline = None
        while any(p.exitcode is None for p in self._procs.values()):
            multiprocessing.connection.wait([p.sentinel for p in self._procs.values() if p.exitcode is None],
                                            timeout=0.5)
            for key, p in list(self._procs.items()):
                if p.exitcode is not None and key not in self._exits:
                    self._exits.add(key)
                    self._exited(*key, p.exitcode)
            if self._finished and deadline is None:
                deadline = time.monotonic() + self.grace_s
            if deadline is not None and time.monotonic() > deadline:
                self._send(signal.SIGKILL)

    def _exited(self, uid: int, index: int, code: int) -> None:
        """A process of replica ``uid`` ended: the replica ended when all of them did, or when one
        failed (the others are then killed: without it their model is incomplete)."""
        self.events({"event": "exit", "uid": uid, "index": index, "code": code, "time": time.time()})
        if uid in self.codes:
            return  # the replica ended already (this process was killed with it)
        mine = [p for (u, _), p in self._procs.items() if u == uid]
        if code == 0 and any(p.exitcode is None for p in mine):
            return  # finished; the replica is done once all of its processes are
        if code != 0 and not self._signals:  # (after a signal, each stops on its own after the step)
            self._send(signal.SIGKILL, mine)
        self._ended(uid, code)

    def _ended(self, uid: int, code: int) -> None:
        self.codes[uid] = code
        if code == 0:
            self._finished = True
            self._store.set("heal/done", "1")
            return
        self._store.set(f"heal/dead/{uid}", str(code))
        if uid == self._standby:  # the standby itself failed: nothing to wake any more
            self._standby = None
        elif not self._finished and not self._signals:
            if all(self.codes.get(m, 0) != 0 for m in self._members()):  # no replica holds the state
                raise ReplicasFailed(f"every replica of the last epoch died (exit codes by uid: "
                                     f"{self.codes}); none holds the state a replacement would take")
            self._replace()

    def _members(self) -> list[int]:
        """The members of the newest epoch the replicas agreed on (epoch 0: the first ``replicas``)."""
        number = 0
        while self._store.check([f"heal/epoch/{number + 1}"]):
            number += 1
        if number == 0:
            return list(range(self.replicas))
        return [int(u) for u in json.loads(self._store.get(f"heal/epoch/{number}"))["members"]]

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals.append(signum)
        self._send(signum if len(self._signals) == 1 else signal.SIGKILL)

    def _send(self, sig: int, procs: list[multiprocessing.process.BaseProcess] | None = None) -> None:
        """``sig`` to ``procs`` (default: every process) that are still running."""
        for p in self._procs.values() if procs is None else procs:
            if p.exitcode is None and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, sig)
