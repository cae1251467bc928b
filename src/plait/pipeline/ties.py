"""Weights tied across pipeline ranks, e.g. a tied embedding and LM head on the first and last stage.

Each rank whose stages use the tensor keeps its own copy, initialised from the tensor's first owner
in ``named_modules()`` order (the single-process oracle's rule). After every backward the copies'
gradients are summed over the ranks that share the tensor (one all-reduce on a small group per
tie), so identical optimizer steps keep the copies equal. This is how Megatron-LM handles the
shared word embedding under pipeline parallelism (Narayanan et al. 2021, sec. 4).

With tensor parallelism each copy is the rank's tp shard: the groups join the pp ranks of the same
coordinate on every other axis (tp included), so a tensor split alike at every use (vocabulary-
parallel embedding and LM head: the same rows on the same tp rank) is summed shard by shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from plait import comm
from plait.mesh import Mesh
from plait.pipeline.schedules import Schedule

__all__ = ["Tie", "find_ties", "tie_groups", "first_owners", "sync_grads"]


@dataclass(frozen=True)
class Tie:
    names: tuple[str, ...]  # qualified names of every use, first owner first
    ranks: tuple[int, ...]  # pp ranks holding a use, ascending


def find_ties(segs: list[tuple[str, nn.Module]], plan: list[list[int]], sched: Schedule) -> list[Tie]:
    """Tensors used by stages on more than one pp rank."""
    uses: dict[int, list[tuple[str, int]]] = {}
    for s, idx in enumerate(plan):
        for i in idx:
            name, mod = segs[i]
            for k, prm in mod.named_parameters(remove_duplicate=False):
                uses.setdefault(id(prm), []).append((f"{name}.{k}", sched.stage_rank(s)))
    ties = []
    for use in uses.values():
        ranks = tuple(sorted({r for _, r in use}))
        if len(ranks) > 1:
            ties.append(Tie(tuple(n for n, _ in use), ranks))
    return ties


def tie_groups(ties: list[Tie], mesh: Mesh) -> list[dist.ProcessGroup | None]:
    """One process group per tie holding this rank's copies (None where this rank holds none).

    Every rank creates every group, in the same order (group creation is collective): one per tie
    and per coordinate of the other mesh axes.
    """
    mine: list[dist.ProcessGroup | None] = []
    for tie in ties:
        found = None
        for line in mesh.all_group_ranks("pp"):
            ranks = [line[i] for i in tie.ranks]
            group = comm.new_group(ranks, "pp_tied")
            if group is not None:
                found = group
        mine.append(found)
    return mine


def first_owners(module: nn.Module) -> dict[int, tuple[str, nn.Module, str]]:
    """id(tensor) -> (qualified name, module, key) of the tensor's first owner in named_modules order."""
    out: dict[int, tuple[str, nn.Module, str]] = {}
    for qual, mod in module.named_modules():
        for key, t in [*mod._parameters.items(), *mod._buffers.items()]:
            if t is not None:
                out.setdefault(id(t), (qual, mod, key))
    return out


def sync_grads(params: list[tuple[nn.Parameter, dist.ProcessGroup]]) -> None:
    """Sum the gradients of tied copies over the ranks sharing them (forward: nothing moves)."""
    for prm, group in params:
        if prm.grad is None:
            prm.grad = torch.zeros_like(prm)
        comm.all_reduce(prm.grad, group)
