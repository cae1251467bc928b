"""State dicts for plait's FSDP: a full one for export, a sharded one for checkpoints.

* **Full**: every original parameter gathered (one flat group at a time, over the fsdp axis)
  and copied to CPU under its original name; persistent buffers as they are. Over tensor
  parallelism each tp-sharded tensor is then gathered over tp as well, so the result is the
  original model's full tensors there too. Loading slices each tensor back into this rank's
  shard (its tp shard first, over tensor parallelism).
* **Sharded**: each original parameter as a DTensor ``Shard(0)`` over the fsdp axis (dim-0
  chunks, the last ones possibly short or empty), so `torch.distributed.checkpoint` can save
  it and load it at a different number of ranks. Optimizer state that has the shape of a
  shard (Adam's moments) is converted the same way under ``optim.<param>.<key>``; scalar state
  (``step``) is stored per parameter as a plain tensor. DTensor is only the container here.
  Over tensor parallelism, a parameter's entry is its tp shard as a DTensor over tp instead
  (the original model's full shape), so the keys and shapes match every other layout.

Converting between the flat layout (a contiguous slice of all of a unit's parameters) and
dim-0 chunks needs the whole flat vector of one group at a time: one all-gather per group,
so a rank briefly holds one unit, never the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from plait import comm
from plait.checkpoint.protocol import load_module_state, module_state, state_layout
from plait.dtensors import contiguous_stride, mesh_of
from plait.fsdp.flat import FlatParam, ShardCfg
from plait.fsdp.units import Unit
from plait.state_dict import with_other_experts, without_others_experts
from plait.tensor_source import FullValue, flat_range, whole
from plait.tp.apply import TPInfo
from plait.tp.state import checkpoint_entry, gather_full, restore_entry

__all__ = ["ShardedModel", "full_state_dict", "load_full_state_dict", "sharded_state_dict",
           "load_sharded_state_dict"]


class ShardedModel(Protocol):
    """What these functions read of a `plait.FullyShardedDataParallel`, which calls them with
    itself (so this module need not import the wrapper that imports it)."""

    @property
    def module(self) -> nn.Module: ...  # the wrapped model: buffers and original names

    @property
    def units(self) -> list[Unit]: ...

    @property
    def cfg(self) -> ShardCfg: ...

    @property
    def tp(self) -> TPInfo | None: ...


def _flats(model: ShardedModel) -> list[FlatParam]:
    return [f for u in model.units for f in u.flats]


def _gather_flat(flat: FlatParam, shard: torch.Tensor) -> torch.Tensor:
    """The full flat vector (padding included) of a shard-shaped tensor, on the compute device."""
    src = shard.detach().to(flat.cfg.device)
    out = torch.empty(flat.padded, dtype=src.dtype, device=src.device)
    comm.all_gather_into(out, src.contiguous(), flat.cfg.group)
    return out


@torch.no_grad()
def _scatter_flat(flat: FlatParam, full: torch.Tensor, dest: torch.Tensor) -> None:
    lo, hi = flat.shard_range()
    dest.zero_()
    n = max(0, min(hi, flat.total) - lo)
    dest[:n].copy_(full[lo : lo + n])


def full_state_dict(model: ShardedModel) -> dict[str, torch.Tensor]:
    """Every parameter and buffer at full size on CPU, the same on every rank: one all-gather per
    flat group over fsdp, then, over tensor parallelism, one per tp-sharded slot over tp (the slot
    holds this rank's tp shard; `plait.tp.state.gather_full` drops uneven splits' padding)."""
    out: dict[str, torch.Tensor] = {}
    for flat in _flats(model):
        full = _gather_flat(flat, flat.shard)
        for s in flat.slots:
            value = full[s.offset : s.offset + s.numel].view(s.shape)
            if model.tp is not None:
                value = gather_full(value, model.tp.specs.get(s.fqn), model.tp)
            value = value.to("cpu", copy=True)
            for name in (s.fqn, *s.aliases):  # a tied weight under each of its names, as in state_dict()
                out[name] = value
    for name, b in model.module.state_dict().items():  # only buffers (and experts) remain registered
        out[name] = b.detach().cpu().clone()
    return with_other_experts(model.module, out)


def _check_keys(model: ShardedModel, state: Mapping, expected: set[str], what: str) -> None:
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise KeyError(f"{what}(state=...): missing keys {missing[:8]}, unexpected keys {unexpected[:8]} "
                       f"for {type(model.module).__name__}")


@torch.no_grad()
def load_full_state_dict(model: ShardedModel, state: Mapping[str, FullValue]) -> None:
    """Load full tensors (as `full_state_dict` returns them): each rank keeps its slice. No
    communication: every rank holds the whole ``state``. Only the part of each tensor that falls
    in this rank's shard is read, so a `plait.tensor_source.TensorSource` is asked for the rows
    of that slice (over tensor parallelism: for the rank's tp shard, then cut)."""
    names = {n for f in _flats(model) for s in f.slots for n in (s.fqn, *s.aliases)}
    buffers = dict(model.module.state_dict())
    state = without_others_experts(model.module, state)
    _check_keys(model, state, names | set(buffers), "load_full_state_dict")
    for flat in _flats(model):
        lo, hi = flat.shard_range()
        dest = flat.shard.detach()
        dest.zero_()  # the padding past the last slot stays zero
        for s in flat.slots:
            value = _local_value(model, s.fqn, state[s.fqn], s.shape)
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                dest[a - lo : b - lo].copy_(flat_range(value(), a - s.offset, b - s.offset))
    for name, b in buffers.items():
        b.copy_(whole(state[name]))


def _local_value(model: ShardedModel, name: str, value: FullValue,
                 local: torch.Size) -> Callable[[], FullValue]:
    """This rank's part of the full ``value`` before FSDP's cut, read when called: its tp shard
    (zero-padded like the slot) over tensor parallelism, else ``value`` itself; the shape is
    checked against the full one now."""
    spec = model.tp.specs.get(name) if model.tp is not None else None
    want = list(local)
    if spec is not None:
        want[spec.dim] = spec.full
    if list(value.shape) != want:
        raise ValueError(f"load_full_state_dict: {name} has shape {tuple(value.shape)}, "
                         f"the model expects {tuple(want)}")
    return (lambda: spec.take(value)) if spec is not None else (lambda: value)


# ---------------------------------------------------------------- sharded (DTensor) form
def _rows(dim0: int, world: int, rank: int) -> tuple[int, int]:
    """Dim-0 row range of ``rank``'s Shard(0) chunk (torch.chunk sizes; trailing chunks may be empty)."""
    per = -(-dim0 // world)
    start = min(rank * per, dim0)
    return start, min(start + per, dim0)


def _to_dtensors(model: ShardedModel, flat: FlatParam, shard_like: torch.Tensor) -> list[DTensor]:
    full = _gather_flat(flat, shard_like)
    mesh, world, rank = mesh_of(model.cfg.group, model.cfg.device), flat.cfg.world, flat.cfg.rank
    out = []
    for s in flat.slots:
        p = full[s.offset : s.offset + s.numel].view(s.shape)
        shape = s.shape if len(s.shape) else torch.Size([1])
        a, b = _rows(shape[0], world, rank)
        local = p.reshape(shape)[a:b].clone()
        out.append(DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape,
                                      stride=contiguous_stride(shape)))
    return out


def _from_dtensors(flat: FlatParam, tensors: list[torch.Tensor], dest: torch.Tensor) -> None:
    """Rebuild this rank's flat shard from dim-0 chunks: one all-gather of all chunks, padded."""
    world = flat.cfg.world
    blocks, sizes = [], []
    for s, t in zip(flat.slots, tensors, strict=True):
        shape = s.shape if len(s.shape) else torch.Size([1])
        local = t.to_local() if isinstance(t, DTensor) else t
        per, row = -(-shape[0] // world), math.prod(shape[1:])
        block = torch.zeros(per * row, dtype=dest.dtype, device=flat.cfg.device)
        block[: local.numel()] = local.reshape(-1).to(block.device, block.dtype)
        blocks.append(block)
        sizes.append(per * row)
    mine = torch.cat(blocks)
    everyone = torch.empty(world * mine.numel(), dtype=mine.dtype, device=mine.device)
    comm.all_gather_into(everyone, mine, flat.cfg.group)
    everyone = everyone.view(world, -1)
    full = torch.zeros(flat.padded, dtype=dest.dtype, device=mine.device)
    col = 0
    for s, size in zip(flat.slots, sizes, strict=True):
        full[s.offset : s.offset + s.numel] = everyone[:, col : col + size].reshape(-1)[: s.numel]
        col += size
    _scatter_flat(flat, full.to(dest.device), dest)


def _to_entries(model: ShardedModel, flat: FlatParam, value: torch.Tensor) -> Sequence[torch.Tensor]:
    """Checkpoint entries of a shard-shaped ``value``, one per slot.

    Without tensor parallelism: ``Shard(0)`` DTensors over the fsdp axis. With it, a slot is a
    tp shard of the original parameter: the flat vector is gathered over fsdp (one unit at a
    time) and each slot becomes `plait.tp.state.checkpoint_entry` of its tp shard, a DTensor
    over tp that every fsdp rank of the tp coordinate writes alike (stored once).
    """
    if model.tp is None:
        return _to_dtensors(model, flat, value)
    full = _gather_flat(flat, value)
    return [checkpoint_entry(full[s.offset : s.offset + s.numel].view(s.shape), model.tp.specs.get(s.fqn),
                             model.tp, s.fqn) for s in flat.slots]


def _from_entries(model: ShardedModel, flat: FlatParam, values: list[torch.Tensor],
                  dest: torch.Tensor) -> None:
    """Inverse of `_to_entries`: fill this rank's shard ``dest`` from loaded entries."""
    if model.tp is None:
        _from_dtensors(flat, values, dest)
        return
    full = torch.zeros(flat.padded, dtype=dest.dtype, device=dest.device)
    for s, v in zip(flat.slots, values, strict=True):
        restore_entry(full[s.offset : s.offset + s.numel].view(s.shape), v, model.tp.specs.get(s.fqn))
    _scatter_flat(flat, full, dest)


def sharded_state_dict(model: ShardedModel, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """``{"model": {name: DTensor | buffer}, "optim": {...}}``; also a template for `dcp.load`.

    For an optimizer that has not stepped yet, the optim entries are zero-filled templates of
    the layout it will have, so a checkpoint can be loaded into a fresh optimizer.
    """
    model_sd: dict[str, torch.Tensor] = {}
    optim_sd: dict[str, torch.Tensor] = {}
    layout = state_layout(optimizer) if optimizer is not None else {}
    for flat in _flats(model):
        for s, dt in zip(flat.slots, _to_entries(model, flat, flat.shard), strict=True):
            for name in (s.fqn, *s.aliases):  # a tied weight under each of its names, as in state_dict()
                model_sd[name] = dt
        if optimizer is None or not flat.requires_grad:
            continue
        state = optimizer.state.get(flat.shard, {})
        for key, kind in layout.items():
            if kind == "elem":
                value = state.get(key, torch.zeros_like(flat.shard))
                for s, dt in zip(flat.slots, _to_entries(model, flat, value), strict=True):
                    optim_sd[f"{s.fqn}.{key}"] = dt
            else:
                value = state.get(key, torch.zeros((), dtype=torch.float32))
                for s in flat.slots:
                    optim_sd[f"{s.fqn}.{key}"] = torch.as_tensor(value).detach().clone()
    for name, b in model.module.state_dict().items():
        model_sd[name] = b.detach().clone()
    if optimizer is not None:  # the experts' state: whole tensors, like a plain module's
        optim_sd.update(module_state(model.module, optimizer)["optim"])
    return {"model": model_sd, "optim": optim_sd} if optimizer is not None else {"model": model_sd}


@torch.no_grad()
def load_sharded_state_dict(model: ShardedModel, state: dict,
                            optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a (DCP-filled) `sharded_state_dict` into the shards and, if given, the optimizer."""
    model_sd = state["model"]
    names = {n for f in _flats(model) for s in f.slots for n in (s.fqn, *s.aliases)}
    buffers = dict(model.module.state_dict())
    _check_keys(model, model_sd, names | set(buffers), "load_sharded_state_dict")
    layout = state_layout(optimizer) if optimizer is not None else {}
    for flat in _flats(model):
        _from_entries(model, flat, [model_sd[s.fqn] for s in flat.slots], flat.shard.detach())
        if optimizer is None or not flat.requires_grad:
            continue
        new: dict[str, torch.Tensor] = {}
        for key, kind in layout.items():
            if kind == "elem":
                dest = torch.zeros_like(flat.shard.detach())
                _from_entries(model, flat, [state["optim"][f"{s.fqn}.{key}"] for s in flat.slots], dest)
                new[key] = dest
            else:
                new[key] = state["optim"][f"{flat.slots[0].fqn}.{key}"].detach().clone()
        optimizer.state[flat.shard] = new
    for name, b in buffers.items():
        b.copy_(model_sd[name])
    if optimizer is not None:  # the experts' state (the module's only parameters left)
        load_module_state(model.module, optimizer, state)
