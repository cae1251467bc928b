"""Where each parameter lives: the records tensor and expert parallelism write, and every other
strategy reads.

Tensor parallelism (`plait.tensor_parallel`) attaches a `TPInfo` to the module it splits: the tp
group and, per parameter name, the rows each rank holds (`ShardSpec`). Expert parallelism
(`plait.expert_parallel`) marks each expert parameter with its `ExpertPlacement` (the ranks
holding the same experts, the ranks holding the others) and attaches an `ExpertParallelInfo` to
the model. DDP, FSDP, clipping, state dicts and checkpoints learn how a parameter is placed here,
so none of them imports the strategy that placed it.

Each parameter plait places carries one record, a `ParamPlacement` (`placement_of`): its tp
split (`TPParam`), its expert placement, the rows of a stacked expert tensor it holds, the piece of
the model it is (`plait.state.placement.pieces`), the gradient hooks that must follow it when a strategy
replaces it, and one `ParamState` saying where its gradient goes. The model-level records ride on
the module as attributes. FSDP's parameters and tp's (`plait.state.placement.tp_params`) are DTensors,
which carry their placement themselves as well; what plait computes with stays plain
(`plain_leaf`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from plait._torch_compat import compiled_original
from plait.state.placement.shards import ShardSpec

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


_EP_ATTR = "_plait_ep"  # where an expert-parallel model carries its ExpertParallelInfo


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


# ------------------------------------------------------------------ one record per parameter
@dataclass(eq=False)
class TPParam:
    """A tp DTensor parameter ``param`` standing on the plain ``leaf`` forward reads
    (`plait.state.placement.tp_params`); ``spec``: its rows when split (None: replicated); ``owners``:
    every (module, attribute) holding it (a tied weight has several)."""

    name: str
    leaf: nn.Parameter
    param: nn.Parameter
    spec: ShardSpec | None
    info: TPInfo
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)

    @property
    def dtensor(self) -> DTensor:
        return cast(DTensor, self.param)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """The DTensor's local rows of ``t``, a tensor shaped like the leaf (padding cut off)."""
        spec = self.spec
        if spec is None or spec.valid == spec.local:
            return t
        return t.narrow(spec.dim, 0, spec.valid)

    def padded(self, t: torch.Tensor) -> torch.Tensor:
        """``t``, shaped like the DTensor parameter (its gradient, its optimizer state), as this
        rank's plain tensor shaped like the leaf (the padding rows zero)."""
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.shape == self.leaf.shape:
            return local
        out = torch.zeros(self.leaf.shape, dtype=local.dtype, device=local.device)
        self.rows(out).copy_(local)
        return out

    def as_dtensor(self, local: torch.Tensor) -> DTensor:
        """``local`` (rows as `rows` gives them) as a DTensor placed like ``param``."""
        return DTensor.from_local(local, self.dtensor.device_mesh, self.dtensor.placements, run_check=False,
                                  shape=self.param.shape, stride=self.param.stride())


@dataclass(frozen=True)
class Piece:
    """What a parameter that is one rank's piece of the model holds (`plait.state.placement.pieces`):
    ``what``, in words; ``split``: a piece of one tensor (a tp shard), rather than whole tensors of
    a part of the model (a stage, some experts). A split piece may say how a tensor shaped like it
    (its optimizer state) stands for the full tensor: ``to_full(t)``, a DTensor of the full tensor
    on ``t``'s storage, and ``to_local(value, base)``, this rank's rows of such a value (or of the
    full tensor) on a copy of ``base``. ``kept_whole``: not a piece but a whole tensor that every
    rank holds, kept plain beside FSDP's DTensor shards (experts under FSDP without ep), whose mix
    torch's clip cannot take."""

    what: str
    split: bool
    to_full: Callable[[torch.Tensor], torch.Tensor] | None = None
    to_local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    kept_whole: bool = False


class ParamState(enum.Enum):
    """Where a parameter's gradient goes. A plain parameter's stays on it; the three others are a
    tp DTensor parameter's (`plait.state.placement.tp_params`), whose gradient autograd accumulates into
    the plain leaf it stands on. They move as:

    - HOOK_MOVES_GRAD -> WRAPPER_ASSIGNS_GRAD: `let_wrapper_assign_grads` (DDP wraps the leaves);
    - WRAPPER_ASSIGNS_GRAD <-> GRAD_PUBLISHED: `gradient_assigned` publishes the wrapper's gradient
      on the DTensor; a backward after the user dropped it (``zero_grad()``) drops the leaf's too;
    - HOOK_MOVES_GRAD -> PLAIN: `to_plain_parameters` (FSDP, a pipeline, ep shard the leaves), which
      refuses a parameter a wrapper already assigns.
    """

    PLAIN = "plain"  # no DTensor stands on it: autograd's gradient is the parameter's own
    HOOK_MOVES_GRAD = "hook moves grad"  # the leaf's hook moves each fresh gradient onto the DTensor
    WRAPPER_ASSIGNS_GRAD = "wrapper assigns grad"  # a wrapper (DDP) reduces the leaf's gradient, assigns it
    GRAD_PUBLISHED = "grad published"  # ...and the DTensor's gradient is the one it last assigned


