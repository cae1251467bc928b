"""Deterministic, sharding-independent initialisation.

Each module that owns parameters or buffers directly is initialised by its own
``reset_parameters()`` under an RNG seeded from ``(seed, module name)``. The values of a
module therefore depend only on the seed and its name, never on the order modules are
visited or on how the model is split, which is what lets a rank that builds the model on the
meta device materialize exactly the slice a single-process run would hold:

    oracle = GPT(cfg); init_weights(oracle, seed=0)          # single process
    with torch.device("meta"): model = GPT(cfg)              # any strategy, any rank
    ... strategy calls full_values(...) one module at a time and keeps its shard

Only one module's full tensors exist at a time, so no rank ever holds the full model.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["init_weights", "owner_modules", "full_values", "is_meta", "module_seed"]


def module_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def owner_modules(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Modules that own parameters or buffers directly (not through children)."""
    for name, mod in module.named_modules(prefix=prefix, remove_duplicate=True):
        if mod._parameters or mod._buffers:
            yield name, mod


def is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def full_values(mod: nn.Module, name: str, seed: int) -> dict[str, torch.Tensor]:
    """The full-size initial values of ``mod``'s own parameters and buffers, on CPU.

    ``name`` is the module's qualified name in the *original* model. Works for modules on
    the meta device: a shallow copy with empty CPU tensors is reset under the seeded RNG.
    """
    reset = getattr(mod, "reset_parameters", None)
    if reset is None and any(p is not None for p in mod._parameters.values()):
        raise TypeError(
            f"module {name!r} ({type(mod).__name__}) owns parameters but has no "
            "reset_parameters(), so plait cannot initialise it deterministically; "
            "add one (it should initialise only the module's own tensors)"
        )
        # Buffers without a reset keep their constructed values (meta ones become zeros).
    shell = copy.copy(mod)
    shell._modules = {}
    shell._parameters = {
        k: None if p is None else nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad)
        for k, p in mod._parameters.items()
    }
    shell._buffers = {
        k: None if b is None
        else torch.zeros(b.shape, dtype=b.dtype) if b.is_meta else b.detach().cpu().clone()
        for k, b in mod._buffers.items()
    }
    if reset is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(module_seed(seed, name))
            with torch.no_grad():
                type(mod).reset_parameters(shell)
    out = {k: p.detach() for k, p in shell._parameters.items() if p is not None}
    out.update({k: b for k, b in shell._buffers.items() if b is not None})
    return out


@torch.no_grad()
def init_weights(module: nn.Module, seed: int = 0) -> nn.Module:
    """Initialise every parameter and buffer of a materialized module in place, by name.

    The single-process reference for every strategy's meta-device initialisation.

    A tensor shared by several modules (tied weights) takes the values of its first owner
    in ``named_modules()`` order; every strategy follows the same rule.
    """
    seen: set[int] = set()
    for name, mod in owner_modules(module):
        for key, value in full_values(mod, name, seed).items():
            target = mod._parameters.get(key)
            if target is None:
                target = mod._buffers[key]
            if id(target) in seen:
                continue
            seen.add(id(target))
            target.copy_(value)
    return module
