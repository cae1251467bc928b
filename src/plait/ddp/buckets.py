"""Helpers of `plait.ddp` that need no DDP state: bucket planning and finding the parameters
a forward's output can reach."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from plait._torch_compat import tensors_in

__all__ = ["plan_buckets", "params_reached_by"]

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
    roots = [t.grad_fn for t in tensors_in(out) if t.grad_fn is not None]
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
