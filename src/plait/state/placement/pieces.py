"""Gradients that are one rank's piece of the model's: torch's tools that would be silently wrong
on them refuse them by name.

`torch.nn.utils.clip_grad_norm_` sums the squares of the gradients it is given. On a rank that
holds a piece of the model (a tensor-parallel shard, its experts under expert parallelism, a
pipeline stage) that sum is the piece's alone: every rank would clip by its own factor, and
nothing would say so. `torch.optim.Muon` orthogonalizes each gradient matrix, and a tp shard's
orthogonalization is not a shard of the whole matrix's. torch's own tensor parallelism avoids both
with DTensor parameters, whose norms and products DTensor takes over every rank, and so does
plait's FSDP and tensor parallelism (`plait.state.placement.tp_params`: their parameters are DTensors, on
which both tools are right). Experts over ep, pipeline stages (tp's shards in them included) and
tp splits no DTensor describes hold plain local tensors. Their gradients are marked
instead: a tensor subclass that is a plain tensor to every operation (optimizers, DDP's buckets,
`clip_grad_value_`, comparisons), except a norm taken by `torch.nn.utils`' clipping, and anything
`torch.optim.Muon` does with a tp shard, which raise `TorchToolRefused` naming the piece and what to
use instead. Nothing has been changed when they raise.

A parameter is marked once (`mark_piece`: the ``piece`` of its `ParamPlacement` record); its
gradient is marked whenever autograd accumulates into it, and again wherever plait assigns one
(`mark_grad`: DDP's bucket views, the experts' reduction, the end of a pipeline step). A marked
gradient carries its parameter's record.

A tp shard's mark also says how its optimizer state is a piece of the full tensor's. An optimizer
stepping such parameters gets a ``state_dict()`` hook that gives that state as DTensors of the full
tensors (as under torch's tensor parallelism, whose parameters are DTensors), so that
`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` and DCP save every rank's rows
rather than one rank's under every rank's name; ``load_state_dict`` takes them back.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from plait._torch_compat import (
    MUON_MODULE,
    caller_frame,
    every_optimizer_step,
    foreach_norm,
    plain_torch_functions,
    set_class,
)
from plait.state.placement.records import Piece, carry_placement, placement_for, placement_of, set_placement

_CLIP_MODULE = "torch.nn.utils.clip_grad"
_NORMS = frozenset({torch.linalg.vector_norm, foreach_norm, torch.norm, torch.Tensor.norm,
                    torch.linalg.norm})
# Only these calls look up their caller (a frame walk per call, which an optimizer's per-parameter
# loop would pay on every op otherwise): the norms, and Muon's first use of a gradient, its
# momentum update.
_LOOKED_AT = _NORMS | {torch.Tensor.lerp_}


class TorchToolRefused(RuntimeError):
    """One of torch's tools was given a gradient that is one rank's piece of the model's, on which
    it would be silently wrong."""


def mark_piece(p: nn.Parameter | torch.Tensor, what: str, split: bool = False, *,
               to_full: Callable[[torch.Tensor], torch.Tensor] | None = None,
               to_local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
               kept_whole: bool = False) -> None:
    """Record that ``p`` holds one rank's piece of the model (see `Piece`), so that torch's tools
    that would be wrong on its gradient refuse it. A second mark keeps the first words; a piece
    marked ``kept_whole`` too is refused as a piece."""
    rec = placement_for(p)
    old = rec.piece
    new = Piece(what, split, to_full, to_local, kept_whole)
    if old is not None:
        new = Piece(old.what, old.split or split, old.to_full or to_full, old.to_local or to_local,
                    old.kept_whole and kept_whole)
    rec.piece = new
    if new.to_full is not None:
        _watch_optimizers()
    if p.requires_grad and not isinstance(p, DTensor) and not rec.marks_grads:
        p.register_post_accumulate_grad_hook(mark_grad)
        rec.marks_grads = True
    mark_grad(p)


def carry_mark(old: torch.Tensor, new: torch.Tensor) -> None:
    """Place ``new``, a parameter that replaces ``old`` (materialized, or moved to its device), as
    ``old`` was placed (`plait.state.placement.records.carry_placement`), and mark it as ``old``'s piece,
    if it was one."""
    rec = carry_placement(old, new)
    piece = None if rec is None else rec.piece
    if piece is not None:
        mark_piece(new, piece.what, piece.split, to_full=piece.to_full, to_local=piece.to_local,
                   kept_whole=piece.kept_whole)


def piece_of(p: torch.Tensor | object) -> Piece | None:
    """The `Piece` ``p`` (a parameter or its gradient) holds, if `mark_piece` marked it."""
    rec = placement_of(p)
    return None if rec is None else rec.piece


def mark_grad(p: torch.Tensor) -> None:
    """Mark ``p``'s gradient if ``p`` is marked and the gradient is not yet (the marked gradient is
    the same memory: nothing is copied); it carries ``p``'s record."""
    rec, g = placement_of(p), p.grad
    if rec is None or rec.piece is None or g is None or placement_of(g) is rec:
        return
    if isinstance(g, DTensor):
        set_class(g, _PieceDTensorGrad)  # a DTensor still: only the class's torch-function check differs
    elif not isinstance(g, _PieceGrad):
        g = g.as_subclass(_PieceGrad)
        p.grad = g
    set_placement(g, rec)


