"""Tensor-parallel parameters as DTensors, as on torch's own tensor parallelism.

After `plait.tensor_parallel`, ``model.named_parameters()`` and ``model.state_dict()`` give each
parameter as a DTensor over the tp group: a split one as ``Shard(dim)`` of the full tensor (its
shape is the full shape), a replicated one as ``Replicate()``. torch's tools then see the model
as one process would: ``clip_grad_norm_`` takes the norm over every rank, ``torch.optim.Muon``
orthogonalizes the whole matrix, an optimizer's state is DTensors that DCP saves and reshards.

The model still computes with plain tensors. Each DTensor parameter stands on the *leaf*, the plain
tensor of this rank's rows that the module's attribute gives inside ``forward`` (the leaf sits in
the owner module's ``__dict__``, which attribute lookup reads before ``_parameters``: FSDP's
arrangement too). The DTensor's local tensor is the leaf's storage, so an optimizer's in-place
step is the model's new value. Autograd accumulates into the leaf; a hook then moves that
gradient onto the DTensor (``leaf.grad`` is None again), so ``zero_grad`` and accumulation over
several backwards act on the DTensor's gradient alone.

A vocabulary split padded at its end (V rows over tp ranks that do not divide it) is a DTensor too:
its local tensor is the leaf's valid rows; the padding rows stay out of the optimizer. A split that
a DTensor cannot describe (fused q/k/v weights split part by part) stays a plain local shard whose
gradient is marked (`plait.state.placement.pieces`): torch's clip refuses it by name.

plait's other strategies (DDP, FSDP, pipelines, expert parallelism, mixed precision) compute
their buckets, shards and stages over the plain leaves: each calls `to_plain_parameters` on the module
it wraps, which puts the leaves back as the parameters (marked as tp pieces, as before).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from plait._torch_compat import unwrap_apply, wrap_apply
from plait.state.dtensors import contiguous_stride, mesh_of
from plait.state.placement.pieces import mark_grad, mark_piece
from plait.state.placement.records import (
    ParamPlacement,
    ParamState,
    TPInfo,
    TPParam,
    placement_for,
    placement_of,
    set_placement,
    tp_param_of,
)
from plait.state.placement.shards import ShardSpec
from plait.state.placement.state import chunk_rows, full_as_shard, shard_as_full


def describable(spec: ShardSpec | None, size: int) -> bool:
    """Whether a DTensor describes this rank's rows: replicated, or `chunk_rows` of one block."""
    return spec is None or (spec.contiguous and chunk_rows(spec, size))


def place_tp_parameters(module: nn.Module, info: TPInfo) -> None:
    """Make every parameter of the tp-split ``module`` a DTensor over ``info.group`` standing on
    the plain tensor it was (see the module doc); mark those a DTensor cannot describe."""
    done: dict[int, TPParam | None] = {}
    for owner_name, mod in module.named_modules():
        for attr, p in list(mod._parameters.items()):
            if p is None:
                continue
            name = f"{owner_name}.{attr}" if owner_name else attr
            if id(p) not in done:
                spec = info.specs.get(name)
                if spec is not None and not describable(spec, info.size):
                    _mark_shard(p, name, spec, info)
                    done[id(p)] = None
                else:
                    done[id(p)] = _place(p, name, spec, info)
            rec = done[id(p)]
            if rec is None:
                continue
            rec.owners.append((mod, attr))
            mod._parameters[attr] = rec.param
            mod.__dict__[attr] = rec.leaf
            mod.register_state_dict_post_hook(partial(_state_entry, attr=attr, rec=rec))
            mod.register_load_state_dict_pre_hook(partial(_loaded_entry, attr=attr, rec=rec))
            wrap_apply(mod, _apply_placed)


def _place(leaf: nn.Parameter, name: str, spec: ShardSpec | None, info: TPInfo) -> TPParam:
    placements: list[Placement] = [Replicate() if spec is None else Shard(spec.dim)]
    shape = list(leaf.shape)
    if spec is not None:
        shape[spec.dim] = spec.full
    full = torch.Size(shape)
    rec = TPParam(name, leaf, leaf, spec, info)  # param set just below
    local = rec.rows(leaf.detach())
    dt = DTensor.from_local(local, mesh_of(info.group, leaf.device), placements, run_check=False,
                            shape=full, stride=contiguous_stride(full))
    rec.param = nn.Parameter(dt, requires_grad=leaf.requires_grad)
    placed = placement_for(leaf)  # the leaf's gradient hooks (tp's sums) stay in it
    placed.tp, placed.state = rec, ParamState.HOOK_MOVES_GRAD
    set_placement(rec.param, placed)
    if leaf.requires_grad:
        leaf.register_post_accumulate_grad_hook(partial(_move_grad, placed))
    return rec


