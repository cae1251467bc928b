"""Expert parallelism for experts stacked in tensors: transformers' MoE models (Mixtral, Qwen2-MoE).

transformers 5 keeps a layer's experts in one module (``MixtralExperts``): parameters with the
experts on dim 0 (``gate_up_proj`` (experts, 2 * inner, hidden), ``down_proj`` (experts, hidden,
inner)), an int ``num_experts``, and a forward ``(hidden_states, top_k_index, top_k_weights)`` that
the MoE block calls after its router. `stacked_expert_modules` finds such modules by that shape,
never by class.

Over ep ranks, rank j keeps rows ``j * E/ep .. (j+1) * E/ep - 1`` of each such tensor (the same
names, fewer rows: `StackedRows` records which) and the module's forward becomes a
`StackedDispatch`: each (token, choice) pair goes to the rank holding its expert, with the
all-to-alls of `ExpertDispatch`; there the module's own forward runs on what arrived, as its
experts renumbered from 0, each row with weight 1; the outputs come back and are weighted and
summed per token as the module's own forward sums them (in expert order).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.ep.dispatch import ExpertDispatch
from plait.state.placement.pieces import mark_piece
from plait.state.placement.records import ExpertPlacement, StackedRows, mark_expert, mark_rows
from plait.state.placement.state import local_rows, rows_entry

_CALL = ("hidden_states", "top_k_index", "top_k_weights")


def stacked_expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules holding experts stacked on dim 0 of their own parameters: an int
    ``num_experts``, every own parameter of at least 2 dims with ``num_experts`` rows, no child
    with parameters, and a forward taking ``(hidden_states, top_k_index, top_k_weights)``."""
    found = []
    for name, mod in model.named_modules():
        n = getattr(mod, "num_experts", None)
        own = list(mod.parameters(recurse=False))
        if not isinstance(n, int) or n < 1 or not own:
            continue
        if any(p.dim() < 2 or p.shape[0] != n for p in own):
            continue
        if any(True for c in mod.children() for _ in c.parameters()):
            continue
        if _call_names(mod) == _CALL:
            found.append((name, mod))
    return found


def expert_count(mod: nn.Module) -> int:
    """A stacked expert module's number of experts (its ``num_experts``)."""
    n = getattr(mod, "num_experts", 0)
    assert isinstance(n, int)
    return n


def _call_names(mod: nn.Module) -> tuple[str, ...]:
    try:
        params = inspect.signature(type(mod).forward).parameters
    except (TypeError, ValueError):
        return ()
    return tuple(params)[1:4]


def split_stacked(mod: nn.Module, placement: ExpertPlacement, rank: int, group: dist.ProcessGroup | None,
                  name: str = "", check: bool = True) -> list[str]:
    """Keep ``mod``'s rows for ep rank ``rank`` of ``placement.ep_size``, mark them, and route its
    calls through a `StackedDispatch` (``name`` and ``check``: `ExpertDispatch`'s); return the
    names of the split parameters."""
    n, size = expert_count(mod), placement.ep_size
    per = n // size
    first = rank * per
    names = []
    for pname, p in list(mod.named_parameters(recurse=False)):
        kept = nn.Parameter(p.detach().narrow(0, first, per).clone(), requires_grad=p.requires_grad)
        mark_expert(kept, placement)
        mark_rows(kept, StackedRows(first, n))
        if size > 1:  # torch's clip would take this rank's rows for all of them
            rows = f"{first}..{first + per - 1}"
            mark_piece(kept, f"ep rank {rank}'s rows {rows} of '{name}.{pname}' (ep={size})")
        setattr(mod, pname, kept)
        names.append(pname)
    mod.num_experts = per  # type: ignore[assignment]  # what its forward counts experts by
    mod.forward = StackedDispatch(mod, n, first, group, size, name, check)
    mod.register_state_dict_post_hook(_as_full_tensors)
    mod.register_load_state_dict_pre_hook(_to_local_rows)
    return names


def _as_full_tensors(mod: nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
    """``state_dict()`` gives each split tensor as the full one it is rows of: a DTensor over ep
    (`plait.state.placement.state.rows_entry`), which torch.distributed.checkpoint saves and reshards.
    Under the same name on every ep rank, the plain rows would be taken for copies of one tensor."""
    for pname, p in mod.named_parameters(recurse=False):
        value = state.get(prefix + pname)
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):  # keep_vars: as is
            state[prefix + pname] = rows_entry(value, p)


def _to_local_rows(mod: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
    """``load_state_dict`` takes the full tensor (as one process saves it), the DTensor
    `_as_full_tensors` gives, or this rank's rows."""
    for pname, p in mod.named_parameters(recurse=False):
        if isinstance(state.get(prefix + pname), torch.Tensor):
            state[prefix + pname] = local_rows(state[prefix + pname], p)


class StackedDispatch(ExpertDispatch):
    """A stacked expert module's forward over an ep group (see the module's docstring)."""

    def __init__(self, module: nn.Module, n_experts: int, first: int, group: dist.ProcessGroup | None,
                 size: int, name: str = "", check: bool = True) -> None:
        super().__init__(nn.ModuleList(), n_experts, first, group, size, name, check)
        self.module = module
        self.own_forward = type(module).forward  # the class's (transformers picks the implementation)

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,  # type: ignore[override]
                 top_k_weights: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs:
            raise TypeError(f"{type(self.module).__name__} under expert parallelism takes (hidden_states, "
                            "top_k_index, top_k_weights) only")
        k = top_k_index.shape[-1]
        choice = top_k_index.reshape(-1)
        order = torch.argsort(choice, stable=True)  # (token, choice) pairs by expert
        token = order // k
        counts = torch.bincount(choice, minlength=self.n_experts)
        back = super().__call__(hidden_states[token], counts)
        weighted = back * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add_(0, token, weighted.to(hidden_states.dtype))

    def _compute(self, received: torch.Tensor, sizes: list[int],
                 runs: list[bool] | None = None) -> torch.Tensor:
        """The module's own forward on every received row, its expert renumbered from 0 (rows
        arrive by source rank, then expert), each with weight 1. (The stacked tensors are one
        parameter each: ``runs`` changes nothing.)"""
        rows = received.shape[0]
        local = torch.arange(self.per_rank, device=received.device).repeat(self.size)
        expert = local.repeat_interleave(torch.tensor(sizes, device=received.device), output_size=rows)
        ones = torch.ones(rows, 1, dtype=received.dtype, device=received.device)
        out = self.own_forward(self.module, received, expert.unsqueeze(1), ones)
        if not rows:  # no token came: a zero gradient, as one process gives these rows of the tensor
            out = out + sum(p.sum() for p in self.module.parameters(recurse=False)) * 0
        return out

    def reference(self, rows: torch.Tensor, e: int) -> torch.Tensor:
        """The module's own forward on ``rows``, all for its local expert ``e`` with weight 1: one
        expert per call, where `_compute` runs them all in one."""
        n = rows.shape[0]
        expert = torch.full((n, 1), e, dtype=torch.int64, device=rows.device)
        ones = torch.ones(n, 1, dtype=rows.dtype, device=rows.device)
        out = self.own_forward(self.module, rows, expert, ones)
        assert isinstance(out, torch.Tensor)
        return out
