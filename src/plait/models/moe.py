"""A mixture-of-experts MLP for plait's GPT: a router picks ``top_k`` of ``n_experts`` expert
MLPs for each token (plus ``n_shared_experts`` every token uses), and the token's output is
their outputs weighted by the router.

Plain PyTorch with no parallel code. The experts' part of the computation is one method,
`MoE.experts_forward`, given the routed tokens sorted by expert and each expert's count: expert
parallelism (`plait.expert_parallel`) replaces that method with one that sends each expert's
tokens to the rank holding it.

Routing:

* ``gating="softmax"``: probabilities over experts, the top ``k`` chosen and renormalised
  (Mixtral); ``"sigmoid"``: independent scores, the top ``k`` normalised (DeepSeek-V3).
* Load balancing by an auxiliary loss ``aux_loss_coef * E * sum_i f_i * P_i`` (Switch
  Transformer: ``f_i`` the share of assignments expert i got, ``P_i`` its mean router weight),
  added to the gradients in backward without changing the forward's output, so the caller's loss
  stays the language-model loss (weighted by ``aux_loss_scale``: `set_aux_loss_scale`); and/or
  DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the scores only to
  choose experts, moved by ``bias_update_rate`` towards balance
  by `update_balance` (after an optimizer step, from the counts the router saw).
* ``capacity_factor=None``: dropless, every routed token is computed. Otherwise each expert
  takes at most ``ceil(capacity_factor * tokens * k / E)`` tokens, first come first served;
  the rest of its assignments are dropped (the token keeps its residual and its other experts).
  ``last_drop_rate`` holds the share of assignments dropped in the last forward.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MoE", "SwiGLU", "GATINGS", "update_balance", "moe_layers", "set_aux_loss_scale"]

GATINGS = ("softmax", "sigmoid")


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: each expert, and plait GPT's dense MLP."""

    def __init__(self, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_hidden, bias=False)
        self.up_proj = nn.Linear(d_model, d_hidden, bias=False)
        self.down_proj = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _AuxLoss(torch.autograd.Function):
    """Identity on ``out``; in backward, the auxiliary loss gets gradient ``scale`` (it is added
    to the loss without appearing in it)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.aux_dtype, ctx.scale = aux.dtype, scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


class MoE(nn.Module):
    """Tokens (..., d_model) -> the same shape, through the routed and shared experts."""

    expert_bias: torch.Tensor

    def __init__(self, d_model: int, d_hidden: int, n_experts: int, top_k: int, n_shared_experts: int = 0,
                 gating: str = "softmax", aux_loss_coef: float = 0.0, bias_update_rate: float = 0.0,
                 capacity_factor: float | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"MoE: top_k={top_k} must be between 1 and n_experts={n_experts}")
        if gating not in GATINGS:
            raise ValueError(f"MoE: gating must be one of {GATINGS}, got {gating!r}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"MoE: capacity_factor must be > 0 (or None: dropless), got {capacity_factor}")
        self.n_experts, self.top_k, self.gating = n_experts, top_k, gating
        self.aux_loss_coef, self.bias_update_rate, self.capacity_factor = (aux_loss_coef, bias_update_rate,
                                                                           capacity_factor)
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(d_model, d_hidden) for _ in range(n_experts))
        self.shared = SwiGLU(d_model, d_hidden * n_shared_experts) if n_shared_experts else None
        # Chooses experts only (DeepSeek-V3's balancing); saved with the model.
        self.register_buffer("expert_bias", torch.zeros(n_experts))
        # Assignments per expert since the last update_balance: not a buffer, which data parallelism
        # would broadcast from one rank over every rank's own counts.
        self.load: torch.Tensor | None = None
        self.last_drop_rate = 0.0
        # The weight of this forward's auxiliary loss in the step's loss: 1/K when the caller
        # divides each of K accumulated micro-batches' losses by K (`set_aux_loss_scale`).
        self.aux_loss_scale = 1.0

    def reset_parameters(self) -> None:
        """The balancing bias starts at 0 (what per-module initialisation of a meta model calls)."""
        if not self.expert_bias.is_meta:
            self.expert_bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:  # a shape-only run (a pipeline's dry run): routing needs values
            return torch.empty_like(x)
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, chosen, scores = self.route(tokens)
        n, k = tokens.shape[0], self.top_k
        expert_of = chosen.reshape(-1)
        token_of = torch.arange(n, device=x.device).repeat_interleave(k)
        weight_of = weights.reshape(-1)
        order = torch.argsort(expert_of, stable=True)  # by expert, then by token: first come first served
        expert_of, token_of, weight_of = expert_of[order], token_of[order], weight_of[order]
        counts = torch.bincount(expert_of, minlength=self.n_experts)
        if self.training:
            self.load = counts if self.load is None else self.load + counts
        if self.capacity_factor is not None:
            keep, counts = self._within_capacity(expert_of, counts, n)
            self.last_drop_rate = 1.0 - float(keep.sum()) / max(1, keep.numel())
            expert_of, token_of, weight_of = expert_of[keep], token_of[keep], weight_of[keep]
        routed = self.experts_forward(tokens[token_of], counts)
        weighted = routed * weight_of.unsqueeze(-1).to(routed.dtype)
        out = torch.zeros_like(tokens).index_add(0, token_of, weighted)
        if self.shared is not None:
            out = out + self.shared(tokens)
        if self.training and self.aux_loss_coef and torch.is_grad_enabled():
            out = _AuxLoss.apply(out, self._aux_loss(scores, chosen, n), self.aux_loss_scale)
        return out.reshape(shape)

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights (n, k), chosen experts (n, k), router weights over all experts (n, E))."""
        logits = self.router(tokens).to(torch.promote_types(tokens.dtype, torch.float32))
        scores = logits.softmax(-1) if self.gating == "softmax" else logits.sigmoid()
        chosen = torch.topk(scores + self.expert_bias.to(scores.dtype), self.top_k, dim=-1).indices
        picked = scores.gather(-1, chosen)
        renormalise = self.top_k > 1 or self.gating == "sigmoid"
        weights = picked / picked.sum(-1, keepdim=True) if renormalise else picked
        return weights, chosen, scores

    def experts_forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Outputs of the routed ``tokens`` (sorted by expert; ``counts[e]`` of them for expert e),
        in the same order."""
        parts = tokens.split(counts.tolist())
        outs = [self.experts[e](part) for e, part in enumerate(parts) if part.shape[0]]
        return torch.cat(outs) if outs else tokens[:0].clone()

    def _within_capacity(self, expert_of: torch.Tensor, counts: torch.Tensor,
                         n: int) -> tuple[torch.Tensor, torch.Tensor]:
        capacity = math.ceil(self.capacity_factor * n * self.top_k / self.n_experts)  # type: ignore[operator]
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.arange(expert_of.numel(), device=expert_of.device) - starts[expert_of]
        keep = rank_in_expert < capacity
        return keep, counts.clamp(max=capacity)

    def token_statistics(self, counts: torch.Tensor) -> torch.Tensor:
        """The balancing loss's counts (assignments per expert, then tokens) over the tokens of
        one batch. Here, this forward's; a layout that splits a sequence's tokens over ranks
        (sequence parallelism) replaces it with their sum over those ranks."""
        return counts

    def _aux_loss(self, scores: torch.Tensor, chosen: torch.Tensor, n: int) -> torch.Tensor:
        assigned = torch.bincount(chosen.reshape(-1), minlength=self.n_experts).to(scores.dtype)
        counts = self.token_statistics(torch.cat([assigned, assigned.new_full((1,), n)]))
        assigned, total = counts[:-1], counts[-1]
        share = assigned / (total * self.top_k)
        probs = scores / scores.sum(-1, keepdim=True) if self.gating == "sigmoid" else scores
        # This forward's tokens' share of the mean router weight: over ranks that each hold part
        # of the tokens, the parts add up to the whole batch's loss.
        return self.aux_loss_coef * self.n_experts * (share * probs.sum(0) / total).sum()


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Weigh each forward's auxiliary loss by ``scale`` (1/K for K accumulated micro-batches
    whose losses are divided by K), as the language-model loss is."""
    for moe in moe_layers(model):
        moe.aux_loss_scale = scale


@torch.no_grad()
def update_balance(model: nn.Module, load: list[torch.Tensor] | None = None) -> None:
    """DeepSeek-V3's balancing step: each MoE layer's expert bias moves by ``bias_update_rate``
    up for experts that got fewer than the mean assignments since the last call, down for those
    that got more; the counts then restart. ``load`` gives the counts to use instead of each
    layer's own (the sum over data-parallel ranks, so every replica moves alike)."""
    for i, moe in enumerate(moe_layers(model)):
        counts = moe.load if load is None else load[i]
        if moe.bias_update_rate and counts is not None:
            step = torch.sign(counts.double().mean() - counts.double())
            moe.expert_bias += moe.bias_update_rate * step.to(moe.expert_bias)
        moe.load = None
