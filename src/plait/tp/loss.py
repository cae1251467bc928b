"""Vocabulary-parallel cross-entropy (Megatron-LM, section 3): the loss of logits that stay
split by vocabulary across the tp group, without ever forming the full ``(tokens, vocab)``
logits on one rank.

Forward, per token: the maximum logit is all-reduced (MAX) for a stable softmax, then the sum
of exponentials and the target's logit (only the rank owning the target contributes it) are
all-reduced (SUM) together in one call. Backward is local: this rank's slice of
``softmax - one_hot(target)``. Vocabulary padding (when tp does not divide the vocabulary)
is masked to -inf, so the result is exact.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.runtime import comm, faults


class _VocabParallelCE(torch.autograd.Function):
    """Forward: all-reduce(MAX) of a per-token scalar, then one all-reduce(SUM) of two per-token
    scalars. Backward: no communication (each rank owns its columns of the gradient)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup,
                start: int, valid: int) -> torch.Tensor:
        # float32 at least: low-precision logits are raised to it, float64 ones stay float64.
        x = logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32)).clone()
        t = targets.reshape(-1)
        if valid < x.shape[1] and not faults.active("tp-vocab-padding"):  # an injected bug in tests only
            x[:, valid:] = float("-inf")  # padding columns take no probability
        m = x.max(dim=1).values
        comm.all_reduce(m, group, op=comm.ReduceOp.MAX)
        x.sub_(m.unsqueeze(1))
        mine = (t >= start) & (t < start + valid)
        local_t = (t - start).masked_fill(~mine, 0)
        # The target's shifted logit (not its exp, which can underflow), before x is overwritten.
        target = x.gather(1, local_t.unsqueeze(1)).squeeze(1) * mine
        x.exp_()  # x now holds exp(logit - max)
        both = torch.stack([x.sum(dim=1), target])
        comm.all_reduce(both, group)
        sum_exp, target = both[0], both[1]
        loss = (sum_exp.log() - target).mean()
        x.div_(sum_exp.unsqueeze(1))  # softmax, kept for backward
        ctx.save_for_backward(x, local_t, mine)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local_t, mine = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local_t] -= mine.to(g.dtype)
        g.mul_(grad / g.shape[0])
        return g.view(ctx.shape).to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup, vocab_size: int | None = None
) -> torch.Tensor:
    """Mean cross-entropy over every position, from logits split by vocabulary.

    ``logits``: ``(..., local_vocab)``, this rank's contiguous slice (rank r owns entries
    ``[r * local_vocab, (r + 1) * local_vocab)``); ``targets``: ``(...)`` full token ids,
    the same on every rank; ``vocab_size``: the real vocabulary when the last slice is padded
    (default: ``local_vocab * tp``). Returns the same scalar on every rank, equal to
    `plait.losses.lm_loss` on the full logits.
    """
    n, r = dist.get_world_size(group), dist.get_rank(group)
    local = logits.shape[-1]
    full = local * n if vocab_size is None else vocab_size
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and targets "
                         f"{tuple(targets.shape)} must agree on every dim but the last")
    if not (local * (n - 1) < full <= local * n):
        raise ValueError(f"vocab_parallel_cross_entropy: vocab_size={full} does not fit {n} shards of "
                         f"{local} logits (expected {local * (n - 1) + 1}..{local * n})")
    start = r * local
    valid = max(0, min(local, full - start))
    return _VocabParallelCE.apply(logits, targets, group, start, valid)
