"""Peak live memory of one training step, measured the same way for plait and for torch.

On CUDA the caching allocator keeps the figures (`torch.cuda.max_memory_allocated`,
`torch.cuda.memory_allocated`). On CPU nothing does, so `LiveStorageBytes` keeps its own count
of live tensor storage while it is active:

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

import gc
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from plait._torch_compat import TorchDispatchMode, tensors_in

__all__ = ["LiveStorageBytes", "PeakMeter"]


class LiveStorageBytes(TorchDispatchMode):
    """Live CPU tensor-storage bytes while active: ``peak``, ``peak_phase``, ``at_phase_start``,
    and ``marks`` (label, live bytes) recorded by `mark`. Slow: for untimed steps only."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"  # set by the caller; the phase of the peak is reported
        self.peak_phase = self.phase
        self.at_phase_start: dict[str, int] = {}  # live bytes at each phase's first op
        self.marks: list[tuple[str, int]] = []
        self._refs: dict[int, tuple[StorageWeakRef, int]] = {}  # storage -> (weak ref, bytes seen)
        # Garbage from before (cycles not yet collected) would otherwise be freed mid-step by a
        # collection and read as negative bytes: collect it first.
        gc.collect()
        self.scan()
        self.start = self.peak = self._bound = self.now()

    def scan(self) -> None:
        """Register every tensor the garbage collector knows (tensors made outside any op, e.g. an
        RNG state a checkpoint keeps, are found this way)."""
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor):  # type(): some gc'd proxies warn on isinstance
                self._add(obj)

    def _add(self, t: Any) -> int:
        """Track ``t``'s storage; return by how many bytes it is new or has grown since last seen."""
        local = getattr(t, "_local_tensor", None)  # a DTensor: the storage behind it
        if isinstance(local, torch.Tensor):
            t = local
        if not isinstance(t, torch.Tensor) or t.is_meta or t.device.type != "cpu":
            return 0
        st = t.untyped_storage()
        key, size = st._cdata, st.nbytes()
        seen = self._refs.get(key)
        if seen is not None and not seen[0].expired():
            if size <= seen[1]:
                return 0
            self._refs[key] = (seen[0], size)
            return size - seen[1]
        self._refs[key] = (StorageWeakRef(st), size)
        return size

    def now(self) -> int:
        """Live bytes now (drops the storages that have been freed)."""
        total = 0
        for key, (ref, _) in list(self._refs.items()):
            if ref.expired():
                del self._refs[key]
                continue
            size = torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
            self._refs[key] = (ref, size)
            total += size
        return total

    def _update(self) -> int:
        now = self._bound = self.now()
        if now > self.peak:
            self.peak, self.peak_phase = now, self.phase
        return now

    def mark(self, label: str) -> int:
        """Record (and return) the live bytes at this point, ``label`` naming it."""
        self.scan()
        now = self._update()
        self.marks.append((label, now))
        return now

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.phase not in self.at_phase_start:
            self.at_phase_start[self.phase] = self.now()
        out = func(*args, **(kwargs or {}))
        for t in tensors_in((args, kwargs, out)):
            self._bound += self._add(t)
        if self._bound > self.peak:  # else live <= bound <= peak: the peak cannot have moved
            self._update()
        return out


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
