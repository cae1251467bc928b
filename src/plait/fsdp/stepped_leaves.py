"""Refuse an optimizer that steps FSDP's gathered tensors instead of its DTensor parameters.

Under FSDP a module attribute (``model.block.weight``) is the gathered tensor forward reads, a view
into the unit's flat buffer; the parameter an optimizer must step is the DTensor shard that
``model.parameters()`` yields. An optimizer built on the attributes gets no gradient (so it never
moves anything) or, once the buffer is freed under ZeRO-3, writes storage FSDP has released. Both
are silent or crash far from the cause, so the first step of such an optimizer is refused, naming
the parameter.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from plait._torch_compat import every_optimizer_step

# id(leaf) -> (weak reference to the leaf, its parameter's name): ids are compared with the live
# object, so a reused id never matches a different tensor.
_leaves: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
# Optimizers already checked, with the number of parameters they held then (add_param_group
# adds more).
_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_handle: Any = None


def watch_leaves(named_leaves: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Remember these gathered tensors; from now on every optimizer's first step checks it holds none
    of them (one process-wide step pre-hook, installed once)."""
    global _handle
    for name, leaf in named_leaves:
        _leaves[id(leaf)] = (weakref.ref(leaf, _forget(id(leaf))), name)
    if _handle is None:
        _handle = every_optimizer_step(_refuse_leaves, after=False)


def _forget(key: int) -> Any:
    def drop(_: Any) -> None:
        _leaves.pop(key, None)
    return drop


def _refuse_leaves(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    # Every step of every optimizer passes here: only a count, unless its parameters changed.
    if not _leaves:
        return
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    if _checked.get(optimizer) == count:
        return
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        entry = _leaves.get(id(p))
        if entry is not None and entry[0]() is p:
            raise ValueError(
                f"{type(optimizer).__name__}.step(): it holds {entry[1]!r} as FullyShardedDataParallel's "
                "module attribute, the gathered tensor forward reads (freed between forwards under "
                "ZeRO-3), not the parameter FSDP trains; build the optimizer and its param groups "
                "from the wrapped model's parameters() / named_parameters() (this rank's DTensor "
                "shards)")
    _checked[optimizer] = count
