"""Weights tied across pipeline ranks, e.g. a tied embedding and LM head on the first and last stage.

Each rank whose stages use the tensor keeps its own copy, initialised from the tensor's first owner
in ``named_modules()`` order (the single-process oracle's rule). After every backward the copies'
gradients are summed over the ranks that share the tensor (one all-reduce on a small group per
tie), so identical optimizer steps keep the copies equal. This is how Megatron-LM handles the
shared word embedding under pipeline parallelism (Narayanan et al. 2021, sec. 4).

Gradients accumulated over several steps before one optimizer step are summed once: after a step
every copy holds the same sum, so before the next one all copies but one drop it (`TiedCopy`),
and the next sum carries it once. Summing the accumulated gradients again would count every
earlier step once per copy.

With tensor parallelism each copy is the rank's tp shard: the groups join the pp ranks of the same
coordinate on every other axis (tp included), so a tensor split alike at every use (vocabulary-
parallel embedding and LM head: the same rows on the same tp rank) is summed shard by shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from plait.pipeline.schedules import Schedule
from plait.runtime import comm, faults


@dataclass(frozen=True)
class Tie:
    names: tuple[str, ...]  # qualified names of every use, first owner first
    ranks: tuple[int, ...]  # pp ranks holding a use, ascending


@dataclass(frozen=True)
class TiedCopy:
    """This rank's copy of a tied weight and the group of the ranks holding the other copies."""

    param: nn.Parameter
    group: dist.ProcessGroup
    carries: bool  # this copy carries the sum of earlier steps into the next (one copy per tie does)


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


def tie_groups(ties: list[Tie], lines: list[list[int]]) -> list[dist.ProcessGroup | None]:
    """One process group per tie holding this rank's copies (None where this rank holds none);
    ``lines``: every pp group's global ranks (`plait.Mesh.all_group_ranks`).

    Every rank creates every group, in the same order (group creation is collective): one per tie
    and per coordinate of the other mesh axes.
    """
    mine: list[dist.ProcessGroup | None] = []
    for tie in ties:
        found = None
        for line in lines:
            ranks = [line[i] for i in tie.ranks]
            group = comm.new_group(ranks, "pp_tied")
            if group is not None:
                found = group
        mine.append(found)
    return mine


def drop_earlier_sums(copies: list[TiedCopy]) -> None:
    """Before a step: every copy's gradient holds the same sum of the earlier steps since the last
    ``zero_grad``; all but the carrying copy drop it, so that `sync_grads` counts it once.

    Zeroed rather than divided by the number of copies: exact, and still right when a data-
    parallel stage reduces the accumulated gradient during the step (a mean over replicas of
    what each replica holds is linear, so the carrying copy's replicas bring their sums)."""
    for c in copies:
        if not c.carries and c.param.grad is not None:
            c.param.grad.zero_()


def sync_grads(copies: list[TiedCopy]) -> None:
    """Sum the gradients of tied copies over the ranks sharing them (forward: nothing moves)."""
    for c in copies:
        if c.param.grad is None:
            c.param.grad = torch.zeros_like(c.param)
        if faults.active("pp-tied-grad"):  # an injected bug in tests only
            continue
        comm.all_reduce(c.param.grad, c.group)
