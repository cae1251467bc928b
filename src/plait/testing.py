"""A pool of persistent Gloo ranks for tests: spawn once per module, run many functions.

Spawning a process and importing torch costs seconds, so each test module starts one pool per
world size and sends it picklable top-level functions. Every rank runs the same function
(SPMD) and the pool returns the per-rank results in rank order, or raises `RankFailure` with
every failing rank's traceback. A pool whose ranks disagreed (some failed, others did not) is
restarted, because the survivors may be stuck inside a collective, and so is a pool with a rank
that died or stayed silent past its deadline (its error then gives that rank's thread stacks).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.overrides import TorchFunctionMode

from plait._torch_compat import caller_frame, default_store
from plait.runtime.env import free_port, set_rank_env

__all__ = ["RankPool", "RankFailure", "cached_mesh", "DeviceAudit"]

_mesh_cache: dict[tuple[int, ...], Any] = {}


def cached_mesh(pp: int = 1, dp: int = 1, fsdp: int = 1, tp: int = 1, cp: int = 1, ep: int = 1):
    """A `plait.Mesh` reused across tasks in one worker (process groups are costly to make)."""
    from plait.runtime.mesh import Mesh

    key = (pp, dp, fsdp, tp, cp, ep)
    if key not in _mesh_cache:
        _mesh_cache[key] = Mesh(pp=pp, dp=dp, fsdp=fsdp, tp=tp, cp=cp, ep=ep)
    return _mesh_cache[key]


class DeviceAudit(TorchFunctionMode):
    """Marks tensors that plait's library makes with a factory and no ``device=``.

    On a CPU-only machine every tensor is on the CPU, so a bookkeeping tensor made without a
    device (``torch.tensor([loss])``) looks right, and fails only on NCCL, which carries device
    tensors. Under this mode such tensors carry where they were made (``_plait_made_without_device``), and
    `plait.comm` refuses them as it would refuse a CPU tensor on a GPU group. Tensors made by
    models, tests or torch itself are left alone: only plait's parallel code is audited.
    """

    _FACTORIES = frozenset({torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full,
                            torch.arange, torch.rand, torch.randn, torch.randint})

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Under torch.compile the audit stays out of the graph (it walks frames, which Dynamo
        # cannot trace): a compiled region's factories are left unmarked.
        if torch.compiler.is_compiling():
            return out
        if func in self._FACTORIES and kwargs.get("device") is None and isinstance(out, torch.Tensor):
            site = _plait_library_caller()
            if site is not None:
                out._plait_made_without_device = site  # type: ignore[attr-defined]
        return out


def _plait_library_caller() -> str | None:
    """file:line of the caller when it is plait's parallel code (not its models or apps)."""
    import plait

    root = os.path.dirname(os.path.abspath(plait.__file__))
    frame: FrameType | None = caller_frame(2)
    while frame is not None and frame.f_code.co_filename.startswith(os.path.dirname(torch.__file__)):
        frame = frame.f_back
    if frame is None:
        return None
    path = frame.f_code.co_filename
    if not path.startswith(root) or os.sep + "models" + os.sep in path or path.endswith("testing.py"):
        return None
    return f"{os.path.relpath(path, root)}:{frame.f_lineno}"


class RankFailure(RuntimeError):
    """Some ranks raised or died; ``errors`` has their tracebacks, ``results`` the others' values."""

    def __init__(self, errors: dict[int, str], results: dict[int, Any] | None = None) -> None:
        self.errors, self.results = errors, results or {}
        body = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        super().__init__(f"{len(errors)} rank(s) failed:\n{body}")


def _unpicklable(value: Any) -> str:
    """Which entries of a dict result cannot be pickled (an empty string for other results)."""
    if not isinstance(value, dict):
        return ""
    bad = []
    for k, v in value.items():
        try:
            pickle.dumps(v)
        except Exception:
            bad.append(repr(k))
    return f" (its entries {', '.join(bad)})" if bad else ""


