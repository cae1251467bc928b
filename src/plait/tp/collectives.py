"""Autograd-aware tensor-parallel operators (Megatron-LM, Shoeybi et al. 2019, sec. 3;
sequence parallelism: Korthikanti et al. 2022, sec. 4.2), built on `plait.comm`'s collectives.

Each operator's docstring says what moves in forward and backward; each is the identity when
the group has one rank. Inside `emulated` (the layout trace of `plait.tp.check_plan`) each operator
is handed to an emulator that makes a tensor of the right shape on one rank, and nothing moves.

Under torch.compile each operator is traced into the graph, forward and backward, with torch's
functional collectives (``torch.distributed._functional_collectives``), so tensor parallelism adds
no graph break: the compiler sees the collectives and may overlap them. Traced collectives skip
`plait.comm`'s bookkeeping (counts, the per-call desync check), which Dynamo cannot trace; eager
runs keep it. The layout trace's emulator is never compiled (plan checks do not compile).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Protocol

import torch
import torch.distributed as dist

from plait._torch_compat import functional_collectives, is_view
from plait.runtime import faults
from plait.runtime.comm import all_gather_into, all_reduce, describe, reduce_scatter_into

funcol = functional_collectives()


class Emulator(Protocol):
    """Stands in for the tp group in a layout trace: ``op`` is the operator's name, ``dim`` the dim
    it acts on; returns what this rank would hold afterwards (shape, dtype, device)."""

    def collective(self, op: str, x: torch.Tensor, dim: int) -> torch.Tensor: ...


_EMULATOR: ContextVar[Emulator | None] = ContextVar("plait_tp_emulator", default=None)


@contextlib.contextmanager
def emulated(emulator: Emulator) -> Iterator[None]:
    """Within the block every operator of this module calls ``emulator`` instead of a collective."""
    token = _EMULATOR.set(emulator)
    try:
        yield
    finally:
        _EMULATOR.reset(token)


def shapes_only() -> bool:
    """Whether this runs inside the layout trace (an emulator whose ``shapes_only`` is true: fake
    tensors, no values), where a style may stand in for code that branches on values."""
    return not _tracing() and bool(getattr(_EMULATOR.get(), "shapes_only", False))


def _tracing() -> bool:
    """Whether Dynamo is tracing this call (then the traceable collectives run)."""
    return torch.compiler.is_compiling()


def fresh(x: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of its own. What an operator returns must not be a view: a model that
    adds to it in place (Falcon's ``mlp_output += attention_output``) would otherwise be refused by
    autograd, which cannot rewrite a custom Function's backward for a view (a copy of b*s*h/tp)."""
    if _tracing():  # the graph's copy; the compiler drops it where nothing needs it
        return x.clone(memory_format=torch.contiguous_format)
    return x.clone(memory_format=torch.contiguous_format) if is_view(x) else x.contiguous()


def _summed(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """A new tensor: the sum of ``x`` over ``group`` (``x`` itself is never written)."""
    if _tracing():
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))
    x = x.clone(memory_format=torch.contiguous_format)
    all_reduce(x, group)
    return x


def _split_dim(x: torch.Tensor, group: dist.ProcessGroup, dim: int = -1) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (no communication)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % n:
        raise ValueError(f"splitting dim {dim} ({x.shape[dim]}) of a {tuple(x.shape)} tensor across the "
                         f"{n} ranks of {describe(group)}: it is not divisible")
    return fresh(x.chunk(n, dim=dim)[r])


