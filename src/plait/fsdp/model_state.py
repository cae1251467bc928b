"""What plait's FSDP saves and loads: its state dicts, under the model's own names.

* ``state_dict()`` / ``load_state_dict()`` are nn.Module's, over the DTensor parameters and the
  buffers, with the wrapper's ``module.`` level dropped (`plait.fsdp.names`); ``named_parameters``,
  ``named_buffers``, attribute access and ``_fqn_modifiers`` show the same names, so torch's
  ``torch.distributed.checkpoint.state_dict`` functions find every entry.
* ``full_state_dict`` (gathered, for export) and ``sharded_state_dict`` (per-parameter DTensors,
  optionally with the optimizer's state) are `plait.fsdp.state_dict`'s, and the latter is the
  entry of `plait.checkpoint`'s protocol (``checkpoint_state``).

``state_dict()`` (and each forward) first copies into the shards what was written through the
module attributes since (`FlatParam.write_back`): the shards are what is saved.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from plait.fsdp.layout import ShardCfg
from plait.fsdp.names import top_level_names
from plait.fsdp.units import Unit
from plait.state.placement.records import TPInfo, expert_of


class ModelState(nn.Module):
    """The state-dict methods of `plait.FullyShardedDataParallel` (its base)."""

    # What the wrapper sets in its __init__ (and `plait.fsdp.state_dict` reads).
    module: nn.Module
    units: list[Unit]
    cfg: ShardCfg
    tp: TPInfo | None
    _experts: list[nn.Parameter]

    def _torch_state_refusal(self) -> str | None:
        """Why ``state_dict()`` (what torch.distributed.checkpoint saves) cannot hold this model's
        own tensors, or None: a fused or padded tp split, or experts held whole on some ranks."""
        if self._experts or placed_experts(self.module):
            return ("its expert-parallel experts are plain tensors under the same names on every ep "
                    "rank, holding different experts (DCP would keep one rank's copy)")
        if self.tp is None or self.tp.size == 1:
            return None
        odd = [n for n, spec in self.tp.specs.items()
               if not spec.contiguous or spec.local * self.tp.size != spec.full]
        if odd:
            return (f"tensor parallelism splits {odd[:4]} fused (parts) or padded, which a DTensor "
                    "placement cannot describe")
        return None

    def state_dict(self, *args, **kwargs):
        """nn.Module's: the DTensor parameters and the buffers under the model's own names (no
        ``module.``, as torch's FSDP1 and FSDP2: `plait.fsdp.names`), which `torch.save` pickles and
        `torch.distributed.checkpoint` saves and reshards. Refused where a DTensor cannot describe a
        parameter (see `_torch_state_refusal`)."""
        self._write_back()
        why = self._torch_state_refusal()
        if why is not None:
            raise ValueError(
                f"FullyShardedDataParallel.state_dict(): {why}, so torch.distributed.checkpoint would "
                "save wrong values; save model.sharded_state_dict(optimizer) (plait.checkpoint) or "
                "plait.full_state_dict(model) instead")
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """nn.Module's, under the model's own names (`plait.fsdp.names`). ``assign=True`` (torch's
        idiom for a model built on the meta device) copies the values in instead: FSDP materialized
        the shards when it wrapped the model, and a parameter assigned in place of a shard would be
        cut off the flat vector that forward reads."""
        return super().load_state_dict(state_dict, strict=strict, assign=False)

    def _write_back(self) -> None:
        """Writes through the module attributes (an in-place init after wrapping) into the shards."""
        for unit in self.units:
            for flat in unit.flats:
                flat.write_back()

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The DTensor shards under the model's own names, without the wrapper's ``module.`` (as
        torch's FSDP1 and FSDP2 name them), so param groups, `get_optimizer_state_dict` and the
        state dict agree on one name per parameter."""
        yield from self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's buffers under its own names (as `named_parameters`)."""
        yield from self.module.named_buffers(prefix, recurse, remove_duplicate)

    def _fqn_modifiers(self) -> dict[str, str]:
        """torch.distributed.checkpoint.state_dict's contract for a module whose state-dict keys
        skip a level: the model's top-level names stand for ``module.<name>``."""
        return top_level_names(self.module)

    def __getattr__(self, name: str) -> Any:
        """The wrapped model's submodules, parameters and buffers through the wrapper: the state
        dict's names are the model's own, and torch's state-dict functions (torch 2.6's
        ``get_model_state_dict``) find each name's module by attribute from the wrapper. Other
        attributes stay the wrapper's own (plait reads its marks on the model it was given)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self._modules.get("module")  # None while __init__ has not registered it
            owned = (inner._modules, inner._parameters, inner._buffers) if inner is not None else ()
            if not any(name in d for d in owned):
                raise
            return getattr(inner, name)

    # The state-dict functions are imported when called: they need plait.checkpoint, whose
    # torch.distributed.checkpoint would otherwise load with every `import plait`.
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and persistent buffer gathered in full, on CPU, under the original names,
        the same on every rank (over tensor parallelism, tp shards are gathered over tp too)."""
        from plait.fsdp.state_dict import full_state_dict

        return full_state_dict(self)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load full tensors (original names and shapes): each rank keeps its shard. No communication."""
        from plait.fsdp.state_dict import load_full_state_dict

        load_full_state_dict(self, state)

    def sharded_state_dict(self, optimizer: torch.optim.Optimizer | None = None) -> dict:
        """Parameters (and optimizer state) as DTensors of the original model's tensors, for
        torch.distributed.checkpoint: Shard(0) over fsdp, or, over tensor parallelism, each tp
        shard over tp (see `plait.fsdp.state_dict`)."""
        from plait.fsdp.state_dict import sharded_state_dict

        return sharded_state_dict(self, optimizer)

    def load_sharded_state_dict(self, state: dict, optimizer: torch.optim.Optimizer | None = None) -> None:
        from plait.fsdp.state_dict import load_sharded_state_dict

        load_sharded_state_dict(self, state, optimizer)

    # The checkpoint protocol (`plait.state.checkpoint.protocol`): the sharded state dict is the entry.
    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return self.sharded_state_dict(optimizer)

    def load_checkpoint_state(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        self.load_sharded_state_dict(state, optimizer)


def placed_experts(module: nn.Module) -> list[nn.Parameter]:
    """The parameters expert parallelism placed (`plait.state.placement`): held whole, outside the shards."""
    return [p for p in module.parameters() if expert_of(p) is not None]
