"""The state of a tensor-parallel model: full (unsharded) state dicts, and checkpoint entries
(DTensors of the full tensors) that load at any tp size. `plait.full_state_dict` and
`plait.checkpoint`'s default path call these for a tensor-parallel module; FSDP over tp calls
`gather_full`, `checkpoint_entry` and `restore_entry` per flat slot.

All read the shard layout that `plait.tensor_parallel` records (`plait.state.placement.tp_info(model).specs`);
parameters without a spec are replicated on every tp rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from torch import nn

from plait.runtime import comm
from plait.state.dtensors import contiguous_stride, local_of, mesh_of
from plait.state.placement.records import TPInfo, expert_of, plain_leaf, rows_of, tp_info, tp_module
from plait.state.placement.shards import ShardSpec
from plait.state.tensor_source import FullValue, whole


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every entry of ``model.state_dict()`` at its full, unpadded size, on every tp rank.

    Sharded entries are all-gathered over the tp group (one all-gather each), so the result
    loads into the single-process model or, through `load_full_state_dict`, into a
    tensor-parallel one of any tp size. Keys are those of the tensor-parallel module itself
    (without the ``module.`` prefix of a DDP wrapper around it).
    """
    inner = tp_module(model)  # not `or`: a compiled wrapper's truth value asks for its len()
    model = model if inner is None else inner
    info = tp_info(model)
    _check_not_fsdp(model, "full_state_dict")
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():  # the tensors held (not DTensor views)
        t = plain_leaf(t)
        spec = info.specs.get(name) if info is not None else None
        out[name] = t.detach().clone() if spec is None else gather_full(t, spec, info)
    return out