def _move_grad(placed: ParamPlacement, leaf: torch.Tensor) -> None:
    """The leaf's post-accumulate hook: in `ParamState.HOOK_MOVES_GRAD`, its fresh gradient joins
    the DTensor's (``leaf.grad`` is None again); in any other state the gradient stays."""
    rec, g = placed.tp, leaf.grad
    if placed.state is not ParamState.HOOK_MOVES_GRAD or rec is None or rec.leaf is not leaf or g is None:
        return
    leaf.grad = None
    have = rec.param.grad
    if have is None:
        rec.param.grad = rec.as_dtensor(rec.rows(g))
    else:
        with torch.no_grad():
            local = have.to_local() if isinstance(have, DTensor) else have
            local.add_(rec.rows(g))


def _apply_placed(mod: nn.Module, apply: Any, fn: Any, recurse: bool = True) -> nn.Module:
    """``mod._apply`` (what ``.to()``, ``.double()``, ``.cuda()`` run) for a module owning tp
    DTensor parameters: the conversion runs on the leaves, then each DTensor is rebuilt on its
    converted leaf in place (the same parameter object, so an optimizer made before keeps it)."""
    recs = [(attr, rec) for attr, p in mod._parameters.items()
            if (rec := tp_param_of(p)) is not None and rec.param is p]
    for attr, rec in recs:
        mod._parameters[attr] = rec.leaf
    try:
        return apply(fn, recurse)
    finally:
        for attr, rec in recs:
            leaf = mod._parameters[attr]
            assert leaf is not None
            if leaf is not rec.leaf:  # converted into a new tensor (torch's swap-on-conversion)
                _rebind(rec, leaf)
            mod._parameters[attr], mod.__dict__[attr] = rec.param, rec.leaf
            local = rec.rows(rec.leaf.detach())
            now = rec.dtensor.to_local()
            if now.data_ptr() != local.data_ptr() or now.dtype != local.dtype or now.device != local.device:
                fresh = DTensor.from_local(local, mesh_of(rec.info.group, local.device),
                                           rec.dtensor.placements, run_check=False, shape=rec.param.shape,
                                           stride=rec.param.stride())
                placed = placement_of(rec.param)
                torch.utils.swap_tensors(rec.param, nn.Parameter(fresh, rec.param.requires_grad))
                assert placed is not None
                set_placement(rec.param, placed)  # the swap took the attributes with it


def _rebind(rec: TPParam, leaf: nn.Parameter) -> None:
    placed = placement_of(rec.param)
    assert placed is not None
    set_placement(leaf, placed)
    if leaf.requires_grad:  # the old leaf's hook sees it is no longer the leaf
        leaf.register_post_accumulate_grad_hook(partial(_move_grad, placed))
    rec.leaf = leaf
    for mod, attr in rec.owners:
        mod.__dict__[attr] = leaf


def _records(module: nn.Module) -> list[ParamPlacement]:
    """The records of the tp DTensor parameters ``module`` holds, placed, each once."""
    found: dict[int, ParamPlacement] = {}
    for mod in module.modules():
        for p in mod._parameters.values():
            placed = placement_of(p)
            if placed is not None and placed.tp is not None and placed.tp.param is p:
                found.setdefault(id(placed), placed)
    return list(found.values())


def let_wrapper_assign_grads(module: nn.Module) -> None:
    """For a wrapper that reduces the leaves' gradients itself and then assigns them (DDP, over the
    leaves: `plain_leaf`): stop moving each fresh gradient onto the DTensor
    (`ParamState.WRAPPER_ASSIGNS_GRAD`); the wrapper calls `gradient_assigned` on the leaf with the
    finished one, which the DTensor's gradient then shares. Before autograd accumulates into a leaf,
    a published gradient the user dropped from the DTensor since (``zero_grad()``) is dropped from
    the leaf too, so nothing stale is added to."""
    for placed in _records(module):
        if placed.state is not ParamState.HOOK_MOVES_GRAD:
            continue
        placed.state = ParamState.WRAPPER_ASSIGNS_GRAD
        assert placed.tp is not None
        if placed.tp.leaf.requires_grad:
            placed.tp.leaf.register_hook(partial(_drop_stale, placed))


def _drop_stale(placed: ParamPlacement, grad: torch.Tensor) -> None:
    # Only a gradient published and dropped since: one still accumulating (DDP's no_sync) stays.
    rec = placed.tp
    if placed.state is ParamState.GRAD_PUBLISHED and rec is not None and rec.param.grad is None:
        rec.leaf.grad = None
        placed.state = ParamState.WRAPPER_ASSIGNS_GRAD


