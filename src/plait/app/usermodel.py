"""`plait train --model package.module:function`: the user's model, under the layout flags.

The FACTORY contract is `plait check`'s: a function of no arguments returning a `torch.nn.Module`,
or ``(model, make_batch, loss_fn)``. `plait train` feeds the model its own data (token ids of shape
(sequences, ``--seq-len``)), so ``make_batch`` is not called; ``loss_fn(output, targets)``, when
given, replaces the next-token cross-entropy. Each rank builds the model whole under the run's
seed, with the factory's own initialisation, and keeps its part (as for ``--hf-config``);
tensor-parallel plans come from `plait.plan_for`, which knows plait's GPT and the common
transformers families.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn

from plait.check.common import CheckInputError, LossFn, load_factory
from plait.runtime.env import seed_everything


def is_factory(name: str) -> bool:
    """``--model`` names a function (``package.module:function``) rather than a preset."""
    return ":" in name


def _call(factory: str, device: torch.device | str) -> tuple[nn.Module, LossFn | None]:
    if os.getcwd() not in sys.path:  # the module is found the way `python -m` would find it
        sys.path.insert(0, os.getcwd())
    try:
        fn = load_factory(factory)
    except CheckInputError as e:
        raise ValueError(f"--model {factory}: {e}") from None
    try:
        with torch.device(device):
            made = fn()
    except Exception as e:  # the user's code: bad input, said where
        raise ValueError(f"--model {factory}: the factory raised {type(e).__name__}: {e}") from None
    parts = tuple(made) if isinstance(made, (tuple, list)) else (made,)
    if not 1 <= len(parts) <= 3 or not isinstance(parts[0], nn.Module):
        raise ValueError(f"--model {factory}: the factory must return a torch.nn.Module or (model, "
                         f"make_batch, loss_fn); got {type(made).__name__}")
    loss_fn = parts[2] if len(parts) == 3 else None
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"--model {factory}: the factory returned a {type(loss_fn).__name__} as loss_fn, "
                         "not a callable")
    return parts[0], loss_fn


def build(factory: str, seed: int, device: torch.device | str) -> nn.Module:
    """The factory's model on ``device`` in train mode, built under ``seed`` (every rank alike);
    ``device="meta"``: its shapes only, for the checks made before any rank starts."""
    if str(device) != "meta":
        seed_everything(seed)
    return _call(factory, device)[0].train()


def loss_of(factory: str) -> LossFn | None:
    """The factory's ``loss_fn``, or None for the next-token loss (built on meta: nothing allocated)."""
    return _call(factory, "meta")[1]


def max_positions(model: nn.Module) -> int | None:
    """The longest sequence the model's positions cover, where its config says (plait's GPT's
    ``cfg.seq_len``, a transformers config's ``max_position_embeddings``...)."""
    from plait.app.hf import max_positions as config_positions

    cfg = getattr(model, "cfg", None)
    if isinstance(getattr(cfg, "seq_len", None), int):
        return int(cfg.seq_len)  # type: ignore[union-attr]
    return config_positions(getattr(model, "config", None))


def vocab_size_of(model: nn.Module) -> int | None:
    """The model's vocabulary: ``config.vocab_size`` / ``cfg.vocab_size``, else its first embedding's rows."""
    for holder in (getattr(model, "config", None), getattr(model, "cfg", None)):
        size: Any = getattr(holder, "vocab_size", None)
        if isinstance(size, int):
            return size
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return None if emb is None else emb.num_embeddings
