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
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from plait.env import is_dry_run
from plait.names import plain_name

__all__ = ["init_weights", "owner_modules", "full_values", "is_meta", "module_seed", "materialize", "Keep"]

# What a strategy keeps of one tensor: (owner's qualified name, attribute, full value, the
# current tensor) -> the tensor to put in its place, or None to leave the module untouched.
Keep = Callable[[str, str, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


def module_seed(seed: int, name: str) -> int:
    # The uncompiled model's name: a torch.compile'd block starts from the values it has uncompiled.
    return (seed * 1_000_003 + zlib.crc32(plain_name(name).encode())) % (2**63 - 1)


def owner_modules(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Modules that own parameters or buffers directly (not through children)."""
    for name, mod in module.named_modules(prefix=prefix, remove_duplicate=True):
        if mod._parameters or mod._buffers:
            yield name, mod


def is_meta(module: nn.Module) -> bool:
    """Whether ``module`` still waits to be materialized: it has meta tensors, outside a dry run
    (`plait.env.dry_run`, where meta tensors stand for materialized ones)."""
    return not is_dry_run() and any(t.is_meta for t in [*module.parameters(), *module.buffers()])


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
                getattr(type(mod), "reset_parameters")(shell)  # noqa: B009 (not every Module has it)
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
            target: torch.Tensor | None = mod._parameters.get(key)
            if target is None:
                target = mod._buffers[key]
            assert target is not None
            if id(target) in seen:
                continue
            seen.add(id(target))
            target.copy_(value)
    return module


@torch.no_grad()
def materialize(roots: nn.Module | Sequence[tuple[str, nn.Module]], seed: int, keep: Keep,
                first_owner: dict[int, tuple[str, nn.Module, str]] | None = None) -> None:
    """Give each parameter and buffer under ``roots`` what ``keep`` makes of its full value.

    The one materializer of every strategy (FSDP keeps a slice in its flat shard, tensor
    parallelism a shard, a pipeline stage the whole tensor on its device). Owner modules are
    visited one at a time and a meta tensor's full value is computed for its owner only, so no
    rank ever holds more than one module's full tensors. Already materialized tensors are
    passed as they are. A tensor shared by several owners (tied weights) is seen once, with
    the values of its first owner, and every owner gets the same replacement.

    ``roots`` is a module, or (qualified name, module) pairs for parts of a larger model;
    ``first_owner`` (id -> qualified name, module, attribute in the original model) gives a
    tensor tied to a module outside ``roots`` its first owner's values (pipeline stages).
    """
    parts = [("", roots)] if isinstance(roots, nn.Module) else list(roots)
    placed: dict[int, torch.Tensor | None] = {}
    cache: dict[str, dict[str, torch.Tensor]] = {}
    for prefix, part in parts:
        for name, mod in owner_modules(part, prefix=prefix):
            for store in (mod._parameters, mod._buffers):
                for key, t in list(store.items()):
                    if t is None:
                        continue
                    if id(t) not in placed:
                        qual, attr = _owner(t, name, mod, key, first_owner)
                        full = _initial(t, name, mod, key, seed, first_owner, cache)
                        placed[id(t)] = _place(keep(qual, attr, full, t), t)
                    new = placed[id(t)]
                    if new is not None:
                        store[key] = new  # type: ignore[assignment]


def _owner(t: torch.Tensor, name: str, mod: nn.Module, key: str,
           first_owner: dict[int, tuple[str, nn.Module, str]] | None) -> tuple[str, str]:
    qual, _, attr = first_owner.get(id(t), (name, mod, key)) if first_owner else (name, mod, key)
    return qual, attr


def _initial(t: torch.Tensor, name: str, mod: nn.Module, key: str, seed: int,
             first_owner: dict[int, tuple[str, nn.Module, str]] | None,
             cache: dict[str, dict[str, torch.Tensor]]) -> torch.Tensor:
    """A meta tensor's oracle value (its first owner's `full_values`), else the tensor itself."""
    if not t.is_meta or is_dry_run():  # in a dry run a meta tensor is its own (shape-only) value
        return t.detach()
    qual, src, attr = first_owner.get(id(t), (name, mod, key)) if first_owner else (name, mod, key)
    if qual not in cache:  # one owner module's full tensors at a time
        cache.clear()
        cache[qual] = full_values(src, qual, seed)
    return cache[qual][attr]


# Marks plait puts on a parameter that its materialized replacement keeps (an expert's placement).
_KEPT_MARKS = ("_plait_expert",)


def _place(new: torch.Tensor | None, old: torch.Tensor) -> torch.Tensor | None:
    """Wrap a parameter's replacement as a parameter with the same requires_grad and marks."""
    if new is None or new is old or not isinstance(old, nn.Parameter) or isinstance(new, nn.Parameter):
        return new
    param = nn.Parameter(new, requires_grad=old.requires_grad)
    for mark in _KEPT_MARKS:
        if hasattr(old, mark):
            setattr(param, mark, getattr(old, mark))
    return param
