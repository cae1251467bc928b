"""Live tensor-storage bytes, counted op by op: the measure `plait plan` predicts with and its
validation measures with.

On CUDA the caching allocator keeps the figures; on CPU, and on the meta device of a dry run
(`plait.runtime.env.dry_run`), nothing does, so `LiveStorageBytes` keeps its own count while it is active:

* it starts from the tensors alive before the first op: every tensor the garbage collector knows
  (the default), or the tensors of given ``roots`` (a dry run, where meta tensors outside the
  layout, such as a pipeline's shape-only skeleton of the model, must not count);
* every dispatched op then hands it the storages the op read, wrote or made (a DTensor counts by
  its local tensor), each held by a weak reference only, so tracking never keeps memory alive;
* a storage counts its *current* size while anything holds it (Python, or autograd's saved
  tensors, which Python cannot see), and nothing once it is freed; a storage resized to zero
  (how FSDP frees gathered parameters) counts zero;
* live bytes can only rise when an op makes a storage or one it touched has grown; the tracker
  adds each such growth to a bound on the live bytes (frees only lower the true figure) and
  re-reads the exact sum whenever that bound passes the peak, so the peak is exactly what
  re-reading after every op would give, at a fraction of the cost.

What it does not see: memory that never becomes a tensor storage passing through the dispatcher
(a kernel's internal workspace, a collective's staging buffers inside Gloo).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from plait._torch_compat import (
    TorchDispatchMode,
    dtensor_local,
    is_fake,
    storage_id,
    tensors_in,
    weak_storage_nbytes,
)


def storage_key(t: torch.Tensor) -> int:
    """What tells storages apart (views of one storage share it)."""
    return storage_id(t.untyped_storage())


class LiveStorageBytes(TorchDispatchMode):
    """Live tensor-storage bytes on ``device`` ("cpu" or "meta") while active: ``peak``,
    ``peak_phase``, ``at_phase_start``, ``marks`` (label, live bytes) recorded by `mark`, and, with
    ``keep_peak_storages``, ``peak_storages`` (storage key -> bytes at the peak). Slow: for untimed
    steps only."""

    def __init__(self, device: str = "cpu", roots: Iterable[torch.Tensor] | None = None,
                 keep_peak_storages: bool = False) -> None:
        super().__init__()
        self.device = device
        self._roots = None if roots is None else list(roots)
        self.keep_peak_storages = keep_peak_storages
        self.peak_storages: dict[int, int] = {}
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
        """Register the roots, or else every tensor the garbage collector knows (tensors made outside
        any op, e.g. an RNG state a checkpoint keeps, are found this way)."""
        if self._roots is not None:
            for t in self._roots:
                self._add(t)
            return
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor):  # type(): some gc'd proxies warn on isinstance
                self._add(obj)

    def _add(self, t: Any) -> int:
        """Track ``t``'s storage; return by how many bytes it is new or has grown since last seen."""
        local = dtensor_local(t)  # a DTensor: the storage behind it
        if local is not None:
            t = local
        if not isinstance(t, torch.Tensor) or t.device.type != self.device or is_fake(t):
            return 0  # a fake tensor (torch.compile's caches keep them) owns no memory
        st = t.untyped_storage()
        key, size = storage_id(st), st.nbytes()
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
            size = weak_storage_nbytes(ref)
            self._refs[key] = (ref, size)
            total += size
        return total

    def _update(self) -> int:
        now = self._bound = self.now()
        if now > self.peak:
            self.peak, self.peak_phase = now, self.phase
            if self.keep_peak_storages:
                self.peak_storages = {k: s for k, (_, s) in self._refs.items()}
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