@torch.no_grad()
def gather_full(t: torch.Tensor, spec: ShardSpec | None, info: TPInfo | None) -> torch.Tensor:
    """The full tensor of which ``t`` is this rank's shard, on every tp rank (one all-gather over
    ``info.group``); ``t`` itself when replicated (``spec`` None).

    Rank r's rows start at ``r * spec.local``, so the shards concatenated in rank order are the
    full tensor followed by the padding of an uneven (vocabulary) split, which is cut off.
    """
    if spec is None or info is None:  # a spec always comes from an info's specs
        return t.detach()
    moved = t.detach().movedim(spec.dim, 0).contiguous()
    buf = moved.new_empty((info.size * moved.shape[0], *moved.shape[1:]))
    comm.all_gather_into(buf, moved, info.group)
    if not spec.contiguous:  # a fused tensor: part i is the ranks' i-th blocks, in rank order
        per_rank = buf.view(info.size, moved.shape[0], *moved.shape[1:])
        blocks, at = [], 0
        for _, rows in spec.pieces():
            blocks.append(per_rank[:, at : at + rows].reshape(-1, *moved.shape[1:]))
            at += rows
        buf = torch.cat(blocks)
    return buf[: spec.full].movedim(0, spec.dim).contiguous()


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: Mapping[str, FullValue]) -> None:
    """Load full-size tensors (e.g. from `full_state_dict` or a single-process model) into a
    tensor-parallel ``model``: each rank copies its slice (of a `plait.state.tensor_source.TensorSource`
    it reads only that slice; replicated tensors whole). No communication. Keys as in
    `full_state_dict`."""
    inner = tp_module(model)  # not `or`: a compiled wrapper's truth value asks for its len()
    model = model if inner is None else inner
    info = tp_info(model)
    _check_not_fsdp(model, "load_full_state_dict")
    own = model.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise KeyError(f"load_full_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    loaded: set[int] = set()
    for name, target in own.items():
        target = plain_leaf(target)
        if id(target) in loaded:  # a tied tensor, listed under each of its names, is read once
            continue
        loaded.add(id(target))
        spec = info.specs.get(name) if info is not None else None
        value = state[name]
        if spec is not None:
            if value.shape[spec.dim] != spec.full:
                raise ValueError(f"load_full_state_dict: {name!r} has {value.shape[spec.dim]} entries "
                                 f"along dim {spec.dim}, expected the full {spec.full}")
            value = spec.take(value)
        if value.shape != target.shape:
            raise ValueError(f"load_full_state_dict: {name!r} has shape {tuple(value.shape)}, "
                             f"expected {tuple(target.shape)}")
        target.copy_(whole(value))


def _check_not_fsdp(model: nn.Module, what: str) -> None:
    """FSDP over the tp model shards its parameters again (DTensors placed over fsdp too): a
    state dict of the module would silently hold this rank's fsdp rows only."""
    from torch.distributed.tensor import DTensor

    info = tp_info(model)
    sd = model.state_dict(keep_vars=True)
    kept = [sd[n] for n in info.specs if n in sd] if info is not None else []
    if info is not None and info.specs and (
            not kept or any(isinstance(plain_leaf(t), DTensor) for t in kept)):
        raise ValueError(f"plait.state.placement.state.{what}: this tensor-parallel model is wrapped by "
                         f"FSDP, which holds its parameters: call plait.{what}(model) on the FSDP wrapper")


# ------------------------------------------------------------------ checkpoint entries
def chunk_rows(spec: ShardSpec, size: int) -> bool:
    """Whether every rank's valid rows are exactly its ``torch.chunk`` part (DTensor's Shard).

    True for even splits and vocabulary splits padded at the end in single rows; never for a
    fused tensor (its rows are one block per part).
    """
    if not spec.contiguous:
        return False
    per = -(-spec.full // size)
    chunks = [max(0, min(per, spec.full - r * per)) for r in range(size)]
    mine = [max(0, min(spec.local, spec.full - r * spec.local)) for r in range(size)]
    return chunks == mine


def checkpoint_entry(t: torch.Tensor, spec: ShardSpec | None, info: TPInfo | None,
                     name: str = "") -> torch.Tensor:
    """``t`` (this rank's shard when ``spec``) as an entry of the full-size checkpoint layout.

    A shard becomes a DTensor of the full tensor over the tp group, ``Shard(spec.dim)``, holding
    this rank's valid rows (padding is not saved), so each rank writes its own rows and any
    layout can read them back. No communication, except for a fused tensor (q, k and v in one
    weight), whose rows DTensor cannot describe: it is gathered over tp (one all-gather) and
    saved whole, as a replicated entry that any layout reads back (`restore_entry`).
    """
    t = t.detach()
    if spec is None or info is None:  # a spec always comes from an info's specs
        return t.clone()
    if not spec.contiguous:
        return gather_full(t, spec, info)
    if not chunk_rows(spec, info.size):
        raise ValueError(f"checkpoint: {name!r} is split into {spec.local}-row shards of {spec.full} "
                         f"rows over tp={info.size}, which is not DTensor's chunking; cannot save it")
    return _full_dtensor(t.narrow(spec.dim, 0, spec.valid).contiguous().clone(), spec, info)


def _full_dtensor(rows: torch.Tensor, spec: ShardSpec, info: TPInfo) -> torch.Tensor:
    """This rank's valid ``rows`` as the DTensor ``Shard(spec.dim)`` of the full tensor over tp."""
    from torch.distributed.tensor import DTensor, Shard

    shape = list(rows.shape)
    shape[spec.dim] = spec.full
    full = torch.Size(shape)
    return DTensor.from_local(rows, mesh_of(info.group, rows.device), [Shard(spec.dim)], run_check=False,
                              shape=full, stride=contiguous_stride(full))


@torch.no_grad()
def restore_entry(target: torch.Tensor, value: torch.Tensor, spec: ShardSpec | None) -> None:
    """Copy a loaded `checkpoint_entry` back into this rank's tensor (its shard when ``spec``)."""
    from torch.distributed.tensor import DTensor

    if spec is None:
        target.copy_(local_of(value))
    elif not spec.contiguous:  # saved whole (see checkpoint_entry)
        target.copy_(spec.take(value))
    else:
        assert isinstance(value, DTensor), "a tp shard's template entry is a DTensor"
        target.narrow(spec.dim, 0, spec.valid).copy_(value.to_local())


def expert_or_tp_entry(t: torch.Tensor, p: nn.Parameter, spec: ShardSpec | None, info: TPInfo | None,
                       name: str = "") -> torch.Tensor:
    """`checkpoint_entry` of ``t`` (``p``'s value, or per-element state of it); for rows of a stacked
    expert tensor, gathered over tp first where tp splits them too, then `rows_entry` over ep."""
    if rows_of(p) is None:
        return checkpoint_entry(t, spec, info, name)
    return rows_entry(gather_full(t, spec, info).clone() if spec is not None else t.detach().clone(), p)


@torch.no_grad()
def restore_expert_or_tp(target: torch.Tensor, value: torch.Tensor, p: nn.Parameter,
                         spec: ShardSpec | None) -> None:
    """The inverse of `expert_or_tp_entry`: copy a loaded entry into this rank's tensor."""
    if rows_of(p) is None:
        restore_entry(target, value, spec)
        return
    rows = local_of(value)
    target.copy_(spec.take(rows) if spec is not None else rows)


def rows_entry(t: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
    """``t`` (``p``'s value, or per-element state of it) as the full stacked expert tensor it holds
    rows of (`plait.state.placement.StackedRows`): a DTensor ``Shard(0)`` over the ep group, sharing
    ``t``'s storage, so torch.distributed.checkpoint writes each rank's rows and can reshard them.
    ``t`` itself where ``p`` holds no such rows."""
    rows, where = rows_of(p), expert_of(p)
    if rows is None or where is None or where.ep_size == 1:
        return t
    from torch.distributed.tensor import DTensor, Shard

    shape = torch.Size((rows.full, *t.shape[1:]))
    return DTensor.from_local(t, mesh_of(where.ep, t.device), [Shard(0)], run_check=False, shape=shape,
                              stride=contiguous_stride(shape))


def local_rows(value: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
    """This rank's rows of a stacked expert tensor given as a `rows_entry` DTensor, the full tensor
    (a one-process state dict) or the rows themselves."""
    from torch.distributed.tensor import DTensor, Shard

    rows = rows_of(p)
    if rows is None:
        return value
    if isinstance(value, DTensor):
        if tuple(value.placements) == (Shard(0),) and value.to_local().shape == p.shape:
            return value.to_local()
        value = value.full_tensor()
    if value.shape[0] == rows.full and rows.full != p.shape[0]:
        return value.narrow(0, rows.first, p.shape[0])
    return value


# ------------------------------------------------------------------ the module's own state_dict()
def place_state_dict(module: nn.Module, info: TPInfo) -> None:
    """Make ``module.state_dict()`` give each tp shard as the full tensor it is a piece of: a
    DTensor ``Shard(dim)`` over the tp group holding this rank's valid rows, on this rank's
    storage (no copy), which torch.distributed.checkpoint saves and reshards, as on torch's own
    tensor parallelism. Under the same name on every tp rank the plain shards would be taken for
    copies of one tensor: DCP would keep one rank's and load it everywhere. ``load_state_dict``
    then takes such DTensors, the full tensors one process saves, or this rank's shards.

    A shard DTensor cannot describe (a fused q/k/v weight split per part) makes ``state_dict()``
    raise by name, pointing to `plait.full_state_dict` and plait's checkpoints, which gather it.
    ``state_dict(keep_vars=True)`` gives the held tensors as they are (what plait reads)."""
    owners = dict(module.named_modules())
    for name, spec in info.specs.items():
        owner, _, attr = name.rpartition(".")
        mod = owners[owner]
        mod.register_state_dict_post_hook(partial(_shard_as_dtensor, attr=attr, spec=spec, info=info,
                                                  name=name))
        mod.register_load_state_dict_pre_hook(partial(_dtensor_as_shard, attr=attr, spec=spec))


def _shard_as_dtensor(mod: nn.Module, state: dict[str, Any], prefix: str, _meta: Any, *, attr: str,
                      spec: ShardSpec, info: TPInfo, name: str) -> None:
    from torch.distributed.tensor import DTensor

    t = state.get(prefix + attr)
    if isinstance(t, torch.Tensor) and not isinstance(t, (nn.Parameter, DTensor)):  # keep_vars, FSDP's: as is
        state[prefix + attr] = shard_as_full(t, spec, info, name)


def _dtensor_as_shard(mod: nn.Module, state: dict[str, Any], prefix: str, *_: Any, attr: str,
                      spec: ShardSpec) -> None:
    value = state.get(prefix + attr)
    if isinstance(value, torch.Tensor):
        state[prefix + attr] = full_as_shard(value, getattr(mod, attr), spec)


def shard_as_full(t: torch.Tensor, spec: ShardSpec, info: TPInfo, name: str) -> torch.Tensor:
    """This rank's shard ``t`` (a parameter's, or its optimizer state's) as the DTensor ``Shard(dim)``
    of the full tensor over the tp group, on ``t``'s own storage (no copy); raises by name for a
    split a DTensor cannot describe."""
    if not chunk_rows(spec, info.size):
        raise ValueError(
            f"state_dict(): {name!r} is split over tp={info.size} in a way a DTensor cannot describe "
            f"({'one block per fused part' if not spec.contiguous else 'uneven rows'}), so "
            "torch.distributed.checkpoint could not save it right: save with plait.full_state_dict(model) "
            "or plait's checkpoints (plait.checkpoint.save), which gather it")
    return _full_dtensor(t.narrow(spec.dim, 0, spec.valid), spec, info)


@torch.no_grad()
def full_as_shard(value: torch.Tensor, held: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The inverse of `shard_as_full` for loading into ``held`` (this rank's tensor, whose padding
    rows are kept): a `shard_as_full` DTensor, another layout's DTensor of the full tensor, one
    process's full tensor, or this rank's shard itself."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(value, DTensor):
        if tuple(value.placements) == (Shard(spec.dim),) and value.to_local().shape[spec.dim] == spec.valid:
            shard = held.detach().clone()
            shard.narrow(spec.dim, 0, spec.valid).copy_(value.to_local())
            return shard
        value = value.full_tensor()  # another layout's DTensor (a collective, as DCP's load is)
    return spec.take(value) if value.shape != held.shape else value
