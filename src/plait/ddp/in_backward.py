"""``optimizer_in_backward``: DDP steps the optimizer bucket by bucket as the all-reduces land.

Parameters marked by torch's ``torch.distributed.optim._apply_optimizer_in_backward`` before
wrapping are honoured the same way, as torch's DDP honours them: their optimizers step with their
bucket, after its all-reduce (the hooks torch registered, which would step with the local gradient,
are removed).

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
from plait.state.placement.records import expert_of, plain_leaf
from plait.state.placement.tp_params import gradient_assigned

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


def refuse_model(module: nn.Module, ignored: frozenset[str], both: bool = False) -> None:
    """What optimizer_in_backward (or torch's ``_apply_optimizer_in_backward`` marks) cannot step
    with the buckets, refused before any collective; ``both``: given the option on marked parameters."""
    from plait._torch_compat import in_backward_optimizers

    if both and any(in_backward_optimizers(p) for p in module.parameters()):
        raise ValueError("DistributedDataParallel(optimizer_in_backward=...): the parameters already carry "
                         "optimizers from torch's _apply_optimizer_in_backward; use one or the other")
    sparse = sparse_params(module)
    named = [(n, p) for n, p in module.named_parameters() if n not in ignored and p.requires_grad]
    found = [n for n, p in named if id(p) in sparse]
    if found:
        raise ValueError(f"DistributedDataParallel(optimizer_in_backward=...): not with sparse gradients "
                         f"({', '.join(found)}): those are reduced on their own after the buckets; use "
                         "an optimizer after backward")
    experts = [n for n, p in named if expert_of(plain_leaf(p)) is not None]
    if experts:
        raise ValueError("DistributedDataParallel(optimizer_in_backward=...): not with expert parallelism "
                         f"({experts[0]}, ...): experts split over ep are reduced outside the buckets; use "
                         "an optimizer after backward")


class BucketOptimizers:
    """What each bucket steps: ``steps[i]``, the optimizers to step once bucket i has landed, and
    ``stepped[i]``, the parameters whose gradients are then dropped."""

    def __init__(self, steps: list[list[torch.optim.Optimizer]], stepped: list[list[nn.Parameter]]) -> None:
        self.steps, self.stepped = steps, stepped

    @classmethod
    def from_spec(cls, spec: InBackward, buckets: list[Bucket]) -> BucketOptimizers:
        """``optimizer_in_backward=(class, kwargs)``: one optimizer per bucket, over its parameters."""
        opt_cls, kwargs = spec
        return cls([[opt_cls(b.params, **kwargs)] for b in buckets], [list(b.params) for b in buckets])

    @classmethod
    def from_torch(cls, buckets: list[Bucket],
                   marks: dict[int, list[torch.optim.Optimizer]]) -> BucketOptimizers:
        """torch's ``_apply_optimizer_in_backward``: each marked parameter's own optimizers (``marks``,
        by the id of the tensor in the bucket), stepped with its bucket; unmarked parameters keep
        their gradients for an optimizer after backward, as under torch's DDP."""
        steps, stepped = [], []
        for b in buckets:
            mine = [p for p in b.params if marks.get(id(p))]
            steps.append(list({id(o): o for p in mine for o in marks[id(p)]}.values()))
            stepped.append(mine)
        return cls(steps, stepped)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every optimizer, in the order the buckets step them."""
        return list({id(o): o for opts in self.steps for o in opts}.values())

    def step(self, b: Bucket) -> None:
        """Step bucket ``b``'s optimizers with the reduced gradients, then drop their gradients."""
        for opt in self.steps[b.index]:
            opt.step()
        for p in self.stepped[b.index]:
            p.grad = None
            gradient_assigned(p)  # a tp DTensor's gradient goes with its leaf's
