"""``optimizer_in_backward``: DDP steps the optimizer bucket by bucket as the all-reduces land.

torch offers the same as ``torch.distributed.optim._apply_optimizer_in_backward`` (an optimizer per
parameter, stepped by its DDP after each bucket's all-reduce). Here each bucket gets one optimizer
of the class and keyword arguments given, over the bucket's parameters. At the end of a reducing
backward the buckets are awaited in launch order (the first launched is the first to land); each
bucket's optimizer steps as soon as its own all-reduce is in, while the later buckets are still on
the wire, and its gradients are dropped (``.grad`` is None after backward, as with torch's). The
gradients autograd made are freed before the next forward, as without it (freed during backward,
the allocator gave their memory back to the system and the next backward faulted it in again), so
the memory is plain DDP's: what it saves is the optimizer's pass after backward, overlapped with
the last buckets' all-reduces.

Each bucket's result is used on its own, before the last bucket's, so each carries its own desync
check (`DistributedDataParallel._checks_desync`): a 16-byte all-reduce on the companion group per
bucket, sent beside the bucket and read before its step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.ddp.buckets import Bucket, sparse_params
from plait.placement.records import placement_of, plain_leaf
from plait.placement.tp_params import gradient_assigned

__all__ = ["InBackward", "check_spec", "refuse_model", "BucketOptimizers"]

InBackward = tuple[type[torch.optim.Optimizer], dict[str, Any]]


def check_spec(spec: Any) -> InBackward | None:
    """``(optimizer class, keyword arguments)`` or None, as given to ``optimizer_in_backward=``."""
    if spec is None:
        return None
    ok = (isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], type)
          and issubclass(spec[0], torch.optim.Optimizer) and isinstance(spec[1], dict))
    if not ok:
        raise TypeError("DistributedDataParallel(optimizer_in_backward=...) takes (optimizer class, keyword "
                        "arguments), e.g. (torch.optim.AdamW, {'lr': 1e-3}); got " + repr(spec))
    if "params" in spec[1]:
        raise ValueError("DistributedDataParallel(optimizer_in_backward=...): the keyword arguments must not "
                         "name params: each bucket's optimizer takes the bucket's parameters")
    return spec


def refuse_model(module: nn.Module, ignored: frozenset[str]) -> None:
    """What optimizer_in_backward cannot step with the buckets, refused before any collective."""
    sparse = sparse_params(module)
    named = [(n, p) for n, p in module.named_parameters() if n not in ignored and p.requires_grad]
    found = [n for n, p in named if id(p) in sparse]
    if found:
        raise ValueError(f"DistributedDataParallel(optimizer_in_backward=...): not with sparse gradients "
                         f"({', '.join(found)}): those are reduced on their own after the buckets; use "
                         "an optimizer after backward")
    experts = [n for n, p in named if placement_of(plain_leaf(p)) is not None]
    if experts:
        raise ValueError("DistributedDataParallel(optimizer_in_backward=...): not with expert parallelism "
                         f"({experts[0]}, ...): experts split over ep are reduced outside the buckets; use "
                         "an optimizer after backward")


class BucketOptimizers:
    """One optimizer per bucket (``optimizers[i]`` over bucket i's parameters, in its order)."""

    def __init__(self, spec: InBackward, buckets: list[Bucket]) -> None:
        cls, kwargs = spec
        self.optimizers = [cls(b.params, **kwargs) for b in buckets]

    def step(self, b: Bucket) -> None:
        """Step bucket ``b``'s parameters with their reduced gradients, then drop the gradients."""
        self.optimizers[b.index].step()
        for p in b.params:
            p.grad = None
            gradient_assigned(p)  # a tp DTensor's gradient goes with its leaf's
