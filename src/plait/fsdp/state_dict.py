"""State dicts for plait's FSDP: a full one for export, a sharded one for checkpoints.

* **Full**: every original parameter gathered (one flat group at a time, over the fsdp axis)
  and copied to CPU under its original name; persistent buffers as they are. Over tensor
  parallelism each tp-sharded tensor is then gathered over tp as well, so the result is the
  original model's full tensors there too. Loading slices each tensor back into this rank's
  shard (its tp shard first, over tensor parallelism).
* **Sharded**: each original parameter as a DTensor ``Shard(0)`` over the fsdp axis (dim-0
  chunks, the last ones possibly short or empty: the parameters themselves, placed as
  `plait.fsdp.flat` places them), so `torch.distributed.checkpoint` can save it and load it at
  a different number of ranks. Optimizer state that has the shape of a parameter (Adam's
  moments) is stored the same way under ``optim.<param>.<key>``; scalar state (``step``) per
  parameter as a plain tensor. No communication. Over tensor parallelism, a parameter's entry
  is its tp shard as a DTensor over tp instead (the original model's full shape; a fused or
  padded split too, which the parameters' own placement cannot describe), so the keys and
  shapes match every other layout: that needs the tp shards whole, one all-gather over fsdp per
  flat group, so a rank briefly holds one unit, never the model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from plait.fsdp.flat import FlatParam
from plait.fsdp.layout import ShardCfg, Slot
from plait.fsdp.units import Unit
from plait.runtime import comm
from plait.state.checkpoint.protocol import state_layout
from plait.state.dtensors import local_of
from plait.state.placement.records import TPInfo
from plait.state.placement.state import checkpoint_entry, gather_full, restore_entry, rows_entry
from plait.state.state_dict import with_other_experts, without_others_experts
from plait.state.tensor_source import FullValue, flat_range, whole


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


def _names(model: ShardedModel) -> set[str]:
    return {n for f in _flats(model) for s in f.slots for n in (s.fqn, *s.aliases)}


def _buffers(model: ShardedModel, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """The wrapped module's state besides FSDP's parameters: buffers and experts."""
    names = _names(model)
    return {k: v for k, v in model.module.state_dict(keep_vars=keep_vars).items() if k not in names}


def _shard_of(flat: FlatParam) -> torch.Tensor:
    """This rank's parameter chunks end to end (what the all-gather sends)."""
    return flat.pack([flat.local(i) for i in range(len(flat.slots))])


def _gather_flat(flat: FlatParam, shard: torch.Tensor) -> torch.Tensor:
    """The gathered, parameter-major vector (`FlatParam.param_major`) of a shard-shaped tensor,
    on the compute device: slot ``s`` is ``out[s.offset : s.offset + s.numel]``."""
    src = shard.detach().to(flat.cfg.device)
    out = torch.empty(flat.padded, dtype=src.dtype, device=src.device)
    comm.all_gather_into(out, src.contiguous(), flat.cfg.group)
    return flat.param_major(out)


def _value(full: torch.Tensor, s: Slot) -> torch.Tensor:
    return full[s.offset : s.offset + s.numel].view(s.shape)


@torch.no_grad()
def _scatter_flat(flat: FlatParam, full: torch.Tensor, dest: torch.Tensor) -> None:
    """Fill the shard-shaped ``dest`` with this rank's rows of each slot of parameter-major ``full``."""
    dest.zero_()
    for i, s in enumerate(flat.slots):
        a, b = s.rows_of(flat.cfg.rank)
        flat.local(i, dest).copy_(_value(full, s)[a:b] if not s.replicated else _value(full, s))


def full_state_dict(model: ShardedModel) -> dict[str, torch.Tensor]:
    """Every parameter and buffer at full size on CPU, the same on every rank: one all-gather per
    flat group over fsdp, then, over tensor parallelism, one per tp-sharded slot over tp (the slot
    holds this rank's tp shard; `plait.state.placement.state.gather_full` drops uneven splits' padding)."""
    out: dict[str, torch.Tensor] = {}
    for flat in _flats(model):
        full = _gather_flat(flat, _shard_of(flat))
        for s in flat.slots:
            value = _value(full, s)
            if model.tp is not None:
                value = gather_full(value, model.tp.specs.get(s.fqn), model.tp)
            value = value.to("cpu", copy=True)
            for name in (s.fqn, *s.aliases):  # a tied weight under each of its names, as in state_dict()
                out[name] = value
    for name, b in _buffers(model).items():  # buffers (and experts)
        out[name] = b.detach().cpu().clone()
    return with_other_experts(model.module, out)


