"""Spawn local ranks: used by `plait train` (when not under torchrun), tests and benchmarks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from plait.env import free_port, set_rank_env

__all__ = ["spawn"]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, threads: int | None,
           args: tuple[Any, ...]) -> None:
    set_rank_env(rank, world_size, port, threads)
    try:
        fn(*args)
    except BaseException:
        from plait.env import mark_failed

        mark_failed()  # its peers may be mid-collective: exit without the exit barrier
        raise


def spawn(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = (),
          threads: int | None = None) -> None:
    """Run ``fn(*args)`` in ``nprocs`` fresh processes that each see torchrun-style env vars.

    Raises if any rank fails (torch.multiprocessing reports the failing rank's traceback).
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    port = free_port()
    mp.start_processes(_entry, args=(fn, nprocs, port, threads, args), nprocs=nprocs,
                       join=True, start_method="spawn")
