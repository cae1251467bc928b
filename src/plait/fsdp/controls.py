"""torch's FSDP2 controls (``FSDPModule``'s methods) on plait's FullyShardedDataParallel.

torch's ``fully_shard`` turns each sharded module into an ``FSDPModule`` with methods of its own;
plait wraps the model once and its sharding units are plain modules, so these controls live on the
wrapper and act on every unit: FSDP2's ``recurse=True`` (its default). ``recurse=False`` would
reach the root unit alone, which plait does not single out, so it is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import Shard

from plait.fsdp.units import Unit

__all__ = ["FSDPControls", "PlacementFn", "UnshardHandle", "check_placements", "ignored_grads", "ignored_ids"]


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
    _sync: bool
    reshard_after_forward: bool
    reshard_after_backward: bool


class FSDPControls:
    """torch's ``FSDPModule`` methods, for `plait.FullyShardedDataParallel` to inherit."""

    def set_requires_gradient_sync(self: _Wrapper, requires_gradient_sync: bool,
                                   *, recurse: bool = True) -> None:
        """Whether the next backwards reduce gradients (False: accumulate unsharded, as ``no_sync()``)."""
        _whole_model("set_requires_gradient_sync", recurse)
        self._sync = bool(requires_gradient_sync)

    def set_reshard_after_forward(self: _Wrapper, reshard_after_forward: bool,
                                  *, recurse: bool = True) -> None:
        """ZeRO-3: free each unit's gathered parameters after its forward (True) or keep them for backward."""
        _whole_model("set_reshard_after_forward", recurse)
        self.reshard_after_forward = bool(reshard_after_forward)

    def set_reshard_after_backward(self: _Wrapper, reshard_after_backward: bool,
                                   *, recurse: bool = True) -> None:
        """ZeRO-3: free each unit's gathered parameters after its backward (True) or keep them, e.g.
        between micro-batches accumulated without sync, so the next forward gathers nothing. A
        backward that reduces gradients reuses the gathered memory for them, so it gathers again."""
        _whole_model("set_reshard_after_backward", recurse)
        self.reshard_after_backward = bool(reshard_after_backward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for torch's API: plait waits for every reduction at the end of each backward, so
        the gradients are complete after any backward, the last one or not."""

    def unshard(self: _Wrapper, async_op: bool = False) -> UnshardHandle | None:
        """Gather every unit's parameters (ZeRO-3), as before a forward; with ``async_op`` the
        all-gathers are only issued and the returned handle's ``wait()`` completes them."""
        for unit in self.units:
            unit.prefetch()
        handle = UnshardHandle(list(self.units))
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self: _Wrapper) -> None:
        """Free every unit's gathered parameters (ZeRO-3; ZeRO-1/2 keep them gathered by design)."""
        for unit in self.units:
            unit.reshard()

    def set_modules_to_forward_prefetch(self, modules: Iterable[nn.Module]) -> None:
        raise NotImplementedError(
            "FullyShardedDataParallel.set_modules_to_forward_prefetch: plait prefetches on its own, in "
            "forward the unit that ran next in the previous step and in backward the one before; "
            "explicit prefetch lists are not taken (backward_prefetch=False turns backward's off)")

    def set_modules_to_backward_prefetch(self, modules: Iterable[nn.Module]) -> None:
        raise NotImplementedError(
            "FullyShardedDataParallel.set_modules_to_backward_prefetch: plait prefetches in backward the "
            "unit that ran before in forward; explicit prefetch lists are not taken "
            "(backward_prefetch=False turns it off)")


def _whole_model(what: str, recurse: bool) -> None:
    if not recurse:
        raise ValueError(f"FullyShardedDataParallel.{what}(recurse=False): plait's sharding units are plain "
                         "modules under one wrapper, so its controls act on every unit; pass recurse=True")


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
