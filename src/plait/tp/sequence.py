"""Where sequence parallelism starts and ends, for models that compute from the whole sequence
before their decoder layers (positions, rotary tables, masks) or after them (a reshape to the
input's length)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from plait.tp.collectives import replicate_from_sp, scatter_to_sp
from plait.tp.context import Style, TPContext
from plait.tp.layers import input_pre_hook
from plait.tp.styles import check_sequence


@dataclass(frozen=True)
class ScatterSequence(Style):
    """Where sequence parallelism starts, for models that compute positions, rotary tables and
    masks from the sequence before their decoder layers: under SP the module's activation
    (full-length and replicated until here) is cut along the sequence, forward keeping this
    rank's chunk (nothing moves), backward all-gathering the gradient. Everything computed
    before it saw the full length. Without SP: nothing. Put it on the first decoder layer.

    ``gather_output``: on a module that runs all the layers (BERT's ``encoder``, whose layers
    end in their norms, with no final norm after them), its output (a tensor, or the first of
    a tuple or of a ``ModelOutput``) is gathered again, as `GatherSequence` does: what the
    model does after it runs replicated. Such a span is not one unit of the numeric plan check
    (`plait.tp.numeric`): the styled modules inside it are.
    """

    gather_output: bool = False

    def is_unit(self) -> bool:
        return not self.gather_output

    def install(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        if not ctx.sequence_parallel:
            return

        def scatter(x: torch.Tensor) -> torch.Tensor:
            check_sequence(x, ctx, name)
            return scatter_to_sp(x, ctx.group, dim=1)

        mod.register_forward_pre_hook(input_pre_hook(scatter, name), with_kwargs=True)
        if self.gather_output:
            mod.register_forward_hook(lambda _m, _a, out: _gather_first(out, ctx, name))


def _gather_first(out: Any, ctx: TPContext, name: str) -> Any:
    """``out`` with its first tensor (itself, or the first entry of a tuple or a mapping, as
    transformers' ``ModelOutput``) gathered along the sequence (`replicate_from_sp`)."""
    if isinstance(out, torch.Tensor):
        return replicate_from_sp(out, ctx.group, dim=1)
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return (replicate_from_sp(out[0], ctx.group, dim=1), *out[1:])
    if isinstance(out, dict) and out and isinstance(first := next(iter(out.values())), torch.Tensor):
        # A ModelOutput sets the attribute of the same name too.
        out[next(iter(out))] = replicate_from_sp(first, ctx.group, dim=1)
        return out
    raise TypeError(f"{name}: ScatterSequence(gather_output=True) gathers the first tensor of the module's "
                    f"output, but it returns a {type(out).__name__} that starts with none")


@dataclass(frozen=True)
class GatherSequence(Style):
    """Where sequence parallelism ends, for models whose code after the decoder layers needs the
    whole sequence (GPT-2 reshapes the final norm's output to the input's length): under SP
    the module's activation is all-gathered along the sequence first, so the module and
    everything after it run replicated; backward keeps this rank's chunk of the gradient. A
    column-parallel layer after it takes ``input_is_sequence_parallel=False``. Without SP:
    nothing. Put it on the final norm.
    """

    def install(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        if ctx.sequence_parallel:
            gather = partial(replicate_from_sp, group=ctx.group, dim=1)
            mod.register_forward_pre_hook(input_pre_hook(gather, name), with_kwargs=True)