def _check_keys(model: ShardedModel, state: Mapping, expected: set[str], what: str) -> None:
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise KeyError(f"{what}(state=...): missing keys {missing[:8]}, unexpected keys {unexpected[:8]} "
                       f"for {type(model.module).__name__}")


@torch.no_grad()
def load_full_state_dict(model: ShardedModel, state: Mapping[str, FullValue]) -> None:
    """Load full tensors (as `full_state_dict` returns them): each rank keeps its rows. No
    communication: every rank holds the whole ``state``. Only this rank's rows of each tensor are
    read, so a `plait.state.tensor_source.TensorSource` is asked for those rows only (over tensor
    parallelism: for the rank's tp shard, then cut)."""
    buffers = _buffers(model)
    state = without_others_experts(model.module, state)
    _check_keys(model, state, _names(model) | set(buffers), "load_full_state_dict")
    for flat in _flats(model):
        for i, s in enumerate(flat.slots):
            value = _local_value(model, s.fqn, state[s.fqn], s.shape)()
            a, b = s.rows_of(flat.cfg.rank)
            local = flat.local(i)
            local.copy_(whole(value).reshape(local.shape) if s.replicated
                        else flat_range(value, a * s.row, b * s.row).view(local.shape))
    for name, buf in buffers.items():
        buf.copy_(whole(state[name]))


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
def _to_entries(model: ShardedModel, flat: FlatParam, locals_: list[torch.Tensor]) -> Sequence[torch.Tensor]:
    """Checkpoint entries of per-slot local tensors (parameters or optimizer state), one per slot.

    Without tensor parallelism: the DTensors themselves (``Shard(0)`` over fsdp, HSDP replicated
    over dp), made from the locals. With it, a slot is a tp shard of the original parameter: the
    flat vector is gathered over fsdp (one unit at a time) and each slot becomes
    `plait.state.placement.state.checkpoint_entry` of its tp shard, a DTensor over tp that every fsdp rank of
    the tp coordinate writes alike (stored once); that also covers fused and padded tp splits.
    """
    if model.tp is None:
        return [flat._dtensor(i, t.detach().clone()) for i, t in enumerate(locals_)]
    full = _gather_flat(flat, flat.pack(locals_, locals_[0].dtype if locals_ else None))
    return [checkpoint_entry(_value(full, s), model.tp.specs.get(s.fqn), model.tp, s.fqn) for s in flat.slots]


def _from_entries(model: ShardedModel, flat: FlatParam, values: list[torch.Tensor],
                  dests: list[torch.Tensor]) -> None:
    """Inverse of `_to_entries`: fill this rank's local tensors ``dests`` from loaded entries."""
    if model.tp is None:
        for i, (v, d) in enumerate(zip(values, dests, strict=True)):
            d.copy_(_rows_of_entry(flat, i, v))
        return
    full = torch.zeros(flat.padded, dtype=dests[0].dtype, device=flat.cfg.device)
    for s, v in zip(flat.slots, values, strict=True):
        restore_entry(_value(full, s), v, model.tp.specs.get(s.fqn))
    shard = torch.zeros(flat.shard_size, dtype=full.dtype, device=full.device)
    _scatter_flat(flat, full, shard)
    for i, d in enumerate(dests):
        d.copy_(flat.local(i, shard))


