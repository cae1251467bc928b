"""Shared fixtures: one persistent pool of Gloo ranks per world size, per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from plait.testing import RankPool


@pytest.fixture(scope="module")
def pools() -> Iterator[dict[int, RankPool]]:
    """``pools[n]`` starts an n-rank pool on first use and closes it after the module."""
    made: dict[int, RankPool] = {}

    class _Lazy(dict):
        def __missing__(self, n: int) -> RankPool:
            made[n] = RankPool(n)
            self[n] = made[n]
            return made[n]

    yield _Lazy()
    for pool in made.values():
        pool.close()


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> list[float]:
    """Per-step losses of the single-process run that every layout must reproduce."""
    from oracle import train_losses

    return train_losses(str(tmp_path_factory.mktemp("single")), strategy="none", nproc=1)
