"""torch's FSDP2 controls (``FSDPModule``'s methods) on plait's FullyShardedDataParallel.

torch's ``fully_shard`` turns each sharded module into an ``FSDPModule`` with methods of its own;
plait wraps the model once and its sharding units are plain modules. The wrapper carries the
methods for the root unit: ``recurse=True`` (FSDP2's default) acts on every unit, ``recurse=False``
on the root alone. ``model.unit(module)`` gives the same methods for one unit, as torch's
``module.set_...`` on a submodule ``fully_shard`` was applied to: with ``recurse=True`` they act on
that unit and the units inside it. Explicit prefetch lists (``set_modules_to_forward_prefetch``,
``set_modules_to_backward_prefetch``) replace, for the unit they are set on, the order plait would
prefetch in otherwise (forward: the unit that ran next in the previous step; backward: the one that
ran before in forward).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import Shard

from plait.fsdp.units import Unit


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: ``wait()`` blocks until every unit is gathered."""

    def __init__(self, units: list[Unit]) -> None:
        self._units: list[Unit] | None = units

    def wait(self) -> None:
        if self._units is not None:
            for unit in self._units:
                unit.gather()
            self._units = None


class _Wrapper(Protocol):
    units: list[Unit]
    zero_stage: int
    reshard_after_forward: bool
    reshard_after_backward: bool

    def _forward_method(self, unit: Unit, method: Callable[..., Any]) -> Callable[..., Any]: ...


def _within(outer: Unit, unit: Unit) -> bool:
    return outer.name == "" or unit.name == outer.name or unit.name.startswith(outer.name + ".")


