"""A nanoGPT-shaped model written for the tests (not imported from anywhere), in the ways models
outside plait count positions and read their sizes in forward.

Its attention splits the fused ``c_attn`` by ``self.n_embd`` and views the heads by
``self.n_head``, as nanoGPT does. ``positions`` picks how it knows where a token is:
``"wpe"`` nanoGPT's learned table read at ``torch.arange(t)``; ``"table"`` a rotary table held as
a buffer and sliced to the length (torchtitan's ``freqs_cis[:seqlen]``); ``"arange"`` a rotary
table computed in forward from ``torch.arange(t)``; ``"module"`` a module whose forward takes
``positions`` (plait GPT's rotary protocol); ``"cumsum"`` the learned table read at a running
count of the tokens (OPT counts its positions from its attention mask so); ``"none"`` nothing
(no positions at all).
``width_from_input=True`` takes the attention's width from its input's shape (nanoGPT's
``C``), which no split of its heads can keep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Config:
    vocab_size: int = 64
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    positions: str = "wpe"
    width_from_input: bool = False


def rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (b, heads, t, d) by angles (t, d / 2)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = angles.cos(), angles.sin()
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def inverse_frequencies(head_dim: int) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.n_head, self.n_embd = cfg.n_head, cfg.n_embd
        self.width_from_input = cfg.width_from_input

    def forward(self, x: torch.Tensor, angles: torch.Tensor | None) -> torch.Tensor:
        B, T, C = x.size()
        width = C if self.width_from_input else self.n_embd
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        if angles is not None:
            q, k = rotate(q, angles), rotate(k, angles)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, width))


class MLP(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.n_embd), MLP(cfg)

    def forward(self, x: torch.Tensor, angles: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), angles)
        return x + self.mlp(self.ln_2(x))


class PositionAngles(nn.Module):
    """Rotary angles of the tokens of ``x`` (dim 1) at ``positions`` (counted from 0 when None): a
    module of one's own that takes positions, as plait GPT's rotary tables do."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        return torch.outer(positions.to(x.dtype), inverse_frequencies(self.head_dim).to(x.dtype))


class GPT(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.config = cfg
        parts: dict[str, nn.Module] = {"wte": nn.Embedding(cfg.vocab_size, cfg.n_embd)}
        if cfg.positions in ("wpe", "cumsum"):  # where nanoGPT registers it: after wte, before the blocks
            parts["wpe"] = nn.Embedding(cfg.block_size, cfg.n_embd)
        parts["h"] = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        parts["ln_f"] = nn.LayerNorm(cfg.n_embd)
        self.transformer = nn.ModuleDict(parts)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as in nanoGPT
        head_dim = cfg.n_embd // cfg.n_head
        if cfg.positions == "module":
            self.angles_of = PositionAngles(head_dim)
        if cfg.positions == "table":
            t = torch.arange(cfg.block_size, dtype=torch.float64)
            self.register_buffer("angles", torch.outer(t, inverse_frequencies(head_dim)), persistent=False)
        for p in self.parameters():
            nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.transformer.wte(idx)
        angles = None
        if self.config.positions == "wpe":
            x = x + self.transformer.wpe(torch.arange(0, t, dtype=torch.long, device=idx.device))
        elif self.config.positions == "cumsum":
            x = x + self.transformer.wpe(torch.ones_like(idx).cumsum(1) - 1)
        elif self.config.positions == "table":
            angles = self.angles[:t]
        elif self.config.positions == "module":
            angles = self.angles_of(x)
        elif self.config.positions == "arange":
            head_dim = self.config.n_embd // self.config.n_head
            angles = torch.outer(torch.arange(t, dtype=x.dtype), inverse_frequencies(head_dim).to(x.dtype))
        for block in self.transformer.h:
            x = block(x, angles)
        return self.lm_head(self.transformer.ln_f(x))


def build(seed: int = 0, **overrides: object) -> GPT:
    torch.manual_seed(seed)
    return GPT(Config(**overrides)).to(torch.float64)  # type: ignore[arg-type]
