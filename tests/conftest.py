"""Shared fixtures: one persistent pool of Gloo ranks per world size, for the whole session.

Starting a pool costs every rank an interpreter, torch's import and a rendezvous: seconds each
on two cores, paid once per world size rather than once per module. A pool's ranks hold only
their default group between tasks (each task's groups are destroyed when it ends, see
`plait.testing`), and meshes that `plait.testing.cached_mesh` keeps.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import pytest

from plait.testing import RankPool


@pytest.fixture(scope="session")
def pools() -> Iterator[dict[int, RankPool]]:
    """``pools[n]`` starts an n-rank pool on first use and closes it at the end of the session."""
    made: dict[int, RankPool] = {}

    class _Lazy(dict):
        def __missing__(self, n: int) -> RankPool:
            made[n] = RankPool(n)
            self[n] = made[n]
            return made[n]

    yield _Lazy()
    for pool in made.values():
        _discard(pool)


def _discard(pool: RankPool) -> None:
    """Close a pool whose session is done by killing its ranks. An orderly exit spends about a CPU
    second per rank (exit barriers on every group, the groups torn down, the interpreter finalized)
    and nothing checks how the pool's ranks exit: `test_exit` tests plait's exit on processes of
    its own. Killed together, no rank is left waiting on a peer."""
    for pid in pool.pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    pool.close()  # reaps them (dead already, so at once)


@pytest.fixture(scope="session")
def oracle(tmp_path_factory) -> list[float]:
    """Per-step losses of the single-process run that every layout must reproduce: seeded, so one
    run serves every module."""
    from oracle import train_losses

    return train_losses(str(tmp_path_factory.mktemp("single")), strategy="none", nproc=1)
