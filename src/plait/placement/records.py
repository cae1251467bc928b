"""Where each parameter lives: the records tensor and expert parallelism write, and every other
strategy reads.

Tensor parallelism (`plait.tensor_parallel`) attaches a `TPInfo` to the module it splits: the tp
group and, per parameter name, the rows each rank holds (`ShardSpec`). Expert parallelism
(`plait.expert_parallel`) marks each expert parameter with its `ExpertPlacement` (the ranks
holding the same experts, the ranks holding the others) and attaches an `ExpertParallelInfo` to
the model. DDP, FSDP, clipping, state dicts and checkpoints learn how a parameter is placed here,
so none of them imports the strategy that placed it.

The records ride on the module or the parameter as attributes. FSDP's parameters and tp's
(`plait.placement.tp_params`) are DTensors, which carry their placement themselves as well; what
plait computes with stays plain (`plain_leaf`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from plait._torch_compat import compiled_original
from plait.placement.shards import ShardSpec

# ------------------------------------------------------------------ tensor parallelism

@dataclass
class TPInfo:
    """Attached to a tensor-parallel model: what was split, and how the loss must be computed."""

    group: dist.ProcessGroup
    size: int
    rank: int
    sequence_parallel: bool
    specs: dict[str, ShardSpec]  # qualified parameter name -> its shard (absent: replicated)
    styles: dict[str, Any]  # module name -> its style (a `plait.tp.Style`)
    vocab_size: int | None  # full vocabulary of a VocabParallelOutput with sharded logits


_TP_ATTR = "_plait_tp"  # where a tensor-parallel module carries its TPInfo


def attach_tp_info(module: nn.Module, info: TPInfo) -> None:
    """Record that ``module`` is tensor-parallel as ``info`` says (names in ``info.specs`` are
    relative to ``module``)."""
    setattr(module, _TP_ATTR, info)


def attached_tp_info(module: nn.Module) -> TPInfo | None:
    """The `TPInfo` attached to ``module`` itself (not looking through wrappers), else None."""
    return getattr(module, _TP_ATTR, None)


def tp_info(model: nn.Module) -> TPInfo | None:
    """The `TPInfo` of a tensor-parallel model (looking through ``.module`` wrappers), else None."""
    found = tp_module(model)
    return None if found is None else getattr(found, _TP_ATTR)


def tp_module(model: nn.Module) -> nn.Module | None:
    """The tensor-parallel module itself, inside ``.module`` wrappers such as DDP and inside
    torch.compile's wrapper (else None). Parameter names in `TPInfo.specs` are relative to it."""
    for _ in range(8):
        original = compiled_original(model)  # its attributes read through to the original's
        model = model if original is None else original
        if getattr(model, _TP_ATTR, None) is not None:
            return model
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return None
        model = inner
    return None


def mark_part(part: nn.Module, info: TPInfo) -> None:
    """Make ``part``, a piece of a tensor-parallel model holding some of its modules under the same
    names (a pipeline stage), tensor-parallel in its own right: `tp_info` of the part is ``info``
    limited to the part's parameters, so strategies wrapping the part (FSDP's gradient norm and
    state dicts) see which of its tensors are tp shards."""
    names = {n for n, _ in part.named_parameters(remove_duplicate=False)}
    attach_tp_info(part, dataclasses.replace(info, specs={n: s for n, s in info.specs.items() if n in names}))


T = TypeVar("T", bound=torch.Tensor)
# The attribute a tp DTensor parameter and its plain leaf carry their record under
# (`plait.placement.tp_params.TPParam`).
TP_PARAM_MARK = "_plait_tp_param"


def plain_leaf(t: T) -> T:
    """The tensor plait computes with: the plain leaf a tp DTensor parameter stands on
    (`plait.placement.tp_params`), else ``t`` itself."""
    rec = getattr(t, TP_PARAM_MARK, None)
    return t if rec is None else rec.leaf


# ------------------------------------------------------------------ expert parallelism

@dataclass(frozen=True)
class ExpertPlacement:
    """Where an expert parameter's copies and siblings are."""

    edp: dist.ProcessGroup  # ranks holding the same experts: its gradient is summed here
    ep: dist.ProcessGroup  # ranks holding the other experts of the layer
    ep_size: int
    ep_ranks: tuple[int, ...]
    edp_ranks: tuple[int, ...]


@dataclass(frozen=True)
class ExpertParallelInfo:
    placement: ExpertPlacement
    local: tuple[str, ...]  # this rank's expert state keys (names in the model)
    absent: tuple[str, ...]  # prefixes of the experts other ep ranks hold
    stacked: tuple[str, ...] = ()  # state keys of experts stacked in one tensor, split on dim 0 over ep


@dataclass(frozen=True)
class StackedRows:
    """On a parameter holding some experts of a stacked tensor (transformers' ``gate_up_proj`` of
    shape (experts, ...)): this rank's rows ``first .. first + local - 1`` of ``full``, the ep
    ranks holding the rest in rank order."""

    first: int
    full: int


# The attribute an expert parameter carries its placement under (`plait.materialize` copies it
# onto the parameter's materialized replacement), and a stacked expert tensor's rows.
EXPERT_MARK = "_plait_expert"
ROWS_MARK = "_plait_expert_rows"
_EP_ATTR = "_plait_ep"  # where an expert-parallel model carries its ExpertParallelInfo


def mark_expert(p: nn.Parameter, placement: ExpertPlacement) -> None:
    """Record that ``p`` is an expert's parameter placed as ``placement`` says."""
    setattr(p, EXPERT_MARK, placement)


def mark_rows(p: nn.Parameter, rows: StackedRows) -> None:
    """Record that ``p`` holds ``rows`` of a stacked expert tensor."""
    setattr(p, ROWS_MARK, rows)


def rows_of(p: nn.Parameter | object) -> StackedRows | None:
    """The `StackedRows` of a split stacked expert tensor, else None."""
    found = getattr(p, ROWS_MARK, None)
    return found if isinstance(found, StackedRows) else None


def placement_of(p: nn.Parameter | object) -> ExpertPlacement | None:
    """The `ExpertPlacement` of an expert parameter, else None (a dense parameter)."""
    found = getattr(p, EXPERT_MARK, None)
    return found if isinstance(found, ExpertPlacement) else None


def attach_ep_info(model: nn.Module, info: ExpertParallelInfo) -> None:
    """Record that ``model``'s experts are split as ``info`` says."""
    setattr(model, _EP_ATTR, info)


def ep_info(model: nn.Module | object) -> ExpertParallelInfo | None:
    """The `ExpertParallelInfo` of an expert-parallel model (or of any module inside the model,
    such as a wrapper's), else None."""
    modules = model.modules() if isinstance(model, nn.Module) else []
    for mod in modules:
        info = getattr(mod, _EP_ATTR, None)
        if isinstance(info, ExpertParallelInfo):
            return info
    return None
