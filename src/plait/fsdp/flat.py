"""One flat, sharded group of parameters: the storage unit of plait's FSDP.

A sharding unit's parameters (of one dtype and one ``requires_grad``) are laid end to end in
one flat vector, padded to a multiple of the shard count ``N``, and each rank keeps the
contiguous slice ``[r*S, (r+1)*S)`` with ``S = padded / N`` (ZeRO, Rajbhandari et al. 2020,
sec. 5). The slice is an ``nn.Parameter`` — the only thing the optimizer ever sees.

The gathered parameters live in ``buf``, which collectives write into. Its storage is
resized to zero to free them and resized back before the next all-gather, so tensors that
autograd saved in forward see the re-gathered values in backward.

Each original parameter is an autograd leaf aliasing its range of ``buf`` with its *own*
version counter, so writing into ``buf`` never trips autograd's "modified by an inplace
operation" check. The modules' attributes point at these leaves, and their gradients land
on them as usual. Under ZeRO-3 each leaf's gradient is copied into the leaf's own range of
``buf`` the moment autograd has accumulated it (then dropped): by then every backward node that
read that parameter has run, so its gathered values are dead and ``buf`` turns, range by range,
into the unit's flat gradient. A unit never holds its gathered parameters and a full copy of its
gradients at once, and the reduce-scatter reads ``buf`` directly (freed once it lands). Stages
1-2 keep ``buf`` (the parameters stay gathered), so there the gradients are copied into a new
flat buffer once every leaf has reported.

Gradient hooks that an earlier transformation registered on an original parameter (e.g. tensor
parallelism's sum over the tp group for a replicated weight applied to sequence shards) die
with that parameter object, so such code also lists them in the parameter's
``_plait_grad_hooks`` attribute (see `GRAD_HOOKS_ATTR`); each leaf registers them again, and
they run on the leaf's gradient before it is accumulated, exactly as on the original.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from plait import comm

__all__ = ["Slot", "FlatParam", "GRAD_HOOKS_ATTR"]

# Attribute of a parameter: gradient hooks (tensor -> tensor | None) that must survive FSDP
# replacing the parameter by its alias leaf. Whoever calls ``p.register_hook(h)`` on a
# parameter that FSDP may wrap later appends ``h`` here too.
GRAD_HOOKS_ATTR = "_plait_grad_hooks"


@dataclass
class Slot:
    """Where one original parameter lives: its owners (several when tied) and its flat range."""

    fqn: str
    shape: torch.Size
    offset: int
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)  # fqns of tied copies (state dicts list them)
    grad_hooks: list = field(default_factory=list)  # carried over from the original parameter

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ShardCfg:
    """What every flat group of one FSDP wrapper shares."""

    stage: int
    group: dist.ProcessGroup  # the fsdp axis: shards live here
    dp_group: dist.ProcessGroup | None  # hybrid: replicas across dp
    world: int  # ranks on the fsdp axis
    rank: int
    replicas: int  # ranks on the dp axis
    device: torch.device  # where compute runs
    param_dtype: torch.dtype | None  # mixed precision compute dtype (None: keep)
    reduce_dtype: torch.dtype | None  # gradient reduction dtype (None: gradient's dtype)
    offload: bool


class FlatParam:
    """A unit's parameters of one kind, sharded across the fsdp axis."""

    def __init__(self, slots: list[Slot], dtype: torch.dtype, requires_grad: bool, cfg: ShardCfg) -> None:
        self.slots, self.cfg, self.requires_grad = slots, cfg, requires_grad
        self.total = sum(s.numel for s in slots)
        self.shard_size = -(-self.total // cfg.world)
        self.padded = self.shard_size * cfg.world
        self.compute_dtype = cfg.param_dtype if (cfg.param_dtype and dtype.is_floating_point) else dtype
        home = torch.device("cpu") if cfg.offload else cfg.device
        # ZeRO-1/2 without casting or offload keep the gathered vector anyway, so the shard can
        # be a window on it instead of a copy (the ZeRO formula counts parameters once).
        self.aliased = cfg.stage < 3 and self.compute_dtype == dtype and not cfg.offload
        self.buf = torch.zeros(self.padded, dtype=self.compute_dtype, device=cfg.device)
        self.leaves = [_alias(self.buf, s.offset, s.shape).requires_grad_(requires_grad) for s in slots]
        if requires_grad:
            for s, leaf in zip(slots, self.leaves, strict=True):
                for hook in s.grad_hooks:
                    leaf.register_hook(hook)
        # Set by the wrapper when the module is tensor-parallel: (start, end, tp_sharded) ranges
        # of this rank's shard, one per slot piece it holds (for the global gradient norm).
        self.tp_ranges: list[tuple[int, int, bool]] = []
        self.arrived = 0  # leaves whose gradient this backward has accumulated
        self.in_buf = [False] * len(slots)  # ZeRO-3: leaf i's gradient already sits in buf
        start = cfg.rank * self.shard_size
        if self.aliased:
            local = _alias(self.buf, start, self.shard_size)
        else:
            local = torch.zeros(self.shard_size, dtype=dtype, device=home)
            if cfg.offload and torch.cuda.is_available():
                local = local.pin_memory()  # lets host->device copies run asynchronously
        self.shard = nn.Parameter(local, requires_grad=requires_grad)
        self.gathered = True  # buf holds the full vector (zeros now, filled at first gather)
        self.gathered_version = -1  # shard._version at the last gather; -1 forces one
        if cfg.stage == 3:  # built one unit at a time and freed at once: no rank holds the model
            self.buf.untyped_storage().resize_(0)
            self.gathered = False
        self._handle: comm.Handle | None = None
        self._src: torch.Tensor | None = None
        self.pending: tuple[comm.Handle | None, torch.Tensor] | None = None
        self.offload_bytes = {"to_device": 0, "to_host": 0}

    # ------------------------------------------------------------- layout helpers
    def shard_range(self, rank: int | None = None) -> tuple[int, int]:
        r = self.cfg.rank if rank is None else rank
        return r * self.shard_size, (r + 1) * self.shard_size

    # ------------------------------------------------------------- unshard / reshard
    def needs_gather(self) -> bool:
        return self._handle is None and not (self.gathered and self.gathered_version == self.shard._version)

    def start_gather(self) -> None:
        """Issue the all-gather of every rank's shard into ``buf`` (async; `finish_gather` waits).

        Forward: all-gather of ``padded`` elements in the compute dtype over the fsdp axis.
        """
        if self.cfg.stage == 3 and self.pending is not None:
            self.finish_reduce()  # buf may be the in-flight reduction's input
        if not self.needs_gather():
            return
        nbytes = self.padded * self.buf.element_size()
        if self.buf.untyped_storage().nbytes() != nbytes:
            self.buf.untyped_storage().resize_(nbytes)
        src = self.shard.detach()
        if self.cfg.offload:
            src = src.to(self.cfg.device, copy=True, non_blocking=True)
            self.offload_bytes["to_device"] += src.numel() * src.element_size()
        if src.dtype != self.compute_dtype:
            src = src.to(self.compute_dtype)
        if self.aliased:
            src = src.clone()  # the shard is a window on buf: never gather a tensor into itself
        self._src = src
        self._handle = comm.all_gather_into(self.buf, src, self.cfg.group, async_op=True)
        self.gathered_version = self.shard._version

    def finish_gather(self) -> None:
        self.start_gather()
        if self._handle is not None:
            self._handle.wait()
            self._handle, self._src = None, None
        self.gathered = True

    def reshard(self) -> None:
        """Free the gathered parameters (ZeRO-3); the shard stays."""
        if self.cfg.stage < 3:
            return
        if self._handle is not None:
            # A prefetch nobody used: let it land before freeing. Also when not gathered yet, or it
            # would stay pending and be taken for current values after the optimizer step.
            self._handle.wait()
            self._handle, self._src = None, None
        elif not self.gathered:
            return
        self.buf.untyped_storage().resize_(0)
        self.gathered = False

    def bind_views(self) -> None:
        """Point every owner module's attribute at its parameter's leaf (tied owners share one)."""
        for slot, leaf in zip(self.slots, self.leaves, strict=True):
            for mod, attr in slot.owners:
                mod.__dict__[attr] = leaf

    # ------------------------------------------------------------- gradients
    def grad_ready(self, i: int) -> bool:
        """Leaf ``i``'s gradient has been accumulated; True once every leaf has reported.

        ZeRO-3 moves the gradient into the leaf's range of ``buf`` at once. Autograd accumulates
        a leaf only after every node that used it has run, so nothing reads those gathered
        values again (a parameter read outside autograd's sight, e.g. through ``.detach()`` in
        forward and saved by another op, would break this; plait's FSDP does not support it).
        """
        leaf = self.leaves[i]
        if self.cfg.stage == 3 and leaf.grad is not None and self.gathered:
            slot = self.slots[i]
            with torch.no_grad():
                self.buf.narrow(0, slot.offset, slot.numel).copy_(leaf.grad.reshape(-1))
            leaf.grad = None
            self.in_buf[i] = True
        self.arrived += 1
        return self.arrived == len(self.leaves)

    def abandon_backward(self) -> None:
        """Forget a backward that raised midway: buf may hold some gradients in place of values."""
        if any(self.in_buf):
            self.gathered = False  # the next use gathers the parameters again
        self.arrived, self.in_buf = 0, [False] * len(self.leaves)

    def _flatten_grads(self) -> torch.Tensor | None:
        have = [i for i, leaf in enumerate(self.leaves) if self.in_buf[i] or leaf.grad is not None]
        if not have:
            return None
        if self.cfg.stage == 3:
            # buf becomes the flat gradient: ranges already moved there stay, the rest take the
            # leaves' gradients (no_sync leftovers) or zeros; the padding is zeroed too.
            if self.buf.untyped_storage().nbytes() == 0:
                self.buf.untyped_storage().resize_(self.padded * self.buf.element_size())
            flat = self.buf
            self.gathered = False  # from here on buf holds gradients; freed after the reduction
        else:
            # Only stage 3 moves gradients into buf: here ``have`` lists the leaves with a .grad.
            first = next(g for leaf in self.leaves if (g := leaf.grad) is not None)
            dtype = self.cfg.reduce_dtype or first.dtype
            flat = torch.empty(self.padded, dtype=dtype, device=self.buf.device)
        with torch.no_grad():
            for i, (slot, leaf) in enumerate(zip(self.slots, self.leaves, strict=True)):
                if self.in_buf[i]:
                    continue
                dst = flat.narrow(0, slot.offset, slot.numel)
                if leaf.grad is None:
                    dst.zero_()
                else:
                    dst.copy_(leaf.grad.reshape(-1))
                    leaf.grad = None
            flat.narrow(0, self.total, self.padded - self.total).zero_()
        self.in_buf = [False] * len(self.leaves)
        return flat

    def start_reduce(self) -> None:
        """Issue this backward's gradient reduction (async) and drop the unsharded gradient.

        ZeRO-1: all-reduce of the full gradient (each rank keeps the whole sum; the shard's
        ``.grad`` is a window on it). ZeRO-2/3: reduce-scatter, rank r receives the sum of
        slice r. Both in the reduce dtype over the fsdp axis.
        """
        g, self.arrived = self._flatten_grads(), 0
        if g is None:
            return
        if self.cfg.reduce_dtype is not None and g.dtype != self.cfg.reduce_dtype:
            g = g.to(self.cfg.reduce_dtype)
            if g is not self.buf and self.cfg.stage == 3:
                self.buf.untyped_storage().resize_(0)  # the cast copy is what gets reduced
        if self.cfg.stage == 1:
            self.pending = (comm.all_reduce(g, self.cfg.group, async_op=True), g)
        else:
            # g is dropped after the reduction, so it may serve as the reduction's own scratch
            # (on Gloo: no hidden full-size clone; the result is a view of g).
            self.pending = comm.reduce_scatter_consuming(g, self.cfg.group, async_op=True)

    def finish_reduce(self) -> None:
        """Wait for the reduction, average, reduce across dp replicas (hybrid) and accumulate."""
        if self.pending is None:
            return
        handle, red = self.pending
        self.pending = None
        if handle is not None:
            handle.wait()
        if self.cfg.stage == 1:
            red = red.narrow(0, self.cfg.rank * self.shard_size, self.shard_size)
        if self.cfg.dp_group is not None:
            comm.all_reduce(red, self.cfg.dp_group)  # replicas hold the same slice: plain all-reduce
        red.div_(self.cfg.world * self.cfg.replicas)
        if self.cfg.offload or red.dtype != self.shard.dtype or red.device != self.shard.device:
            # A blocking copy: the optimizer reads this host gradient right after backward.
            # (On a CPU-only machine offload still makes the copy, so the data path is exercised.)
            red = red.to(self.shard.device, self.shard.dtype, copy=True)
            if self.cfg.offload:
                self.offload_bytes["to_host"] += red.numel() * red.element_size()
        st = red.untyped_storage()
        borrowed = st.nbytes() > red.numel() * red.element_size() or st.data_ptr() == self.buf.data_ptr()
        if self.shard.grad is not None:
            self.shard.grad.add_(red)
        elif self.cfg.stage > 1 and borrowed:
            # A window on the reduced full vector (Gloo reduces in place; at world 1 it is buf
            # itself), which is dropped next. (ZeRO-1 keeps its window: every rank holds the
            # whole gradient there by design.)
            self.shard.grad = red.clone()
        else:
            self.shard.grad = red
        del red, st
        if self.cfg.stage == 3 and not self.gathered and self._handle is None:
            self.buf.untyped_storage().resize_(0)  # the reduction's input, released at once


def _alias(base: torch.Tensor, offset: int, shape: tuple[int, ...] | torch.Size | int) -> torch.Tensor:
    """A contiguous tensor on ``base``'s storage with its own autograd version counter."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    stride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        stride[d] = stride[d + 1] * shape[d + 1]
    return torch.empty(0, dtype=base.dtype, device=base.device).set_(
        base.untyped_storage(), offset, shape, tuple(stride))