def _rows_of_entry(flat: FlatParam, i: int, value: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a loaded entry: its local tensor when placed as this slot is (a
    template this module made), else cut from the full tensor (a DTensor placed otherwise)."""
    mine = flat.params[i]
    if isinstance(value, DTensor):
        if value.device_mesh == mine.device_mesh and value.placements == mine.placements:
            return value.to_local()
        value = value.full_tensor()
    s = flat.slots[i]
    a, b = s.rows_of(flat.cfg.rank)
    return value.reshape(s.shape) if s.replicated else value.reshape(s.shape)[a:b]


def sharded_state_dict(model: ShardedModel, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """``{"model": {name: DTensor | buffer}, "optim": {...}}``; also a template for `dcp.load`.

    For an optimizer that has not stepped yet, the optim entries are zero-filled templates of
    the layout it will have, so a checkpoint can be loaded into a fresh optimizer.
    """
    model_sd: dict[str, torch.Tensor] = {}
    optim_sd: dict[str, torch.Tensor] = {}
    layout = state_layout(optimizer) if optimizer is not None else {}
    for flat in _flats(model):
        locals_ = [flat.local(i) for i in range(len(flat.slots))]
        for s, dt in zip(flat.slots, _to_entries(model, flat, locals_), strict=True):
            for name in (s.fqn, *s.aliases):  # a tied weight under each of its names, as in state_dict()
                model_sd[name] = dt
        if optimizer is None or not flat.requires_grad:
            continue
        states = [optimizer.state.get(p, {}) for p in flat.params]
        for key, kind in layout.items():
            if kind == "elem":
                values = [local_of(st[key]) if key in st else torch.zeros_like(t)
                          for st, t in zip(states, locals_, strict=True)]
                for s, dt in zip(flat.slots, _to_entries(model, flat, values), strict=True):
                    optim_sd[f"{s.fqn}.{key}"] = dt
            else:
                for s, st in zip(flat.slots, states, strict=True):
                    value = st.get(key, torch.zeros((), dtype=torch.float32))
                    optim_sd[f"{s.fqn}.{key}"] = local_of(torch.as_tensor(value)).detach().clone()
    for name, b in _buffers(model).items():
        model_sd[name] = b.detach().clone()
    if optimizer is not None:  # the experts' state: whole tensors, like a plain module's
        optim_sd.update(_expert_state(model, optimizer, layout))
    return {"model": model_sd, "optim": optim_sd} if optimizer is not None else {"model": model_sd}


def _experts(model: ShardedModel) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.module.named_parameters() if not isinstance(p, DTensor)]


def _expert_state(model: ShardedModel, optimizer: torch.optim.Optimizer, layout: dict[str, str]) -> dict:
    out: dict[str, torch.Tensor] = {}
    for name, p in _experts(model):
        if not p.requires_grad:
            continue
        state = optimizer.state.get(p, {})
        for key, kind in layout.items():
            default = torch.zeros_like(p) if kind == "elem" else torch.zeros((), dtype=torch.float32)
            value = torch.as_tensor(state.get(key, default)).detach().clone()
            out[f"{name}.{key}"] = rows_entry(value, p) if kind == "elem" else value
    return out


@torch.no_grad()
def load_sharded_state_dict(model: ShardedModel, state: dict,
                            optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a (DCP-filled) `sharded_state_dict` into the shards and, if given, the optimizer."""
    model_sd = state["model"]
    buffers = _buffers(model)
    _check_keys(model, model_sd, _names(model) | set(buffers), "load_sharded_state_dict")
    layout = state_layout(optimizer) if optimizer is not None else {}
    for flat in _flats(model):
        locals_ = [flat.local(i) for i in range(len(flat.slots))]
        _from_entries(model, flat, [model_sd[s.fqn] for s in flat.slots], locals_)
        if optimizer is None or not flat.requires_grad:
            continue
        new: list[dict[str, torch.Tensor]] = [{} for _ in flat.slots]
        for key, kind in layout.items():
            values = [state["optim"][f"{s.fqn}.{key}"] for s in flat.slots]
            if kind == "elem":
                dests = [torch.zeros_like(t) for t in locals_]
                _from_entries(model, flat, values, dests)
                for i, d in enumerate(dests):
                    new[i][key] = flat._dtensor(i, d)
            else:
                for i, v in enumerate(values):
                    new[i][key] = local_of(v).detach().clone()
        for p, st in zip(flat.params, new, strict=True):
            optimizer.state[p] = st
    for name, buf in buffers.items():  # the experts' values too
        buf.copy_(model_sd[name])
    if optimizer is not None:  # the experts' state: whole tensors, like a plain module's
        for name, p in _experts(model):
            if p.requires_grad:
                optimizer.state[p] = {k: local_of(state["optim"][f"{name}.{k}"]).detach().clone()
                                      for k in layout}
