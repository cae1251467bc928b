"""`plait train --hf-config`: a `transformers` causal LM built from its config, randomly initialised.

Nothing is downloaded: the config is a local ``config.json`` (or a folder holding one, as
``save_pretrained`` writes it). `transformers` is the optional extra ``plait[hf]``; only this
module of the application imports it, and only when ``--hf-config`` is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

BYTE_VOCAB = 256  # the built-in corpus is byte-level: token ids 0..255


def load_config(path: str) -> Any:
    """The model config at ``path`` (a ``config.json`` or its folder); ``ValueError`` naming the flag."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ValueError("--hf-config needs the transformers library: pip install 'plait[hf]'") from None
    where = Path(path)
    if not where.exists():
        raise ValueError(f"--hf-config {path}: no such file or folder")
    if where.is_dir() and not (where / "config.json").is_file():
        raise ValueError(f"--hf-config {path}: the folder holds no config.json")
    try:
        return AutoConfig.from_pretrained(str(where))
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"--hf-config {path}: not a transformers model config ({e})") from None


def max_positions(config: Any) -> int | None:
    """The longest sequence the model's positions cover, where the config says."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def build(config: Any, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """The causal LM of ``config`` with the model's own initialisation under ``seed`` (the same
    values on every rank), on ``device`` (``"meta"``: shapes only)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        if str(device) != "meta":
            torch.manual_seed(seed)
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError as e:  # a config of a model that is not a causal LM
            raise ValueError(f"--hf-config: {type(config).__name__} has no causal-LM model ({e})") from None
    # use_cache stays as configured: with it off and no attention mask, transformers inspects
    # position ids for packed sequences with a data-dependent test, which the tensor-parallel
    # plan's layout trace on the meta device cannot evaluate. A cache lives for one forward only.
    return model
