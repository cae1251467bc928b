"""Attention of a block of queries against a block of keys, with the log-sum-exp that lets
blocks computed apart be merged exactly (the online softmax of flash attention).

Plain tensor operations, so it runs on any device and in float64 (what parity tests use);
low-precision inputs are computed in float32. Grouped-query attention (fewer key/value heads
than query heads) is computed without repeating the keys and values.

For a query row, ``lse = log sum_j exp(s_j)`` over the scores ``s`` of the keys it sees, and
the block's output is ``softmax(s) @ v``. Two blocks' results merge as::

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

The backward of one block needs only the *final* output and lse of the whole row (flash
attention's trick): ``p = exp(s - lse)`` is then that block's share of the full softmax.

A sliding window of ``w`` (Mistral's, Gemma3's local layers) hides, on top of causality, the keys
``w`` or more positions before the query; a block is then skipped, full or partial by both rules.

On CPU, blocks whose mask torch's fused kernel can express (all keys visible, or the causal
diagonal of a chunk against itself, uncut by a window) run through it
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, which return and take
the log-sum-exp): tiled, never holding a block's whole score matrix, and it stops at the
causal diagonal. Other blocks, and other devices, use the plain operations below.
"""

from __future__ import annotations

import torch

from plait._torch_compat import cpu_flash_attention, cpu_flash_attention_backward
from plait.cp.layout import Span

FULL, PARTIAL, NONE = "full", "partial", "none"


def visibility(q: Span, k: Span, causal: bool, window: int | None = None) -> str:
    """How queries at positions ``q`` see keys at positions ``k``: all, some (causal, or cut by a
    sliding ``window``: a query sees the keys less than ``window`` positions before it), none."""
    if not causal:
        return FULL
    if k.start > q.end - 1 or (window is not None and q.start - (k.end - 1) >= window):
        return NONE
    if k.end - 1 <= q.start and (window is None or (q.end - 1) - k.start < window):
        return FULL
    return PARTIAL


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, qs: Span, ks: Span, kind: str,
            window: int | None) -> torch.Tensor:
    """Scores (b, kv_heads, groups, lq, lk) in the accumulation dtype, masked for ``PARTIAL``."""
    b, h, lq, d = q.shape
    hk = k.shape[1]
    acc = _acc_dtype(q)
    q5 = q.to(acc).view(b, hk, h // hk, lq, d)
    s = q5 @ k.to(acc).unsqueeze(2).transpose(-1, -2) * scale
    if kind == PARTIAL:
        qpos = torch.arange(qs.start, qs.end, device=q.device)
        kpos = torch.arange(ks.start, ks.end, device=q.device)
        hidden = kpos[None, :] > qpos[:, None]
        if window is not None:
            hidden |= qpos[:, None] - kpos[None, :] >= window
        s = s.masked_fill(hidden, float("-inf"))
    return s


def _fused(q: torch.Tensor, qs: Span, ks: Span, kind: str, window: int | None) -> bool:
    """Whether torch's fused CPU kernel computes this block: every key visible, or a chunk's
    causal diagonal (its top-left-aligned mask) that no window cuts. A dry run's meta tensors take
    the same path (the kernel has a shape-only form), so `plait plan` sees what a CPU run keeps."""
    diagonal = kind == PARTIAL and qs == ks and (window is None or qs.length <= window)
    return q.device.type in ("cpu", "meta") and (kind == FULL or diagonal)


def _heads(t: torch.Tensor, h: int) -> torch.Tensor:
    """K or V with its heads repeated to the query heads (the fused kernel takes equal heads)."""
    return t if t.shape[1] == h else t.repeat_interleave(h // t.shape[1], dim=1)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, qs: Span, ks: Span,
                  kind: str, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (b, h, lq, d), lse (b, h, lq)) of queries ``q`` at ``qs`` against keys at ``ks``,
    both in the accumulation dtype. A row that sees no key has lse -inf and output 0."""
    b, h, lq, d = q.shape
    if _fused(q, qs, ks, kind, window):
        out, lse = cpu_flash_attention(
            q, _heads(k, h), _heads(v, h), 0.0, kind == PARTIAL, scale=scale)
        return out.to(_acc_dtype(q)), lse.to(_acc_dtype(q))
    s = _scores(q, k, scale, qs, ks, kind, window)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    out = p @ v.to(s.dtype).unsqueeze(2)
    return out.reshape(b, h, lq, v.shape[-1]), lse.reshape(b, h, lq)


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, scale: float, qs: Span, ks: Span, kind: str,
                   window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of one block's share, in the accumulation dtype, given the row's
    final ``out`` and ``lse`` (over every block) and the gradient ``dout`` of the final output."""
    b, h, lq, d = q.shape
    hk, g = k.shape[1], h // k.shape[1]
    if _fused(q, qs, ks, kind, window):
        dq, dk, dv = cpu_flash_attention_backward(
            dout.to(q.dtype).contiguous(), q, _heads(k, h), _heads(v, h), out.to(q.dtype).contiguous(),
            lse.to(torch.promote_types(q.dtype, torch.float32)).contiguous(), 0.0, kind == PARTIAL,
            scale=scale)
        acc = _acc_dtype(q)
        lk = k.shape[2]
        return (dq.to(acc), dk.reshape(b, hk, g, lk, d).sum(2).to(acc),
                dv.reshape(b, hk, g, lk, v.shape[-1]).sum(2).to(acc))
    s = _scores(q, k, scale, qs, ks, kind, window)
    acc = s.dtype
    p = torch.exp(s - lse.to(acc).view(b, hk, g, lq, 1))
    do5 = dout.to(acc).view(b, hk, g, lq, -1)
    v5 = v.to(acc).unsqueeze(2)
    dv = (p.transpose(-1, -2) @ do5).sum(2)
    dp = do5 @ v5.transpose(-1, -2)
    rowdot = (do5 * out.to(acc).view(b, hk, g, lq, -1)).sum(-1, keepdim=True)
    ds = p * (dp - rowdot)
    dq = (ds @ k.to(acc).unsqueeze(2)) * scale
    dk = (ds.transpose(-1, -2) @ q.to(acc).view(b, hk, g, lq, d)).sum(2) * scale
    return dq.reshape(b, h, lq, d), dk, dv


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a block's (out, lse) into the running ones (None: the first block)."""
    if out is None or lse is None:
        return out_b, lse_b
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isinf(new), 0.0, new)  # rows that have seen no key yet stay 0
    out = out * torch.exp(lse - safe).unsqueeze(-1) + out_b * torch.exp(lse_b - safe).unsqueeze(-1)
    return out, new
