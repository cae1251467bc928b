"""`expert_parallel`: an MoE model's experts split over the mesh's ``ep`` groups.

The ep groups are folded out of the data axes (`plait.Mesh(ep=...)`): ``ep`` data-parallel ranks
that see different tokens share their tokens among their experts. Rank j of an ep group keeps
experts ``j * E/ep ..`` of every MoE layer and drops the others' modules (so its state holds its
experts under their global indices, ``layers.0.mlp.experts.5...``, and a checkpoint reloads into
any other ep degree); its layers' `MoE.experts_forward` becomes an `ExpertDispatch`.

Gradients: dense parameters are averaged over all data ranks as usual (DDP over dp x cp, FSDP
over fsdp x cp). An expert's gradient already sums its ep group's tokens (the dispatch's
backward), so DDP sums it over ``edp`` (the ranks holding the same experts) and divides by the
same count as the dense ones; an expert that got no token anywhere keeps ``grad=None``, as in one
process. Each expert parameter carries an `ExpertPlacement` that tells DDP, FSDP (which leaves
experts unsharded), clipping (disjoint over ep) and `plait.full_state_dict` (gathered over ep)
how to treat it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from plait.ep.dispatch import ExpertDispatch
from plait.ep.stacked import expert_count, split_stacked, stacked_expert_modules
from plait.models.moe import MoE, moe_layers
from plait.runtime.mesh import Mesh
from plait.runtime.routing import share_routing
from plait.state.placement.pieces import mark_piece
from plait.state.placement.records import (
    ExpertParallelInfo,
    ExpertPlacement,
    attach_ep_info,
    ep_info,
    mark_expert,
)
from plait.state.placement.tp_params import to_plain_parameters

_DATA = ("dp", "fsdp", "cp")  # the ranks that see different tokens of the step (ep folded in)


class _Elsewhere(nn.Module):
    """An expert another ep rank holds."""

    def __init__(self, index: int, owner: int) -> None:
        super().__init__()
        self.index, self.owner = index, owner

    def forward(self, *_: object) -> None:
        raise RuntimeError(f"expert {self.index} lives on ep rank {self.owner}; its tokens go there")


def expert_parallel(model: nn.Module, mesh: Mesh, sequence_parallel: bool = False,
                    check: bool = True) -> nn.Module:
    """Split ``model``'s experts over ``mesh``'s ep groups, in place; return it. With ep=1 every
    rank keeps every expert, and the experts are only marked (their gradients, summed over the
    data ranks, may be missing where a rank routed no token to them).

    Each layer's balancing statistics are summed over the ranks its ``balance_statistic`` covers
    (one small all-reduce of the per-expert counts per layer and forward), so that under
    ``"global"`` every layout trains as one process does.

    ``sequence_parallel``: the MoE blocks run on the tp ranks' sequence shards (plait's GPT plan
    replicates them over tp), so the statistics count their assignments over the tp group too.

    Experts stacked in tensors (transformers' MoE models, `plait.ep.stacked`) are split by rows
    at ep > 1 and stay dense parameters at ep=1; their model computes its own balancing loss.

    ``check`` (default): at ep > 1, each layer's first forward verifies its dispatch by its numbers
    (`plait.ep.numeric`: a few rows of every expert recomputed by the rank holding it, compared
    with what came back) and refuses, naming the layer and the expert, rows that went to the
    wrong expert or came back out of order. False skips it."""
    layers, stacked = _moe_layers(model)
    to_plain_parameters(model)  # experts over ep are plain pieces; tp's DTensors would mix with them
    if ep_info(model) is not None:
        raise ValueError("expert_parallel: the model is already expert parallel")
    n, j = mesh.size("ep"), mesh.rank("ep")
    for name, count in expert_counts(model):
        if count % n:
            raise ValueError(f"expert_parallel: {name} has {count} experts, which do not split "
                             f"evenly over ep={n}")
    # Every group this function needs, read from the mesh once.
    ep_group = mesh.group("ep")
    placement = ExpertPlacement(mesh.group("edp"), ep_group, n, tuple(mesh.group_ranks("ep")),
                                tuple(mesh.group_ranks("edp")))
    statistics = _StatisticsGroups.of(mesh, sequence_parallel)
    local: list[str] = []
    absent: list[str] = []
    for name, moe in layers:
        per = moe.n_experts // n
        mine = range(j * per, (j + 1) * per)
        for e in range(moe.n_experts):
            prefix = f"{name}.experts.{e}" if name else f"experts.{e}"
            if e in mine:
                for pname, p in moe.experts[e].named_parameters():
                    mark_expert(p, placement)
                    if n > 1:  # torch's clip would take this rank's experts for all of them
                        mark_piece(p, f"ep rank {j}'s expert '{prefix}.{pname}' (ep={n})")
                    local.append(f"{prefix}.{pname}")
            else:
                moe.experts[e] = _Elsewhere(e, e // per)
                absent.append(prefix + ".")
        statistics.share(moe)
        if n > 1:
            moe.experts_forward = ExpertDispatch(moe.experts, moe.n_experts, j * per,  # type: ignore[method-assign]
                                                 ep_group, n, name, check)
    split: list[str] = []
    if n > 1:  # at ep=1 a stacked tensor is one dense parameter, every rank's gradient complete
        for name, mod in stacked:
            kept = split_stacked(mod, placement, j, ep_group, name, check)
            split += [f"{name}.{p}" if name else p for p in kept]
    attach_ep_info(model, ExpertParallelInfo(placement, tuple(local), tuple(absent), tuple(split)))
    return model


@dataclass(frozen=True)
class _StatisticsGroups:
    """The ranks an MoE layer's balancing statistics sum over: for ``"global"`` every rank that
    holds part of the step's batch (the data axes, ep folded among them, cp, and the tp ranks under
    SP), for ``"microbatch"`` the tp ranks that split one micro-batch under SP."""

    shards: int  # the parts of each forward's tokens a layer sees (tp under SP, else 1)
    split: list[dist.ProcessGroup]  # the tp group under SP
    data: list[dist.ProcessGroup]  # the data axes, when they hold several ranks
    routed_by: list[dist.ProcessGroup]

    @classmethod
    def of(cls, mesh: Mesh, sequence_parallel: bool) -> _StatisticsGroups:
        split = sequence_parallel and mesh.size("tp") > 1
        tp = [mesh.group("tp")] if split else []
        data = [mesh.group(_DATA)] if mesh.size(_DATA) > 1 else []
        # Under SP each expert's gradient is summed over tp as each of its parameters' is made, so
        # every tp rank must make it when one does: the ranks whose tokens reach the same experts
        # (tp, and ep, whose ranks send them) run every expert any of them routed to, on no tokens if
        # need be.
        routed_by = tp + ([mesh.group("ep")] if split and mesh.size("ep") > 1 else [])
        return cls(mesh.size("tp") if split else 1, tp, data, routed_by)

    def share(self, moe: MoE) -> None:
        groups = self.split + (self.data if moe.balance_statistic == "global" else [])
        share_routing(moe, self.shards, groups, self.routed_by)


def _moe_layers(model: nn.Module) -> tuple[list[tuple[str, MoE]], list[tuple[str, nn.Module]]]:
    """plait's MoE layers and the stacked expert modules (`plait.ep.stacked`) of ``model``."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]
    stacked = stacked_expert_modules(model)
    if not found and not stacked:
        raise ValueError(f"expert_parallel: {no_moe_reason(model)}")
    return found, stacked


