"""nn.Module's conversions on plait's FSDP after wrapping: ``.to(dtype)``, ``.double()``, ``to_empty``.

torch's FSDP2 lets a sharded model change dtype and be emptied after ``fully_shard`` (its meta-device
idiom: build on meta, shard, ``to_empty``, re-initialise). nn.Module's own conversion would replace
each DTensor parameter's data, cutting it off the flat shard forward reads; here the flat groups
are rebuilt in the new dtype instead, the parameter objects kept.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from plait._torch_compat import wrap_apply
from plait.fsdp.flat import FlatParam
from plait.fsdp.units import Unit

Convert = Callable[[torch.Tensor], torch.Tensor]  # what nn.Module's conversions map over tensors


class Conversions(nn.Module):
    """The conversion methods of `plait.FullyShardedDataParallel` (its base)."""

    units: list[Unit]
    _make_post_backward: Callable[[FlatParam, int], Callable[[torch.Tensor], None]]  # the wrapper's

    def _take_conversions(self) -> None:
        """Route nn.Module's conversions of the wrapper through `_convert` (`wrap_apply`: the
        conversions have no public hook)."""
        wrap_apply(self, _convert)

    def _convert(self, apply: Callable[[Convert, bool], nn.Module], fn: Convert,
                 recurse: bool = True) -> Conversions:
        """nn.Module's conversions (``.to``, ``.double()``, ``to_empty``...) after wrapping: buffers and
        experts as nn.Module converts them (``apply``, its own conversion); FSDP's flat groups are
        rebuilt in a new dtype (values and parameter objects kept, as torch's FSDP2 keeps them).
        nn.Module's own conversion would replace each DTensor parameter's data, cutting it off the
        flat shard forward reads."""
        flats = [(u, j, f) for u in self.units for j, f in enumerate(u.flats)]
        targets = [_converted(fn, f) for _, _, f in flats]
        moved = [f.slots[0].fqn for (_, _, f), (_, dev) in zip(flats, targets, strict=True) if dev != f.home]
        if moved:
            raise ValueError(
                f"FullyShardedDataParallel: moving the wrapped model to another device would leave its "
                f"shards ({moved[:3]}) where FSDP communicates them from; move the model (or build it "
                "on the meta device) before FullyShardedDataParallel(...), which places them on "
                "plait.init()'s device")
        hidden = [(m, a, p) for _, _, f in flats for s, p in zip(f.slots, f.params, strict=True)
                  for m, a in s.owners]
        for m, a, _ in hidden:
            m._parameters[a] = None  # kept in place (order) and skipped by nn.Module._apply
        try:
            apply(fn, recurse)
        finally:
            for m, a, p in hidden:
                m._parameters[a] = p
        for (unit, j, flat), (dtype, _) in zip(flats, targets, strict=True):
            if dtype != flat.dtype:
                if any(p.grad is not None for p in flat.params):
                    raise ValueError("FullyShardedDataParallel: changing the dtype of parameters that hold "
                                     "gradients; call zero_grad(set_to_none=True) first")
                new = unit.flats[j] = flat.retyped(dtype)
                new.label = flat.label.replace(str(flat.dtype), str(dtype))
                new.set_grad_hook(functools.partial(self._make_post_backward, new))
                new.bind_views()
        return self

    def to_empty(self, *, device: torch.device | str | int | None,
                 recurse: bool = True) -> Conversions:
        """torch's meta-device idiom (build on meta, wrap, ``to_empty``, then ``reset_parameters()`` or
        ``init_weights()``): the shards, materialized when FSDP wrapped the model, keep their values
        and the buffers are emptied, as nn.Module empties them. ZeRO-3 then gathers every unit, so
        the module attributes the re-initialisation writes through hold whole tensors; the writes go
        back to the shards (`FlatParam.write_back`) and the units are freed at the next forward."""
        super().to_empty(device=device, recurse=recurse)
        for unit in self.units:  # as unshard(): ZeRO-1/2 hold them gathered already
            unit.gather()
        return self


def _convert(module: nn.Module, apply: Callable[[Convert, bool], nn.Module], fn: Convert,
             recurse: bool = True) -> nn.Module:
    return cast(Conversions, module)._convert(apply, fn, recurse)


def _converted(fn: Convert, flat: FlatParam) -> tuple[torch.dtype, torch.device]:
    """The dtype and device nn.Module's conversion ``fn`` gives a tensor like ``flat``'s shards."""
    with torch.no_grad():
        out = fn(torch.zeros(1, dtype=flat.dtype, device=flat.home))
    return out.dtype, out.device