def gradient_assigned(leaf: torch.Tensor) -> None:
    """A wrapper assigned ``leaf.grad`` (see `let_wrapper_assign_grads`): the DTensor's gradient becomes its
    rows, the same memory (`ParamState.GRAD_PUBLISHED`); a leaf that is no tp DTensor's keeps its
    mark (`mark_grad`)."""
    placed = placement_of(leaf)
    rec = None if placed is None else placed.tp
    if placed is None or rec is None or rec.leaf is not leaf or placed.state not in _WRAPPER_ASSIGNS:
        mark_grad(leaf)
        return
    g = leaf.grad
    rec.param.grad = None if g is None else rec.as_dtensor(rec.rows(g))
    placed.state = ParamState.WRAPPER_ASSIGNS_GRAD if g is None else ParamState.GRAD_PUBLISHED


_WRAPPER_ASSIGNS = (ParamState.WRAPPER_ASSIGNS_GRAD, ParamState.GRAD_PUBLISHED)


def to_plain_parameters(module: nn.Module) -> None:
    """Put every tp DTensor parameter of ``module`` back as the plain leaf it stands on (its
    gradient with it), marked as a tp piece: for a strategy that shards, buckets or stages plain
    parameters (DDP, FSDP, pipelines, expert parallelism, mixed precision). The record the two
    shared stays the leaf's, in `ParamState.PLAIN`, without ``tp``."""
    inside = {id(m) for m in module.modules()}
    for placed in _records(module):
        rec = placed.tp
        assert rec is not None
        if placed.state in _WRAPPER_ASSIGNS:
            raise ValueError(f"'{rec.name}' is already in a wrapper that reduces its gradient (DDP): "
                             "apply this strategy before that wrapper")
        for mod, attr in rec.owners:  # a tied parameter has several
            if id(mod) in inside and mod._parameters.get(attr) is rec.param:
                mod._parameters[attr] = rec.leaf
                mod.__dict__.pop(attr, None)
                unwrap_apply(mod)
        _grad_back(rec)
        placed.tp, placed.state = None, ParamState.PLAIN
        if rec.spec is not None:
            _mark_shard(rec.leaf, rec.name, rec.spec, rec.info)


def _grad_back(rec: TPParam) -> None:
    g = rec.param.grad
    if g is None:
        return
    rec.param.grad = None
    rec.leaf.grad = rec.padded(g)


def _mark_shard(p: nn.Parameter, name: str, spec: ShardSpec, info: TPInfo) -> None:
    """Mark ``p``, tp rank ``info.rank``'s plain shard of ``name``, as a piece torch's norms refuse;
    its optimizer state as DTensors where a DTensor describes the split (a fused one's module
    ``state_dict()`` refuses by name; plain state keeps torch.save per rank working)."""
    n, r = info.size, info.rank
    placed: dict[str, Any] = {"to_full": partial(shard_as_full, spec=spec, info=info, name=name),
                              "to_local": partial(full_as_shard, spec=spec)} if chunk_rows(spec, n) else {}
    mark_piece(p, f"tp rank {r}'s shard of '{name}' (tp={n})", split=True, **placed)


# ------------------------------------------------------------------ the module's state dict
def _state_entry(mod: nn.Module, state: dict[str, Any], prefix: str, _meta: Any, *, attr: str,
                 rec: TPParam) -> None:
    """A replicated parameter's entry is its plain tensor, as a one-process model's is: it loads
    anywhere (DCP keeps one copy of such an entry); a split one stays the DTensor of the full
    tensor, on this rank's storage. ``keep_vars=True`` gives the parameter as held."""
    key = prefix + attr
    t = state.get(key)
    if mod._parameters.get(attr) is not rec.param:  # made plain again: another strategy's tensor
        return
    if rec.spec is None and isinstance(t, DTensor) and not isinstance(t, nn.Parameter):
        state[key] = t.to_local()


def _loaded_entry(mod: nn.Module, state: dict[str, Any], prefix: str, *_: Any, attr: str,
                  rec: TPParam) -> None:
    """What ``load_state_dict`` gets for this parameter as a DTensor placed like it: a DTensor of
    the full tensor in any layout, one process's full tensor, or this rank's plain rows (a split
    one's value comes here as the latter, from `plait.state.placement.state.place_state_dict`'s hook)."""
    key = prefix + attr
    value = state.get(key)
    if mod._parameters.get(attr) is not rec.param or not isinstance(value, torch.Tensor):
        return
    if isinstance(value, DTensor) and value.device_mesh == rec.dtensor.device_mesh \
            and value.placements == rec.dtensor.placements:
        return
    if rec.spec is None:
        local = value.full_tensor() if isinstance(value, DTensor) else value
    else:
        local = rec.rows(full_as_shard(value, rec.leaf, rec.spec))
    # On the leaf's device: a state dict loaded on the CPU goes into a GPU model too.
    state[key] = rec.as_dtensor(local.to(device=rec.leaf.device, dtype=rec.leaf.dtype))
