"""Verify a context-parallel model by its numbers, on its first forward, before it trains.

`context_parallel` replaces the model's attention and its positions, and both can be wrong in
ways no shape shows: positions the model derives in a way plait did not see (a cumulative sum of
a mask, a table indexed by hand) count each rank's tokens from 0; a mask read as the wrong kind
attends to the wrong tokens. Such a run trains, silently off. So on the model's first call, before
it runs, the check takes the first sequence of the batch it got, gathered over cp and cut to at
most `TOKENS` tokens (a multiple of 2 * cp), and runs it twice without gradients, in eval mode:
once whole on every rank (attention and positions as the model computes them alone: the reference
one process gives) and once split over cp as training will run it. Every output that carries the
sequence on dim 1 (logits, hidden states) must agree with the reference's slice for the rank's
tokens, within `plait.runtime.tolerance`'s bound (float64: 1e-8 of the largest entry; float32: 256 eps,
3e-5; a 16-bit dtype anywhere in the run: 25%, as rounding adds up over a whole model's layers).
The worst ratio is agreed over the data ranks (dp, fsdp, cp), so all of them refuse together,
naming the output, the rank and the difference; otherwise the first forward goes on as if
nothing had run.

Cost: one forward of one short sequence whole and one split, and one small all-gather of the
inputs, once per process (logged; `plait.cp.verified(model)` holds the result). What it cannot
see: a module the short sequence does not reach (a sliding window longer than `TOKENS`), and
backward (its attention kernels are tested against torch's; its positions are the forward's). A
model whose outputs carry no sequence dimension (a loss computed inside) is not compared, and
says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait._torch_compat import eager, tensors_in, tree_flatten, tree_unflatten
from plait.cp.group import CPGroup
from plait.cp.layout import Layout
from plait.runtime import comm
from plait.runtime.tolerance import LowestPrecision

HALF_BOUND = 0.25  # the least bound in bfloat16 and float16 (`bound`)
TOKENS = 256  # the longest sequence the check runs: its cost stays one short forward at any length
_log = logging.getLogger("plait.cp.numeric")


@dataclass(frozen=True)
class Verified:
    """What the check found: the tokens it ran, the outputs it compared, the largest difference as
    a fraction of the bound (over the data ranks; at most 1 to pass) and its seconds."""

    tokens: int
    compared: int
    worst: float
    seconds: float


def install_check(model: nn.Module, cp: CPGroup, agree: dist.ProcessGroup | None,
                  record: Callable[[Verified], None]) -> None:
    """Run the check on ``model``'s first call, before anything else of it runs, and ``record``
    what it found; the verdict is agreed over ``agree`` (every rank that runs this call at the
    same time)."""
    def first_call(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        if _rehearsal(model, (args, kwargs)):
            return  # a run on the meta device (`plait plan`, a pipeline's shapes): no values to compare
        handle.remove()
        found = _verify(model, cp, agree, args, kwargs)
        if found is not None:
            record(found)

    # First among the hooks: the check calls the model itself, and positions' hooks must see those
    # calls from their start.
    handle = model.register_forward_pre_hook(eager(first_call), with_kwargs=True, prepend=True)


def _verify(model: nn.Module, cp: CPGroup, agree: dist.ProcessGroup | None, args: tuple,
            kwargs: dict) -> Verified | None:
    leaves, spec = tree_flatten((args, kwargs))
    first = next((t for t in leaves if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    if first is None:
        return None  # the forward's own refusal (positions) says what is missing
    batch, local = first.shape[:2]
    start = time.perf_counter()
    full = cp.layout_of_local(local).seq_len
    tokens = _tokens(full, cp.size)
    small = cp.layout(tokens)
    whole, split = [], []
    for x in leaves:  # the first sequence, gathered and cut; everything else as it came
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and tuple(x.shape[:2]) == (batch, local):
            x = cp.unshard(x[:1], 1).narrow(1, 0, tokens)
            whole.append(x)
            split.append(small.shard(x, 1))
        else:
            x = x[:1] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch else x
            whole.append(x)
            split.append(x)
    precision = LowestPrecision()
    with _evaluating(model), torch.no_grad(), precision:
        with cp.whole():
            w_args, w_kwargs = tree_unflatten(whole, spec)
            want = tensors_in(model(*w_args, **w_kwargs))
        s_args, s_kwargs = tree_unflatten(split, spec)
        got = tensors_in(model(*s_args, **s_kwargs))
    limit = bound(precision)
    compared, ratio, where = _compare(want, got, small, limit)
    worst = torch.tensor([ratio], dtype=torch.float64, device=comm.device_of(agree))
    with comm.operation("context parallelism's numeric check"):
        comm.all_reduce(worst, agree, op=dist.ReduceOp.MAX)
    result = Verified(tokens, compared, float(worst), time.perf_counter() - start)
    if not result.worst <= 1.0:
        here = where if ratio > 1.0 else "on another data rank"
        raise ValueError(f"context parallelism's numeric check: {type(model).__name__} run split over "
                         f"cp={cp.size} differs from the same {tokens} tokens run whole: {here} (bound: "
                         f"{limit:g} of the largest entry). Its attention or positions are not what one "
                         "process computes: a position the model derives in a way plait cannot see (let "
                         "its forward take position_ids), or a mask that is not causal")
    if not compared:
        _log.warning("context parallelism's numeric check: %s returned no output with the sequence on "
                     "dim 1 (logits, hidden states), so its split run was not compared with the whole",
                     type(model).__name__)
    _log.info("context parallelism's numeric check: %d tokens at cp=%d, %d outputs, worst %.2g of the "
              "bound, in %.3f s", tokens, cp.size, compared, result.worst, result.seconds)
    return result


def bound(precision: LowestPrecision) -> float:
    """`plait.runtime.tolerance`'s bound, but at least `HALF_BOUND` in a 16-bit dtype: the check compares a
    whole model, whose rounding adds up over every layer, where tensor parallelism's compares one
    block (measured on the 25M GPT at 256 tokens: bf16 1.2% of the largest logit, float16 0.12%).
    A position counted from 0 moves the outputs by about half their size."""
    bound = precision.rtol()
    return max(bound, HALF_BOUND) if precision.eps > torch.finfo(torch.float32).eps else bound


def _rehearsal(model: nn.Module, call: Any) -> bool:
    return any(t.is_meta for t in tensors_in(call)) or any(p.is_meta for p in model.parameters())


def _tokens(full: int, cp: int) -> int:
    """The check's sequence: at most `TOKENS` (the whole one if shorter), a multiple of 2 * cp."""
    if full <= TOKENS:
        return full
    step = 2 * cp
    return max(step, TOKENS // step * step)


def _compare(want: list[torch.Tensor], got: list[torch.Tensor], small: Layout,
             bound: float) -> tuple[int, float, str]:
    """(outputs compared, the worst difference as a fraction of ``bound``, which one and where)."""
    compared, worst, where = 0, 0.0, ""
    if len(want) != len(got):
        return 0, float("inf"), f"where it returned {len(got)} tensors against {len(want)}"
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        if not (w.is_floating_point() and w.dim() >= 2 and w.shape[1] == small.seq_len):
            continue  # no sequence on dim 1 (a loss, a cache): not a per-token output
        ref = small.shard(w, 1)
        what = f"output {i} of shape {tuple(g.shape)} (one sequence) on cp rank {small.rank}"
        if g.shape != ref.shape:
            return compared, float("inf"), f"{what}, where the whole run's slice is {tuple(ref.shape)}"
        compared += 1
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        err = float((g - ref).abs().max()) if ref.numel() else 0.0
        ratio = err / (bound * scale) if scale else (0.0 if err == 0 else float("inf"))
        if ratio > worst:
            worst, where = ratio, f"{what} is off by up to {err:.3g}, its largest entry {scale:.3g}"
    return compared, worst, where


@contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """Every module in eval mode (no dropout), restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
