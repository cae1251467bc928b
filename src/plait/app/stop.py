"""Stopping `plait train` on SIGTERM or SIGINT: every rank finishes the same step, saves, exits.

A signal only raises a flag here: its handler runs between two bytecodes of the main thread,
possibly in the middle of a step whose collectives must all complete. Once per step the
training loop calls `StopRequest.agreed`, which max-reduces the flag over every rank, so every
rank stops after the same step even when the signal reached them at different moments (a
launcher forwards it rank by rank; a scheduler may signal one node first). The first signal
restores the default actions, so a second one ends the process at once.
"""

from __future__ import annotations

import shlex
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from plait.runtime import comm

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """The stop signals' flag for one run; a context manager that installs and restores the handlers."""

    def __init__(self) -> None:
        self.signum = 0  # the signal this process received
        self.stopped = 0  # the one every rank agreed to stop on
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        # Only the main thread can catch signals (a rank run inside a thread is stopped by its owner).
        if threading.current_thread() is threading.main_thread():
            self._old = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._old = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        for sig in STOP_SIGNALS:  # a second signal is not caught: the process ends at once
            signal.signal(sig, signal.SIG_DFL)

    def agreed(self) -> int:
        """The signal some rank received (0: none), the same on every rank (a collective on the
        default group: one 8-byte all-reduce per step)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            self.stopped = self.signum
        else:
            flag = torch.tensor([self.signum], dtype=torch.int64, device=comm.device_of(None))
            comm.all_reduce(flag, None, op=dist.ReduceOp.MAX)
            self.stopped = int(flag.item())
        return self.stopped

    def report(self, step: int, steps: int, save_dir: str | None, resume: str | None, log: Any) -> None:
        """Say (rank 0) where the run stopped, what was saved, and the command that continues it."""
        name = signal.Signals(self.stopped).name
        if save_dir is None:
            log.warning("stopped by %s after step %d of %d; nothing was saved (no --save-dir), so this "
                        "run cannot be resumed: give --save-dir to make a stopped run resumable",
                        name, step, steps)
            return
        log.warning("stopped by %s after step %d of %d; checkpoint %s written. Resume with: %s", name, step,
                    steps, Path(save_dir) / f"step_{step:06d}", resume or "the same command with --resume")

    @property
    def exit_code(self) -> int:
        """128 + the signal, as a shell reports a process a signal ended (0 if none did)."""
        return 128 + self.stopped if self.stopped else 0


def resume_command(argv: list[str], launcher: str | None = None) -> str:
    """The command line that continues this run: the same one, with ``--resume``; ``launcher``
    names the one that started the ranks (torchrun, slurm), if not `plait train` itself."""
    args = list(argv) if "--resume" in argv else [*argv, "--resume"]
    under = f" (launched as before, by {launcher})" if launcher else ""
    return "plait train " + shlex.join(args) + under
