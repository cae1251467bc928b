"""The step timeout: a rank that makes no progress for `--step-timeout` seconds ends itself, naming it.

The timeouts nest, innermost first, so the one that knows most fires first (docs/failures.md):

1. **collective** (`--timeout`, `plait.init(timeout_s=...)`): a collective whose peers do not arrive;
   the error names the collective, its group and the ranks that never came.
2. **step** (`--step-timeout`, here): no step, evaluation or checkpoint finished on this rank for
   that long. It catches what the collective timeout cannot: a rank stuck outside any collective
   (a data read, a hung file system, a loop in user code) or inside one that does not honour its
   timeout. The rank writes every thread's stack to its run folder and stderr and exits with
   `STEP_TIMEOUT_EXIT`, so a launcher with restarts (`--max-restarts`, `--resume auto`) starts the
   job again instead of waiting forever.
3. **rendezvous** (`plait run --rdzv-conf join_timeout=...`): how long the launchers wait for every
   node to come back after a failure; longer than the step timeout, so a node still waiting out
   its own step timeout is not left behind.
4. **restart** (`--max-restarts`, Slurm `--requeue`, a Job's `backoffLimit`): how many times.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

# The exit status of a rank ended by its step timeout (distinct from a crash's 1 and a signal's).
STEP_TIMEOUT_EXIT = 75

log = logging.getLogger("plait.train")


class StepWatchdog:
    """Ends this process if `beat()` is not called for `seconds` (None: never).

    Used as a context manager around the training loop; the loop calls `beat(what)` whenever it
    finishes a unit of progress, naming what comes next (the message says what was running)."""

    def __init__(self, seconds: float | None, rank: int, stacks_dir: Path | None = None) -> None:
        self.seconds = seconds
        self.rank = rank
        self.stacks_dir = stacks_dir
        self._last = time.monotonic()
        self._doing = "the first step"
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, doing: str) -> None:
        """Progress was made; `doing` is what this rank does next."""
        self._last = time.monotonic()
        self._doing = doing

    def __enter__(self) -> StepWatchdog:
        if self.seconds is not None:
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="plait-step-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        assert self.seconds is not None
        # Checked often enough that the step timeout fires within a few percent of its value.
        poll = min(1.0, self.seconds / 20)
        while not self._done.wait(poll):
            if time.monotonic() - self._last > self.seconds:
                self._fire()

    def _fire(self) -> None:
        where = self._write_stacks()
        log.error("rank %d: step timeout fired (--step-timeout %g s): no progress for %g s while running %s; "
                  "the collective timeout (--timeout) did not fire first, so this rank is stuck outside a "
                  "collective or in one that does not honour its timeout. Every thread's stack: %s. Exiting "
                  "with status %d (a launcher with --max-restarts and --resume auto starts the job again)",
                  self.rank, self.seconds, self.seconds, self._doing, where, STEP_TIMEOUT_EXIT)
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(STEP_TIMEOUT_EXIT)  # the stuck thread may hold locks that a normal exit would wait on

    def _write_stacks(self) -> str:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.stacks_dir is None:
            return "above, on stderr"
        try:
            self.stacks_dir.mkdir(parents=True, exist_ok=True)
            path = self.stacks_dir / f"rank{self.rank}-stacks.txt"
            with open(path, "w") as f:
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as e:
            return f"above, on stderr (writing them to {self.stacks_dir} failed: {e})"
        return f"above, on stderr, and in {path}"
