"""The gradient side of a flat group: collect its leaves' gradients, reduce them, keep this rank's.

`FlatParam` (`plait.fsdp.flat`) gathers the parameters; this mixin takes their gradients back the
other way. Each leaf reports when autograd has accumulated it (`GradReduction.grad_ready`; ZeRO-3
moves it into ``buf`` at once), the unit's gradient is laid out rank-major (or left parameter-major
where the backend reduces in place) and reduce-scattered (ZeRO-1: all-reduced), and this rank's
chunks become the DTensor parameters' gradients (`GradReduction.finish_reduce`). Under ``no_sync``
the gradients wait unreduced (`GradReduction.hold_unreduced`) for the next backward that reduces.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from plait.fsdp.layout import ShardCfg, Slot
from plait.runtime import comm, faults


class GradReduction:
    """The gradient-reduction methods of `plait.fsdp.flat.FlatParam` (its base)."""

    # What `FlatParam` builds and the reduction reads: the layout, the storage, the leaves and the
    # DTensor parameters, whether buf holds gathered values (or a gather is in flight, which keeps
    # buf allocated), and the layout helpers.
    slots: list[Slot]
    cfg: ShardCfg
    dtype: torch.dtype
    label: str
    shard_size: int
    padded: int
    reduce_param_major: bool
    home: torch.device
    buf: torch.Tensor
    shard: torch.Tensor
    leaves: list[torch.Tensor]
    params: list[Any]  # nn.Parameters holding DTensors (`FlatParam._dtensor`)
    trains: list[bool]
    gathered: bool
    _handle: comm.Handle | None
    offload_bytes: dict[str, int]
    local: Callable[..., torch.Tensor]
    rank_major: Callable[[torch.Tensor], torch.Tensor]
    own_chunks: Callable[..., torch.Tensor]
    _dtensor: Callable[..., Any]
    _ensure_buf: Callable[[], None]

    def _init_reduction(self) -> None:
        """Nothing reported, held or in flight: the state of a group before its first backward."""
        self.arrived = 0  # leaves whose gradient this backward has accumulated
        self.skip: set[int] = set()  # slots this reduction leaves without a gradient (`start_reduce`)
        self.in_buf = [False] * len(self.slots)  # ZeRO-3: leaf i's gradient already sits in buf
        # Unreduced gradients accumulated under no_sync in the reduce dtype (bf16 compute, fp32
        # reduction: summed in fp32, as torch's FSDP2 does), one per leaf, until the next reduction.
        self.acc: list[torch.Tensor | None] = [None] * len(self.slots)
        # The flat vector of this rank's reduced gradient chunks and the parameters' DTensor
        # gradients on it, as last installed (weak: the parameters' .grad owns them).
        self._grad_flat: Callable[[], torch.Tensor | None] = lambda: None
        self._grads: list[Callable[[], Any]] = []
        self.pending: tuple[comm.Handle | None, torch.Tensor] | None = None

    def used(self) -> list[bool]:
        """Which leaves hold a gradient not reduced yet (moved into buf, accumulated or on the leaf)."""
        return [self.in_buf[i] or self.acc[i] is not None or leaf.grad is not None
                for i, leaf in enumerate(self.leaves)]

    def hold_unreduced(self, i: int) -> None:
        """no_sync: keep leaf ``i``'s new gradient for the next reduction. With a reduce dtype wider
        than the compute dtype it is summed there (bf16 gradients accumulated in fp32), else it
        stays on the leaf, where autograd accumulates the next one."""
        leaf, rd = self.leaves[i], self.cfg.reduce_dtype
        g = leaf.grad
        if g is None or rd is None or g.dtype == rd:
            return
        with torch.no_grad():
            acc = self.acc[i]
            self.acc[i] = g.to(rd) if acc is None else acc.add_(g)
        leaf.grad = None

    def grad_ready(self, i: int) -> bool:
        """Leaf ``i``'s gradient has been accumulated; True once every leaf has reported.

        ZeRO-3 moves the gradient into the leaf's range of ``buf`` at once. Autograd accumulates
        a leaf only after every node that used it has run, so nothing reads those gathered
        values again (a parameter read outside autograd's sight, e.g. through ``.detach()`` in
        forward and saved by another op, would break this; plait's FSDP does not support it).
        """
        leaf = self.leaves[i]
        if self.acc[i] is not None:
            self.hold_unreduced(i)  # joins the fp32 sum; reduced from there (`_flatten_grads`)
        elif self.cfg.stage == 3 and leaf.grad is not None and self.gathered:
            with torch.no_grad():
                self._put(self.buf, i, leaf.grad)
            leaf.grad = None
            self.in_buf[i] = True
        self.arrived += 1
        return self.arrived == sum(self.trains)

    def _put(self, flat: torch.Tensor, i: int, grad: torch.Tensor | None) -> None:
        """Write slot ``i``'s gradient into its padded range of parameter-major ``flat``."""
        s = self.slots[i]
        dst = flat.narrow(0, s.offset, self.cfg.world * s.chunk)
        if grad is None:
            dst.zero_()
        elif s.replicated:  # every rank's chunk holds it: the reduce-scatter sums it for all
            dst.copy_(grad.reshape(1).expand(self.cfg.world))
        else:
            dst[: s.numel].copy_(grad.reshape(-1))
            dst[s.numel :].zero_()

    def abandon_backward(self) -> None:
        """Forget a backward that raised midway: buf may hold some gradients in place of values."""
        if any(self.in_buf):
            self.gathered = False  # the next use gathers the parameters again
        self.arrived, self.in_buf = 0, [False] * len(self.leaves)

    def _flatten_grads(self) -> torch.Tensor | None:
        """The unit's gradient, rank-major (what the reduce-scatter splits), or None if none."""
        if not any(self.used()):
            return None
        if any(a is not None for a in self.acc):
            return self._flatten_accumulated()
        if self.cfg.stage == 3:
            # buf becomes the flat gradient: ranges already moved there stay, the rest take the
            # leaves' gradients (no_sync leftovers) or zeros.
            self._ensure_buf()
            flat = self.buf
            self.gathered = False  # from here on buf holds gradients; freed after the reduction
        else:
            # Only stage 3 moves gradients into buf: here the leaves' gradients are written
            # straight in rank-major order.
            first = next(g for leaf in self.leaves if (g := leaf.grad) is not None)
            dtype = self.cfg.reduce_dtype or first.dtype
            out = torch.empty(self.padded, dtype=dtype, device=self.buf.device)
            with torch.no_grad():
                for i, leaf in enumerate(self.leaves):
                    self._put_rank_major(out, i, leaf.grad)
                    leaf.grad = None
            return out
        with torch.no_grad():
            for i, leaf in enumerate(self.leaves):
                if not self.in_buf[i]:
                    self._put(flat, i, leaf.grad)
                    leaf.grad = None
            out = flat if self.reduce_param_major else self.rank_major(flat)
        if out is not self.buf:
            self.buf.untyped_storage().resize_(0)  # its gradients now sit in rank-major order
        self.in_buf = [False] * len(self.leaves)
        return out

    def _flatten_accumulated(self) -> torch.Tensor:
        """`_flatten_grads` when no_sync left gradients summed in the reduce dtype: every slot's
        gradient (the sum, a range of buf, the leaf's or zeros) is written into a new vector of
        that dtype, so nothing is rounded to the compute dtype before the reduction."""
        rd = self.cfg.reduce_dtype
        assert rd is not None
        full = torch.empty(self.padded, dtype=rd, device=self.cfg.device)
        with torch.no_grad():
            for i, leaf in enumerate(self.leaves):
                s = self.slots[i]
                g = self.acc[i] if self.acc[i] is not None else leaf.grad
                if self.in_buf[i]:
                    g = self.buf.narrow(0, s.offset, s.numel).view(s.shape)
                self._put(full, i, g)
                leaf.grad = None
        out = full if self.reduce_param_major else self.rank_major(full)
        if self.cfg.stage == 3:
            self.gathered = False
            self.buf.untyped_storage().resize_(0)
        self.acc, self.in_buf = [None] * len(self.leaves), [False] * len(self.leaves)
        return out

    def _put_rank_major(self, out: torch.Tensor, i: int, grad: torch.Tensor | None) -> None:
        """Write slot ``i``'s gradient into rank-major ``out``: rank r's rows to its chunk."""
        s, w = self.slots[i], self.cfg.world
        if s.chunk == 0:
            return
        dst = out.view(w, self.shard_size).narrow(1, s.local_offset, s.chunk)
        if grad is None:
            dst.zero_()
            return
        if s.replicated:
            dst.copy_(grad.reshape(1, 1).expand(w, 1))
            return
        g = grad.reshape(-1)
        full, rem = divmod(s.numel, s.chunk)  # ranks with a whole chunk, rows of the next one
        if full:
            dst[:full].copy_(g[: full * s.chunk].view(full, s.chunk))
        if full < w:
            dst[full, :rem].copy_(g[full * s.chunk :])
            dst[full, rem:].zero_()
            dst[full + 1 :].zero_()

    def start_reduce(self, unused: set[int] | None = None) -> None:
        """Issue this backward's gradient reduction (async) and drop the unsharded gradient.

        ZeRO-1: all-reduce of the full gradient (every rank keeps the whole sum, then its chunks).
        ZeRO-2/3: reduce-scatter, rank r receives the sum of its chunks. Both in the reduce dtype
        over the fsdp axis. The slots in ``unused`` (no rank used them) and those that do not
        train keep the gradient they had (None, as on one process) instead of a zero one.
        """
        self.skip = set(unused or ()) | {i for i, t in enumerate(self.trains) if not t}
        g, self.arrived = self._flatten_grads(), 0
        if g is None:
            return
        if faults.active("fsdp-reduce-scatter-shard") and not self.reduce_param_major:
            # an injected bug in tests only: rows shifted a rank (parameter-major: `own_chunks`)
            g = g.view(self.cfg.world, -1).roll(1, 0).reshape(-1)
        if self.cfg.reduce_dtype is not None and g.dtype != self.cfg.reduce_dtype:
            g = g.to(self.cfg.reduce_dtype)
            if self.cfg.stage == 3:
                self.buf.untyped_storage().resize_(0)  # the cast copy is what gets reduced
        if self.cfg.stage == 1:
            with comm.operation(f"FSDP gradient all-reduce of {self.label}"):
                self.pending = (comm.all_reduce(g, self.cfg.group, async_op=True), g)
        else:
            # g is dropped after the reduction, so it may serve as the reduction's own scratch
            # (on Gloo: no hidden full-size clone; the result is a view of g).
            with comm.operation(f"FSDP gradient reduce-scatter of {self.label}"):
                handle, chunk = comm.reduce_scatter_consuming(g, self.cfg.group, async_op=True)
            # Parameter-major, the whole of g is summed and this rank's chunks are read after.
            self.pending = (handle, g if self.reduce_param_major else chunk)

    def finish_reduce(self) -> None:
        """Wait for the reduction, average, reduce across dp replicas (hybrid) and accumulate."""
        if self.pending is None:
            return
        handle, red = self.pending
        self.pending = None
        if handle is not None:
            handle.wait()
        fresh = self.reduce_param_major  # red becomes a new shard-sized vector
        if self.cfg.stage == 1:
            red = red.narrow(0, self.cfg.rank * self.shard_size, self.shard_size)
        elif fresh:
            r = self.cfg.rank
            if faults.active("fsdp-reduce-scatter-shard"):  # an injected bug in tests only
                r = (r - 1) % self.cfg.world
            red = self.own_chunks(red, r)
        if self.cfg.dp_group is not None:
            with comm.operation(f"FSDP gradient all-reduce over dp of {self.label}"):
                comm.all_reduce(red, self.cfg.dp_group)  # replicas hold the same slice: plain all-reduce
        red.div_(self.cfg.divide_factor or self.cfg.world * self.cfg.replicas)
        if self.cfg.offload:
            # (On a CPU-only machine offload still makes the copy, so the data path is exercised.)
            self.offload_bytes["to_host"] += red.numel() * self.shard.element_size()
        self._accumulate(red, fresh)
        del red
        if self.cfg.stage == 3 and not self.gathered and self._handle is None:
            self.buf.untyped_storage().resize_(0)  # the reduction's input, released at once

    def _accumulate(self, red: torch.Tensor, fresh: bool = False) -> None:
        """Add ``red`` to the parameters' gradients, or make it theirs where they have none
        (``fresh``: ``red`` is a new vector nobody else holds, kept as it is where it fits).

        The gradients are DTensors over views of one flat vector, held only through the
        parameters' ``.grad`` (weakly here), so ``zero_grad()`` frees them as on any module."""
        flat = self._grad_flat() if self._grads else None
        held = [flat is not None and p.grad is not None and p.grad is ref()
                for p, ref in zip(self.params, self._grads, strict=True)] if self._grads else []
        with torch.no_grad():
            if flat is not None and all(h for i, h in enumerate(held) if i not in self.skip):
                flat.add_(red.to(flat.device, flat.dtype))
                return
            if fresh and red.dtype == self.dtype and red.device == self.home:
                new = red
            else:
                new = torch.empty(self.shard_size, dtype=self.dtype, device=self.home)
                new.copy_(red)  # a blocking copy: the optimizer reads it right after backward
            for i, p in enumerate(self.params):
                if p.grad is not None:  # accumulated earlier, or set by the user
                    self.local(i, new).add_(cast(DTensor, p.grad).to_local())
        grads = [None if i in self.skip else self._dtensor(i, self.local(i, new))
                 for i in range(len(self.slots))]
        for p, g in zip(self.params, grads, strict=True):
            if g is not None:
                p.grad = g
        self._grad_flat = weakref.ref(new)
        self._grads = [_dead if g is None else weakref.ref(g) for g in grads]


def _dead() -> None:
    """A weak reference that never resolves: a slot left without a gradient."""
    return None
