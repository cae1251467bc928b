"""The two algorithms that move whole tensors instead of passing blocks around a ring.

* **All-gather KV** (Llama 3's choice for grouped-query attention, where K and V are a small
  part of the activations): every rank gathers the whole sequence's keys and values and
  attends its own queries to them; backward reduce-scatters their gradients to their owners.
  Bytes per layer: an all-gather of K, V forward and a reduce-scatter of dK, dV backward.
* **All-to-all (Ulysses)**: an all-to-all trades the sequence split for a head split, so each
  rank attends the whole sequence with ``heads / cp`` heads, and a second all-to-all trades
  back. Bytes per layer: all-to-alls of Q, K, V (one collective) and of the output forward, the
  same backward.

Ranks may hold different lengths (a sequence that does not split evenly): the collectives carry
equal chunks, padded to the longest rank's length.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.cp.group import CPGroup
from plait.cp.kernel import FULL, PARTIAL, block_forward
from plait.cp.layout import Layout, Span
from plait.runtime import comm


def _longest(layout: Layout) -> int:
    return max(layout.local_len(r) for r in range(layout.size))


def _padded(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """``t`` zero-padded along ``dim`` to ``length``."""
    if t.shape[dim] == length:
        return t
    shape = list(t.shape)
    shape[dim] = length - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def _to_sequence(per_rank: torch.Tensor, layout: Layout, dim: int) -> torch.Tensor:
    """Every rank's padded shard (``per_rank[r]``) -> the full sequence in order, along ``dim``
    (counted in a shard, which has lost the leading rank dimension)."""
    parts = [per_rank[r].narrow(dim, 0, layout.local_len(r)) for r in range(layout.size)]
    return layout.unshard(parts, dim=dim)


def _to_ranks(full: torch.Tensor, layout: Layout, dim: int) -> torch.Tensor:
    """The inverse of `_to_sequence`: (ranks, ...) of each rank's tokens, padded."""
    longest = _longest(layout)
    shards = [_padded(torch.cat([full.narrow(dim, s.start, s.length) for s in layout.spans(r)], dim=dim),
                      longest, dim) for r in range(layout.size)]
    return torch.stack(shards)


