"""Floors: the step any implementation of a layout needs on these ranks when nothing is communicated.

Each floor runs the same model, batch and optimizer as the compared implementations on each rank's
share of the work, with every collective left out, so an implementation's step can be at most as
fast as its floor. Set against another implementation's step in the same alternation (paired,
`bench.common.paired_ratios`), a floor above a target ratio says the target cannot be reached by
any implementation on this machine, whatever its communication costs.

* ZeRO (every stage): forward and backward of the whole model on the rank's rows of the batch,
  then AdamW over the rank's share of each parameter (its dim-0 rows, ``torch.chunk``'s rule, as
  plait and FSDP2 shard), from plain tensors: no gather, no reduction.
* Pipeline: each rank's stage alone: its segments' forward and backward on every microbatch (the
  first stage fed the tokens and given a fixed gradient for its output, the last fed a fixed
  activation and ending in the loss), then AdamW over the stage's parameters; no sends, no bubble.
* Ulysses: the sequence-parallel model with each all-to-all replaced by a local reshuffle of the
  same shapes (`local_ulysses`), and no gradient all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def zero_floor(args: dict, x: torch.Tensor, y: torch.Tensor) -> Callable[[], float]:
    """ZeRO's floor on this rank (see the module docstring); the step returns its loss."""
    import torch.distributed as dist

    import plait
    from bench.common import gpt_config
    from plait.models.gpt import GPT, lm_loss

    model = plait.init_weights(GPT(gpt_config(args)), 0)
    world, rank = dist.get_world_size(), dist.get_rank()
    params = list(model.parameters())
    shards = [nn.Parameter(_rows(p.detach(), world, rank).clone()) for p in params]
    opt = torch.optim.AdamW(shards, lr=1e-3, weight_decay=0.1)

    def step() -> float:
        loss = lm_loss(model(x), y)
        loss.backward()
        for shard, p in zip(shards, params, strict=True):  # the same rows of each gradient (views)
            shard.grad = None if p.grad is None else _rows(p.grad, world, rank)
        opt.step()
        for shard, p in zip(shards, params, strict=True):
            shard.grad = p.grad = None
        return float(loss.item())
    return step


def _rows(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """``rank``'s dim-0 rows of ``t`` under torch.chunk's rule (possibly none); a 0-d ``t`` whole."""
    if t.dim() == 0:
        return t
    per = -(-t.shape[0] // world)
    a = min(rank * per, t.shape[0])
    return t[a:min(a + per, t.shape[0])]


def stage_floor(args: dict, segs: list[tuple[str, nn.Module]], parts: list[int],
                micro: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
    """The pipeline's floor on this rank: its stage (segments ``parts[r]`` to ``parts[r+1]`` of
    ``segs``) computing alone over every microbatch in ``micro`` (inputs, targets)."""
    import torch.distributed as dist

    from plait.models.gpt import lm_loss

    world, rank = dist.get_world_size(), dist.get_rank()
    stage = nn.Sequential(*[mod for _, mod in segs[parts[rank]:parts[rank + 1]]])
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-3, weight_decay=0.1)
    first, last = rank == 0, rank == world - 1
    g = torch.Generator().manual_seed(rank)
    # What a middle or last stage receives, and what a first or middle stage is sent back: fixed
    # activations of the width between stages (the embedding's).
    width = segs[0][1](micro[0][0][:1, :1]).shape[-1]
    shape = (*micro[0][0].shape, width)
    acts = [torch.randn(shape, generator=g) for _ in micro]
    grads = [torch.randn(shape, generator=g) / shape[-1] for _ in micro]

    def step() -> None:
        for i, (tokens, target) in enumerate(micro):
            out = stage(tokens if first else acts[i].detach().requires_grad_())
            if last:
                lm_loss(out, target).backward()
            else:
                out.backward(grads[i])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def local_ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: object,
                  **kwargs: object) -> torch.Tensor:
    """DeepSpeed-Ulysses' attention on 2 ranks without its all-to-alls: (batch, s/2, heads,
    head_dim) in, the same out, through the shapes its all-to-alls make (batch, s, heads/2,
    head_dim); this rank's half-sequence stands for the other rank's, so the arithmetic and the
    copies are those of the real step, and nothing moves between ranks."""
    import torch.nn.functional as F

    half = q.shape[2] // 2
    whole = [torch.cat([t[:, :, :half]] * 2, dim=1) for t in (q, k, v)]  # what the all-to-all returns
    y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in whole), is_causal=True).transpose(1, 2)
    b, s, h, d = y.shape
    # back to this rank's half-sequence over every head, as the second all-to-all lays it out
    return y.reshape(b, 2, s // 2, h, d).permute(0, 2, 1, 3, 4).reshape(b, s // 2, 2 * h, d)


def floor_table(pairs: list[tuple[str, dict]]) -> str:
    """One row per layout whose alternation timed ``plait``, ``deepspeed`` and ``floor``: the floor's
    step against DeepSpeed's and plait's, wall time (paired, with spread) and rank 0's CPU time."""
    from bench.common import markdown_table, median, paired_ratios, spread

    rows = []
    for label, out in pairs:
        t, cpu = out["times"], out["cpu"]
        f = spread(paired_ratios(t["floor"], t["deepspeed"]))
        # A schedule's own idle time (a pipeline's fill and drain) is part of any implementation's
        # step: the bound is the floor stretched by it.
        bound = f.median * out.get("schedule_factor", 1.0)
        rows.append([label, median(t["floor"]), median(t["deepspeed"]), f.median,
                     f"{f.p25:.3f}-{f.p75:.3f}; {f.p10:.3f}-{f.p90:.3f}",
                     median(paired_ratios(cpu["floor"], cpu["deepspeed"])), bound,
                     median(paired_ratios(t["plait"], t["deepspeed"])),
                     median(paired_ratios(cpu["plait"], cpu["deepspeed"])),
                     median(paired_ratios(t["plait"], t["floor"])),
                     "yes" if bound <= 0.8 else "no"])
    return markdown_table(["layout", "floor step (s)", "DeepSpeed step (s)",
                           "floor / DeepSpeed (median of pairs)", "IQR; p10-p90",
                           "floor / DeepSpeed, CPU time",
                           "bound / DeepSpeed (the floor with the schedule's bubble)",
                           "plait / DeepSpeed", "plait / DeepSpeed, CPU time", "plait / floor",
                           "0.8 of DeepSpeed reachable here"], rows)


FLOOR_NOTE = """The floor is the same step with nothing communicated (`bench/floors.py`): the model's
forward and backward on the rank's share of the batch and AdamW on the rank's share of the
parameters (ZeRO), each stage's compute alone over the microbatches (pipeline), or the attention's
all-to-alls replaced by local reshuffles of the same shapes (Ulysses). No implementation of the
layout can step faster on these ranks. A pipeline schedule also idles by its nature: 1F1B over p
stages and m microbatches takes m + p - 1 stage-slots where the floor computes m, so its bound is
the floor times (m + p - 1) / m. Where the bound is above 0.8 of DeepSpeed's step, 0.8 is out of
reach here by construction. Ratios are medians of per-step pairs from the same alternation
as the rows above; CPU time is rank 0's process (every thread), steadier than wall time under load."""
