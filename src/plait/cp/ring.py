"""Ring attention: key/value blocks travel around the cp ring, each rank attending its queries
to one block while the next one is in flight.

Forward, on each of the cp steps a rank merges the attention of its two query chunks against
the two key chunks it holds (`plait.cp.kernel`: full, causal or skipped, by position) into a
running output and log-sum-exp, and passes the block on: ``cp - 1`` sends of the local K and V.

Backward recomputes each block's scores from the saved queries, the block's keys and the final
output and log-sum-exp. The block's key/value gradients travel with it: a rank adds its share
and passes the sum on, so after ``cp`` sends each block's gradient is back with its owner,
complete. Bytes one rank sends per layer: ``(cp - 1) * |K, V|`` forward, and
``(cp - 1) * |K, V| + cp * |dK, dV|`` backward (gradients in the accumulation dtype).
"""

from __future__ import annotations

from typing import Any

import torch

from plait.cp.group import CPGroup
from plait.cp.kernel import NONE, block_backward, block_forward, merge, visibility
from plait.cp.layout import Layout
from plait.runtime import comm, faults

_KV, _GRAD = 0, 1  # exchange tags: the key/value blocks and their gradients travel together


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPGroup, layout: Layout,
                   causal: bool = True, scale: float | None = None,
                   window: int | None = None) -> torch.Tensor:
    """Attention of this rank's queries (b, heads, local, d) over the whole sequence's keys,
    whose blocks the ranks of ``cp`` hold as ``layout`` says; ``k``, ``v`` (b, kv_heads, local, d).
    ``window``: a causal sliding window (`plait.cp.kernel.visibility`). Blocks wholly outside it
    are skipped, but still travel: every rank passes every block on."""
    _check(q, k, v, layout)
    s = q.shape[-1] ** -0.5 if scale is None else scale
    out = _Ring.apply(q, k, v, cp, layout, causal, s, window)
    assert isinstance(out, torch.Tensor)
    return out


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError("ring attention takes q (b, heads, seq, d) and k, v of one shape (b, kv_heads, "
                         f"seq, d); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} KV "
                         "heads")
    want = layout.local_len()
    if q.shape[2] != want or k.shape[2] != want:
        raise ValueError(f"ring attention: cp rank {layout.rank} holds {want} of {layout.seq_len} tokens, "
                         f"but q has {q.shape[2]} and k {k.shape[2]}")


def _split(t: torch.Tensor, layout: Layout, rank: int, dim: int) -> list[torch.Tensor]:
    first, second = layout.spans(rank)
    return [t.narrow(dim, 0, first.length), t.narrow(dim, first.length, second.length)]


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPGroup, layout: Layout,
                causal: bool, scale: float, window: int | None) -> torch.Tensor:
        n, me = cp.size, cp.rank
        qs = layout.spans()
        q_parts = _split(q, layout, me, 2)
        acc: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [(None, None), (None, None)]
        kv, src = torch.stack((k, v)), me
        for step in range(n):
            handle, incoming = None, None
            if step < n - 1:  # the next block is in flight while this one is computed
                shape = list(kv.shape)
                shape[3] = layout.local_len((src - 1) % n)
                incoming = kv.new_empty(shape)
                handle = comm.exchange(kv, cp.next, incoming, cp.prev, cp.group, tag=_KV)
            for i, q_span in enumerate(qs):
                for kv_part, k_span in zip(_split(kv, layout, src, 3), layout.spans(src)):
                    kind = visibility(q_span, k_span, causal, window)
                    if kind != NONE:
                        o, lse = block_forward(q_parts[i], kv_part[0], kv_part[1], scale, q_span, k_span,
                                               kind, window)
                        acc[i] = merge(*acc[i], o, lse)
            if handle is not None and incoming is not None:
                handle.wait()
                kv, src = incoming, (src - 1) % n
        out = torch.cat([o for o, _ in acc if o is not None], dim=2)
        lse = torch.cat([s for _, s in acc if s is not None], dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.layout, ctx.causal, ctx.scale, ctx.window = cp, layout, causal, scale, window
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        cp, layout, causal, scale, window = ctx.cp, ctx.layout, ctx.causal, ctx.scale, ctx.window
        n, me = cp.size, cp.rank
        qs = layout.spans()
        q_parts, do_parts = _split(q, layout, me, 2), _split(dout, layout, me, 2)
        out_parts, lse_parts = _split(out, layout, me, 2), _split(lse, layout, me, 2)
        dq = torch.zeros_like(out)
        dq_parts = _split(dq, layout, me, 2)
        kv, src = torch.stack((k, v)), me
        grad_in: tuple[comm.Handle, torch.Tensor] | None = None  # the travelling gradient of block src
        for step in range(n):
            kv_handle, incoming = None, None
            if step < n - 1:
                shape = list(kv.shape)
                shape[3] = layout.local_len((src - 1) % n)
                incoming = kv.new_empty(shape)
                kv_handle = comm.exchange(kv, cp.next, incoming, cp.prev, cp.group, tag=_KV)
            mine = torch.zeros(kv.shape, dtype=out.dtype, device=kv.device)  # this rank's share for block src
            mine_parts = _split(mine, layout, src, 3)
            for i, q_span in enumerate(qs):
                for j, (kv_part, k_span) in enumerate(zip(_split(kv, layout, src, 3), layout.spans(src))):
                    kind = visibility(q_span, k_span, causal, window)
                    if kind == NONE:
                        continue
                    dqi, dki, dvi = block_backward(do_parts[i], q_parts[i], kv_part[0], kv_part[1],
                                                   out_parts[i], lse_parts[i], scale, q_span, k_span, kind,
                                                   window)
                    dq_parts[i].add_(dqi)
                    mine_parts[j][0].add_(dki)
                    mine_parts[j][1].add_(dvi)
            if grad_in is not None:  # what the ranks before added to this block, sent while computing
                grad_in[0].wait()
                mine.add_(grad_in[1])
            if n == 1:
                return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None, None, None, None
            back = torch.empty(*kv.shape[:3], layout.local_len((src - 1) % n), kv.shape[4],
                               dtype=out.dtype, device=kv.device)
            grad_in = (comm.exchange(mine, cp.next, back, cp.prev, cp.group, tag=_GRAD), back)
            if kv_handle is not None and incoming is not None:
                kv_handle.wait()
                kv, src = incoming, (src - 1) % n
        assert grad_in is not None
        grad_in[0].wait()  # the last exchange brought this rank's own block's gradient home
        dkv = grad_in[1]
        if faults.active("cp-ring-grad") and mine.shape == dkv.shape:  # an injected bug in tests only:
            dkv = mine  # the gradient of the block this rank saw last, block (rank + 1) % cp's
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None
