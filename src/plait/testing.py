"""A pool of persistent Gloo ranks for tests: spawn once per module, run many functions.

Spawning a process and importing torch costs seconds, so each test module starts one pool per
world size and sends it picklable top-level functions. Every rank runs the same function
(SPMD) and the pool returns the per-rank results in rank order, or raises `RankFailure` with
every failing rank's traceback. A pool whose ranks disagreed (some failed, others did not) is
restarted, because the survivors may be stuck inside a collective.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from plait.launch import free_port, set_rank_env

__all__ = ["RankPool", "RankFailure", "cached_mesh"]

_mesh_cache: dict[tuple[int, ...], Any] = {}


def cached_mesh(pp: int = 1, dp: int = 1, fsdp: int = 1, tp: int = 1):
    """A `plait.Mesh` reused across tasks in one worker (process groups are costly to make)."""
    from plait.mesh import Mesh

    key = (pp, dp, fsdp, tp)
    if key not in _mesh_cache:
        _mesh_cache[key] = Mesh(pp=pp, dp=dp, fsdp=fsdp, tp=tp)
    return _mesh_cache[key]


class RankFailure(RuntimeError):
    def __init__(self, errors: dict[int, str]) -> None:
        self.errors = errors
        body = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        super().__init__(f"{len(errors)} rank(s) failed:\n{body}")


def _worker(rank: int, world: int, port: int, tasks: Any, results: Any, timeout_s: float) -> None:
    set_rank_env(rank, world, port, threads=1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import plait

    plait.init(timeout_s=timeout_s)
    while True:
        item = tasks.get()
        if item is None:
            return
        fn, args, kwargs = pickle.loads(item)
        try:
            from plait import comm

            comm.reset_stats()
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException as e:  # report everything, keep serving
            results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class RankPool:
    def __init__(self, world_size: int, timeout_s: float = 120.0) -> None:
        self.world_size, self.timeout_s = world_size, timeout_s
        self._procs: list[Any] = []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, self.world_size, port, self._tasks[r], self._results, self.timeout_s))
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        # Pickle here, not in the queue's feeder thread, so an unpicklable task fails at once.
        payload = pickle.dumps((fn, args, kwargs))
        for q in self._tasks:
            q.put(payload)
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        try:
            for _ in range(self.world_size):
                rank, ok, value = self._results.get(timeout=self.timeout_s + 30)
                (out if ok else errors)[rank] = value
        except queue.Empty:
            self.restart()
            missing = sorted(set(range(self.world_size)) - set(out) - set(errors))
            raise RankFailure({**errors, **{r: "no answer (hung or died)" for r in missing}}) from None
        if errors:
            if out:  # ranks disagreed: survivors may have left collectives half-done
                self.restart()
            raise RankFailure(errors)
        return [out[r] for r in range(self.world_size)]

    def errors(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[int, str]:
        """Run ``fn`` expecting every rank to raise; return each rank's error text."""
        try:
            self.run(fn, *args, **kwargs)
        except RankFailure as e:
            return e.errors
        raise AssertionError(f"{getattr(fn, '__name__', fn)} was expected to raise on every rank")

    def restart(self) -> None:
        self.close()
        self._start()

    def close(self) -> None:
        for q in self._tasks:
            with contextlib.suppress(OSError, ValueError):
                q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self._procs = []
