"""The language-model loss every layout computes on full logits (tensor parallelism's vocab-parallel
loss, `plait.tp.loss`, equals it on split ones). It lives in the library, beside the strategies that
choose it, not with the reference model that uses it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["lm_loss"]


def lm_loss(logits: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position. ``logits`` may also be a model output
    that holds them as ``.logits`` (what transformers' causal LMs return). Computed in float32
    at least: low-precision logits are raised to it, float64 ones stay float64."""
    logits = getattr(logits, "logits", logits)
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(wide.flatten(0, -2), targets.flatten())