def _gather_dim(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    n = dist.get_world_size(group)
    if n == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    if _tracing():
        out = funcol.wait_tensor(funcol.all_gather_tensor(moved, 0, group))
        return fresh(out.movedim(0, dim))
    out = torch.empty((n * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(out, moved, group)
    # Contiguous: layers that flatten their input with .view (GPT-2's Conv1D) need it.
    return fresh(out.movedim(0, dim))


def _reduce_scatter_dim(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    n = dist.get_world_size(group)
    if n == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    if moved.shape[0] % n:
        raise ValueError(f"reduce-scatter along dim {dim}: size {moved.shape[0]} is not divisible "
                         f"by the {n} ranks of {describe(group)}")
    if _tracing():
        out = funcol.wait_tensor(funcol.reduce_scatter_tensor(moved, "sum", 0, group))
        return fresh(out.movedim(0, dim))
    out = torch.empty((moved.shape[0] // n, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_into(out, moved, group)
    return fresh(out.movedim(0, dim))


class _CopyToTP(torch.autograd.Function):
    """Megatron f. Forward: nothing moves. Backward: all-reduce (sum) of the input gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if faults.active("tp-backward-all-reduce"):  # an injected bug in tests only
            return g.clone(memory_format=torch.contiguous_format), None
        # A new tensor: autograd may hand the same gradient tensor to other consumers of the output.
        return _summed(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron g. Forward: all-reduce (sum) of partial outputs. Backward: nothing moves."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return _summed(x, group)  # never reduce the caller's tensor in place

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


class _SumOverTP(torch.autograd.Function):
    """Forward: all-reduce (sum). Backward: all-reduce (sum) of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _summed(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _summed(g, ctx.group), None


class _SumGradOnFirst(torch.autograd.Function):
    """Forward: nothing moves. Backward: all-reduce (sum) of the gradient, kept by the group's
    first rank; the others pass on zeros."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        total = _summed(g, ctx.group)
        return (total if dist.get_rank(ctx.group) == 0 else torch.zeros_like(total)), None


class _GatherLast(torch.autograd.Function):
    """Forward: all-gather along the last dim. Backward: nothing moves (keep this rank's slice)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _gather_dim(x, group, x.dim() - 1)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _split_dim(g, ctx.group), None


class _ScatterLast(torch.autograd.Function):
    """Forward: nothing moves (keep this rank's slice). Backward: all-gather along the last dim."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _split_dim(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _gather_dim(g, ctx.group, g.dim() - 1), None


class _GatherSeq(torch.autograd.Function):
    """SP g-bar. Forward: all-gather along ``dim``. Backward: reduce-scatter along ``dim``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather_dim(x, group, dim)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _reduce_scatter_dim(g, ctx.group, ctx.dim), None, None


class _ScatterSeq(torch.autograd.Function):
    """SP entry. Forward: keep this rank's chunk along ``dim``. Backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _split_dim(x, group, dim)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _gather_dim(g, ctx.group, ctx.dim), None, None


class _ReplicateSeq(_GatherSeq):
    """SP exit to replicated consumers. Forward: all-gather along ``dim`` (as `_GatherSeq`).
    Backward: keep this rank's chunk of the gradient."""

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _split_dim(g, ctx.group, ctx.dim), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    """SP g. Forward: reduce-scatter along ``dim``. Backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_dim(x, group, dim)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _gather_dim(g, ctx.group, ctx.dim), None, None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Megatron's *f*: forward identity; backward all-reduce of the input gradient.

    Sits before a column-parallel layer whose input is replicated: each rank computes a
    partial input gradient from its column shard, and the full gradient is their sum.
    """
    if not _tracing() and (em := _EMULATOR.get()) is not None:
        return em.collective("copy_to_tp", x, -1)
    return x if dist.get_world_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Megatron's *g*: forward all-reduce (sum of partial outputs); backward identity.

    Sits after a row-parallel layer: each rank holds a partial sum of the output.
    """
    if not _tracing() and (em := _EMULATOR.get()) is not None:
        return em.collective("reduce_from_tp", x, -1)
    return x if dist.get_world_size(group) == 1 else _ReduceFromTP.apply(x, group)


def sum_over_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Forward all-reduce (sum) of per-rank partial statistics; backward all-reduce of the gradient.

    For a statistic over features split across the ranks (the sum of squares of an RMSNorm over
    all heads, OLMo2's ``q_norm``): every rank's output depends on every rank's input, so the
    gradient of each rank's partial sum is the sum of what every rank's output sends back. The
    same exchange as Megatron's vocabulary-parallel softmax (Shoeybi et al. 2019, sec. 3), whose
    denominator sums over vocabulary shards; here a tensor of b*s values moves each way."""
    if not _tracing() and (em := _EMULATOR.get()) is not None:
        return em.collective("sum_over_tp", x, -1)
    return x if dist.get_world_size(group) == 1 else _SumOverTP.apply(x, group)


def sum_grad_on_first(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Forward identity; backward all-reduce (sum) of the gradient, which the group's first rank
    passes on and the others replace by zeros.

    Sits where a replicated tensor meets split computation inside a region and its gradient
    flows back into replicated code: the routing weights of experts split by hidden units, each
    rank weighting its partial expert outputs (Megatron's MLP split, Shoeybi et al. 2019, sec. 3).
    The gradient is summed where it arises, in the dtype the experts compute in, so that the
    router's own code (a softmax in float32, whose backward rounds what it receives) sees the
    gradient one process computes rather than rounding each rank's part. One rank carries it on,
    so that what the region sums later (f at its input, the router's parameter gradients summed
    over tp) counts it once. A tensor of tokens x top-k values moves in backward."""
    if not _tracing() and (em := _EMULATOR.get()) is not None:
        return em.collective("sum_grad_on_first", x, -1)
    return x if dist.get_world_size(group) == 1 else _SumGradOnFirst.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Forward all-gather along the last dim; backward keeps this rank's slice of the gradient."""
    if not _tracing() and (em := _EMULATOR.get()) is not None:
        return em.collective("gather_from_tp", x, -1)
    return x if dist.get_world_size(group) == 1 else _GatherLast.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Forward keeps this rank's slice of the last dim; backward all-gathers the gradient."""
    if not _tracing() and (em := _EMULATOR.get()) is not None:
        return em.collective("scatter_to_tp", x, -1)
    return x if dist.get_world_size(group) == 1 else _ScatterLast.apply(x, group)


def gather_from_sp(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Sequence parallel *g-bar*: forward all-gather along the sequence dim; backward
    reduce-scatter of the gradient (each rank's partial gradient is summed, then split)."""
    if not _tracing() and (em := _EMULATOR.get()) is not None:
        return em.collective("gather_from_sp", x, dim)
    return x if dist.get_world_size(group) == 1 else _GatherSeq.apply(x, group, dim)


def reduce_scatter_to_sp(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Sequence parallel *g*: forward reduce-scatter of partial sums along the sequence dim;
    backward all-gather of the gradient."""
    if not _tracing() and (em := _EMULATOR.get()) is not None:
        return em.collective("reduce_scatter_to_sp", x, dim)
    return x if dist.get_world_size(group) == 1 else _ReduceScatterSeq.apply(x, group, dim)


def scatter_to_sp(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Where sequence parallelism starts on a replicated activation: forward keeps this rank's
    chunk of the sequence (nothing moves); backward all-gathers the gradient, since every rank's
    replicated producer needs the gradient of the whole sequence."""
    if not _tracing() and (em := _EMULATOR.get()) is not None:
        return em.collective("scatter_to_sp", x, dim)
    return x if dist.get_world_size(group) == 1 else _ScatterSeq.apply(x, group, dim)


def replicate_from_sp(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Where sequence parallelism ends before replicated code (a final norm whose output the
    model reshapes): forward all-gathers the sequence; backward keeps this rank's chunk of the
    gradient, which every rank computes in full because everything after runs replicated
    (unlike `gather_from_sp`, whose column-parallel consumers leave partial gradients to sum)."""
    if not _tracing() and (em := _EMULATOR.get()) is not None:
        return em.collective("replicate_from_sp", x, dim)
    return x if dist.get_world_size(group) == 1 else _ReplicateSeq.apply(x, group, dim)
