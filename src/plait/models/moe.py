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

Which tokens the balancing statistics (``f_i`` and the bias's counts) cover,
``balance_statistic``:

* ``"global"`` (the default): every token of the training step, so that a model trains the same
  on any number of ranks. The counts of each training forward go through `MoE.token_statistics`,
  which a layout replaces with their sum over the ranks that share the step's batch
  (`plait.expert_parallel` does), and add up over the step's forwards; ``f`` is read in backward,
  when the step's forwards have all run. The loss is linear in ``P`` given ``f``: each forward
  contributes its tokens' part of ``P`` (differentiable, local), weighted as its language-model
  loss is. A step ends at an optimizer step (any torch optimizer; `MoE.restart_statistics`
  otherwise); a forward after a backward of the same step has read ``f`` (gradient accumulation
  with a backward per micro-batch, a 1F1B pipeline) is refused, as ``f`` was already used.
  Forwards without a backward belong under ``torch.no_grad()`` or ``eval()``: they are not counted.
* ``"microbatch"``: each forward's own tokens (each rank's micro-batch), what Megatron and most
  trainers compute; the result then depends on how the batch is split.
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

from plait._torch_compat import every_optimizer_step, in_backward

__all__ = ["MoE", "SwiGLU", "update_balance", "moe_layers", "set_aux_loss_scale"]

GATINGS = ("softmax", "sigmoid")
BALANCE_STATISTICS = ("global", "microbatch")


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: each expert, and plait GPT's dense MLP."""

    def __init__(self, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_hidden, bias=False)
        self.up_proj = nn.Linear(d_model, d_hidden, bias=False)
        self.down_proj = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Share:
    """The balancing loss's ``f``: assignments per expert over ``top_k`` times the tokens, from
    ``counts`` (per expert, then tokens) fixed when the forward ran."""

    def __init__(self, counts: torch.Tensor | None, top_k: int) -> None:
        self.counts, self.top_k = counts, top_k

    def read(self) -> torch.Tensor:
        assert self.counts is not None
        return self.counts[:-1] / (self.counts[-1] * self.top_k)


class _OptimizerSteps:
    """How many optimizer steps this process has taken (torch's hook after every optimizer's
    step): where the global statistic's training step ends."""

    count = 0
    _handle: Any = None

    @classmethod
    def watch(cls) -> None:
        if cls._handle is None:
            cls._handle = every_optimizer_step(cls._stepped, after=True)

    @classmethod
    def _stepped(cls, *_: object) -> None:
        cls.count += 1


class _StepShare(_Share):
    """``f`` over every forward of a training step: counts add up until an optimizer step; a
    forward after a backward has read them, before the optimizer stepped, is refused."""

    def __init__(self, top_k: int) -> None:
        super().__init__(None, top_k)
        _OptimizerSteps.watch()
        self.step, self.read_in_step = _OptimizerSteps.count, False

    def add(self, counts: torch.Tensor) -> None:
        if self.step != _OptimizerSteps.count:  # the optimizer stepped: a new training step
            self.counts, self.step, self.read_in_step = None, _OptimizerSteps.count, False
        if self.read_in_step:
            raise RuntimeError(
                "MoE balancing loss (balance_statistic='global'): a forward ran after a backward of the "
                "same optimizer step had used the routing statistics over the step's forwards, which this "
                "forward now changes (gradient accumulation with a backward per micro-batch, or a pipeline "
                "schedule that interleaves forwards and backwards). Run every forward of a step before "
                "its backwards (a GPipe schedule), or use balance_statistic='microbatch' (each forward's "
                "own tokens); a step that skipped its optimizer step calls restart_statistics()")
        self.counts = counts if self.counts is None else self.counts + counts

    def read(self) -> torch.Tensor:
        self.read_in_step = True
        return super().read()


