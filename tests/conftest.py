"""Shared fixtures: one persistent pool of Gloo ranks per world size, for the whole session.

Starting a pool costs every rank an interpreter, torch's import and a rendezvous: seconds each
on two cores, paid once per world size rather than once per module. A pool's ranks hold only
their default group between tasks (each task's groups are destroyed when it ends, see
`plait.testing`), and meshes that `plait.testing.cached_mesh` keeps.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from plait.testing import RankPool


@pytest.fixture(scope="session")
def pools() -> Iterator[dict[int, RankPool]]:
    """``pools[n]`` starts an n-rank pool on first use and closes it at the end of the session.

    Its ranks compare each group's whole history once at the end of every task
    (`plait.comm.verify_history`) rather than before every collective: the same verdict on
    every call (no layout trips the check), without a round trip per collective that made
    the multi-rank tests a fifth slower. The per-call check itself is tested by test_failures'
    pool and by every job the suite launches (`plait train`, `plait check`), which run as users
    do."""
    made: dict[int, RankPool] = {}

    class _Lazy(dict):
        def __missing__(self, n: int) -> RankPool:
            made[n] = RankPool(n, desync_check="off")
            self[n] = made[n]
            return made[n]

    yield _Lazy()
    # Killed, not closed: nothing checks how the pool's ranks exit (`test_exit` tests plait's exit
    # on processes of its own), and an orderly exit costs each rank about a CPU second.
    for pool in made.values():
        pool.kill()


@pytest.fixture(autouse=True)
def _idle_pools_stopped(pools) -> Iterator[None]:
    """Each test starts with every pool stopped; a pool wakes when the test runs a task on it. The
    pools a test does not use then take no CPU from it (its own ranks, its subprocesses)."""
    for pool in list(pools.values()):
        pool.pause()
    yield


# Threads a pool rank may hold before its pool is started afresh. Each Gloo group keeps a thread
# that wakes many times a second; a rank holds its default group's few between tasks, but a group
# something still references after its task destroyed it (a model freed later, state kept in
# C++) keeps its thread, and mid-suite a 4-rank pool once held 72 of them per rank: the idle
# pools then took a third of this 2-core machine from the tests that ran.
MAX_GLOO_THREADS = 32


def gloo_threads() -> int:
    """Gloo's event-loop threads in this process (run on a pool's ranks)."""
    import glob

    names = glob.glob(f"/proc/{os.getpid()}/task/*/comm")
    return sum(open(n).read().strip() == "gloo_tcp_loop" for n in names)


@pytest.fixture(autouse=True, scope="module")
def _bounded_pools(pools) -> Iterator[None]:
    """After each module, a pool whose ranks hold more than `MAX_GLOO_THREADS` restarts."""
    yield
    if not os.path.isdir("/proc/self/task"):
        return
    for pool in list(pools.values()):
        if max(pool.run(gloo_threads)) > MAX_GLOO_THREADS:
            pool.restart()


@pytest.fixture(scope="session")
def oracle(tmp_path_factory) -> list[float]:
    """Per-step losses of the single-process run that every layout must reproduce: seeded, so one
    run serves every module."""
    from oracle import train_losses

    return train_losses(str(tmp_path_factory.mktemp("single")), strategy="none", nproc=1)
