"""A small decoder-only transformer: RMSNorm, rotary attention, SwiGLU MLP.

Plain PyTorch with no parallel code. Head counts are read from tensor shapes in ``forward``
(not from the config), so a tensor-parallel plan can shard the projections by module name
and the same code runs on its local heads.

Module names (what plans key on)::

    tok_emb
    layers.{i}.attn_norm   layers.{i}.attn.{q_proj,k_proj,v_proj,o_proj}
    layers.{i}.mlp_norm    layers.{i}.mlp.{gate_proj,up_proj,down_proj}
                           (MoE: layers.{i}.mlp.router, .experts.{e}.{gate,up,down}_proj, .shared.*)
    norm  lm_head          (lm_head shares tok_emb.weight when tie_embeddings)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from plait.losses import lm_loss
from plait.models.moe import MoE, SwiGLU

# lm_loss is the library's (`plait.losses`), named here too as the loss GPT trains with.
__all__ = ["GPTConfig", "GPT", "Block", "PRESETS", "lm_loss"]


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: same as n_heads (no grouped-query attention)
    d_ff: int | None = None  # None: 8/3 * d_model rounded up to a multiple of 16
    dropout: float = 0.0
    tie_embeddings: bool = False
    rope_base: float = 10000.0
    # Mixture of experts (plait.models.moe): 0 experts is the dense MLP.
    n_experts: int = 0
    top_k: int = 2
    n_shared_experts: int = 0
    d_expert: int | None = None  # each expert's hidden size; None: d_ff
    gating: str = "softmax"  # or "sigmoid"
    aux_loss_coef: float = 0.0  # load-balancing loss weight (0: off)
    bias_update_rate: float = 0.0  # auxiliary-loss-free balancing step (0: off)
    capacity_factor: float | None = None  # None: dropless
    # Tokens the balancing statistics cover: "global" (the step's whole batch, on any layout) or
    # "microbatch" (each forward's own; plait.models.moe).
    balance_statistic: str = "global"

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.d_ff is None:
            self.d_ff = 16 * math.ceil(8 * self.d_model / 3 / 16)
        for field_name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "n_kv_heads"):
            if getattr(self, field_name) < 1:
                value = getattr(self, field_name)
                raise ValueError(f"GPTConfig.{field_name} must be >= 1, got {value}")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig: d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"GPTConfig: n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("GPTConfig: the head dimension must be even for rotary embeddings")
        if self.n_experts < 0 or self.n_shared_experts < 0:
            raise ValueError(f"GPTConfig: n_experts={self.n_experts} and "
                             f"n_shared_experts={self.n_shared_experts} must be >= 0")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"GPTConfig: top_k={self.top_k} must be between 1 and "
                             f"n_experts={self.n_experts}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(),
    "small": GPTConfig(seq_len=128, d_model=256, n_layers=4, n_heads=8),
    "25m": GPTConfig(seq_len=256, d_model=512, n_layers=8, n_heads=8),
    "50m": GPTConfig(seq_len=256, d_model=640, n_layers=10, n_heads=10),
    "100m": GPTConfig(seq_len=512, d_model=768, n_layers=14, n_heads=12),
    # Llama 3's shapes (the same blocks: RMSNorm, rotary attention with grouped KV heads, SwiGLU),
    # for planning layouts of models that size (`plait plan`).
    "llama3-8b": GPTConfig(vocab_size=128256, seq_len=8192, d_model=4096, n_layers=32, n_heads=32,
                           n_kv_heads=8, d_ff=14336, rope_base=500000.0),
    "llama3-70b": GPTConfig(vocab_size=128256, seq_len=8192, d_model=8192, n_layers=80, n_heads=64,
                            n_kv_heads=8, d_ff=28672, rope_base=500000.0),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # bf16/fp16 up to fp32; fp64 stays
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class Embedding(nn.Embedding):
    """nn.Embedding initialised N(0, 0.02), as in GPT-2, so a tied head starts calm."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class Rotary(nn.Module):
    """Rotary position embedding tables (non-persistent buffers, rebuilt by reset)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, seq_len: int, base: float) -> None:
        super().__init__()
        self.head_dim, self.seq_len, self.base = head_dim, seq_len, base
        self.register_buffer("cos", torch.empty(seq_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(seq_len, head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        inv = 1.0 / self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        angles = torch.outer(torch.arange(self.seq_len, dtype=torch.float32), inv)
        if self.cos.is_meta:
            return
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, x: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x`` of shape (batch, seq, heads, head_dim) by position: ``start``,
        ``start + 1``... or, given, the ``positions`` (seq,) of its tokens."""
        if positions is None:
            s = x.shape[1]
            cos = self.cos[start : start + s, None, :].to(x.dtype)
            sin = self.sin[start : start + s, None, :].to(x.dtype)
        else:
            cos = self.cos[positions + start, None, :].to(x.dtype)
            sin = self.sin[positions + start, None, :].to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return out.flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        assert cfg.n_kv_heads is not None  # filled in by GPTConfig.__post_init__
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.d_model, bias=False)
        self.rotary = Rotary(hd, cfg.seq_len, cfg.rope_base)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.q_proj(x).view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)
        q, k = self.rotary(q), self.rotary(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if k.shape[1] != q.shape[1]:  # grouped-query attention
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(SwiGLU):
    def __init__(self, cfg: GPTConfig) -> None:
        assert cfg.d_ff is not None  # filled in by GPTConfig.__post_init__
        super().__init__(cfg.d_model, cfg.d_ff)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp: nn.Module = MLP(cfg) if not cfg.n_experts else MoE(
            cfg.d_model, cfg.d_expert or cfg.d_ff or 0, cfg.n_experts, cfg.top_k, cfg.n_shared_experts,
            cfg.gating, cfg.aux_loss_coef, cfg.bias_update_rate, cfg.capacity_factor,
            cfg.balance_statistic)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x)))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class GPT(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok_emb(idx))
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
