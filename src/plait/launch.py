"""Spawn local ranks: used by `plait train` (when not under torchrun), tests and benchmarks."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["free_port", "spawn", "set_rank_env"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_rank_env(rank: int, world_size: int, port: int, threads: int | None = None) -> None:
    """Set the torchrun-style variables that `plait.init()` reads, in this (child) process."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


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
