"""Attention split by heads in models that read their own head counts in forward, and the norms
inside it that act on one head at a time."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from torch import nn

from plait.tp.context import Style, TPContext
from plait.tp.styles import ParallelRegion

__all__ = ["AttentionParallel", "HEAD_COUNTS", "HeadNorm"]

HEAD_COUNTS = ("heads", "kv_heads", "groups", "width", "kv_width")


@dataclass(frozen=True)
class AttentionParallel(ParallelRegion):
    """An attention module split by heads: a `ParallelRegion` that also gives the module's own
    head counts their local values, for models that read them in forward.

    ``heads`` query heads and ``kv_heads`` key/value heads (0: as many as ``heads``) of
    ``head_dim`` features. ``attrs`` names attributes, as ``(path, count)`` pairs, that hold
    one of `HEAD_COUNTS`: ``heads``, ``kv_heads``, ``groups`` (heads per KV head), ``width``
    (heads * head_dim) or ``kv_width``. A dotted path (``config.num_attention_heads``) gives
    the module its own copy of the object holding the attribute, so the model's shared config
    keeps the full counts. Each attribute must hold the full count when the plan is applied.
    With fewer KV heads than ranks (tp a multiple of them) each rank keeps one KV head, the one
    its query heads use (see ``ColwiseParallel(replicate=True)``).

    ``head_groups``: the heads come in that many groups, each split across the ranks on its own
    (CodeGen's fused projection holds ``mp_num`` groups of [q v k]: rank r takes its share of
    the heads of every group), so tp must divide the heads of one group.
    """

    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    attrs: tuple[tuple[str, str], ...] = ()
    head_groups: int = 1

    def counts(self, n: int) -> dict[str, int]:
        """Every count of `HEAD_COUNTS` on one of ``n`` ranks."""
        kv_full = self.kv_heads or self.heads
        h = self.heads // n
        kv = kv_full // n if kv_full % n == 0 else 1
        return {"heads": h, "kv_heads": kv, "groups": h // max(kv, 1), "width": h * self.head_dim,
                "kv_width": kv * self.head_dim}

    def fits(self, n: int) -> bool:
        """Whether the heads split across ``n`` ranks (see `validate`)."""
        kv = self.kv_heads or self.heads
        return self.heads % (self.head_groups * n) == 0 and (kv % n == 0 or n % kv == 0)

    def validate(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        super().validate(mod, name, ctx)
        kv, n, groups = self.kv_heads or self.heads, ctx.size, self.head_groups
        works = f"tp degrees that work: {', '.join(str(t) for t in range(1, self.heads + 1) if self.fits(t))}"
        if self.heads < 1 or groups < 1 or self.head_dim < 1 or self.heads % groups:
            raise ValueError(f"plan: {self!r} on {name!r}: {self.heads} heads of {self.head_dim} features in "
                             f"{groups} groups is not a head layout")
        if self.heads % (groups * n):
            grouped = f" ({groups} groups of {self.heads // groups}, each split on its own)" * (groups > 1)
            raise ValueError(f"plan: {self!r} on {name!r} cannot split {self.heads} attention heads{grouped} "
                             f"evenly across tp={n}; {works}")
        if kv % n and n % kv:
            raise ValueError(f"plan: {self!r} on {name!r}: {kv} KV heads can be neither split across tp={n} "
                             f"nor replicated (tp must divide them or be a multiple of them); {works}")
        full = self.counts(1)
        for path, what in self.attrs:
            if what not in HEAD_COUNTS:
                raise ValueError(f"plan: {self!r}: {what!r} is not one of {HEAD_COUNTS}")
            value = _resolve(mod, path)
            if value != full[what]:
                raise ValueError(f"plan: {self!r} on {name!r}: attribute {path!r} is {value!r}, but the plan "
                                 f"says it holds the full {what} ({full[what]})")

    def install(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        super().install(mod, name, ctx)
        local = self.counts(ctx.size)
        for path, what in self.attrs:
            _assign(mod, path, local[what])


@dataclass(frozen=True)
class HeadNorm(Style):
    """A norm over each head's features inside an attention split by heads (Qwen3's and Gemma3's
    ``q_norm`` / ``k_norm`` over ``head_dim``): its weight is replicated, and each rank applies it
    to its own heads only, so its gradient is summed over the tp group after backward (with or
    without sequence parallelism: inside the attention every rank sees the whole sequence)."""

    def install(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        for p in mod.parameters(recurse=False):
            if p.requires_grad:
                ctx.seq_grads.watch(p)


def _resolve(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def _assign(mod: nn.Module, path: str, value: int) -> None:
    """Set ``mod.<path>``, copying every object on the way (a shared config stays untouched)."""
    *parents, last = path.split(".")
    obj: Any = mod
    for part in parents:
        child = copy.copy(getattr(obj, part))
        setattr(obj, part, child)
        obj = child
    setattr(obj, last, value)
