"""Full state dicts in every layout: the whole model, under its original names.

`full_state_dict(model)` returns what ``model.state_dict()`` of the unwrapped single-process
model would: every parameter and persistent buffer at its full shape, under the names that
model gives them (a tied weight under each of its names; a torch.compile'd module's under its
uncompiled names, without ``_orig_mod.``, as torch's own state-dict helpers give them), as CPU
tensors, the same on every rank. It is a collective: every rank of the model's groups calls it.
`load_full_state_dict` loads such a dict (or a single-process model's own) into any layout.

A wrapper that holds the state in its own way supplies it with two methods,
``full_state_dict()`` and ``load_full_state_dict(state)``: FSDP gathers its flat shards (and,
over tensor parallelism, the tp shards), a pipeline gathers its stages across pp (`union_over`),
DDP and DataParallel ask their module. Any other module takes the default path: a
tensor-parallel module's shards are gathered over tp (`plait.state.placement.state`), a plain module's
state dict is copied. The checkpoint protocol (`plait.state.checkpoint.protocol`) has the same shape.

The values given to `load_full_state_dict` may also be `plait.state.tensor_source.TensorSource`s (a
tensor in a file, read on demand): tensor parallelism and FSDP then read only the rows each
rank keeps; a layout that keeps whole tensors (DDP, a pipeline stage) reads its tensors whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.runtime import comm
from plait.state.dtensors import local_of
from plait.state.names import plain_name
from plait.state.placement import state as tp_state
from plait.state.placement.records import ep_info, tp_module
from plait.state.tensor_source import FullValue, whole

_DATA_AXES = ("dp", "fsdp")  # the ranks that see different samples, whose buffers may differ


def full_state_dict(model: nn.Module | Any) -> dict[str, torch.Tensor]:
    """The full state of ``model`` in any layout, on CPU, identical on every rank (a collective)."""
    own = getattr(model, "full_state_dict", None)
    if own is not None:
        state = own()
    elif tp_module(model) is not None:
        state = with_other_experts(model, tp_state.full_state_dict(model))
    else:  # (a wrapper's own method comes here for its module: experts are gathered once)
        state = with_other_experts(model, {k: v.detach().clone() for k, v in model.state_dict().items()})
    moved: dict[int, torch.Tensor] = {}  # a tensor listed under two names (tied) moves once
    full = {plain_name(k): moved.setdefault(id(v), v.cpu()) for k, v in state.items()}
    buffers_of_first_data_rank(model, full)
    return full


def buffers_of_first_data_rank(model: Any, state: dict[str, Any]) -> None:
    """Replace the buffers in ``state`` (by their original names) by those of the first rank of
    ``model``'s data ranks, in place; a collective over them.

    A data-parallel layout keeps a buffer per rank, and a buffer updated in forward differs across
    them (BatchNorm's running statistics are each rank's batches' under DDP between broadcasts,
    and under FSDP always): without this each rank would return its own, and "the same on every
    rank" would not hold. Rank 0's, as DDP broadcasts them; `plait.checkpoint.save` writes the
    same (DCP stores a replicated entry from whichever rank balances the bytes)."""
    from plait.runtime.mesh import Mesh

    mesh, module = getattr(model, "mesh", None), getattr(model, "module", None)
    if not isinstance(mesh, Mesh) or not isinstance(module, nn.Module) or mesh.size(_DATA_AXES) == 1:
        return
    held = [n for n in (plain_name(k) for k, _ in module.named_buffers())
            if type(state.get(n)) is torch.Tensor]  # plain tensors: a DTensor is placed, not replicated
    mine = [(n, tuple(state[n].shape), str(state[n].dtype)) for n in held]
    group = mesh.group(_DATA_AXES)
    # Only what every rank holds alike (a rank's own experts' buffers, say, stay its own): a
    # broadcast of tensors some rank lacks would not match up.
    every = comm.all_gather_object(mine, group)
    names = [n for n, shape, dtype in mine if all((n, shape, dtype) in other for other in every)]
    if not names:
        return
    device = comm.device_of(group)
    moved = [state[n].to(device, copy=True) for n in names]
    with comm.operation("buffers of the first data rank"):
        comm.broadcast_coalesced(moved, mesh.group_ranks(_DATA_AXES)[0], group)
    for n, t in zip(names, moved):
        state[n] = t.to(state[n].device)


def load_full_state_dict(model: nn.Module | Any, state: Mapping[str, FullValue]) -> None:
    """Load full tensors (or `plait.state.tensor_source.TensorSource`s) under the original names into
    ``model`` in any layout: each rank takes its own part, without communication (every rank
    passes the whole ``state``)."""
    own = getattr(model, "load_full_state_dict", None)
    if own is not None:
        own(state)
    elif tp_module(model) is not None:
        tp_state.load_full_state_dict(model, without_others_experts(model, state))
    else:
        read: dict[int, torch.Tensor] = {}  # a source under two names (tied) is read once
        for v in state.values():
            if id(v) not in read:
                read[id(v)] = whole(v)
        # A torch.compile'd module's keys, from the uncompiled names a full state dict has.
        own_key = {plain_name(k): k for k in model.state_dict()}
        model.load_state_dict({own_key.get(k, k): read[id(v)]
                               for k, v in without_others_experts(model, state).items()})


def with_other_experts(model: nn.Module | Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with the experts other ep ranks hold (`plait.expert_parallel`), gathered over ep."""
    info = ep_info(model)
    if info is None or info.placement.ep_size == 1:
        return state
    mine = {k: state[k] for k in info.local if k in state}
    where = info.placement
    gathered = union_over(mine, where.ep, where.ep_ranks)
    stacked = {k: _rows_over_ep(local_of(state[k]), where.ep) for k in info.stacked if k in state}
    return {**state, **gathered, **stacked}


