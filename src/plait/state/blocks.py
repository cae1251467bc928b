"""Repeated blocks: where a model keeps its layers, found from its structure alone.

A *block container* is an ``nn.ModuleList`` (whatever it holds), or an ``nn.ModuleDict`` or
``nn.Sequential`` whose children are all of one class with submodules of its own: torchtitan keeps
its transformer layers in ``nn.ModuleDict({"0": block, "1": block, ...})``, others in a
``Sequential`` of blocks, while a ``Sequential(Linear, GELU, Linear)`` or a dict of unlike heads is
no container of blocks. The container's children are the *blocks*: FSDP's default sharding units
(`plait.fsdp`) and activation checkpointing's default blocks (`plait.activation_checkpointing`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

DESCRIBED = "nn.ModuleList of blocks (nor an nn.ModuleDict or nn.Sequential of blocks of one class)"


def is_container(mod: nn.Module) -> bool:
    """Whether ``mod`` holds repeated blocks (see the module docstring)."""
    if isinstance(mod, nn.ModuleList):
        return True
    if not isinstance(mod, (nn.ModuleDict, nn.Sequential)):
        return False
    children = list(mod.children())
    one_class = bool(children) and len({type(c) for c in children}) == 1
    return one_class and any(True for _ in children[0].children())


def blocks(module: nn.Module, outermost: bool = False) -> list[str]:
    """Qualified names of the blocks of every container in ``module``, in model order;
    ``outermost``: only of the containers that lie in no other container."""
    found = [n for n, m in module.named_modules() if is_container(m)]
    if outermost:
        found = [n for n in found if not any(_inside(n, o) for o in found)]
    return [f"{n}.{c}" if n else c for n in found for c, _ in module.get_submodule(n).named_children()]


def _inside(name: str, outer: str) -> bool:
    return name != outer and (outer == "" or name.startswith(outer + "."))


# A block's record of its activation checkpointing, kept here (not in `plait.activation_checkpointing`)
# so that strategies whose hooks must sit inside or outside the recomputation (context parallelism)
# read it without importing the strategy that wrote it.
_CHECKPOINTED = "_plait_checkpointed"  # on a checkpointed module: its `Checkpointed`


@dataclass
class Checkpointed:
    """What a checkpointed module carries: its name (for errors), the policy and its own forward
    (a bound method: copies of the module, e.g. a pipeline's meta skeleton, rebind it)."""

    name: str
    policy: str
    forward: Callable[..., Any]


def mark_checkpointed(module: nn.Module, record: Checkpointed) -> None:
    module.__dict__[_CHECKPOINTED] = record


def checkpoint_record(module: nn.Module) -> Checkpointed | None:
    """``module``'s checkpointing record, None if it is not checkpointed."""
    return module.__dict__.get(_CHECKPOINTED)


def checkpointed(module: nn.Module) -> str | None:
    """The policy ``module`` was checkpointed with, else None."""
    record = checkpoint_record(module)
    return None if record is None else record.policy
