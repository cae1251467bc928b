"""SyncBatchNorm: batch statistics over every rank that holds different samples, on Gloo and NCCL.

Under DDP or FSDP each rank normalizes its own part of the batch with its own statistics
(BatchNorm's semantics, per rank: docs/batchnorm.md). `SyncBatchNorm` normalizes with the
statistics of the global batch instead, as one process would on the whole batch, and as torch's
``nn.SyncBatchNorm`` does on GPUs (which refuses CPU tensors, so a Gloo run had none).

Forward (Ioffe & Szegedy 2015, with the statistics gathered across ranks as in torch's
SyncBatchNorm): each rank computes, per channel, its count, mean and sum of squared deviations
(M2); one all-gather moves these ``2C+1`` numbers per rank and every rank combines them exactly
(Chan et al. 1979: the global mean and M2 from the per-rank ones, so uneven batches, and ranks
with no samples, weigh by their counts). The running statistics are updated with the unbiased
global variance, as torch. Backward: the gradient through the global mean and variance needs
the global sums of ``dy`` and ``dy * (x - mean)`` per channel: one all-reduce of ``2C`` numbers.
The weight and bias gradients stay local (DDP or FSDP reduces them, as any parameter's).

The collectives run on a group of their own over the mesh's data axes (``dp`` and ``fsdp``: for
HSDP both, every rank that holds different samples), made once per `convert_sync_batchnorm`
call, so that they never interleave with DDP's gradient buckets. Under `DDP.join` a rank that ran
out of batches mirrors them with count 0 (it adds no samples, as a rank with an empty batch in
torch's SyncBatchNorm): the others' statistics are those of their batches alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from plait._torch_compat import BatchNormBase
from plait.runtime import comm

DATA_AXES: tuple[str, ...] = ("dp", "fsdp")  # the axes along which ranks hold different samples
_MAX_LOG = 4096  # collectives kept of the current step (see `_Sync.record`)


@dataclass
class _Sync:
    """The group a set of layers reduces over, and the collectives of the last step, in order
    (what a rank that has joined replays with count 0 while the others still train)."""

    group: dist.ProcessGroup
    world: int
    calls: list[tuple[str, int, torch.dtype]] = field(default_factory=list)
    last_step: list[tuple[str, int, torch.dtype]] = field(default_factory=list)
    in_backward: bool = False

    def __deepcopy__(self, memo: dict[int, Any]) -> _Sync:
        """A copied model (an EMA copy, a reference) reduces over the same group: a process group
        cannot be copied, and the copy's ranks are the same."""
        return self

    def record(self, kind: str, numel: int, dtype: torch.dtype) -> None:
        # A forward after a backward starts a step. Forwards without backward (recomputing the
        # running statistics in train mode under no_grad) never end one: the log is cut short
        # rather than grow without end (a rank that joins after such steps cannot mirror them).
        if kind == "forward" and (self.in_backward or len(self.calls) >= _MAX_LOG):
            self.calls, self.in_backward = [], False
        self.in_backward = self.in_backward or kind == "backward"
        self.calls.append((kind, numel, dtype))
        self.last_step = self.calls

    @torch.no_grad()
    def shadow_step(self) -> None:
        """A joined rank's side of one step of the others (`DDP.join`): each collective of this
        rank's last step, in order, contributing count 0 (no samples) and zero gradient sums."""
        if not self.last_step:
            raise RuntimeError("SyncBatchNorm under DDP.join: this rank joined before it trained a step, "
                               "so it cannot tell which SyncBatchNorm collectives the others run; give "
                               "every rank at least one batch (the others would wait for this rank until "
                               "the timeout)")
        device = comm.device_of(self.group)
        for kind, numel, dtype in list(self.last_step):
            zeros = torch.zeros(numel, dtype=dtype, device=device)
            if kind == "forward":
                _gather_stats(zeros, self)
            else:
                _reduce_grads(zeros, self)