@torch.no_grad()
def _rows_over_ep(rows: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """A stacked expert tensor from every ep rank's rows (equal counts, in rank order)."""
    dev = comm.device_of(group)
    mine = rows.detach().to(dev).contiguous()
    out = mine.new_empty((dist.get_world_size(group) * mine.shape[0], *mine.shape[1:]))
    with comm.operation("stacked experts"):
        comm.all_gather_into(out.view(-1), mine.view(-1), group)
    return out


def without_others_experts(model: nn.Module, state: Mapping[str, FullValue]) -> dict[str, FullValue]:
    """``state`` without the experts other ep ranks hold (`plait.expert_parallel`): their
    modules' entries dropped, and of a stacked expert tensor this rank's rows."""
    info = ep_info(model)
    if info is None or not (info.absent or info.stacked):
        return dict(state)
    out = {k: v for k, v in state.items() if not k.startswith(info.absent)} if info.absent else dict(state)
    where = info.placement
    j = where.ep_ranks.index(dist.get_rank()) if where.ep_size > 1 else 0
    for k in info.stacked:
        if k in out:
            per = out[k].shape[0] // where.ep_size
            out[k] = out[k].narrow(0, j * per, per)
    return out


@torch.no_grad()
def union_over(state: Mapping[str, torch.Tensor], group: dist.ProcessGroup | None,
               ranks: Sequence[int]) -> dict[str, torch.Tensor]:
    """Every rank's ``state`` entries, on every rank of ``group`` (global ``ranks``), on CPU.

    For state that ranks hold disjoint parts of (pipeline stages). One all_gather_object of the
    names, shapes and dtypes, then one coalesced broadcast per rank and dtype from that rank, so
    the tensors travel as tensors, never pickled. A name two ranks hold gets the later rank's
    value (the copies of a weight tied across ranks are equal).
    """
    if len(ranks) == 1:
        return {k: v.detach().cpu() for k, v in state.items()}
    me = ranks.index(dist.get_rank())
    layouts = comm.all_gather_object({k: (tuple(v.shape), v.dtype) for k, v in state.items()}, group)
    dev = comm.device_of(group)
    out: dict[str, torch.Tensor] = {}
    for r, (src, layout) in enumerate(zip(ranks, layouts, strict=True)):
        if r == me:  # own copies: a tensor listed twice must not be sent once (receivers expect two)
            bufs = {k: state[k].detach().to(dev, copy=True) for k in layout}
        else:
            bufs = {k: torch.empty(shape, dtype=dtype, device=dev) for k, (shape, dtype) in layout.items()}
        comm.broadcast_coalesced(list(bufs.values()), src, group)
        out.update({k: t.cpu() for k, t in bufs.items()})
    return out
