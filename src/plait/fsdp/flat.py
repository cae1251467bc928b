"""One flat, sharded group of parameters: the storage and communication unit of plait's FSDP.

Every parameter is sharded on its own along dim 0 (ZeRO, Rajbhandari et al. 2020, sec. 5, with
torch FSDP2's per-parameter layout): rank ``r`` holds rows ``[r*k, (r+1)*k)`` of a parameter with
``k = ceil(rows / N)`` (torch.chunk's rule: the last chunks may be short or empty), and the
module's parameter is an ``nn.Parameter`` DTensor ``Shard(0)`` over the fsdp axis (HSDP:
``(Replicate(), Shard(0))`` over dp x fsdp) whose local tensor is those rows. The optimizer,
``torch.nn.utils.clip_grad_norm_`` and ``torch.distributed.checkpoint`` read them as they read
FSDP2's. A 0-d parameter cannot be split: every rank holds it (``Replicate()``).

A unit's parameters of one dtype and ``requires_grad`` still move together: this rank's chunks,
each padded to ``k`` rows, lie end to end in one ``shard`` vector of ``S`` elements (the local
tensors are views of it), so one all-gather of ``S`` per rank fills a rank-major vector, which
is copied out into the gathered buffer ``buf``, parameter by parameter (each one's padded rows,
``N*k`` of them, contiguous). On Gloo, whose all-gather copies every rank's piece out of a flat
buffer of its own anyway, that copy is the reordering: one piece per run of adjacent parameters
with equal chunks, each rank's landing in its strided places of ``buf`` (`comm.all_gather_scattered`),
so the gathered vector is not copied twice. The reduction (`plait.fsdp.reduction`) runs the other way:
``buf``'s gradients are copied into rank-major order and reduce-scattered; each rank receives
its chunks, end to end, into the flat ``grad`` vector that the parameters' DTensor gradients are
views of. (FSDP2 makes the same two copies around its collectives.) With one parameter in the
group, or one rank, both orders are the same and the copies are skipped. On Gloo, whose
reduce-scatter is an all-reduce of the whole input (`plait.comm.reduce_scatter_consuming`),
ZeRO-3 skips the rank-major copy: ``buf``'s gradient is summed in place in parameter order and
each rank then reads its chunks out of it (`FlatParam.own_chunks`) into the new ``grad`` vector,
one copy of a shard instead of a full-size copy and a shard's.

``buf``'s storage is resized to zero to free the gathered parameters and resized back before the
next all-gather, so tensors that autograd saved in forward see the re-gathered values in backward.

Each original parameter's full value is an autograd leaf aliasing its range of ``buf`` with its
*own* version counter, so writing into ``buf`` never trips autograd's "modified by an inplace
operation" check. The modules' attributes point at these leaves (the registered parameters are
the DTensors), and their gradients land on them as usual. Under ZeRO-3 each leaf's gradient is
copied into the leaf's own range of ``buf`` the moment autograd has accumulated it (then
dropped): by then every backward node that read that parameter has run, so its gathered values
are dead and ``buf`` turns, range by range, into the unit's flat gradient. Stages 1-2 keep
``buf`` (the parameters stay gathered), so there the gradients are copied into a new rank-major
vector once every leaf has reported. Without casting or offloading, stages 1-2 need no separate
shard: the local tensors are views of ``buf`` itself (the ZeRO formula counts parameters once).

Gradient hooks that an earlier transformation registered on an original parameter (e.g. tensor
parallelism's sum over the tp group for a replicated weight applied to sequence shards) die
with that parameter object, so such code also lists them in the parameter's placement record
(`plait.state.placement.records.add_grad_hook`); each leaf registers them again (`Slot.grad_hooks`), and
they run on the leaf's gradient before it is accumulated, exactly as on the original.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from plait._torch_compat import version_of
from plait.fsdp.layout import ShardCfg, Slot, lay_out
from plait.fsdp.reduction import GradReduction
from plait.fsdp.stepped_leaves import watch_leaves
from plait.runtime import comm
from plait.state.dtensors import contiguous_stride


class FlatParam(GradReduction):
    """A unit's parameters of one kind, each sharded on dim 0 across the fsdp axis: their layout,
    gather and reshard here, their gradients' reduction in `GradReduction`."""

    def __init__(self, slots: list[Slot], dtype: torch.dtype, requires_grad: bool, cfg: ShardCfg) -> None:
        self.slots, self.cfg, self.dtype = slots, cfg, dtype
        # What its collectives are called in desync reports, and compared as across ranks: a rank
        # that skipped a unit (LayerDrop on one rank) is named at the first collective that differs.
        self.label = f"{slots[0].fqn}..." if slots else "(empty)"
        self.shard_size = lay_out(slots, cfg.world)
        self.padded = self.shard_size * cfg.world
        self.total = self.padded  # every slot's range, padding included
        # One slot, or one rank: rank-major and parameter-major orders coincide.
        self.direct = cfg.world == 1 or len(slots) == 1
        # Where the backend's all-gather copies each rank's piece out of a flat buffer of its own
        # (Gloo), that copy puts the pieces straight into buf's parameter-major places: one piece
        # per run of adjacent slots with equal chunks (a transformer block has about four), so
        # the gathered vector is never copied a second time (`_gather_pieces`).
        self.runs = [] if self.direct or not comm.gathers_by_copy(cfg.group) else _runs(slots)
        # ZeRO-3 on a backend whose reduce-scatter sums the whole input in place (Gloo): the
        # gradient is reduced in buf's parameter-major order and each rank reads its chunks out
        # of it afterwards, sparing the full-size rank-major copy before the reduction.
        self.reduce_param_major = cfg.stage == 3 and not self.direct and comm.reduces_in_place(cfg.group)
        self.compute_dtype = cfg.param_dtype if (cfg.param_dtype and dtype.is_floating_point) else dtype
        self.home = torch.device("cpu") if cfg.offload else cfg.device
        # ZeRO-1/2 without casting or offload keep the gathered vector anyway, so the local
        # tensors can be views of it instead of a copy (the ZeRO formula counts parameters once).
        self.aliased = cfg.stage < 3 and self.compute_dtype == dtype and not cfg.offload
        self.buf = torch.zeros(self.padded, dtype=self.compute_dtype, device=cfg.device)
        self.leaves = [_alias(self.buf, s.offset, s.shape) for s in slots]
        # Whether each parameter trains, as last synchronised between the DTensor parameter and
        # its leaf (`sync_requires_grad`): the user may flip either after wrapping.
        self.trains = [False] * len(slots)
        self.hooked = [False] * len(slots)  # leaf i carries its gradient hooks
        self.on_grad: Callable[[int], Callable[[torch.Tensor], None]] | None = None  # set by the wrapper
        self._init_reduction()  # no gradient reported or held yet (`plait.fsdp.reduction`)
        if self.aliased:
            self.shard = self.buf  # the local tensors are views of buf (see `local`)
        else:
            self.shard = torch.zeros(self.shard_size, dtype=dtype, device=self.home)
            if cfg.offload and torch.cuda.is_available():
                self.shard = self.shard.pin_memory()  # lets host->device copies run asynchronously
        self.params = [self._dtensor(i, self.local(i), requires_grad) for i in range(len(slots))]
        self.sync_requires_grad()
        # The leaves' version counters as FSDP last saw them: a change means a write through the
        # module attributes outside forward (`write_back`).
        self.leaf_versions = [version_of(leaf) for leaf in self.leaves]
        self.gathered = True  # buf holds the full vector (zeros now, filled at first gather)
        self.gathered_version = -1  # shard._version at the last gather; -1 forces one
        if cfg.stage == 3:  # built one unit at a time and freed at once: no rank holds the model
            self.buf.untyped_storage().resize_(0)
            self.gathered = False
        self._handle: comm.Handle | None = None
        self._src: torch.Tensor | None = None
        self._out: torch.Tensor | None = None  # the rank-major all-gather output (not direct)
        self.offload_bytes = {"to_device": 0, "to_host": 0}

    @property
    def requires_grad(self) -> bool:
        """Whether any of its parameters trains (``requires_grad_`` may change it after wrapping)."""
        return any(self.trains)

    def sync_requires_grad(self) -> None:
        """Make each leaf (what forward reads) and its DTensor parameter (what the optimizer and
        ``requires_grad_`` on modules see) agree on ``requires_grad``: the one the user changed
        since the last call wins, as on one process. Called before each forward of the unit."""
        for i, (p, leaf) in enumerate(zip(self.params, self.leaves, strict=True)):
            want = p.requires_grad if p.requires_grad != self.trains[i] else leaf.requires_grad
            if want and not (p.dtype.is_floating_point or p.dtype.is_complex):
                want = False
            self.trains[i] = want
            if p.requires_grad != want:
                p.requires_grad_(want)
            if leaf.requires_grad != want:
                leaf.requires_grad_(want)
            if want and not self.hooked[i]:
                self._hook(i)

    def _hook(self, i: int) -> None:
        """Register leaf ``i``'s gradient hooks (a leaf that does not train cannot hold them)."""
        leaf = self.leaves[i]
        for hook in self.slots[i].grad_hooks:
            leaf.register_hook(hook)
        if self.on_grad is not None:
            leaf.register_post_accumulate_grad_hook(self.on_grad(i))
        self.hooked[i] = True

    def set_grad_hook(self, on_grad: Callable[[int], Callable[[torch.Tensor], None]]) -> None:
        """``on_grad(i)`` makes the post-accumulate-grad hook of leaf ``i`` (the wrapper's)."""
        self.on_grad = on_grad
        for i, leaf in enumerate(self.leaves):
            if self.hooked[i]:
                leaf.register_post_accumulate_grad_hook(on_grad(i))

    # ------------------------------------------------------------- layout helpers
    def local(self, i: int, flat: torch.Tensor | None = None) -> torch.Tensor:
        """Slot ``i``'s rows on this rank, a view of ``flat`` (shard-shaped; default the shard)."""
        s, r = self.slots[i], self.cfg.rank
        a, b = s.rows_of(r)
        shape = s.shape if s.replicated else (b - a, *s.shape[1:])
        if flat is None and self.aliased:
            return self.buf.narrow(0, s.offset + r * s.chunk, (b - a) * s.row).view(shape)
        flat = self.shard if flat is None else flat
        return flat.narrow(0, s.local_offset, (b - a) * s.row).view(shape)

    def _dtensor(self, i: int, local: torch.Tensor, requires_grad: bool | None = None) -> Any:
        """Slot ``i``'s DTensor over ``local`` (an ``nn.Parameter`` when ``requires_grad`` is given)."""
        assert self.cfg.placing is not None
        mesh, placements, shape = self.cfg.placing(self.slots[i])
        dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                                stride=contiguous_stride(shape))
        return nn.Parameter(dt, requires_grad=requires_grad) if requires_grad is not None else dt

    def pack(self, locals_: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        """A shard-shaped vector holding each slot's local rows (padding zero), e.g. optimizer state."""
        out = torch.zeros(self.shard_size, dtype=dtype or self.dtype, device=self.home)
        for i, t in enumerate(locals_):
            self.local(i, out).copy_(t)
        return out

    def rank_major(self, flat: torch.Tensor) -> torch.Tensor:
        """``buf``'s parameter-major order (padded slots) -> the all-gather's rank-major order."""
        if self.direct:
            return flat
        w = self.cfg.world
        out = torch.empty(self.padded, dtype=flat.dtype, device=flat.device)
        torch.cat([flat.narrow(0, s.offset, w * s.chunk).view(w, s.chunk) for s in self.slots], dim=1,
                  out=out.view(w, self.shard_size))
        return out

    def param_major(self, gathered: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The inverse of `rank_major`, into ``out`` (default: a new vector)."""
        if self.direct:
            if out is not None and out is not gathered:
                out.copy_(gathered)
                return out
            return gathered
        w = self.cfg.world
        out = torch.empty_like(gathered) if out is None else out
        torch.split_with_sizes_copy(gathered.view(w, self.shard_size), [s.chunk for s in self.slots], dim=1,
                                    out=[out.narrow(0, s.offset, w * s.chunk).view(w, s.chunk)
                                         for s in self.slots])
        return out

    def own_chunks(self, full: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """``rank``'s (default: this rank's) chunks of parameter-major ``full``, end to end (a new
        shard-sized vector)."""
        r = self.cfg.rank if rank is None else rank
        return torch.cat([full.narrow(0, s.offset + r * s.chunk, s.chunk) for s in self.slots])

    # ------------------------------------------------------------- unshard / reshard
    def _version(self) -> int:
        """Changes whenever the shard's values may have: an in-place op on a DTensor parameter
        (the optimizer's step, a load into ``state_dict()``) bumps the DTensor's version, not its
        local tensor's, so both are read."""
        return version_of(self.shard) + sum(version_of(p) for p in self.params)

    def needs_gather(self) -> bool:
        return self._handle is None and not (self.gathered and self.gathered_version == self._version())

    def _source(self) -> torch.Tensor:
        """This rank's chunks, end to end, on the compute device in the compute dtype."""
        if self.aliased:  # copies: never gather a tensor into itself
            r = self.cfg.rank
            if self.direct:
                return self.buf.narrow(0, r * self.shard_size, self.shard_size).clone()
            return self.own_chunks(self.buf)
        src = self.shard.detach()
        if self.cfg.offload:
            src = src.to(self.cfg.device, copy=True, non_blocking=True)
            self.offload_bytes["to_device"] += src.numel() * src.element_size()
        return src.to(self.compute_dtype) if src.dtype != self.compute_dtype else src

    def start_gather(self) -> None:
        """Issue the all-gather of every rank's shard (async; `finish_gather` waits and copies it
        out into ``buf``).

        Forward: all-gather of ``padded`` elements in the compute dtype over the fsdp axis.
        """
        if self.cfg.stage == 3 and self.pending is not None:
            self.finish_reduce()  # buf may be the in-flight reduction's input
        if not self.needs_gather():
            return
        self._src = self._source()
        if self.runs:
            self._ensure_buf()
            self._out = self.buf
            outs, pieces = self._gather_pieces(self._src)
            with comm.operation(f"FSDP all-gather of {self.label}"):
                self._handle = comm.all_gather_scattered(outs, pieces, self.cfg.group, async_op=True)
            return
        if self.direct:
            self._ensure_buf()
            self._out = self.buf
        else:
            self._out = torch.empty(self.padded, dtype=self.compute_dtype, device=self.cfg.device)
        with comm.operation(f"FSDP all-gather of {self.label}"):
            self._handle = comm.all_gather_into(self._out, self._src, self.cfg.group, async_op=True)

    def _gather_pieces(self, src: torch.Tensor) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
        """Per run of slots (``g`` of them, each chunk ``c``): this rank's ``(g, c)`` piece of
        ``src`` and, for each rank r, the ``(g, c)`` strided view of buf where r's piece belongs."""
        w, outs, pieces = self.cfg.world, [], []
        for first, g, c in self.runs:
            s = self.slots[first]
            pieces.append(src.narrow(0, s.local_offset, g * c).view(g, c))
            dst = self.buf.narrow(0, s.offset, g * w * c).view(g, w, c)
            outs.append([dst[:, r] for r in range(w)])
        return outs, pieces

    def _ensure_buf(self) -> None:
        nbytes = self.padded * self.buf.element_size()
        if self.buf.untyped_storage().nbytes() != nbytes:
            self.buf.untyped_storage().resize_(nbytes)

    def finish_gather(self) -> None:
        self.start_gather()
        if self._handle is not None:
            self._handle.wait()
            if self._out is not None and self._out is not self.buf:
                self._ensure_buf()
                with torch.no_grad():
                    self.param_major(self._out, self.buf)
            self._handle, self._src, self._out = None, None, None
            self.gathered_version = self._version()
        self.gathered = True

    def write_back(self) -> None:
        """Copy into this rank's shard the rows of every leaf written through the module's attributes
        since FSDP last looked (``reset_parameters()``, an in-place init after wrapping): the shard
        is what the optimizer, the state dicts and the next gather read, so the write would be lost."""
        if not self.gathered or self._handle is not None:
            return
        changed = [i for i, leaf in enumerate(self.leaves) if version_of(leaf) != self.leaf_versions[i]]
        with torch.no_grad():
            for i in changed:
                s, leaf = self.slots[i], self.leaves[i]
                a, b = s.rows_of(self.cfg.rank)
                self.local(i).copy_(leaf if s.replicated else leaf[a:b])
        self.leaf_versions = [version_of(leaf) for leaf in self.leaves]

    def reshard(self) -> None:
        """Free the gathered parameters (ZeRO-3); the shard stays."""
        if self.cfg.stage < 3:
            return
        self.write_back()
        if self._handle is not None:
            # A prefetch nobody used: let it land before freeing. Also when not gathered yet, or it
            # would stay pending and be taken for current values after the optimizer step.
            self._handle.wait()
            self._handle, self._src, self._out = None, None, None
            self.gathered_version = -1
        elif not self.gathered:
            return
        self.buf.untyped_storage().resize_(0)
        self.gathered = False

    def retyped(self, dtype: torch.dtype) -> FlatParam:
        """The same parameters held in ``dtype`` (``model.to(torch.float64)`` after wrapping): a new
        flat group with this one's values, whose DTensor parameters are swapped into this one's
        parameter objects (`torch.utils.swap_tensors`), so an optimizer already built on them, and
        ``requires_grad``, carry over as under torch's FSDP2."""
        new = FlatParam(self.slots, dtype, self.requires_grad, self.cfg)
        with torch.no_grad():
            for i in range(len(self.slots)):
                new.local(i).copy_(self.local(i))
        for i, (old_p, new_p) in enumerate(zip(self.params, new.params, strict=True)):
            new_p.requires_grad_(self.trains[i])
            old_p.grad = None
            torch.utils.swap_tensors(old_p, new_p)
            new.params[i] = old_p
        new.trains = [False] * len(self.slots)
        new.sync_requires_grad()
        return new

    def bind_views(self) -> None:
        """Register the DTensor parameters and point every owner module's attribute at its
        parameter's leaf (tied owners share one): forward reads the leaf, `named_parameters` and
        `state_dict` the DTensor."""
        for slot, param, leaf in zip(self.slots, self.params, self.leaves, strict=True):
            for mod, attr in slot.owners:
                mod._parameters[attr] = param  # a DTensor parameter (torch's FSDP2 registers them alike)
                mod.__dict__[attr] = leaf
        watch_leaves((slot.fqn, leaf) for slot, leaf in zip(self.slots, self.leaves, strict=True))


def _runs(slots: list[Slot]) -> list[tuple[int, int, int]]:
    """(first slot, slots, chunk) of each run of adjacent slots with equal non-empty chunks."""
    runs: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if s.chunk == 0:
            continue
        if runs and runs[-1][2] == s.chunk and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, s.chunk)
        else:
            runs.append((i, 1, s.chunk))
    return runs


def _alias(base: torch.Tensor, offset: int, shape: tuple[int, ...] | torch.Size | int) -> torch.Tensor:
    """A contiguous tensor on ``base``'s storage with its own autograd version counter."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    stride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        stride[d] = stride[d + 1] * shape[d + 1]
    return torch.empty(0, dtype=base.dtype, device=base.device).set_(
        base.untyped_storage(), offset, shape, tuple(stride))
