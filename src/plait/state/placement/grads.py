"""The gradient reduction an expert parameter's placement asks for, shared by DDP and FSDP (which
both average dense gradients their own way and leave experts to this)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from plait.runtime import comm, faults
from plait.state.placement.pieces import mark_grad
from plait.state.placement.records import expert_of


@torch.no_grad()
def reduce_expert_grads(params: list[nn.Parameter], divisor: float) -> None:
    """Sum each expert parameter's gradient over the ranks holding it (its `ExpertPlacement`'s
    edp group), in one coalesced all-reduce, and divide by ``divisor`` (what the dense gradients
    are divided by). A rank that routed no token to an expert has no gradient for it: it sends
    zeros and a flag, and an expert with no gradient anywhere keeps none, as in one process."""
    if not params:
        return
    if faults.active("ep-expert-divisor"):  # an injected bug in tests only
        divisor = 1.0
    where = expert_of(params[0])
    assert where is not None
    if dist.get_world_size(where.edp) == 1:  # this rank alone holds its experts: nothing to sum
        for p in params:
            if p.grad is not None and divisor != 1.0:
                p.grad.div_(divisor)
        return
    dev = comm.device_of(where.edp)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads] + [torch.tensor(
        [float(p.grad is not None) for p in params], dtype=grads[0].dtype, device=grads[0].device)])
    flat = flat.to(dev)  # (a no-op where the gradients already live on the group's device)
    with comm.operation("expert gradients"):
        comm.all_reduce(flat, where.edp)
    offset = 0
    had = flat[-len(params):].tolist()
    for p, g, n in zip(params, grads, had):
        p.grad = (flat[offset: offset + g.numel()].view_as(g) / divisor) if n else None
        mark_grad(p)
        offset += g.numel()