class _Controls:
    """The methods torch's ``FSDPModule`` has, acting on ``self._target()`` (one unit) and, with
    ``recurse=True``, on the units inside it."""

    def _fsdp(self) -> _Wrapper:
        raise NotImplementedError

    def _target(self) -> Unit:
        raise NotImplementedError

    def _reach(self, recurse: bool) -> list[Unit]:
        me = self._target()
        return [u for u in self._fsdp().units if u is me or (recurse and _within(me, u))]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether the next backwards reduce these units' gradients (False: accumulate them
        unsharded, as ``no_sync()``, until a backward with sync on reduces the sum)."""
        for u in self._reach(recurse):
            u.sync = bool(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """ZeRO-3: free the units' gathered parameters after their forward (True) or keep them for
        backward (the root too, when set on it; by default the root keeps them, as FSDP2's root)."""
        for u in self._reach(recurse):
            u.reshard_after_forward = bool(reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """ZeRO-3: free the units' gathered parameters after their backward (True) or keep them, e.g.
        between micro-batches accumulated without sync, so the next forward gathers nothing. A
        backward that reduces gradients reuses the gathered memory for them, so it gathers again."""
        for u in self._reach(recurse):
            u.reshard_after_backward = bool(reshard_after_backward)

    def register_fsdp_forward_method(self, method_name: str) -> None:
        """Run the unit's method ``method_name`` (``encode_image``, ``forward_features``,
        ``generate``...) as its forward: parameters gathered before, inputs cast, resharded after
        (torch's ``register_fsdp_forward_method(module, method_name)``). Without it a method other
        than ``forward`` reads parameters FSDP has not gathered."""
        unit = self._target()
        method = getattr(unit.module, method_name, None)
        if not callable(method):
            raise ValueError(f"FullyShardedDataParallel.register_fsdp_forward_method: the unit "
                             f"{unit.name or '(root)'!r} ({type(unit.module).__name__}) has no method "
                             f"{method_name!r}")
        setattr(unit.module, method_name, self._fsdp()._forward_method(unit, method))

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's reduced gradients by ``factor`` instead of the number of data ranks
        (the sum over ranks / ``factor``); as FSDP2's, it applies to this unit alone."""
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 0:
            raise ValueError(f"FullyShardedDataParallel.set_gradient_divide_factor: factor must be a number "
                             f"> 0, got {factor!r}")
        for flat in self._target().flats:
            flat.cfg.divide_factor = float(factor)

    def set_modules_to_forward_prefetch(self, modules: Iterable[nn.Module | str]) -> None:
        """ZeRO-3: issue the all-gathers of these units (modules that are units of this wrapper, or
        their names) at this unit's pre-forward, in this order, instead of the next unit of the
        previous step's order; ``[]`` prefetches nothing."""
        self._target().forward_prefetch = self._units_named(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: Iterable[nn.Module | str]) -> None:
        """ZeRO-3: issue the all-gathers of these units at this unit's pre-backward, in this order,
        instead of the unit that ran before it in forward; ``[]`` prefetches nothing."""
        self._target().backward_prefetch = self._units_named(modules, "set_modules_to_backward_prefetch")

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather the parameters (ZeRO-3), as before a forward; with ``async_op`` the all-gathers are
        only issued and the returned handle's ``wait()`` completes them."""
        units = self._reach(True)
        for unit in units:
            unit.prefetch()
        handle = UnshardHandle(units)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the gathered parameters (ZeRO-3; ZeRO-1/2 keep them gathered by design)."""
        for unit in self._reach(True):
            unit.reshard()

    def _units_named(self, modules: Iterable[nn.Module | str], what: str) -> list[Unit]:
        units = self._fsdp().units
        by_module = {id(u.module): u for u in units}
        by_name = {u.name: u for u in units}
        out = []
        for m in modules:
            unit = by_name.get(m) if isinstance(m, str) else by_module.get(id(m))
            if unit is None:
                raise ValueError(
                    f"FullyShardedDataParallel.{what}: {m if isinstance(m, str) else type(m).__name__!r} "
                    f"is not a sharding unit of this model (units: {[u.name for u in units]}); "
                    "name it in units=[...] when wrapping")
            out.append(unit)
        return out


class UnitControls(_Controls):
    """torch's ``FSDPModule`` methods for one sharding unit: what ``model.unit(block)`` returns."""

    def __init__(self, fsdp: _Wrapper, unit: Unit) -> None:
        self._wrapper, self._unit = fsdp, unit

    def _fsdp(self) -> _Wrapper:
        return self._wrapper

    def _target(self) -> Unit:
        return self._unit

    def __repr__(self) -> str:
        return f"UnitControls({self._unit.name or '(root)'!r})"


class FSDPControls(_Controls):
    """torch's ``FSDPModule`` methods, for `plait.FullyShardedDataParallel` to inherit: they act on
    the root unit, and with ``recurse=True`` on every unit."""

    def _fsdp(self) -> _Wrapper:
        return self  # type: ignore[return-value]

    def _target(self) -> Unit:
        return self._fsdp().units[0]

    def unit(self, module: nn.Module | str) -> UnitControls:
        """torch's ``FSDPModule`` methods for the sharding unit ``module`` (a module of the wrapped
        model, or its name): ``model.unit(model.module.layers[0]).set_modules_to_forward_prefetch(
        [...])`` is torch's ``model.layers[0].set_modules_to_forward_prefetch([...])``."""
        return UnitControls(self._fsdp(), self._units_named([module], "unit")[0])

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        super().set_reshard_after_forward(reshard_after_forward, recurse=recurse)
        if recurse:
            self._fsdp().reshard_after_forward = bool(reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        super().set_reshard_after_backward(reshard_after_backward, recurse=recurse)
        if recurse:
            self._fsdp().reshard_after_backward = bool(reshard_after_backward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for torch's API: plait waits for every reduction at the end of each backward, so
        the gradients are complete after any backward, the last one or not."""


PlacementFn = Callable[[nn.Parameter], Shard | None]


def check_placements(module: nn.Module, shard_placement_fn: PlacementFn | None) -> None:
    """torch's ``shard_placement_fn``: plait shards every parameter on dim 0 (torch.chunk's rule), so
    a function asking for another placement is refused, naming the parameter, before anything moves."""
    if shard_placement_fn is None:
        return
    for name, p in module.named_parameters():
        want = shard_placement_fn(p)
        if want is None or (isinstance(want, Shard) and want.dim in (0, -p.ndim)):
            continue
        raise ValueError(f"FullyShardedDataParallel(shard_placement_fn=...) asks for {want!r} for {name!r}: "
                         "plait shards every parameter on dim 0 (Shard(0)); return None or Shard(0)")


def ignored_ids(module: nn.Module, ignored_params: Iterable[nn.Parameter] | None) -> frozenset[int]:
    """The ids of torch's ``ignored_params``, each checked to be one of the module's parameters."""
    if ignored_params is None:
        return frozenset()
    own = {id(p) for p in module.parameters()}
    ids = frozenset(id(p) for p in ignored_params)
    if not ids <= own:
        raise ValueError("FullyShardedDataParallel(ignored_params=...): some of them are not parameters "
                         "of the wrapped module")
    return ids


def ignored_grads(module: nn.Module, ids: frozenset[int]) -> list[torch.Tensor]:
    """The gradients of the ignored parameters (each rank's own, never reduced)."""
    return [p.grad for p in module.parameters() if id(p) in ids and p.grad is not None]
