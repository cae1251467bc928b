"""`plait.check(...)`: check the arguments, start both sides of the check, return the report.

Outside a process group it spawns the layout's ranks on this machine (NCCL with a GPU each when
there are enough GPUs, else Gloo on the CPU) beside one process for the one-process run; inside a job
(torchrun, or any initialised process group) every rank calls it and rank 0 starts the
one-process run beside the job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from plait.check.common import CheckInputError, Exchange, Spec, load_factory, refuse_routing_in_half
from plait.check.layout import LayoutRun, tp_styles
from plait.check.report import CheckReport
from plait.compose.parallel_plan import ParallelPlan
from plait.compose.rules import LayoutError, check_layout
from plait.runtime import comm
from plait.runtime.env import die_with_parent, free_port, init, mark_failed, set_rank_env
from plait.runtime.mesh import AXES, Mesh

# Relative tolerances by dtype. float64 leaves room for reduction-order rounding (~1e-15) grown over
# a few steps and for float32 islands inside models (norms that cast to float32); layout bugs are
# far above. Other dtypes get their error budget (`plait.check.budget`).
DEFAULT_TOLERANCE = {torch.float64: 1e-9}
# A launcher's variables, which the one-process run must not see (it would join the job).
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")


def check(factory: Callable[[], Any] | str, plan: ParallelPlan | None = None, *, nproc: int | None = None,
          mesh: Mesh | Mapping[str, int] | None = None, steps: int = 5,
          dtype: torch.dtype | str = torch.float64,
          tolerance: float | None = None, batch_size: int = 8, seq: int = 16, vocab: int | None = None,
          lr: float = 0.1, seed: int = 0, activations: bool = True, timeout_s: float = 300.0) -> CheckReport:
    """Train ``factory``'s model in a layout and in one process from the same initial values on the
    same data, and compare them step by step.

    ``factory``: a function, or ``"package.module:function"``, returning a model or ``(model,
    make_batch, loss_fn)``: ``make_batch(step)`` returns a global batch ``(inputs, targets)`` with
    the batch on dim 0 (``inputs`` a tensor or a tuple of positional tensors), ``loss_fn(output,
    targets)`` a mean over the batch; None in either place keeps the default. With a model alone
    the batches are ``batch_size`` random sequences of ``seq`` token ids below ``vocab`` (default:
    the model's vocabulary) and the loss is next-token cross-entropy on the output's logits.

    ``plan``: the `ParallelPlan` (default: DDP, FSDP when ``mesh`` has fsdp > 1); with tp > 1 and
    no ``plan.tp``, the model's built-in plan (`plait.plan_for`), logits gathered. ``mesh``:
    degrees by axis (``{"tp": 2}``; ``"ep"``: expert parallelism folded out of the data axes), the
    data axis (fsdp under FSDP, else dp) taking the ranks left over, or inside a job a `plait.Mesh`
    to use (no new process groups). With cp > 1 each rank gets its tokens of every sequence
    (`plait.cp.shard` of every batch tensor with a dim 1), as `plait train` feeds them. Outside a process
    group ``nproc`` ranks (default 2) are spawned here; inside one, every rank calls this and the
    job's ranks are the layout's (a process alone in its group spawns ``nproc`` > 1 ranks).

    Both runs train with plain SGD at ``lr`` (the layout is measured, not the optimizer) for
    ``steps`` steps in ``dtype``. A tensor diverges when its difference relative to its largest
    value passes ``tolerance`` (default: `DEFAULT_TOLERANCE` in float64, else the dtype's error
    budget, `plait.check.budget`, which grows with the steps). ``activations=False``
    skips the comparison of module outputs (the culprit is then named from gradients only).
    Raises `CheckInputError` (a ValueError) on arguments, factories or layouts that cannot run.
    """
    given, degrees = (mesh, {**mesh.shape, "ep": mesh.ep}) if isinstance(mesh, Mesh) else (None, mesh)
    if given is not None and not dist.is_initialized():
        raise CheckInputError("check(mesh=plait.Mesh(...)): a Mesh belongs to a running job; outside one "
                              "give the degrees, e.g. mesh={'tp': 2}")
    spec = _make_spec(factory, plan, degrees, steps, dtype, tolerance, batch_size, seq, vocab, lr, seed,
                      activations)
    # A process alone in its group (`plait.init()` in a notebook or a script, a one-process `plait
    # train` before this) asked for more ranks is not a job of its own: they are spawned.
    alone = given is None and dist.is_initialized() and dist.get_world_size() == 1 and nproc not in (None, 1)
    if dist.is_initialized() and not alone:
        world = dist.get_world_size()
        if nproc is not None and nproc != world:
            raise CheckInputError(f"check(nproc={nproc}): this job already runs {world} ranks")
        return _in_job(_fit(spec, world), timeout_s, given)
    n = 2 if nproc is None else nproc
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise CheckInputError(f"check(nproc=...) must be an integer >= 1, got {nproc!r}")
    return _spawn(_fit(spec, n), n, timeout_s)


# ---------------------------------------------------------------------------- arguments


def _make_spec(factory: Callable[[], Any] | str, plan: ParallelPlan | None, mesh: Mapping[str, int] | None,
               steps: int, dtype: torch.dtype | str, tolerance: float | None, batch_size: int, seq: int,
               vocab: int | None, lr: float, seed: int, activations: bool) -> Spec:
    fn = load_factory(factory)  # a bad name fails here, before any process starts
    label = factory if isinstance(factory, str) else f"{fn.__module__}:{getattr(fn, '__qualname__', fn)}"
    sizes = {"steps": steps, "batch_size": batch_size, "seq": seq, "vocab": 1 if vocab is None else vocab}
    for name, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise CheckInputError(f"check({name}=...) must be an integer >= 1, got {v!r}")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise CheckInputError(f"check(lr=...) must be a finite number > 0, got {lr!r}")
    dt = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise CheckInputError(f"check(dtype=...) must be a floating dtype such as torch.float64 or "
                              f"'float32', got {dtype!r}")
    # Mixed precision computes in its low dtype whatever the masters' dtype: that dtype's budget.
    mixed = plan.precision if isinstance(plan, ParallelPlan) else None
    tol = (None if mixed is not None else DEFAULT_TOLERANCE.get(dt)) if tolerance is None else tolerance
    if tol is not None and not (isinstance(tol, (int, float)) and math.isfinite(tol) and tol > 0):
        raise CheckInputError(f"check(tolerance=...) must be a finite number > 0, got {tolerance!r}")
    degrees = dict(mesh or {})
    unknown = sorted(set(degrees) - {*AXES, "ep"})
    if unknown:
        raise CheckInputError(f"check(mesh=...): unknown axes {unknown}; the axes are {AXES}, and ep (expert "
                              "parallelism, folded out of the data axes)")
    if plan is None:
        plan = ParallelPlan(data="fsdp" if degrees.get("fsdp", 1) > 1 else "ddp", seed=seed)
    if not isinstance(plan, ParallelPlan):
        raise CheckInputError(f"check(plan=...) expects a plait.ParallelPlan, got {type(plan).__name__}")
    plan.validate()
    return Spec(factory, label, plan, degrees, steps, dt, None if tol is None else float(tol), batch_size,
                seq, vocab, float(lr), seed, activations)


def _fit(spec: Spec, world: int) -> Spec:
    """Resolve the mesh degrees for ``world`` ranks and check the batch and schedule against them."""
    plan, degrees = spec.plan, dict(spec.degrees)
    ep = degrees.pop("ep", 1)
    degrees.setdefault("fsdp" if plan.data == "fsdp" else "dp", -1)  # the data axis takes the rest
    given = ", ".join(f"{a}={d}" for a, d in degrees.items())
    bad = [a for a, d in degrees.items() if not isinstance(d, int) or (d < 1 and d != -1)]
    known = math.prod(d for d in degrees.values() if d != -1)
    if bad or list(degrees.values()).count(-1) > 1 or world % known:
        raise CheckInputError(f"check: the mesh {given} does not fit {world} ranks (degrees are integers "
                              ">= 1, at most one -1, and their product is the number of ranks)")
    full = {a: world // known if degrees.get(a) == -1 else degrees.get(a, 1) for a in AXES}
    if math.prod(full.values()) != world:
        raise CheckInputError(f"check: the mesh {given} has {math.prod(full.values())} ranks, not {world}")
    spec = dataclasses.replace(spec, degrees={**full, "ep": ep})
    _check_rules(spec)
    if spec.batch_size % (spec.data_size * spec.microbatches):
        raise CheckInputError(f"check: batch size {spec.batch_size} is not divisible by the data-parallel "
                              f"size {spec.data_size} x microbatches {spec.microbatches}")
    for what, obj in (("the factory", spec.factory), ("the plan", plan)):
        try:  # both travel to other processes
            pickle.dumps(obj)
        except Exception as e:  # noqa: BLE001 - any pickling failure means the same here
            raise CheckInputError(f"{what} must reach other processes by pickling: use top-level functions "
                                  f"or 'package.module:function': {e}") from None
    return spec


def _check_rules(spec: Spec) -> None:
    """`plait.compose.rules.check_layout` here, before any process starts: the factory's model built on the
    meta device (nothing allocated), the plan the ranks will use. A factory that cannot build on
    meta is left to the ranks, which run the same rules in `plait.parallelize`."""
    plan, full = spec.plan, spec.degrees
    try:
        with torch.device("meta"):
            made = load_factory(spec.factory)()
    except Exception:  # noqa: BLE001 - the user's code; the ranks build it for real and report
        return
    parts = tuple(made) if isinstance(made, (tuple, list)) else (made,)
    model, user_loss = parts[0], (parts[2] if len(parts) > 2 else None)
    if not isinstance(model, torch.nn.Module):
        return  # `build` refuses it by name on the ranks
    refuse_routing_in_half(model, spec)
    if full["tp"] > 1 and plan.tp is None:
        plan = dataclasses.replace(plan, tp=tp_styles(model, full["tp"], user_loss is None))
    try:
        check_layout(model, full, plan, tp_trace=True)  # the ranks' plan check would fail alike
    except LayoutError as e:
        raise CheckInputError(f"check: {e}") from e  # the cause: a CLI names its flags


# ---------------------------------------------------------------------------- processes


class _Reference:
    """The process of the one-process runs: a fresh interpreter with this one's ``sys.path``, given
    jobs one at a time on its stdin (`plait.check.oracle.main`). One serves a single check, or every
    check in a `shared_reference` block. If it dies, the job in progress gets an error file of its
    own, so the ranks waiting on it stop."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.backend: str | None = None
        self.folder: str | None = None  # the job in progress

    def submit(self, spec: Spec, folder: str, timeout_s: float, threads: int) -> None:
        if self.proc is not None and (self.proc.poll() is not None or spec.backend != self.backend):
            self.close()  # dead, or the world of one is on another kind of device
        if self.proc is None:
            env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
            cmd = [sys.executable, "-c", "from plait.check.oracle import main; main()"]
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, text=True)
            self.backend = spec.backend
            threading.Thread(target=self._watch, args=(self.proc,), name="check-oracle-watch",
                             daemon=True).start()
        path = os.path.join(folder, "oracle.job")
        with open(path, "wb") as f:
            pickle.dump((list(sys.path), pickle.dumps((spec, folder, timeout_s, threads))), f)
        self.folder = folder
        assert self.proc.stdin is not None
        self.proc.stdin.write(path + "\n")
        self.proc.stdin.flush()

    def _watch(self, proc: subprocess.Popen) -> None:
        code = proc.wait()
        folder = self.folder
        if code != 0 and folder is not None and not os.path.exists(os.path.join(folder, Exchange.ERROR)):
            with contextlib.suppress(OSError):  # the check is over and its folder gone
                Exchange(folder, 0).fail(RuntimeError(f"its process exited with code {code}"), "")

    def close(self) -> None:
        """No more jobs: the process ends once it has finished the last one."""
        if self.proc is None:
            return
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)  # done writing by the time the ranks finish; it is exiting
        self.kill()

    def kill(self) -> None:
        """End it now (a failed check: the job in progress is of no more use)."""
        self.folder = None  # its watcher writes no error into a folder that is being removed
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            if self.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
        self.proc = None


