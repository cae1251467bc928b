"""Process-group set-up: the only place in plait that reads the environment.

`init()` understands three launch styles:

* torchrun / `plait run` / `plait train` spawning: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
  MASTER_PORT;
* Slurm (`srun`): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and the first host of
  SLURM_NODELIST (MASTER_PORT if set, else 29500), in a task of a job step (SLURM_STEP_ID);
* neither: one process, world size 1, with an in-memory store. A shell inside a Slurm
  allocation (salloc, or a batch script) that is not a task of `srun` has the job's variables
  but no step: it runs as one process too, with a note saying so, instead of waiting for
  SLURM_NTASKS - 1 peers that were never started.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as _dt
import gc
import logging
import os
import random
import re
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from plait._torch_compat import register_fake_backend
from plait.runtime import comm

DEFAULT_TIMEOUT_S = 300.0
_THREAD_JOIN_S = 2.0  # at exit, for each plait thread still running (daemon threads may be blocked)
_state: dict[str, object] = {}


@dataclass(frozen=True)
class Launch:
    """Where this process sits in the job, as read from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "single"
    note: str = ""  # why a Slurm allocation's variables were not taken for a launch
    # torchrun's restart of the job (0: its first attempt), when its agent hosts the store the
    # ranks meet through; None otherwise.
    attempt: int | None = None


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm nodelist such as ``node[003-005,9],gpu1`` -> ``node003``."""
    match = re.match(r"([^\[,]+)(\[([^\]]+)\])?", nodelist)
    if match is None:
        raise ValueError(f"cannot parse SLURM_NODELIST={nodelist!r}")
    prefix, bracket = match.group(1), match.group(3)
    if bracket is None:
        return prefix
    first = bracket.split(",")[0].split("-")[0]
    return prefix + first


# Job-step ids of a batch script and of the allocation's own "extern" step: not `srun` tasks.
_NOT_SRUN_STEPS = ("batch", "extern", "4294967291", "4294967292", "4294967293", "4294967294")


def _srun_task(env: Any) -> bool:
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    in_step = step is not None and step not in _NOT_SRUN_STEPS
    return "SLURM_PROCID" in env and "SLURM_NTASKS" in env and in_step


def launch_from_env(environ: dict[str, str] | None = None) -> Launch:
    """Read the torchrun or Slurm variables; a single process when neither is set."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return Launch(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
            source="torchrun",
            attempt=(int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
                     if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else None),
        )
    if _srun_task(env):
        nodelist = env.get("SLURM_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        return Launch(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            master_addr=env.get("MASTER_ADDR", _first_slurm_host(nodelist)),
            master_port=int(env.get("MASTER_PORT", "29500")),
            source="slurm",
        )
    note = ""
    if any(k in env for k in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID")):
        job, tasks = env.get("SLURM_JOB_ID", "?"), env.get("SLURM_NTASKS", "?")
        note = (f"Slurm job {job} with {tasks} tasks, but this process is not a task of srun (no "
                "SLURM_STEP_ID): it runs on its own; start it with srun for one rank per Slurm task")
    return Launch(0, 1, 0, "127.0.0.1", 0, "single", note)


def _attempt_store(launch: Launch, timeout: _dt.timedelta) -> dist.Store:
    """The store of torchrun's agent, its keys under this restart's own prefix.

    The agent keeps one store for the whole job, and the default group's keys (each rank's
    address) are the same names on every attempt: after a restart (``--max-restarts``), the new
    ranks read the dead ones' addresses and never connect (seen with torch 2.13 and Gloo, under
    the static and the c10d rendezvous alike). A prefix per attempt keeps each one's keys apart.
    The count is each launcher's own, so it names one attempt only while all nodes restart
    together (a node started again alone counts from 0 while the survivors count from 1);
    ``plait run`` keeps the c10d rendezvous's ranks off this store, each round getting its own
    (``plait.app.run.NO_SHARED_STORE``).
    """
    agent = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"plait/attempt_{launch.attempt}", agent)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy (if present) and torch (CPU and every CUDA device)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is optional
        pass