def _data_group_ranks(mesh: Any, axes: Sequence[str]) -> list[list[int]]:
    """Every group of ranks that differ only along ``axes``, in the order of their first rank
    (each rank must make every group, in the same order)."""
    from plait.runtime.mesh import AXES

    shape = [mesh.shape[a] for a in AXES]
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(math.prod(shape)):
        coords, rest = {}, rank
        for a, n in zip(reversed(AXES), reversed(shape)):  # the mesh's order, tp innermost
            coords[a], rest = rest % n, rest // n
        key = tuple(coords[a] for a in AXES if a not in axes)
        groups.setdefault(key, []).append(rank)
    return sorted(groups.values())


def make_sync(mesh: Any = None, axes: Sequence[str] = DATA_AXES) -> _Sync | None:
    """The group of this rank's data-parallel peers (every rank calls this together), or None
    when there is nothing to synchronize (one process, or one rank along ``axes``)."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    if mesh is None:
        sets = [list(range(dist.get_world_size()))]
    else:
        unknown = [a for a in axes if a not in mesh.shape]
        if unknown:
            raise ValueError(f"SyncBatchNorm: unknown mesh axes {unknown}; the mesh has {tuple(mesh.shape)}")
        sets = _data_group_ranks(mesh, axes)
    mine = None
    for ranks in sets:
        pg = comm.new_group(ranks, label="syncbn") if len(ranks) > 1 else None
        if dist.get_rank() in ranks:
            mine = (pg, len(ranks))
    assert mine is not None
    return _Sync(mine[0], mine[1]) if mine[0] is not None else None


def _gather_stats(mine: torch.Tensor, sync: _Sync) -> torch.Tensor:
    """All-gather each rank's ``[count, mean (C), M2 (C)]``: forward, one row per rank; no backward
    of its own (the Function's backward reduces the gradient sums instead)."""
    out = torch.empty(sync.world * mine.numel(), dtype=mine.dtype, device=mine.device)
    with comm.operation("SyncBatchNorm statistics"):
        comm.all_gather_into(out, mine, sync.group)
    return out.view(sync.world, mine.numel())


def _reduce_grads(sums: torch.Tensor, sync: _Sync) -> None:
    """All-reduce (sum) of ``[sum dy (C), sum dy*(x-mean) (C)]`` in backward."""
    with comm.operation("SyncBatchNorm gradient sums"):
        comm.all_reduce(sums, sync.group)


def _combine(rows: torch.Tensor, channels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, mean, M2) of the union of the ranks' samples (Chan et al.'s pairwise update, all at
    once): ranks with no samples weigh nothing."""
    counts, means, m2s = rows[:, :1], rows[:, 1:1 + channels], rows[:, 1 + channels:]
    total = counts.sum()
    mean = (counts * means).sum(0) / total
    m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)
    return total, mean, m2


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)  # half inputs: statistics in float32


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float,
                momentum: float, sync: _Sync) -> torch.Tensor:
        channels, dims = x.size(1), [0, *range(2, x.dim())]
        shape = [1, channels] + [1] * (x.dim() - 2)
        xs = x.to(_stats_dtype(x))
        n = x.numel() // channels
        mean_l = xs.mean(dims) if n else xs.new_zeros(channels)
        m2_l = ((xs - mean_l.view(shape)) ** 2).sum(dims) if n else xs.new_zeros(channels)
        mine = torch.cat([torch.full((1,), float(n), dtype=xs.dtype, device=x.device), mean_l, m2_l])
        sync.record("forward", mine.numel(), mine.dtype)
        total, mean, m2 = _combine(_gather_stats(mine, sync), channels)
        if total.item() == 0:
            raise ValueError("SyncBatchNorm: no rank has any sample in this batch")
        invstd = torch.rsqrt(m2 / total + eps)
        if running_mean is not None and running_var is not None:
            unbiased = m2 / (total - 1) if total.item() > 1 else torch.full_like(m2, float("nan"))
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        xhat = (xs - mean.view(shape)) * invstd.view(shape)
        y = xhat if weight is None else xhat * weight.view(shape)
        y = y if bias is None else y + bias.view(shape)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.sync, ctx.total = sync, total
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        channels, dims = x.size(1), [0, *range(2, x.dim())]
        shape = [1, channels] + [1] * (x.dim() - 2)
        dys, xmu = dy.to(mean.dtype), x.to(mean.dtype) - mean.view(shape)
        sum_dy, sum_dy_xmu = dys.sum(dims), (dys * xmu).sum(dims)
        affine = weight is not None
        grad_w = (sum_dy_xmu * invstd).to(weight.dtype) if affine and ctx.needs_input_grad[1] else None
        grad_b = sum_dy.to(weight.dtype) if affine and ctx.needs_input_grad[2] else None
        sums = torch.cat([sum_dy, sum_dy_xmu])
        ctx.sync.record("backward", sums.numel(), sums.dtype)
        _reduce_grads(sums, ctx.sync)  # every rank, whether or not its input needs a gradient
        grad_x = None
        if ctx.needs_input_grad[0]:
            g_dy, g_dy_xmu = sums[:channels] / ctx.total, sums[channels:] / ctx.total
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            inner = dys - g_dy.view(shape) - xmu * (invstd ** 2 * g_dy_xmu).view(shape)
            grad_x = (inner * scale.view(shape)).to(x.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


class SyncBatchNorm(BatchNormBase):
    """BatchNorm whose training statistics are those of the global batch across the data ranks.

    As torch's ``nn.SyncBatchNorm`` (same arguments, same buffers and state dict), on Gloo and
    NCCL, with the group given by a mesh instead of ``process_group``: the ranks that differ only
    along ``axes`` (default ``("dp", "fsdp")``: for HSDP both the replicate and the shard axes).
    Without a mesh it reduces over every rank; before ``torch.distributed`` is initialized, or
    with one rank along ``axes``, it is a plain BatchNorm. Making one is collective (it makes the
    group): every rank constructs the same layers in the same order. `convert_sync_batchnorm`
    makes one group for all the layers it converts. In eval mode (and with the running statistics
    in use) nothing is communicated.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, mesh: Any = None,
                 axes: Sequence[str] = DATA_AXES, device: Any = None, dtype: torch.dtype | None = None, *,
                 bias: bool = True, _sync: _Sync | None | str = "make") -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        if affine and not bias:  # torch 2.6's BatchNorm has no bias argument
            self.register_parameter("bias", None)
        self.axes = tuple(axes)
        self._sync = make_sync(mesh, axes) if isinstance(_sync, str) else _sync

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.size(1) == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average, as torch's
                factor = 1.0 / float(self.num_batches_tracked.item())
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        if not (batch_stats and self.training and self._sync is not None):
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, batch_stats, factor,
                                self.eps)
        out: torch.Tensor = _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean,
                                                         running_var, self.eps, factor, self._sync)
        return out

    @property
    def join_mirror(self) -> _Sync | None:
        """What mirrors the others' collectives while this rank has joined (`DDP.join` calls its
        ``shadow_step()`` once per step of theirs; the layers of one conversion share it)."""
        return self._sync

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, mesh: Any = None,
                               axes: Sequence[str] = DATA_AXES) -> nn.Module:
        """Replace every BatchNorm layer in ``module`` by a `SyncBatchNorm` over the data ranks of
        ``mesh`` (torch's method of the same name, with a mesh for its ``process_group``).

        The new layers keep the old ones' parameters and buffers (the same tensors), training
        mode and ``qconfig``; all share one group, made here (every rank calls this together).
        Returns ``module``, or the new layer when ``module`` is itself a BatchNorm."""
        if isinstance(mesh, dist.ProcessGroup):
            raise TypeError("SyncBatchNorm.convert_sync_batchnorm(module, mesh): plait takes a plait.Mesh "
                            "(the data axes of which make the group), not a process group")
        if not any(isinstance(m, BatchNormBase) for m in module.modules()):
            return module
        return _convert(module, make_sync(mesh, axes), tuple(axes))


def _convert(module: nn.Module, sync: _Sync | None, axes: tuple[str, ...]) -> nn.Module:
    out = module
    if isinstance(module, BatchNormBase) and not isinstance(module, SyncBatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, axes=axes, device="meta",
                            bias=module.bias is not None, _sync=sync)
        if module.affine:
            out.weight, out.bias = module.weight, module.bias
        out.running_mean, out.running_var = module.running_mean, module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, _convert(child, sync, axes))
    return out