class _GatherSequence(torch.autograd.Function):
    """All-gather of this rank's tokens (along dim ``dim``) into the full sequence; backward
    reduce-scatters the gradient back to the owners."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, cp: CPGroup, layout: Layout, dim: int) -> torch.Tensor:
        ctx.cp, ctx.layout, ctx.dim = cp, layout, dim
        shard = _padded(t, _longest(layout), dim).contiguous()
        out = shard.new_empty((cp.size, *shard.shape))
        comm.all_gather_into(out.view(-1), shard.view(-1), cp.group)
        return _to_sequence(out, layout, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cp, layout, dim = ctx.cp, ctx.layout, ctx.dim
        full = _to_ranks(grad.contiguous(), layout, dim).contiguous()
        mine = full.new_empty(full.shape[1:])
        comm.reduce_scatter_into(mine.view(-1), full.view(-1), cp.group)
        return mine.narrow(dim, 0, layout.local_len()), None, None, None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPGroup, layout: Layout,
                        causal: bool = True, scale: float | None = None,
                        window: int | None = None) -> torch.Tensor:
    """This rank's queries (b, heads, local, d) against the whole sequence's keys and values,
    gathered from the ranks of ``cp`` (each holding its tokens as ``layout`` says); ``window``: a
    causal sliding window (`plait.cp.kernel.visibility`)."""
    s = q.shape[-1] ** -0.5 if scale is None else scale
    kv = _GatherSequence.apply(torch.stack((k, v)), cp, layout, 3)
    assert isinstance(kv, torch.Tensor)
    first, second = layout.spans()
    outs = []
    halves = ((q.narrow(2, 0, first.length), first), (q.narrow(2, first.length, second.length), second))
    for q_part, span in halves:
        # Causal: the keys before the chunk's end (from the window's start), the rest masked.
        first_key = max(0, span.start - window + 1) if causal and window is not None else 0
        keys = Span(first_key, span.end - first_key) if causal else Span(0, layout.seq_len)
        kv_seen = kv.narrow(3, keys.start, keys.length)
        out, _ = block_forward(q_part, kv_seen[0], kv_seen[1], s, span, keys, PARTIAL if causal else FULL,
                               window)
        outs.append(out)
    return torch.cat(outs, dim=2).to(q.dtype)


class _Swap(torch.autograd.Function):
    """The sequence split traded for a head split (``to_heads``: each (b, heads, local, d) tensor
    with every head -> (b, heads / cp, seq, d) with this rank's heads) or back; backward is the
    other trade. The tensors travel together, in one all-to-all: Q, K and V cost one collective's
    latency (and one desync check), not three."""

    @staticmethod
    def forward(ctx: Any, cp: CPGroup, layout: Layout, to_heads: bool,
                *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.cp, ctx.layout, ctx.to_heads = cp, layout, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(ts, cp, layout)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # An output no loss reached arrives as zeros (autograd materializes them), so every rank
        # sends the same shapes whichever outputs its graph used.
        back = _heads_to_seq if ctx.to_heads else _seq_to_heads
        return (None, None, None, *back(grads, ctx.cp, ctx.layout))


def _seq_to_heads(ts: tuple[torch.Tensor, ...], cp: CPGroup, layout: Layout) -> tuple[torch.Tensor, ...]:
    n, longest = cp.size, _longest(layout)
    # send[r]: this rank's tokens of rank r's heads, every tensor's heads side by side.
    sends = []
    for t in ts:
        b, h, _, d = t.shape
        sends.append(_padded(t, longest, 2).reshape(b, n, h // n, longest, d).transpose(0, 1))
    send = torch.cat(sends, dim=2)  # a new contiguous tensor
    recv = torch.empty_like(send)  # recv[r]: rank r's tokens of this rank's heads
    comm.all_to_all_into(recv, send, cp.group)
    parts = recv.split([t.shape[1] // n for t in ts], dim=2)
    return tuple(_to_sequence(part, layout, 2) for part in parts)


def _heads_to_seq(ts: tuple[torch.Tensor, ...], cp: CPGroup, layout: Layout) -> tuple[torch.Tensor, ...]:
    # send[r]: rank r's tokens of this rank's heads, every tensor's heads side by side.
    send = torch.cat([_to_ranks(t.contiguous(), layout, 2) for t in ts], dim=2)  # a new contiguous tensor
    recv = torch.empty_like(send)  # recv[r]: this rank's tokens of rank r's heads
    comm.all_to_all_into(recv, send, cp.group)
    outs = []
    for t, part in zip(ts, recv.split([t.shape[1] for t in ts], dim=2)):
        b, hn, _, d = t.shape
        whole = part.transpose(0, 1).reshape(b, cp.size * hn, -1, d)
        outs.append(whole.narrow(2, 0, layout.local_len()))
    return tuple(outs)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPGroup, layout: Layout,
                      causal: bool = True, scale: float | None = None,
                      window: int | None = None) -> torch.Tensor:
    """Attention over the whole sequence computed head-parallel: ``heads / cp`` heads per rank;
    ``window``: a causal sliding window (`plait.cp.kernel.visibility`)."""
    n = cp.size
    if q.shape[1] % n or k.shape[1] % n:
        raise ValueError(f"all-to-all (Ulysses) context parallelism splits the heads over cp={n}: "
                         f"{q.shape[1]} query "
                         f"and {k.shape[1]} key/value heads must both divide by {n}; use the 'ring' or "
                         "'allgather' algorithm")
    s = q.shape[-1] ** -0.5 if scale is None else scale
    qh, kh, vh = _Swap.apply(cp, layout, True, q, k, v)
    whole = Span(0, layout.seq_len)
    out, _ = block_forward(qh, kh, vh, s, whole, whole, PARTIAL if causal else FULL, window)
    back, = _Swap.apply(cp, layout, False, out.to(q.dtype))
    return back