_SHARED: ContextVar[_Reference | None] = ContextVar("plait_check_shared_reference", default=None)


@contextlib.contextmanager
def shared_reference() -> Iterator[None]:
    """Run the one-process side of every `check` in the block in one process, started on first use
    and ended with the block. Otherwise each check starts an interpreter that imports torch and plait,
    seconds of CPU, which a series of checks (the layout fuzzer, a test of many layouts) pays once
    this way. Each check still builds its model from the factory; a factory's module is imported
    once per block. Inside a job, every rank enters the block (rank 0 holds the process). A block
    inside another uses the outer one's process."""
    if _SHARED.get() is not None:
        yield
        return
    shared = _Reference()
    token = _SHARED.set(shared)
    try:
        yield
    finally:
        _SHARED.reset(token)
        shared.close()


def _reference(spec: Spec, folder: str, timeout_s: float, threads: int) -> tuple[_Reference, bool]:
    """The process that runs this check's one-process side, and whether it is this check's own."""
    shared = _SHARED.get()
    ref = shared if shared is not None else _Reference()
    ref.submit(spec, folder, timeout_s, threads)
    return ref, shared is None


def _done(ref: _Reference, own: bool, ok: bool) -> None:
    if not ok:  # failed: the one-process run is of no more use, and may be waiting on the ranks
        ref.kill()
    elif own:
        ref.close()