def init(
    seed: int = 0,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str | None = None,
    log_level: int = logging.INFO,
    desync_check: str = "fast",
    run_dir: str = "runs",
) -> torch.device:
    """Set up torch.distributed's default process group and return this rank's device.

    Idempotent: a second call returns the same device and changes nothing (an already
    initialised default group, e.g. made by the user, is adopted as it is). Picks cuda+nccl
    with one device per local rank when CUDA is available, else cpu+gloo. ``timeout_s`` bounds
    every collective on every group plait makes, so a rank that never arrives produces an error
    naming it instead of a hang. ``desync_check`` ("fast", "full" or "off") chooses how ranks
    compare their collectives before running them (`plait.comm`); ``run_dir`` is where a rank
    writes its flight record (its last collectives) when one fails.
    """
    if "launch" in _state:  # set last, once everything succeeded
        return _state["device"]  # type: ignore[return-value]
    if not timeout_s > 0:
        raise ValueError(f"init(timeout_s=...) must be positive, got {timeout_s}")
    comm.configure(desync_check=desync_check, run_dir=run_dir)
    launch = launch_from_env()
    use_cuda = torch.cuda.is_available() and backend in (None, "nccl")
    backend = backend or ("nccl" if use_cuda else "gloo")
    if use_cuda:
        dev = torch.device("cuda", launch.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    timeout = _dt.timedelta(seconds=timeout_s)
    _state.update(timeout_s=timeout_s, device=dev)
    comm.configure(timeout_s=timeout_s, device=dev)  # groups made below take this timeout and device
    if not dist.is_initialized():
        if launch.source == "single":
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        elif launch.attempt is not None:
            dist.init_process_group(backend, store=_attempt_store(launch, timeout), rank=launch.rank,
                                    world_size=launch.world_size, timeout=timeout)
        else:
            os.environ.setdefault("MASTER_ADDR", launch.master_addr)
            os.environ.setdefault("MASTER_PORT", str(launch.master_port))
            dist.init_process_group(
                backend,
                init_method="env://",
                rank=launch.rank,
                world_size=launch.world_size,
                timeout=timeout,
            )
        # Tear the group down before interpreter shutdown: a Gloo group whose threads are
        # still alive when the process exits can abort ("terminate called ...") at random.
        atexit.register(_shutdown)
    if dist.get_world_size() > 1:  # the default group's companion for desync checks (`comm.new_group`)
        ranks = list(range(dist.get_world_size()))
        desync_group = dist.new_group(ranks, timeout=timeout, backend="gloo")
        world = dist.group.WORLD
        assert world is not None  # set by init_process_group
        comm.register_group(world, "world", ranks, desync_group=desync_group)
    seed_everything(seed)
    _configure_logging(log_level)
    if launch.note:
        get_logger("plait.runtime.env").warning("%s", launch.note)
    _state.update(launch=launch)
    return dev


def mark_failed() -> None:
    """Note that this process is exiting on an error, so its shutdown skips the exit barrier
    (a peer may be inside a collective this rank will never join)."""
    _state["failed"] = True


def _shutdown() -> None:
    """Tear every process group down while the interpreter is still whole (registered by `init`).

    Gloo runs each group's collectives on C++ worker threads that live as long as the group
    object. A worker frees a finished collective's tensors a moment after the caller saw it
    complete, and that needs the GIL when Python no longer holds the tensors. If the process is
    already finalizing (the script ended right after its last collective), Python ends the
    worker with pthread_exit, whose unwinding through C++ aborts the process: "terminate called
    without an active exception", after the rank had finished. `dist.destroy_process_group`
    alone does not stop those threads while a `Mesh` or a wrapper still holds its groups.
    So, at exit, unless this process is failing (its peers may be inside a collective it will
    never join):

    1. a barrier on the default group, then on every Gloo group this rank belongs to, in
       creation order (the same on every rank, so they cannot deadlock): no rank destroys a
       group a peer is still using, a Gloo barrier first waits for the work still in flight on
       its group, and the round trips give the workers time, with the GIL free, to release the
       tensors of their last collectives;
    2. the groups plait created, newest first, then the default group with whatever is left;
       groups nothing refers to any more are freed, their threads joined;
    3. the threads plait started that are still alive, joined.
    """
    if dist.is_initialized():
        groups = comm.created_groups()
        failed = bool(_state.get("failed")) or getattr(sys, "last_value", None) is not None
        if not failed:
            try:
                # Plain torch barriers: comm's desync checks would talk on the groups being closed.
                dist.barrier()
                for pg in groups:  # NCCL groups: a barrier would build communicators never used
                    if dist.get_backend(pg) == "gloo" and dist.get_world_size(pg) > 1:
                        dist.barrier(group=pg)
            except Exception as e:  # a peer died: tear down anyway, without waiting for it
                logging.getLogger("plait.runtime.env").warning("exit barrier failed (%s); closing anyway", e)
        for pg in reversed(groups):
            with contextlib.suppress(ValueError):  # destroyed already, e.g. by the user
                dist.destroy_process_group(pg)
        dist.destroy_process_group()
        del groups
        gc.collect()
    for t in threading.enumerate():
        if t is not threading.current_thread() and t.name.startswith("plait-"):
            t.join(timeout=_THREAD_JOIN_S)
    _state.clear()


def device() -> torch.device:
    """The device `init()` chose (cpu when `init()` has not run; meta in a `dry_run`)."""
    return _state.get("device", torch.device("cpu"))  # type: ignore[return-value]


def is_dry_run() -> bool:
    """Inside `dry_run`: tensors on the meta device stand for materialized ones."""
    return device().type == "meta"


@contextlib.contextmanager
def dry_run(world_size: int, rank: int = 0,
            mailbox: dict[tuple[int, int], list[Any]] | None = None) -> Iterator[torch.device]:
    """Stand this one process in for ``rank`` of a world of ``world_size``, with nothing allocated.

    The default process group is torch's fake backend (every collective returns at once and moves
    nothing), plait's device is the meta device, and a meta tensor counts as materialized: a
    layout builds exactly as on that rank (the same groups, shards and wrappers, each collective
    counted by `plait.comm`), but every tensor is a shape. Collectives' values are not real, so
    only what does not depend on them can be trusted: shapes, bytes, counts. Objects a rank sends
    (`plait.comm.send_object`: a pipeline stage's output shapes) go to ``mailbox``, where the dry
    run of their destination, given the same mailbox, receives them. Refused when a process group
    exists already; everything is torn down on exit.
    """
    if dist.is_initialized():
        raise RuntimeError("plait.runtime.env.dry_run: a process group is initialised already; a dry run "
                           "makes its own fake one (run it in a process of its own)")
    if not (isinstance(world_size, int) and world_size >= 1 and 0 <= rank < world_size):
        raise ValueError(f"plait.runtime.env.dry_run: need world_size >= 1 and 0 <= rank < world_size, got "
                         f"world_size={world_size}, rank={rank}")
    register_fake_backend()
    saved = dict(_state)
    hook = sys.excepthook  # torch prefixes the rank to tracebacks for each group it starts: not ours
    meta = torch.device("meta")
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    _state.clear()
    _state.update(device=meta, timeout_s=DEFAULT_TIMEOUT_S)
    try:
        with comm.DryRun(mailbox):
            yield meta
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
        _state.clear()
        _state.update(saved)


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = dist.get_rank() if dist.is_initialized() else 0
        return True


def _configure_logging(level: int) -> None:
    logger = logging.getLogger("plait")
    if any(isinstance(f, _RankFilter) for h in logger.handlers for f in h.filters):
        return
    handler = logging.StreamHandler()
    handler.addFilter(_RankFilter())
    handler.setFormatter(logging.Formatter("[rank%(rank)s] %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


def get_logger(name: str = "plait", all_ranks: bool = False) -> logging.Logger | logging.LoggerAdapter:
    """A standard logger whose lines carry the rank; by default only rank 0 emits.

    ``all_ranks=True`` lets every rank log (useful for desync or per-rank memory reports).
    """
    logger = logging.getLogger(name if name.startswith("plait") else f"plait.{name}")
    if all_ranks or not dist.is_initialized() or dist.get_rank() == 0:
        return logger
    return logging.LoggerAdapter(_SILENT, {})


_SILENT = logging.getLogger("plait.silent")
_SILENT.addHandler(logging.NullHandler())
_SILENT.propagate = False
_SILENT.setLevel(logging.CRITICAL + 1)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent(sig: int, parent: int | None = None) -> None:
    """Have the kernel send ``sig`` to this process when the process that started it dies (Linux's
    ``PR_SET_PDEATHSIG``; elsewhere nothing): ranks and helper processes never outlive their
    launcher, however it ended. With ``parent`` (the launcher's pid), exit at once if it died before
    the request took effect."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # 1: PR_SET_PDEATHSIG, prctl(2)
    if parent is not None and os.getppid() != parent:
        raise SystemExit(128 + sig)


def set_rank_env(rank: int, world_size: int, port: int, threads: int | None = None) -> None:
    """Set the torchrun-style variables that `plait.init()` reads, in this (child) process."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