def _worker(rank: int, world: int, port: int, tasks: Any, results: Any, timeout_s: float,
            run_dir: str, desync_check: str, device_audit: bool = True) -> None:
    set_rank_env(rank, world, port, threads=1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A rank the pool finds silent past its deadline is asked for its stacks (SIGUSR1) before it is
    # killed, so a hang names where every thread was rather than only that it happened.
    stacks = open(_stacks_path(run_dir, rank), "a")  # noqa: SIM115 (open for the process's life)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    import plait

    # Gloo on CPU, pinned: on a CUDA host the default would be NCCL, and CPU models with it fail.
    plait.init(timeout_s=timeout_s, backend="gloo", run_dir=run_dir, desync_check=desync_check)
    between_tasks = _StoreBarrier(world)
    if device_audit:  # for the worker's life: every task's collectives are audited
        DeviceAudit().__enter__()
    while True:
        item = tasks.get()
        if item is None:
            return
        fn, args, kwargs = pickle.loads(item)
        from plait.runtime import comm

        mark = len(comm.created_groups())
        try:
            value = fn(*args, **kwargs)
            if desync_check == "off":  # every collective of the task matched on every rank
                comm.verify_history()
        except BaseException as e:  # report everything, keep serving
            from plait.runtime.env import mark_failed

            # Its peers may be inside a collective it left: at exit, skip the goodbye barriers.
            mark_failed()
            results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            _release_groups(mark, finished=False, barrier=between_tasks)
            results.put((rank, None, b""))  # idle: the task's groups are gone, nothing in flight
        else:
            # Pickled here, by value: the queue's feeder thread would drop an answer it cannot
            # pickle (torch's shared-memory reductions of tensors can fail) and leave the caller
            # waiting out the timeout.
            try:
                answer = pickle.dumps(value)
            except Exception as e:
                results.put((rank, False, f"the task's result cannot be pickled{_unpicklable(value)}: "
                                          f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            else:
                results.put((rank, True, answer))
            _release_groups(mark, finished=True, barrier=between_tasks)
            results.put((rank, None, b""))  # idle: the task's groups are gone, nothing in flight


class _StoreBarrier:
    """Where a pool's ranks meet after each task they all finished: through the default group's
    key-value store, not a Gloo collective. On torch 2.6 a Gloo barrier there (on the default group,
    and on a group of the pool's own alike) was now and then passed by one rank and never by its
    peer, which then served no further task; the store's counter has no such state to lose."""

    def __init__(self, world: int) -> None:
        self.store, self.world, self.met = default_store(), world, 0

    def wait(self) -> None:
        self.met += 1  # the same count on every rank: each meets here after the same tasks
        key = f"plait/pool/after-task/{self.met}"
        if self.store.add(key, 1) == self.world:
            self.store.set(f"{key}/all", "1")
        self.store.wait([f"{key}/all"])


def _stacks_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"stacks-rank{rank}.txt")


def _release_groups(mark: int, finished: bool, barrier: _StoreBarrier) -> None:
    """Destroy the groups a task made (but `cached_mesh`'s), so a pool that serves many tasks (and
    test modules) holds only its default group and cached meshes between them: every Gloo group
    keeps threads and connections alive.
    After a task that finished on this rank, a barrier first (``barrier``, through the store): no
    peer may still be inside the task's last collective. After a failure there is no
    barrier (a peer may never reach it); the pool restarts unless every rank failed, so a rank
    left waiting in that barrier is killed.
    The result is sent before all this: the parent does not wait for the cleanup."""

    from plait.runtime import comm

    kept = {id(g) for mesh in _mesh_cache.values() for g in mesh.own_groups()}  # `cached_mesh`'s
    made = [g for g in comm.created_groups()[mark:] if id(g) not in kept and comm.is_registered(g)]
    if finished:  # on every rank, whether or not it holds groups to destroy (ranks differ in that)
        barrier.wait()
    for pg in reversed(made):
        comm.destroy_group(pg)


def _rank_context() -> Any:
    """Where the ranks come from: forked from a server process that has imported torch and plait
    once (``forkserver``), so a rank starts in a fraction of a second instead of importing torch
    itself; a fresh interpreter per rank (``spawn``) where there is no forkserver. Either way a
    rank never inherits the caller's threads or process groups."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "plait", "plait.testing"])
    return ctx


class RankPool:
    """``world_size`` spawned Gloo ranks serving tasks; ``timeout_s`` is their `plait.init` timeout.

    Flight records of failed collectives go to ``run_dir`` (default: a fresh temporary folder).
    ``desync_check`` is the ranks' `plait.init` mode; with ``"off"``, each task that returns ends
    with `plait.comm.verify_history` on every rank: every collective it made matched on every
    rank, so the per-call check would have passed, at no round trip per collective.
    `pause` stops an idle pool's ranks (SIGSTOP) until its next `run`: a suite with several pools
    then spends no CPU on the ones waiting (each Gloo group keeps a thread that wakes many times a
    second).
    A rank silent ``answer_grace_s`` past its timeout counts as hung: its error gives its threads'
    stacks, and the pool starts afresh, as it does after a rank died.
    ``device_audit=False`` leaves out `DeviceAudit`, for benchmarks: its torch-function mode taxes
    every Python-level torch call, which a user's program never pays, and a wrapper's Python side
    more than torch's C++ one.
    """

    def __init__(self, world_size: int, timeout_s: float = 120.0, run_dir: str | None = None,
                 desync_check: str = "fast", device_audit: bool = True, answer_grace_s: float = 30.0) -> None:
        self.world_size, self.timeout_s, self.desync_check = world_size, timeout_s, desync_check
        self.answer_grace_s = answer_grace_s
        self.device_audit = device_audit
        self.run_dir = run_dir or tempfile.mkdtemp(prefix="plait-pool-")
        self._procs: list[Any] = []
        self._start()

    def _start(self) -> None:
        ctx = _rank_context()
        port = free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, self.world_size, port, self._tasks[r], self._results, self.timeout_s,
                              self.run_dir, self.desync_check, self.device_audit))
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._cleaning = [0] * self.world_size  # tasks each rank has not yet cleaned up after
        self._paused = False

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        # Pickle here, not in the queue's feeder thread, so an unpicklable task fails at once.
        payload = pickle.dumps((fn, args, kwargs))
        self.resume()
        for r, q in enumerate(self._tasks):
            self._cleaning[r] += 1
            q.put(payload)
        out, errors, silent = self._collect()
        if errors:
            # Survivors may have left collectives half-done, and a rank that died or hung serves
            # nothing more: only a task every rank raised from leaves the pool fit to reuse.
            if out or silent:
                self.restart()
            raise RankFailure(errors, out)
        return [out[r] for r in range(self.world_size)]

    def _collect(self) -> tuple[dict[int, Any], dict[int, str], bool]:
        """Every rank's answer; a rank that died, or is silent past the timeout, is an error (then
        the last value is True)."""
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        silent = False
        deadline = time.monotonic() + self.timeout_s + self.answer_grace_s
        while len(out) + len(errors) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=0.5)
                if ok is None:
                    self._cleaning[rank] -= 1
                else:
                    (out if ok else errors)[rank] = pickle.loads(value) if ok else value
                continue
            except queue.Empty:
                pass
            waiting = [r for r in range(self.world_size) if r not in out and r not in errors]
            dead = [r for r in waiting if not self._procs[r].is_alive()]
            for r in dead:
                errors[r], silent = "died", True
            if dead:  # the others get a moment to answer, then count as hung with it
                deadline = min(deadline, time.monotonic() + 3)
            if time.monotonic() > deadline:
                hung = [r for r in waiting if r not in errors]
                errors.update({r: f"no answer (hung); its threads' stacks:\n{stack}"
                               for r, stack in self._stacks(hung).items()})
                silent = True
        return out, errors, silent

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """Where each of ``ranks`` is stuck: the stacks it writes when sent SIGUSR1."""
        sizes = {}
        for r in ranks:
            path = _stacks_path(self.run_dir, r)
            sizes[r] = os.path.getsize(path) if os.path.exists(path) else 0
        self._signal(signal.SIGUSR1, ranks)
        time.sleep(1.0)
        out = {}
        for r in ranks:
            try:
                with open(_stacks_path(self.run_dir, r)) as f:
                    f.seek(sizes[r])
                    out[r] = f.read() or "(none written)"
            except OSError as e:
                out[r] = f"(none: {e})"
        return out

    def pause(self, wait_s: float = 10.0) -> None:
        """Stop the ranks until the next `run`, once each has cleaned up after its last task (a rank
        stopped inside a collective would time out when woken). A rank that does not get there
        within ``wait_s`` leaves the pool running."""
        if self._paused or not self._procs:
            return
        alive = [r for r, p in enumerate(self._procs) if p.is_alive()]
        deadline = time.monotonic() + wait_s
        while any(self._cleaning[r] for r in alive):
            try:
                rank, ok, _ = self._results.get(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    return
                continue
            if ok is None:
                self._cleaning[rank] -= 1
        self._signal(signal.SIGSTOP, alive)
        self._paused = True

    def resume(self) -> None:
        if self._paused:
            self._signal(signal.SIGCONT, range(len(self._procs)))
            self._paused = False

    def _signal(self, sig: signal.Signals, ranks: Any) -> None:
        for r in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._procs[r].pid, sig)

    def pids(self) -> list[int]:
        """The ranks' process ids, in rank order (tests freeze or kill one)."""
        return [p.pid for p in self._procs]

    def errors(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[int, str]:
        """Run ``fn`` expecting every rank to raise; return each rank's error text."""
        name = getattr(fn, "__name__", fn)
        try:
            self.run(fn, *args, **kwargs)
        except RankFailure as e:
            calm = sorted(e.results)
            if calm:  # an error the other ranks never saw is not "refused on every rank"
                raise AssertionError(f"{name} was expected to raise on every rank; ranks {calm} returned "
                                     f"normally:\n{e}") from e
            return e.errors
        raise AssertionError(f"{name} was expected to raise on every rank")

    def restart(self) -> None:
        """Kill the ranks and start afresh: survivors of a failed task may be waiting on a peer
        that will never answer, so an orderly exit would only wait for a timeout."""
        self.kill()
        self._start()

    def kill(self) -> None:
        """End the ranks at once (SIGKILL) and reap them: no rank is left waiting on a peer, and
        none spends its exit barriers and teardown (about a CPU second each) when nothing checks
        how it exits."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        self.close()  # reaps them (dead already, so at once)

    def close(self) -> None:
        self.resume()
        for q in self._tasks:
            with contextlib.suppress(OSError, ValueError):
                q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self._procs = []