def _in_job(spec: Spec, timeout_s: float, mesh: Mesh | None) -> CheckReport:
    device = init(seed=spec.seed)  # adopts the job's process group
    spec = dataclasses.replace(spec, backend=None if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    folder = comm.all_gather_object(tempfile.mkdtemp(prefix="plait-check-") if rank == 0 else None)[0]
    ref = _reference(spec, folder, timeout_s, torch.get_num_threads()) if rank == 0 else None
    report = None
    try:
        report = LayoutRun(spec, Exchange(folder, timeout_s), mesh).run()
        comm.barrier()  # every rank has read its last file
    finally:
        if ref is not None:
            _done(*ref, ok=report is not None)
            shutil.rmtree(folder, ignore_errors=True)
    return report


def _spawn(spec: Spec, n: int, timeout_s: float) -> CheckReport:
    # One GPU per rank (NCCL), or every rank on the CPU (Gloo) when there are fewer GPUs than ranks.
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    spec = dataclasses.replace(spec, backend=None if gpus >= n else "gloo")
    threads = max(1, (os.cpu_count() or 1) // (n + 1))
    with tempfile.TemporaryDirectory(prefix="plait-check-") as folder:
        ref, own = _reference(spec, folder, timeout_s, threads)
        args = (spec, n, free_port(), threads, timeout_s, folder, os.getpid())
        # A signal while the ranks start would leave some of them half made (their arguments half
        # written): it waits until all are up, then unwinds below like one at any later point.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        try:
            ranks = mp.start_processes(_entry, args=args, nprocs=n, join=False, start_method="spawn")
        except BaseException:
            _done(ref, own, ok=False)
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        try:
            while not ranks.join():
                pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            error = _rank_error(folder, e)  # before the one-process run is stopped
            _end(ranks.processes)  # its peers may still write their errors into the folder
            _done(ref, own, ok=False)
            raise error from None
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): the ranks go with it
            _end(ranks.processes)
            _done(ref, own, ok=False)
            raise
        _done(ref, own, ok=True)
        with open(os.path.join(folder, "report.pkl"), "rb") as f:
            return pickle.load(f)


def _end(processes: list) -> None:
    """Kill the ranks still alive and wait for every one to be gone (before the folder is removed)."""
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join()


def _entry(rank: int, spec: Spec, n: int, port: int, threads: int, timeout_s: float, folder: str,
           parent: int) -> None:
    die_with_parent(signal.SIGKILL, parent)  # a check's rank has nothing to save: it ends with its caller
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})  # held while it started
    set_rank_env(rank, n, port, threads)
    phase = "setting up"
    try:
        init(seed=spec.seed, timeout_s=timeout_s, backend=spec.backend)
        run = LayoutRun(spec, Exchange(folder, timeout_s))
        phase = "training"
        report = run.run()
    except BaseException as e:
        mark_failed()  # its peers may be inside a collective: exit without the exit barrier
        where = traceback.extract_tb(e.__traceback__)[-1]
        record = (phase, type(e).__name__, str(e), f"{where.filename}:{where.lineno}", traceback.format_exc(),
                  isinstance(e, (ValueError, TypeError)) and phase == "setting up")
        with open(os.path.join(folder, f"rank{rank}.err"), "wb") as f:
            pickle.dump(record, f)
        raise
    if rank == 0:
        with open(os.path.join(folder, "report.pkl"), "wb") as f:
            pickle.dump(report, f)


def _rank_error(folder: str, e: Exception) -> Exception:
    """The root cause: the one-process run's error, else the first rank's (its peers fail after it)."""
    if os.path.exists(os.path.join(folder, Exchange.ERROR)):
        return Exchange(folder, 0).oracle_error()
    files = sorted((os.path.getmtime(os.path.join(folder, f)), f) for f in os.listdir(folder)
                   if f.endswith(".err"))
    if not files:
        return RuntimeError(f"plait check: a rank died without a report: {e}")
    name = files[0][1]
    with open(os.path.join(folder, name), "rb") as f:
        phase, kind, msg, where, tb, is_input = pickle.load(f)
    rank = name[len("rank"):-len(".err")]
    if kind == CheckInputError.__name__:
        return CheckInputError(msg)
    if is_input:  # plait's own refusals of a layout (parallelize, the pipeline) are input errors
        return CheckInputError(f"{kind} on rank {rank} ({where}): {msg}")
    return RuntimeError(f"plait check: rank {rank} failed while {phase}: {kind}: {msg}\n{tb}")
