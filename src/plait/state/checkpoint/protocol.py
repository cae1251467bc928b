"""The checkpoint protocol: how a model in any layout hands its state to `plait.checkpoint`.

Every layout saves under one key layout, the original model's names and full shapes::

    {"model": {fqn: tensor}, "optim": {f"{fqn}.{state_key}": tensor}}

so a checkpoint written by one layout loads into any other. A wrapper says what it saves and
how it loads with two methods (`Checkpointable`); `state_dict` and `load_state_dict` call them
and know no wrapper type:

* ``checkpoint_state(optimizer)`` returns this rank's entries in that layout, as tensors
  `torch.distributed.checkpoint` can write: a DTensor of the full tensor for an entry this rank
  holds a shard of, a plain tensor for a replicated one (DCP stores it once). The same call
  makes the template `dcp.load` fills in place, so it must work before the optimizer stepped.
* ``load_checkpoint_state(state, optimizer)`` puts a filled template back.

FSDP returns its sharded state dict; a pipeline, its own stages' entries (`module_state`,
renaming weights tied across pp ranks); DDP and DataParallel, their module's. Any other module
takes the default path, `module_state`: its ``state_dict()``, with a tensor-parallel module's
shards as DTensors over tp (`plait.state.placement.state.checkpoint_entry`) and the rows of stacked
experts split over ep as DTensors over ep (`plait.state.placement.state.rows_entry`).

The optimizer side is duck-typed as well: an optimizer that steps only a share of the
parameters (`plait.ZeroRedundancyOptimizer`) answers ``owns(p)``, and only the owner of a
parameter writes and reads its optimizer state.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from plait.state.placement.records import TPInfo, plain_leaf, tp_info, tp_module, tp_param_of
from plait.state.placement.state import expert_or_tp_entry, restore_expert_or_tp


class Checkpointable(Protocol):
    """A layout that supplies its own checkpoint entries (FSDP, a pipeline, DDP, DataParallel)."""

    def checkpoint_state(self, optimizer: Any) -> dict[str, Any]:
        """``{"model": {fqn: tensor}, "optim": {f"{fqn}.{key}": tensor}}`` of this rank."""
        ...

    def load_checkpoint_state(self, state: dict[str, Any], optimizer: Any) -> None:
        """Load a `checkpoint_state` template that DCP has filled."""
        ...


def state_dict(model: Checkpointable | nn.Module, optimizer: Any) -> dict[str, Any]:
    """This rank's view of the model and optimizer in the shared layout (also a `load` template)."""
    own = getattr(model, "checkpoint_state", None)
    return own(optimizer) if own is not None else module_state(_plain(model), optimizer)


def load_state_dict(model: Checkpointable | nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
    """Put a filled `state_dict` template back into the model and optimizer."""
    own = getattr(model, "load_checkpoint_state", None)
    if own is not None:
        own(state, optimizer)
    else:
        load_module_state(_plain(model), optimizer, state)


def _plain(model: Any) -> nn.Module:
    """``model`` for the default path, which reads ``state_dict()``: a module, else an error."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"plait.checkpoint: a {type(model).__name__} is neither an nn.Module nor has "
                        "checkpoint_state(optimizer) and load_checkpoint_state(state, optimizer)")
    return model


def state_layout(optimizer: Any) -> dict[str, str]:
    """Which optimizer state keys are per-element ("elem") and which scalar, found by stepping a
    throwaway copy of the optimizer on a two-element parameter."""
    dummy = nn.Parameter(torch.zeros(2))
    dummy.grad = torch.zeros(2)
    cls = getattr(optimizer, "optimizer_class", type(optimizer))  # the class a ZeRO wrapper runs
    accepted = inspect.signature(cls.__init__).parameters
    probe = cls([dummy], **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    probe.step()
    return {k: "elem" if torch.is_tensor(v) and v.shape == dummy.shape else "scalar"
            for k, v in probe.state[dummy].items()}


def _steps(optimizer: Any, p: nn.Parameter) -> bool:
    """Whether this rank's optimizer steps ``p``: one that holds the state of a share of the
    parameters only (ZeRO-1) writes, and reads back, that share."""
    owns = getattr(optimizer, "owns", None)
    return p.requires_grad and (owns is None or owns(p))


def _view(module: nn.Module) -> tuple[nn.Module, TPInfo | None]:
    """(the module whose state_dict has the original names, its tp info or None)."""
    inner = tp_module(module)
    return (inner, tp_info(inner)) if inner is not None else (module, None)


def module_state(module: nn.Module, optimizer: Any,
                 renames: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The default `Checkpointable.checkpoint_state` of a module, tensor-parallel or not.

    ``renames`` maps a parameter name to the name its optimizer state is stored under (a weight
    tied across pipeline ranks is a copy per rank, named after the module using it there, with
    one optimizer state under its first owner's name). A parameter not stepped yet has no
    state: zeros stand in, made only then, so the template loads into a fresh optimizer.
    """
    module, info = _view(module)
    specs = info.specs if info is not None else {}
    renames = renames or {}
    optim: dict[str, torch.Tensor] = {}
    layout = state_layout(optimizer)
    for name, p in module.named_parameters():
        if not _steps(optimizer, p):
            continue
        state = optimizer.state.get(p, {})
        rec, leaf = tp_param_of(p), plain_leaf(p)  # a tp DTensor's state: DTensors too, read as the leaf's
        for key, kind in layout.items():
            out = f"{renames.get(name, name)}.{key}"
            if kind == "elem":
                value = torch.as_tensor(state[key]) if key in state else torch.zeros_like(leaf)
                value = rec.padded(value) if rec is not None else value
                optim[out] = expert_or_tp_entry(value, leaf, specs.get(name), info, name)
            else:
                value = torch.as_tensor(state[key]) if key in state else torch.zeros((), dtype=torch.float32)
                optim[out] = value.detach().clone()
    model_sd = {k: expert_or_tp_entry(plain_leaf(v), plain_leaf(v), specs.get(k), info, k)
                for k, v in module.state_dict(keep_vars=True).items()}
    return {"model": model_sd, "optim": optim}


@torch.no_grad()
def load_module_state(module: nn.Module, optimizer: Any, state: dict[str, Any],
                      renames: Mapping[str, str] | None = None) -> None:
    """The default `Checkpointable.load_checkpoint_state`: the inverse of `module_state`."""
    module, info = _view(module)
    specs = info.specs if info is not None else {}
    renames = renames or {}
    for key, target in module.state_dict(keep_vars=True).items():
        restore_expert_or_tp(plain_leaf(target), state["model"][key], plain_leaf(target), specs.get(key))
    layout = state_layout(optimizer)
    for name, p in module.named_parameters():
        if not _steps(optimizer, p):
            continue
        restored = {}
        rec, leaf = tp_param_of(p), plain_leaf(p)
        for key, kind in layout.items():
            value = state["optim"][f"{renames.get(name, name)}.{key}"]
            if kind == "elem":
                local = torch.zeros_like(leaf)
                restore_expert_or_tp(local, value, leaf, specs.get(name))
                restored[key] = rec.as_dtensor(rec.rows(local)) if rec is not None else local
            else:
                restored[key] = value.clone()
        optimizer.state[p] = restored
