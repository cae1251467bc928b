"""comm's side of a dry run (`plait.runtime.env.dry_run`): one process rehearses one rank of a large world.

While a `DryRun` is entered, groups are made on the meta device without desync checks (the fake
backend moves nothing, so there is nothing to compare), this process's real groups, settings and
open counters are put aside, and the small objects a rank sends (`plait.comm.send_object`: a
pipeline stage's output shapes) are kept in a mailbox shared by the rehearsals of every rank, where
the rehearsal of their destination receives them. Nothing moves between processes.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.runtime.comm import groups, stats

Mailbox = dict[tuple[int, int], list[Any]]  # (source, destination) -> the objects sent, in order


class MailNotSent(RuntimeError):
    """A dry run's `recv_object` of an object its sender's dry run has not sent yet: rehearse the
    sender, then this rank again (a pipeline whose stages alternate between ranks needs rounds)."""


_current: DryRun | None = None


def current() -> DryRun | None:
    """The dry run entered now in this process, or None."""
    return _current


class DryRun:
    """``with comm.DryRun(mailbox):``: meta-device groups without desync checks, no counting,
    objects sent kept in ``mailbox`` for the rehearsal of their destination; on exit this
    process's real groups, settings and counters are back."""

    def __init__(self, mailbox: Mailbox | None = None) -> None:
        self.mailbox: Mailbox = {} if mailbox is None else mailbox
        # How many objects this rehearsal has sent or received so far per (direction, src, dst).
        self._counts: dict[tuple[str, int, int], int] = {}
        self._outer: tuple[DryRun | None, groups.SetAside, list[stats.CommStats]] | None = None

    def __enter__(self) -> DryRun:
        global _current
        if self._outer is not None:
            raise RuntimeError("comm.DryRun: entered already")
        self._outer = (_current, groups.set_aside(), stats.set_aside())
        groups.configure(desync_check="off", device=torch.device("meta"))
        _current = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _current
        assert self._outer is not None
        (_current, saved, counters), self._outer = self._outer, None
        groups.restore(saved)
        stats.restore(counters)

    def _next(self, key: tuple[str, int, int]) -> int:
        self._counts[key] = self._counts.get(key, -1) + 1
        return self._counts[key]

    def send(self, obj: Any, src: int, dst: int) -> None:
        """Keep ``obj`` for the rehearsal of rank ``dst``; a rank rehearsed again sends the same
        objects again, and they are kept once."""
        sent, i = self.mailbox.setdefault((src, dst), []), self._next(("send", src, dst))
        if i == len(sent):
            sent.append(obj)

    def recv(self, src: int, dst: int) -> Any:
        """The next object rank ``src``'s rehearsal sent to ``dst``; `MailNotSent` when it has not
        been rehearsed that far."""
        sent, i = self.mailbox.get((src, dst), []), self._next(("recv", src, dst))
        if i >= len(sent):
            raise MailNotSent(f"dry run of rank {dst}: rank {src} has not sent it object {i + 1} "
                              f"yet; rehearse rank {src} (with the same mailbox) first")
        return sent[i]