GradHook = Callable[[torch.Tensor], "torch.Tensor | None"]


@dataclass(eq=False)
class ParamPlacement:
    """How one parameter is placed, the one record every strategy reads and writes (FSDP2 keeps
    one `FSDPParam` per parameter the same way). A tp DTensor parameter and the plain leaf it stands
    on share theirs; a parameter's marked gradient carries its parameter's (`plait.state.placement.pieces`).

    ``tp``: the tp DTensor it is, or stands under (None: plain); ``expert``: where an expert
    parameter's copies and siblings are; ``rows``: the rows of a stacked expert tensor it holds;
    ``piece``: the piece of the model it is, which torch's clip refuses; ``grad_hooks``: gradient
    hooks (tensor -> tensor | None) registered on it that must survive a strategy replacing it (FSDP
    registers them again on its own leaf: tp's sum of a replicated weight's gradient over sequence
    shards); ``state``: where its gradient goes; ``marks_grads``: a hook on it marks each fresh
    gradient as the piece's.
    """

    tp: TPParam | None = None
    expert: ExpertPlacement | None = None
    rows: StackedRows | None = None
    piece: Piece | None = None
    grad_hooks: list[GradHook] = field(default_factory=list)
    state: ParamState = ParamState.PLAIN
    marks_grads: bool = False


# The one attribute a placed parameter (and its marked gradient) carries its record under.
_MARK = "_plait_placement"


def placement_of(p: nn.Parameter | object) -> ParamPlacement | None:
    """The `ParamPlacement` of a parameter a strategy placed or marked (or of its marked gradient),
    else None (a plain parameter, whole on every rank that holds it)."""
    found = getattr(p, _MARK, None)
    return found if isinstance(found, ParamPlacement) else None


def placement_for(p: torch.Tensor) -> ParamPlacement:
    """``p``'s record, an empty one attached first if it has none."""
    found = placement_of(p)
    if found is None:
        found = ParamPlacement()
        set_placement(p, found)
    return found


def set_placement(p: torch.Tensor, record: ParamPlacement) -> None:
    """Attach ``record`` to ``p`` (a tp DTensor and its leaf share one; a marked gradient its
    parameter's)."""
    setattr(p, _MARK, record)


def carry_placement(old: torch.Tensor, new: torch.Tensor) -> ParamPlacement | None:
    """Give ``new``, a parameter replacing ``old`` (materialized, or moved to its device), ``old``'s
    expert placement, rows and gradient hooks; its piece is for `plait.state.placement.pieces.carry_mark`
    to mark again (the hooks that mark its gradients are ``new``'s own). Return ``old``'s record."""
    rec = placement_of(old)
    if rec is not None and (rec.expert is not None or rec.rows is not None or rec.grad_hooks):
        mine = placement_for(new)
        mine.expert, mine.rows, mine.grad_hooks = rec.expert, rec.rows, list(rec.grad_hooks)
    return rec


def tp_param_of(p: object) -> TPParam | None:
    """The `TPParam` of a tp DTensor parameter or of its leaf, else None."""
    rec = placement_of(p)
    return None if rec is None else rec.tp


T = TypeVar("T", bound=torch.Tensor)


def plain_leaf(t: T) -> T:
    """The tensor plait computes with: the plain leaf a tp DTensor parameter stands on
    (`plait.state.placement.tp_params`), else ``t`` itself."""
    rec = tp_param_of(t)
    return t if rec is None else cast(T, rec.leaf)


def expert_of(p: nn.Parameter | object) -> ExpertPlacement | None:
    """The `ExpertPlacement` of an expert parameter, else None (a dense parameter)."""
    rec = placement_of(p)
    return None if rec is None else rec.expert


def mark_expert(p: nn.Parameter, placement: ExpertPlacement) -> None:
    """Record that ``p`` is an expert's parameter placed as ``placement`` says."""
    placement_for(p).expert = placement


def rows_of(p: nn.Parameter | object) -> StackedRows | None:
    """The `StackedRows` of a split stacked expert tensor, else None."""
    rec = placement_of(p)
    return None if rec is None else rec.rows


def mark_rows(p: nn.Parameter, rows: StackedRows) -> None:
    """Record that ``p`` holds ``rows`` of a stacked expert tensor."""
    placement_for(p).rows = rows


def grad_hooks_of(p: nn.Parameter | object) -> list[GradHook]:
    """The gradient hooks that must follow ``p`` onto whatever replaces it (see `ParamPlacement`)."""
    rec = placement_of(p)
    return [] if rec is None else list(rec.grad_hooks)


def add_grad_hook(p: nn.Parameter, hook: GradHook) -> None:
    """Register ``hook`` on ``p``'s gradient, and record it so that a strategy replacing ``p``
    (FSDP's leaf) registers it again."""
    p.register_hook(hook)
    placement_for(p).grad_hooks.append(hook)
