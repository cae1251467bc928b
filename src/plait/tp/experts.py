"""Tensor parallelism inside a mixture-of-experts block whose experts are stacked in 3-D tensors
(transformers' Mixtral and Qwen2-MoE: ``experts.gate_up_proj`` of shape (experts, 2 * inner,
hidden), ``experts.down_proj`` of (experts, hidden, inner)): every expert is split by its hidden
units, as Megatron splits an MLP, and the router stays whole on every rank.

The block is one region: its input enters through f, each rank computes every routed token's
expert outputs over its share of the hidden units (a partial sum) and the block's output is
summed over tp by g (under sequence parallelism: all-gather in, reduce-scatter out). The
router, replicated, routes identically on every rank; its gradient, which each rank computes
from its partial outputs only, is summed over tp, as is that of any other replicated parameter
in the block (Qwen2-MoE's ``shared_expert_gate``). The block's own code is trusted by the layout
trace, which cannot run it (routing selects tokens by value: ``nonzero`` on fake tensors) and takes
its output as its input's shape; the numeric check (`plait.tp.numeric`) runs it whole and split.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.state.placement.shards import ShardSpec, make_spec
from plait.tp.collectives import shapes_only, sum_grad_on_first
from plait.tp.context import Style, TPContext
from plait.tp.layers import find_activation, input_pre_hook
from plait.tp.styles import enter_parallel, reduce_out


@dataclass(frozen=True)
class SplitParams(Style):
    """The module's own parameters split over tp, nothing else: ``dims`` lists (parameter name,
    dimension, parts); a fused parameter (``gate_up_proj``: [gate | up]) gives its parts, each split
    on its own. No communication: only inside a `MoEParallel` block, whose f and g surround it.
    The module's forward must take its sizes from the parameters (``F.linear`` on them, as
    transformers' experts and ``nn.Linear`` do)."""

    dims: tuple[tuple[str, int, tuple[int, ...]], ...] = ()

    def validate(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        super().validate(mod, name, ctx)
        if not any(isinstance(ctx.assigned.get(p), MoEParallel) for p in _prefixes(name)):
            raise ValueError(f"plan: {self!r} on {name!r} leaves partial sums: it needs a MoEParallel block "
                             "around it")
        params = dict(mod.named_parameters(recurse=False))
        for key, dim, parts in self.dims:
            p = params.get(key)
            if p is None or not -p.dim() <= dim < p.dim():
                raise ValueError(f"plan: {self!r} on {name!r}: no parameter {key!r} with a dim {dim}")
            for size in parts or (p.shape[dim],):
                if size % ctx.size:
                    raise ValueError(f"plan: {self!r} on {name!r} cannot split {size} features of {key!r} "
                                     f"(dim {dim} of {tuple(p.shape)}) evenly across tp={ctx.size}")
            if parts and sum(parts) != p.shape[dim]:
                raise ValueError(f"plan: {self!r} on {name!r}: parts {parts} do not add up to {p.shape[dim]}")

    def shard_specs(self, mod: nn.Module, ctx: TPContext) -> dict[str, ShardSpec]:
        params = dict(mod.named_parameters(recurse=False))
        return {key: make_spec(dim % params[key].dim(), params[key].shape[dim], ctx.size, ctx.rank, 1, parts)
                for key, dim, parts in self.dims}


@dataclass(frozen=True)
class MoEParallel(Style):
    """A mixture-of-experts block split by its experts' hidden units (see the module docstring):
    f on its input, g on its output, the gradients of its replicated parameters summed over tp.
    The modules holding the split parameters get `SplitParams`."""

    def validate(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        super().validate(mod, name, ctx)
        inside = [n for n, s in ctx.assigned.items() if isinstance(s, SplitParams) and name in _prefixes(n)]
        if not inside:
            raise ValueError(f"plan: {self!r} on {name!r} splits nothing: give its experts SplitParams")

    def install(self, mod: nn.Module, name: str, ctx: TPContext) -> None:
        enter = input_pre_hook(lambda x: enter_parallel(x, ctx), name)
        mod.register_forward_pre_hook(enter, with_kwargs=True)
        mod.register_forward_hook(lambda _m, _a, y: reduce_out(y, ctx, name))
        run = mod.forward

        def forward(self_: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if shapes_only():  # the layout trace: a tensor of the block's output shape, hidden to hidden
                x = find_activation(self_, args, kwargs)
                assert isinstance(x, torch.Tensor)
                return x.clone()
            return run(*args, **kwargs)

        mod.forward = types.MethodType(forward, mod)
        split = set()
        for child, cmod in mod.named_modules():
            style = ctx.assigned.get(".".join(n for n in (name, child) if n))  # the root's name is empty
            if isinstance(style, SplitParams):
                split |= {id(getattr(cmod, key)) for key, _, _ in style.dims}
                cmod.register_forward_pre_hook(_weights_summed_in_backward(ctx), with_kwargs=True)
        for p in mod.parameters():
            if p.requires_grad and id(p) not in split:
                ctx.seq_grads.watch(p)


def _weights_summed_in_backward(ctx: TPContext) -> Any:
    """A forward pre-hook (``with_kwargs=True``) for a module of split experts: each floating
    tensor it receives besides its activation (the routing weights) that needs a gradient is
    widened to the activation's dtype where that is wider, and goes through `sum_grad_on_first`.

    Each rank's experts weight their partial outputs, so each rank's gradient of the weights is
    partial. A router computing in float32 on float64 activations (Mixtral's, Qwen2-MoE's) would
    round each rank's part to float32 before anything sums them: the router's gradients drifted
    6e-8 from one process's. Widening is exact and what the experts' own arithmetic does (type
    promotion) with the weights; the gradient is summed in that dtype, then narrowed once, as in
    one process."""

    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = find_activation(mod, args, kwargs)

        def routed(t: Any) -> Any:
            if t is x or not isinstance(t, torch.Tensor) or not t.is_floating_point() or not t.requires_grad:
                return t
            if x is not None and x.is_floating_point():
                t = t.to(torch.promote_types(t.dtype, x.dtype))
            return sum_grad_on_first(t, ctx.group)

        return tuple(routed(a) for a in args), {k: routed(v) for k, v in kwargs.items()}

    return hook


def _prefixes(name: str) -> list[str]:
    """The names of the modules enclosing ``name`` (the root's is empty)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts))]