def mark_grads(params: Iterable[torch.Tensor]) -> None:
    """`mark_grad` on each of ``params``."""
    for p in params:
        mark_grad(p)


# ------------------------------------------------------------------ optimizer state of tp shards
# torch calls a global step pre-hook for every optimizer: the only place an optimizer made by the
# user's own code shows itself (torch's get_optimizer_state_dict steps it once to make its state).
_hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


@functools.cache  # once per process
def _watch_optimizers() -> None:
    every_optimizer_step(_on_step, after=False)


def _on_step(opt: torch.optim.Optimizer, *_: Any) -> None:
    if opt in _hooked:
        return
    _hooked.add(opt)
    if any((pc := piece_of(p)) is not None and pc.to_full is not None
           for g in opt.param_groups for p in g["params"]):
        opt.register_state_dict_post_hook(_state_as_full)
        opt.register_load_state_dict_pre_hook(_state_as_local)


def _state_as_full(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``opt.state_dict()`` with each tp shard's per-element state as the DTensor of the full tensor
    (the state is numbered by the parameters' order in ``param_groups``)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, st in state_dict["state"].items():
        piece = piece_of(params[i])
        if piece is not None and piece.to_full is not None:
            state_dict["state"][i] = {k: piece.to_full(v) if _per_element(v, params[i]) else v
                                      for k, v in st.items()}
    return state_dict


def _state_as_local(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `_state_as_full`, before ``opt.load_state_dict`` (the saved numbering follows
    the saved ``param_groups``, in the order of this optimizer's)."""
    saved = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = dict(zip(saved, [p for g in opt.param_groups for p in g["params"]], strict=False))
    state = dict(state_dict["state"])
    for i, st in state.items():
        p = params.get(i)
        piece = piece_of(p)
        if p is not None and piece is not None and piece.to_local is not None:
            local = piece.to_local
            state[i] = {k: local(v, torch.zeros_like(p)) if isinstance(v, torch.Tensor) and v.ndim == p.ndim
                        and v.ndim > 0 else v for k, v in st.items()}
    return {**state_dict, "state": state}


def _per_element(v: Any, p: torch.Tensor) -> bool:
    return isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.shape == p.shape


def _calling_module() -> str | None:
    """The torch module whose code called the torch function being dispatched, when it is one that
    refuses pieces (its frames sit just above the dispatch)."""
    frame: FrameType | None = caller_frame(3)
    for _ in range(4):
        if frame is None:
            return None
        name = frame.f_globals.get("__name__")
        if name in (_CLIP_MODULE, MUON_MODULE):
            return name
        frame = frame.f_back
    return None


def _refuse(func: Any, args: Any) -> None:
    if func not in _LOOKED_AT:
        return
    caller = _calling_module()
    if caller is None or (caller == _CLIP_MODULE and func not in _NORMS):
        return
    tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])]
    pieces = [p for t in tensors if (p := piece_of(t)) is not None]
    if caller == _CLIP_MODULE and pieces and all(p.kept_whole for p in pieces):
        raise TorchToolRefused(
            f"torch.nn.utils.clip_grad_norm_ was given the gradient of {pieces[0].what}: FSDP keeps "
            "the experts whole, as plain tensors, beside its DTensor shards, and torch's norm cannot "
            "take the two kinds together. Call plait.clip_grad_norm_(model, max_norm) on the model "
            "plait returned: it takes each kind's norm and sums them, as torch does in one process. "
            "Nothing was scaled.")
    pieces = [p for p in pieces if not p.kept_whole]
    if caller == _CLIP_MODULE and pieces:
        raise TorchToolRefused(
            f"torch.nn.utils.clip_grad_norm_ was given the gradient of {pieces[0].what}: torch's norm "
            "of it is this rank's alone, so every rank would clip by a different factor. Call "
            "plait.clip_grad_norm_(model, max_norm) on the model (or Pipeline) plait returned: it sums "
            "every rank's pieces, as torch does in one process. Nothing was scaled.")
    split = [p for p in pieces if p.split]
    if caller == MUON_MODULE and split:
        raise TorchToolRefused(
            f"torch.optim.Muon was given the gradient of {split[0].what}: it would orthogonalize "
            "this rank's shard, not the whole matrix. Train tensor-parallel matrices with an "
            "element-wise optimizer (AdamW, SGD), or use Muon under FSDP without tensor parallelism, "
            "where each parameter is a DTensor that Muon orthogonalizes whole. Nothing was changed.")


class _Refusing:
    """Every torch function as on the tensor class beside it, but for those `_refuse` stops."""

    __slots__ = ()  # no layout of its own: a DTensor gradient's class can be switched in place

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        _refuse(func, args)
        with plain_torch_functions():
            return func(*args, **(kwargs or {}))


class _PieceGrad(_Refusing, torch.Tensor):
    """A marked plain gradient."""


class _PieceDTensorGrad(_Refusing, DTensor):
    """A marked DTensor gradient (FSDP's, in a pipeline stage)."""

    __slots__ = ()
