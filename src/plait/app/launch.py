"""Spawn local ranks: used by `plait train` (when not under torchrun), tests and benchmarks.

The launcher owns its ranks, so none outlives it:

* each rank runs in a process group of its own, and the SIGINT or SIGTERM the launcher gets is
  forwarded to every rank once (a terminal's Ctrl-C reaches the launcher's group only, so a
  rank never sees one key press twice); a second signal kills every rank at once;
* a rank asks the kernel to send it SIGTERM when the launcher dies, however it dies;
* when a rank fails, the others get a few seconds to fail on their own (a peer's collectives
  fail once its sockets close), then are killed.

A failing rank writes its traceback to a file (``trace_dir``) instead of the terminal, and
`spawn` raises `RanksFailed` whose message is one line: the first rank's error and where the
traces are.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.runtime.env import die_with_parent, free_port, set_rank_env

FAIL_GRACE_S = 5.0  # after a rank failed, how long its peers get to end on their own


class RanksFailed(RuntimeError):
    """A spawned rank failed; the message is one line naming the first failure."""

    def __init__(self, message: str, exit_codes: list[int | None]) -> None:
        super().__init__(message)
        self.exit_codes = exit_codes


def one_line(error: BaseException) -> str:
    """``Type: message`` of an exception on one line (its message's lines joined)."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def record_failure(rank: int | str, error: BaseException, trace_dir: Path) -> Path:
    """Write this rank's traceback to ``trace_dir/rank{rank}.txt``, headed by its one-line error."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    path = trace_dir / f"rank{rank}.txt"
    path.write_text(one_line(error) + "\n\n" + "".join(traceback.format_exception(error)))
    return path


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, threads: int | None,
           args: tuple[Any, ...], trace_dir: Path | None, parent: int) -> None:
    os.setpgid(0, 0)  # the launcher forwards signals: a terminal's reach only the launcher
    die_with_parent(signal.SIGTERM, parent)  # the launcher died: stop as if preempted
    set_rank_env(rank, world_size, port, threads)
    try:
        fn(*args)
    except SystemExit:
        raise  # a chosen exit (a run stopped by a signal): its code goes to the launcher
    except BaseException as e:
        from plait.runtime.env import mark_failed

        mark_failed()  # its peers may be mid-collective: exit without the exit barrier
        if trace_dir is None:
            raise
        record_failure(rank, e, trace_dir)
        raise SystemExit(1) from None


@dataclass
class _Ranks:
    """The spawned processes, the signals the launcher received and when each rank ended."""

    procs: list[multiprocessing.process.BaseProcess]
    signals: list[int]
    ended: dict[int, float]  # rank -> time.time() when the launcher saw it end

    def alive(self) -> list[multiprocessing.process.BaseProcess]:
        return [p for p in self.procs if p.exitcode is None]

    def send(self, sig: int) -> None:
        for p in self.alive():
            assert p.pid is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)

    def on_signal(self, signum: int, frame: Any) -> None:
        self.signals.append(signum)
        self.send(signum if len(self.signals) == 1 else signal.SIGKILL)


@contextlib.contextmanager
def _forwarding(ranks: _Ranks) -> Iterator[None]:
    """SIGINT and SIGTERM go to the ranks while they run (only the main thread can catch them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, ranks.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _wait(ranks: _Ranks) -> None:
    """Until every rank ended; once one failed, the rest are killed after `FAIL_GRACE_S`."""
    deadline = None
    while ranks.alive():
        sentinels = [p.sentinel for p in ranks.alive()]
        multiprocessing.connection.wait(sentinels, timeout=0.5)
        now = time.monotonic()
        for rank, p in enumerate(ranks.procs):
            if p.exitcode is not None and rank not in ranks.ended:
                ranks.ended[rank] = time.time()  # wall clock, as the trace files' times
                p.join()
                if _failed(p.exitcode) and not ranks.signals and deadline is None:
                    deadline = now + FAIL_GRACE_S
        if deadline is not None and now > deadline:
            ranks.send(signal.SIGKILL)


def _failed(code: int | None) -> bool:
    """A rank's exit code that is a failure: not 0, nor a stop code it chose (128 + a signal)."""
    return code is not None and code != 0 and not 128 < code < 160


def _trace(trace_dir: Path | None, rank: int) -> Path | None:
    path = trace_dir / f"rank{rank}.txt" if trace_dir is not None else None
    return path if path is not None and path.is_file() else None


def _failure_message(ranks: _Ranks, trace_dir: Path | None) -> str:
    """One line: the rank that failed first, its error, and where every trace is."""
    codes = [p.exitcode for p in ranks.procs]

    def when(rank: int) -> float:  # a trace is written when the error is caught: closer to its cause
        trace = _trace(trace_dir, rank)
        return trace.stat().st_mtime if trace is not None else ranks.ended[rank]

    failed = sorted((when(r), r) for r in ranks.ended if _failed(codes[r]))
    first = failed[0][1]
    trace = _trace(trace_dir, first)
    if trace is not None:
        what = trace.read_text().split("\n", 1)[0]
    elif (codes[first] or 0) < 0:
        what = f"killed by {signal.Signals(-(codes[first] or 0)).name}"
    else:
        what = f"exited with code {codes[first]}"
    others = f" ({len(failed) - 1} more failed after it)" if len(failed) > 1 else ""
    where = f"; full tracebacks in {trace_dir}/" if trace is not None else ""
    return f"rank {first}: {what}{others}{where}"


def spawn(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = (),
          threads: int | None = None, trace_dir: str | Path | None = None) -> int:
    """Run ``fn(*args)`` in ``nprocs`` fresh processes that each see torchrun-style env vars.

    Returns 0, or the exit code the ranks chose together (``fn`` raised ``SystemExit(code)`` on
    every rank: a run stopped by a signal); raises `RanksFailed` when a rank failed. With
    ``trace_dir`` a failing rank's traceback goes to ``trace_dir/rank{r}.txt`` rather than
    stderr. After a signal the launcher received: 0 if every rank still finished, else 128 + the
    signal's number, as a shell reports a process that a signal ended.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    folder = Path(trace_dir) if trace_dir is not None else None
    if folder is not None:
        for old in folder.glob("rank*.txt"):  # a previous run's, which would be read as this one's
            old.unlink()
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    ranks = _Ranks([ctx.Process(target=_entry, name=f"plait-rank{r}",
                                args=(r, fn, nprocs, port, threads, args, folder, os.getpid()))
                    for r in range(nprocs)], [], {})
    with _forwarding(ranks):
        try:
            for p in ranks.procs:
                p.start()
            _wait(ranks)
        finally:
            ranks.send(signal.SIGKILL)  # only if this launcher itself is failing: none outlives it
    codes = [p.exitcode for p in ranks.procs]
    if ranks.signals:  # stopped as asked: the ranks' own message said how
        return 0 if all(c == 0 for c in codes) else 128 + ranks.signals[0]
    if any(_failed(c) for c in codes):
        raise RanksFailed(_failure_message(ranks, folder), codes)
    return max(c or 0 for c in codes)  # 0, or the stop code the ranks chose (a signal sent to them)
