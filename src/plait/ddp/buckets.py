"""Helpers of `plait.ddp` that need no DDP state: buckets and their planning, finding the
parameters a forward's output can reach, and the parameters whose gradients are sparse."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait._torch_compat import tensors_in
from plait.runtime import comm


@dataclass
class Bucket:
    """One flat gradient buffer and the parameters whose gradients it carries."""

    index: int
    first: int  # the flag index of its first parameter (buckets number parameters consecutively)
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    buffer: torch.Tensor
    slots: list[torch.Tensor] = field(default_factory=list)  # flat view of each parameter's range
    grads: list[torch.Tensor] = field(default_factory=list)  # the same ranges, shaped like the params
    pending: int = 0
    wire: torch.Tensor | None = None  # what is actually all-reduced (compressed copy or buffer)
    handle: comm.Handle | None = None
    future: torch.futures.Future | None = None  # a communication hook's result
    ready: set[int] = field(default_factory=set)

    @classmethod
    def make(cls, index: int, first: int, members: list[tuple[str, nn.Parameter]]) -> Bucket:
        offsets, total = [], 0
        for _, p in members:
            offsets.append(total)
            total += p.numel()
        p0 = members[0][1]
        buf = torch.zeros(total, dtype=p0.dtype, device=p0.device)
        # Views made once: the backward hooks are on the critical path and run once per parameter.
        slots = [buf[o : o + p.numel()] for o, (_, p) in zip(offsets, members)]
        grads = [v.view_as(p) for v, (_, p) in zip(slots, members)]
        return cls(index, first, [p for _, p in members], [n for n, _ in members], offsets, buf, slots, grads)

    def start(self) -> None:
        """Ready for a reducing backward: nothing filled, nothing in flight."""
        self.pending, self.handle, self.wire, self.future = len(self.params), None, None, None
        self.ready.clear()


_Message = tuple[torch.Tensor, list[int], list[torch.Tensor]]  # flat, its tensors' indices, their views


class BufferBroadcast:
    """The buffers' broadcast before a forward (torch's rule), as one flat message per dtype.

    Only the source packs the buffers into the message and only the other ranks unpack it (torch's
    coalesced broadcast packs and unpacks on every rank), and the messages are kept from one
    forward to the next. Each is checked for desync before it moves, as any blocking collective.
    """

    def __init__(self) -> None:
        self._layout: list[tuple[torch.dtype, torch.device, tuple[int, ...]]] = []
        self._plan: list[_Message] = []

    def _plan_for(self, tensors: list[torch.Tensor]) -> list[_Message]:
        layout = [(t.dtype, t.device, tuple(t.shape)) for t in tensors]
        if layout != self._layout:  # the first forward, or buffers replaced by others (.to(), new shapes)
            kinds: dict[tuple[torch.dtype, torch.device], list[int]] = {}
            for i, t in enumerate(tensors):
                kinds.setdefault((t.dtype, t.device), []).append(i)
            self._plan = []
            for (dtype, device), members in kinds.items():
                sizes = [tensors[i].numel() for i in members]
                flat = torch.empty(sum(sizes), dtype=dtype, device=device)
                views = [v.view(tensors[i].shape) for v, i in zip(torch.split(flat, sizes), members)]
                self._plan.append((flat, members, views))
            self._layout = layout
        return self._plan

    @torch.no_grad()
    def __call__(self, tensors: list[torch.Tensor], src: int, group: Any, rank: int) -> None:
        """Broadcast ``tensors`` (distinct) from global rank ``src``; ``rank`` is this one's."""
        for flat, members, views in self._plan_for(tensors):
            if rank == src:
                for i, v in zip(members, views):
                    v.copy_(tensors[i])
            comm.broadcast(flat, src, group)
            if rank != src:
                for i, v in zip(members, views):
                    tensors[i].copy_(v)


def sparse_params(module: nn.Module) -> set[int]:
    """Ids of the parameters whose gradients are sparse: the weights of ``nn.Embedding`` and
    ``nn.EmbeddingBag`` made with ``sparse=True`` (torch's DDP asks the same modules)."""
    return {id(m.weight) for m in module.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}


def output_tensors(out: Any) -> list[torch.Tensor]:
    """Every tensor in a forward's output: containers torch's pytree knows, and dataclasses (as
    torch's DDP walks them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [t for f in dataclasses.fields(out) for t in output_tensors(getattr(out, f.name, None))]
    if isinstance(out, (list, tuple)):
        return [t for x in out for t in output_tensors(x)]
    if isinstance(out, dict):
        return [t for x in out.values() for t in output_tensors(x)]
    return tensors_in(out)

SMALL_BUCKET_BYTES = 2**20  # first and last buckets: see plan_buckets


def plan_buckets(sizes: list[int], cap: int, small: int = SMALL_BUCKET_BYTES) -> list[list[int]]:
    """Group consecutive items (in launch order) into buckets of at most ``cap`` bytes.

    Both ends are small on purpose. The first bucket (<= ``small``) lets communication start
    as soon as backward produces its first gradients. The last buckets (<= ``small``, then
    <= 4 x ``small``) hold the first layers, whose gradients arrive when almost no backward
    work is left: whatever they contain is all-reduced with nothing to overlap, so keeping
    them small shortens the exposed tail of the step.
    """

    def greedy(order: list[int], limits: Iterator[int]) -> list[list[int]]:
        out: list[list[int]] = []
        cur: list[int] = []
        size, limit = 0, next(limits)
        for i in order:
            if cur and size + sizes[i] > limit:
                out.append(cur)
                cur, size, limit = [], 0, next(limits)
            cur.append(i)
            size += sizes[i]
        return out + [cur] if cur else out

    small = min(small, cap)
    tail_limits = itertools.chain([small, min(4 * small, cap)], itertools.repeat(cap))
    from_end = greedy(list(reversed(range(len(sizes)))), tail_limits)
    buckets = [list(reversed(b)) for b in reversed(from_end)]
    head = greedy(buckets[0], itertools.chain([small], itertools.repeat(cap))) if buckets else []
    return head + buckets[1:]


def params_reached_by(out: Any) -> set[int]:
    """Ids of the leaf tensors (parameters) that backward from ``out`` would reach."""
    roots = [t.grad_fn for t in output_tensors(out) if t.grad_fn is not None]
    seen_nodes: set[Any] = set()
    reached: set[int] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node is None or node in seen_nodes:
            continue
        seen_nodes.add(node)
        var = getattr(node, "variable", None)
        if var is not None:
            reached.add(id(var))
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return reached