def has_experts(model: nn.Module) -> bool:
    """Whether ``model`` holds experts `expert_parallel` places."""
    return bool(moe_layers(model)) or bool(stacked_expert_modules(model))


def expert_counts(model: nn.Module) -> list[tuple[str, int]]:
    """(module name, number of experts) of every MoE layer and stacked expert module."""
    plain = [(n, m.n_experts) for n, m in model.named_modules() if isinstance(m, MoE)]
    return plain + [(n, expert_count(m)) for n, m in stacked_expert_modules(model)]


def no_moe_reason(model: nn.Module) -> str:
    """Why ``model``'s experts cannot be split: it has none plait places."""
    foreign = [(n, m) for n, m in model.named_modules() if "expert" in type(m).__name__.lower()]
    if not foreign:
        return f"{type(model).__name__} has no plait MoE layers and no experts stacked in tensors"
    name, mod = foreign[0]
    own = [f"{k} {tuple(p.shape)}" for k, p in mod.named_parameters(recurse=False)]
    form = (f"as tensors ({', '.join(own)}) that are not stacked by expert as transformers stacks them "
            "(an int num_experts, each tensor with num_experts rows, forward(hidden_states, top_k_index, "
            "top_k_weights))" if own else "in a form plait does not place")
    return (f"{type(model).__name__} holds its experts {form} at {name!r}; expert parallelism places "
            "plait's MoE layers (GPTConfig(n_experts=...)) and transformers' stacked experts")
