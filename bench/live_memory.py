"""Peak live memory of one training step, measured the same way for plait and for torch.

On CUDA the caching allocator keeps the figures (`torch.cuda.max_memory_allocated`,
`torch.cuda.memory_allocated`). On CPU nothing does, so `plait.runtime.live_memory.LiveStorageBytes`
(the library's, which `plait plan` also uses on the meta device) keeps its own count of live
tensor storage while it is active:

* it starts from every tensor alive in the process (found by walking the garbage collector's
  objects), so parameters, gradients and optimizer state count from the first op;
* every dispatched op then hands it the storages the op read, wrote or made (a DTensor counts by
  its local tensor), each held by a weak reference only, so tracking never keeps memory alive;
* a storage counts its *current* size while anything holds it (Python, or autograd's saved
  tensors, which Python cannot see), and nothing once it is freed; a storage resized to zero
  (how both FSDPs free gathered parameters) counts zero;
* live bytes can only rise when an op makes a storage or one it touched has grown; the tracker
  adds each such growth to a bound on the live bytes (frees only lower the true figure) and
  re-reads the exact sum whenever that bound passes the peak, so the peak is exactly what
  re-reading after every op would give, at a fraction of the cost.

What it does not see: memory that never becomes a tensor storage passing through the dispatcher
(a kernel's internal workspace, a collective's staging buffers inside Gloo). Both sides of every
comparison are measured by the same tracker, so such gaps fall on both. `tests/test_bench_memory.py`
checks that known allocations, frees, resizes and tensors saved for backward count exactly.
"""

from __future__ import annotations

import torch

from plait.runtime.live_memory import LiveStorageBytes

__all__ = ["LiveStorageBytes", "PeakMeter"]


class PeakMeter:
    """One step's memory on this rank: ``start``, ``peak`` and `mark` readings in bytes. CUDA: the
    allocator's counters; CPU: a `LiveStorageBytes`. Use as a context manager around the step."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self.tracker: LiveStorageBytes | None = None
        self.marks: list[tuple[str, int]] = []
        self.start = self.peak = 0
        self.peak_phase: str | None = None

    def __enter__(self) -> PeakMeter:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            self.tracker = LiveStorageBytes()
            self.tracker.__enter__()
            self.start = self.tracker.start
        return self

    def phase(self, name: str) -> None:
        """Name the part of the step that follows (the phase of the peak is reported on CPU)."""
        if self.tracker is not None:
            self.tracker.phase = name

    def mark(self, label: str) -> int:
        if self.tracker is not None:
            return self.tracker.mark(label)
        torch.cuda.synchronize()
        now = torch.cuda.memory_allocated()
        self.marks.append((label, now))
        return now

    def __exit__(self, *exc: object) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(*exc)
            self.peak, self.peak_phase = self.tracker.peak, self.tracker.peak_phase
            self.marks = self.tracker.marks
        else:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
