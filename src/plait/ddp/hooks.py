"""Communication hooks: torch's ``GradBucket`` contract over plait's buckets.

torch's DDP hands each bucket to a hook as a C++ ``torch.distributed.GradBucket``, which Python
cannot construct. The hooks in ``torch.distributed.algorithms.ddp_comm_hooks`` (allreduce,
fp16/bf16 compression and their wrappers, PowerSGD, post-local SGD) only call its methods, so
`GradBucket` below offers the same ones with the same meaning, and they run unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]


class GradBucket:
    """One bucket as a communication hook sees it (torch's ``GradBucket`` methods).

    ``buffer()`` is the flat gradient tensor the hook reduces: the gradients, not divided by
    the world size (the hook divides, as torch's hooks do). ``gradients()`` are views of the
    current buffer shaped like ``parameters()``. ``set_buffer`` replaces the buffer (the
    fp16/bf16 wrappers hand a compressed copy to the hook they wrap)."""

    def __init__(self, index: int, count: int, buffer: torch.Tensor, params: list[nn.Parameter],
                 offsets: list[int]) -> None:
        self._index, self._count, self._buffer = index, count, buffer
        self._params, self._offsets = params, offsets

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._index == self._count - 1

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        if self._buffer.is_sparse:  # a sparse gradient is a bucket of its own (as torch's)
            return [self._buffer]
        return [self._buffer[o : o + p.numel()].view(p.shape) for o, p in zip(self._offsets, self._params)]

    def parameters(self) -> list[nn.Parameter]:
        return list(self._params)


def validate_hook(hook: Any) -> None:
    """torch's checks of a hook at registration: callable, and annotated (if at all) as taking a
    ``GradBucket`` and returning a ``Future``."""
    if not callable(hook):
        raise TypeError("DistributedDataParallel.register_comm_hook: Communication hook must be callable.")
    sig = inspect.signature(hook)
    bucket = sig.parameters.get("bucket")
    if bucket is not None and bucket.annotation not in (inspect.Parameter.empty, "GradBucket",
                                                         "dist.GradBucket", GradBucket, dist.GradBucket):
        raise ValueError("DistributedDataParallel.register_comm_hook: Communication hook: bucket annotation "
                         "should be dist.GradBucket.")
    ret = sig.return_annotation
    if ret is not inspect.Signature.empty and not (ret is torch.futures.Future or "Future" in str(ret)):
        raise ValueError("DistributedDataParallel.register_comm_hook: Communication hook: return annotation "
                         "should be torch.futures.Future[torch.Tensor].")


def hook_result(future: torch.futures.Future, bucket: torch.Tensor, index: int) -> torch.Tensor:
    """The reduced bucket a hook's future holds (a tensor, or a list of one, as torch accepts)."""
    if not callable(getattr(future, "wait", None)):  # torch.futures.Future, or the C++ one collectives give
        raise RuntimeError("DistributedDataParallel: the communication hook's callback must return a "
                           f"torch.futures.Future object, but got {type(future).__name__}")
    value = future.wait()
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.Tensor) or value.numel() != bucket.numel():
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise RuntimeError(f"DistributedDataParallel: the communication hook's future for bucket {index} "
                           f"holds {shape}; it must hold a tensor of the bucket's {bucket.numel()} elements "
                           "(return bucket.buffer() reduced, as torch's hooks do)")
    return value