class _Balance(torch.autograd.Function):
    """Identity on ``out``; in backward, ``mass`` (each expert's router weight summed over this
    forward's tokens) gets the balancing loss's gradient ``weight * f``, with ``f`` read from
    ``share`` then: the loss is added to the gradients without appearing in the output, and a
    statistic over the whole step can be used once the step's forwards have all counted."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, mass: torch.Tensor, share: _Share,
                weight: float) -> torch.Tensor:
        ctx.share, ctx.weight, ctx.dtype = share, weight, mass.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        f = ctx.share.read().to(device=grad.device)
        return grad, (ctx.weight * f).to(ctx.dtype), None, None


class MoE(nn.Module):
    """Tokens (..., d_model) -> the same shape, through the routed and shared experts."""

    expert_bias: torch.Tensor

    def __init__(self, d_model: int, d_hidden: int, n_experts: int, top_k: int, n_shared_experts: int = 0,
                 gating: str = "softmax", aux_loss_coef: float = 0.0, bias_update_rate: float = 0.0,
                 capacity_factor: float | None = None, balance_statistic: str = "global") -> None:
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"MoE: top_k={top_k} must be between 1 and n_experts={n_experts}")
        if gating not in GATINGS:
            raise ValueError(f"MoE: gating must be one of {GATINGS}, got {gating!r}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"MoE: capacity_factor must be > 0 (or None: dropless), got {capacity_factor}")
        if balance_statistic not in BALANCE_STATISTICS:
            raise ValueError(f"MoE: balance_statistic must be one of {BALANCE_STATISTICS}, got "
                             f"{balance_statistic!r}")
        self.balance_statistic = balance_statistic
        self.n_experts, self.top_k, self.gating = n_experts, top_k, gating
        self.aux_loss_coef, self.bias_update_rate, self.capacity_factor = (aux_loss_coef, bias_update_rate,
                                                                           capacity_factor)
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(d_model, d_hidden) for _ in range(n_experts))
        self.shared = SwiGLU(d_model, d_hidden * n_shared_experts) if n_shared_experts else None
        # Chooses experts only (DeepSeek-V3's balancing); saved with the model.
        self.register_buffer("expert_bias", torch.zeros(n_experts))
        # Assignments per expert since the last update_balance (summed by token_statistics under
        # the global statistic): not a buffer, which data parallelism would broadcast from one rank
        # over every rank's own counts.
        self.load: torch.Tensor | None = None
        self.step_share = _StepShare(top_k)  # the global statistic's counts over this step
        # Ranks whose tokens make up one forward's batch and whose gradients are summed (sequence
        # parallelism's tp ranks): each forward's part of P is its tokens' over all of theirs.
        self.token_shards = 1
        # False while a forward whose graph is never backpropagated runs with gradients (a
        # pipeline's probe of its stages' outputs): it does not count.
        self.counts_forwards = True
        self.last_drop_rate = 0.0
        # The weight of this forward's auxiliary loss in the step's loss: 1/K when the caller
        # divides each of K accumulated micro-batches' losses by K (`set_aux_loss_scale`).
        self.aux_loss_scale = 1.0

    def reset_parameters(self) -> None:
        """The balancing bias starts at 0 (what per-module initialisation of a meta model calls)."""
        if not self.expert_bias.is_meta:
            self.expert_bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:  # a shape-only run (a pipeline's dataflow trace): routing needs values
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
        share = self._statistics(counts, n) if self.training and torch.is_grad_enabled() else None
        if self.capacity_factor is not None:
            keep, counts = self._within_capacity(expert_of, counts, n)
            self.last_drop_rate = 1.0 - float(keep.sum()) / max(1, keep.numel())
            expert_of, token_of, weight_of = expert_of[keep], token_of[keep], weight_of[keep]
        # Experts run in this training forward (on no tokens where none came here): their
        # parameters then get a gradient, zero if unused here, wherever some rank used them.
        run = (self.experts_in_use(counts) if self.training and torch.is_grad_enabled()
               and self.counts_forwards else None)
        routed = self.experts_forward(tokens[token_of], counts, run)
        weighted = routed * weight_of.unsqueeze(-1).to(routed.dtype)
        out = torch.zeros_like(tokens).index_add(0, token_of, weighted)
        if self.shared is not None:
            out = out + self.shared(tokens)
        if share is not None:
            probs = scores / scores.sum(-1, keepdim=True) if self.gating == "sigmoid" else scores
            weight = self.aux_loss_coef * self.n_experts * self.aux_loss_scale / (n * self.token_shards)
            out = _Balance.apply(out, probs.sum(0), share, weight)
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

    def experts_forward(self, tokens: torch.Tensor, counts: torch.Tensor,
                        run: torch.Tensor | None = None) -> torch.Tensor:
        """Outputs of the routed ``tokens`` (sorted by expert; ``counts[e]`` of them for expert e),
        in the same order. An expert with no tokens runs on none where ``run`` (a flag per
        expert, `experts_in_use`) says so."""
        sizes, runs = (torch.stack([counts, run.to(counts.dtype)]).tolist() if run is not None
                       else (counts.tolist(), [0] * counts.numel()))  # one read from the device
        parts = tokens.split(sizes)
        outs = [self.experts[e](part) for e, part in enumerate(parts) if part.shape[0] or runs[e]]
        return torch.cat(outs) if outs else tokens[:0].clone()

    def experts_in_use(self, counts: torch.Tensor) -> torch.Tensor:
        """Which experts a training forward runs: here, those it routed a token to. A layout
        whose ranks sum an expert's gradient as each of its parameters' gradient is made (tensor
        parallelism's ranks under sequence parallelism, `plait.expert_parallel`) replaces it with
        the experts any of those ranks routed a token to, so that every one of them makes it."""
        return counts > 0

    def _within_capacity(self, expert_of: torch.Tensor, counts: torch.Tensor,
                         n: int) -> tuple[torch.Tensor, torch.Tensor]:
        capacity = math.ceil(self.capacity_factor * n * self.top_k / self.n_experts)  # type: ignore[operator]
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.arange(expert_of.numel(), device=expert_of.device) - starts[expert_of]
        keep = rank_in_expert < capacity
        return keep, counts.clamp(max=capacity)

    def token_statistics(self, counts: torch.Tensor) -> torch.Tensor:
        """The balancing statistics' counts (assignments per expert, then tokens) summed over the
        ranks they cover. Here, this forward's; a layout replaces it with their sum over the ranks
        that share the step's batch (``balance_statistic="global"``) or, for ``"microbatch"``,
        over those that split one micro-batch's tokens (sequence parallelism)."""
        return counts

    def restart_statistics(self) -> None:
        """Forget the counts so far: the balancing bias's and this step's."""
        self.load, self.step_share = None, _StepShare(self.top_k)

    def _statistics(self, counts: torch.Tensor, n: int) -> _Share | None:
        """Count this training forward's assignments; the ``f`` its backward reads (None without
        the balancing loss)."""
        # A checkpointed block's forward again (counted already), or a probe that is not training.
        recomputing = in_backward() or not self.counts_forwards
        local = torch.cat([counts, counts.new_full((1,), n)]).to(torch.float64)
        if self.balance_statistic == "microbatch":
            if not recomputing:
                self.load = counts if self.load is None else self.load + counts
            return _Share(self.token_statistics(local), self.top_k) if self.aux_loss_coef else None
        if recomputing or not (self.aux_loss_coef or self.bias_update_rate):
            return self.step_share if self.aux_loss_coef else None
        total = self.token_statistics(local)  # every rank calls it at the same forward
        if self.bias_update_rate:
            assigned = total[:-1].to(counts.dtype)
            self.load = assigned if self.load is None else self.load + assigned
        if not self.aux_loss_coef:
            return None
        self.step_share.add(total)
        return self.step_share


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
    that got more; the counts then restart. Under ``balance_statistic="global"`` a layer's counts
    are already the sum over every rank of the layout. ``load`` gives the counts to use instead of
    each layer's own (for ``"microbatch"``: their sum over data-parallel ranks, so every replica
    moves alike)."""
    for i, moe in enumerate(moe_layers(model)):
        counts = moe.load if load is None else load[i]
        if moe.bias_update_rate and counts is not None:
            step = torch.sign(counts.double().mean() - counts.double())
            moe.expert_bias += moe.bias_update_rate * step.to(moe.expert_bias)
        moe.load = None
