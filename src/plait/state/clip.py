"""Gradient-norm clipping for every layout: one function, told by each wrapper what it holds.

The norm of the whole model's gradient is a sum of p-th powers over pieces that different
ranks hold. A wrapper describes its gradient as *parts*: lists of gradient tensors keyed by the
process groups over which those tensors are disjoint pieces of the model (``grad_norm_parts``):

* FSDP: flat gradient shards, disjoint over the fsdp group (and over tp for tp-sharded slots);
* tensor parallelism: tp-sharded gradients over tp, replicated ones under no group;
* a pipeline: each stage's parts (its wrapper's, or tp's), disjoint over pp as well;
* DDP and plain modules: every gradient under no group (after DDP's all-reduce the replicas
  are equal, so they must not be summed over dp).

The same keys exist on every rank (a part may be empty), so every rank issues the same
all-reduces: one per group, of the sums of every part that includes it. A wrapper holding copies
of a gradient counted on another rank (a pipeline's weight tied across pp ranks) lists them in
``grad_copies()``: scaled like the rest, left out of the norm.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.runtime import comm
from plait.state.dtensors import local_of

GradParts = dict[tuple[dist.ProcessGroup, ...], list[torch.Tensor]]


def clip_grad_norm_(model: nn.Module | Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for ``model`` in any layout; returns the total norm
    before clipping, the same on every rank. An infinite ``max_norm`` only measures."""
    copies = getattr(model, "grad_copies", None)
    return clip_parts_(grad_norm_parts(model), max_norm, norm_type, copies() if copies is not None else ())


def grad_norm_parts(model: nn.Module | Any) -> GradParts:
    """The wrapper's own description, or, for a (tensor-parallel) module, one made here. Experts
    split over ep ranks (`plait.expert_parallel`) are disjoint over ep as well."""
    own = getattr(model, "grad_norm_parts", None)
    if own is not None:
        return own()
    return _experts_apart(model, _module_parts(model))


def _experts_apart(model: nn.Module, parts: GradParts) -> GradParts:
    from plait.state.placement.records import ep_info, expert_of

    info = ep_info(model)
    if info is None or info.placement.ep_size == 1:
        return parts
    experts = {id(p.grad) for p in model.parameters() if p.grad is not None and expert_of(p) is not None}
    out: GradParts = {}
    for key, grads in parts.items():
        out.setdefault(key, []).extend(g for g in grads if id(g) not in experts)
        out.setdefault((*key, info.placement.ep), []).extend(g for g in grads if id(g) in experts)
    return out


def _module_parts(model: nn.Module) -> GradParts:
    from plait.state.placement.records import tp_info, tp_module

    inner, info = tp_module(model), tp_info(model)
    # A tp DTensor parameter's gradient is a DTensor: its local rows are this rank's piece.
    grads = [local_of(p.grad) for p in model.parameters() if p.grad is not None]
    if inner is None or info is None or info.size == 1:
        return {(): grads}
    sharded = {id(p) for name, p in inner.named_parameters(remove_duplicate=False) if name in info.specs}
    held = [(id(p), local_of(p.grad)) for p in inner.parameters() if p.grad is not None]
    return {(info.group,): [g for i, g in held if i in sharded], (): [g for i, g in held if i not in sharded]}


@torch.no_grad()
def clip_parts_(parts: GradParts, max_norm: float, norm_type: float = 2.0,
                copies: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """Scale every gradient in ``parts``, and ``copies`` (not counted), by torch's coefficient for
    the joint ``norm_type`` norm of ``parts``."""
    keys = list(parts)
    grads = [g for key in keys for g in parts[key]]
    dev = grads[0].device if grads else comm.device_of(next((k[0] for k in keys if k), None))
    inf = norm_type == float("inf")
    # Summed in float64 on every rank (the all-reduce's dtype must agree across ranks even where
    # one holds no gradient); each gradient's own norm in its dtype, raised to float32 at least.
    local = torch.zeros(len(keys), dtype=torch.float64, device=dev)
    for i, key in enumerate(keys):
        for g in parts[key]:
            gw = g.detach().to(torch.promote_types(g.dtype, torch.float32))
            piece = (gw.abs().max() if inf else gw.norm(norm_type) ** norm_type).to(torch.float64)
            local[i] = torch.maximum(local[i], piece) if inf else local[i] + piece
    for group in _groups_in_order(keys):
        rows = [i for i, key in enumerate(keys) if any(g is group for g in key)]
        sub = local[rows].clone()
        comm.all_reduce(sub, group, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
        local[rows] = sub
    total = local.max() if inf else local.sum() ** (1.0 / norm_type)
    if max_norm != float("inf"):
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # torch's formula
        for g in [*grads, *copies]:
            g.detach().mul_(coef.to(g.device, g.dtype))
    # As torch returns it: in the gradients' dtype (float32 at least).
    return total.to(torch.promote_types(grads[0].dtype, torch.float32) if grads else torch.float32)


def _groups_in_order(keys: Sequence[tuple[dist.ProcessGroup, ...]]) -> list[dist.ProcessGroup]:
    """Every group named in ``keys``, once, in order of first appearance (the same on every rank)."""
    out: list[dist.ProcessGroup] = []
    for key in keys:
        for g in key:
            if not any(g is h for h in out):
                out.append(g)
    return out
