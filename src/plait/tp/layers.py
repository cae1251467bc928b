"""What tensor parallelism needs to know about a module it did not write, found by duck typing.

* Which argument of a call is the activation: the first parameter of ``forward``, passed by
  position or by keyword (`transformers` calls ``self_attn(hidden_states=...)``).
* How a linear layer stores its weight: ``nn.Linear`` as ``(out, in)``; a *transposed* layer
  such as GPT-2's ``Conv1D`` as ``(in, out)``, recognised by a 2-D weight and an int ``nf``
  attribute equal to its second dimension (never by importing the library that defines it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def activation_name(mod: nn.Module) -> str | None:
    """The name of the first parameter of ``mod.forward`` (None for ``*args`` only)."""
    try:
        params = list(inspect.signature(mod.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    if not params or params[0].kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
        return None
    return params[0].name


def find_activation(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The activation of a call: the first positional argument, else the keyword argument named
    like ``forward``'s first parameter; None when neither is a tensor."""
    if args:
        return args[0] if isinstance(args[0], torch.Tensor) else None
    key = activation_name(mod)
    value = kwargs.get(key) if key is not None else None
    return value if isinstance(value, torch.Tensor) else None


def replace_activation(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                       new: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` with the activation (see `find_activation`) replaced by ``new``."""
    if args:
        return (new, *args[1:]), kwargs
    key = activation_name(mod)
    assert key is not None
    return args, {**kwargs, key: new}


def input_pre_hook(fn: Callable[[torch.Tensor], torch.Tensor], name: str):
    """A forward pre-hook (``with_kwargs=True``) applying ``fn`` to the call's activation."""

    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]):
        x = find_activation(mod, args, kwargs)
        if x is None:
            key = activation_name(mod)
            raise TypeError(f"{name}: the tensor-parallel input hook expects the activation as the first "
                            f"argument of forward ({key!r}), by position or by keyword; got positional "
                            f"{[type(a).__name__ for a in args]} and keywords {sorted(kwargs)}")
        return replace_activation(mod, args, kwargs, fn(x))

    return hook


@dataclass(frozen=True)
class LinearLayout:
    """Where a linear-like layer keeps its sizes: ``out_dim`` is the weight dimension indexed by
    output features (0 for ``nn.Linear``, 1 for a transposed layer), ``size_attrs`` the
    attributes recording (in, out) sizes that must follow a split."""

    out_dim: int
    size_attrs: tuple[str, str]

    @property
    def in_dim(self) -> int:
        return 1 - self.out_dim

    def sizes(self, mod: nn.Module) -> tuple[int, int]:
        """(in features, out features): the size attributes, which keep the full sizes until a
        style installs (the weight may already be this rank's shard), else the weight's shape."""
        w = mod.weight
        assert isinstance(w, torch.Tensor)
        found = [getattr(mod, a, None) for a in self.size_attrs]
        shape = (int(w.shape[self.in_dim]), int(w.shape[self.out_dim]))
        return tuple(v if isinstance(v, int) else d for v, d in zip(found, shape, strict=True))  # type: ignore[return-value]

    def set_sizes(self, mod: nn.Module, in_features: int | None = None,
                  out_features: int | None = None) -> None:
        """Record local sizes (what a transposed layer's own forward reads, and every repr)."""
        for attr, value in zip(self.size_attrs, (in_features, out_features), strict=True):
            if value is not None and hasattr(mod, attr):
                setattr(mod, attr, value)

    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The layer's computation with the given (local) weight and bias."""
        if self.out_dim == 0:
            return F.linear(x, weight, bias)
        y = torch.matmul(x, weight)
        return y if bias is None else y + bias


LINEAR = LinearLayout(out_dim=0, size_attrs=("in_features", "out_features"))
TRANSPOSED = LinearLayout(out_dim=1, size_attrs=("nx", "nf"))


def linear_layout(mod: nn.Module) -> LinearLayout | None:
    """`LINEAR` for ``nn.Linear``, `TRANSPOSED` for a Conv1D-like layer (2-D weight ``(in, out)``
    and an int ``nf``, the output size, which the weight's second dim equals or, once split,
    divides), None for anything else."""
    if isinstance(mod, nn.Linear):
        return LINEAR
    w, nf = getattr(mod, "weight", None), getattr(mod, "nf", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2 and isinstance(nf, int) and w.shape[1] > 0 \
            and nf % w.shape[1] == 0:
        return TRANSPOSED
    return None
