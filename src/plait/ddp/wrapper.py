"""DistributedDataParallel: one replica per process, gradients averaged in overlapping buckets.

How a step works (Li et al., "PyTorch Distributed", VLDB 2020, describe the same idea):

1. Parameters that need gradients are packed, in *reverse* registration order (roughly the
   order backward produces their gradients), into flat buckets of at most ``bucket_cap_mb``.
2. During ``backward()``, a hook fires as each parameter's gradient is fully accumulated; the
   gradient is copied into its bucket. When a bucket is complete it is all-reduced
   asynchronously, so communication overlaps with the rest of backward. Buckets are launched
   strictly in index order, so every rank issues the same collectives in the same order.
3. At the end of backward the handles are awaited and the averaged gradients are written back
   into ``param.grad``; the user's optimizer then steps as usual.

Only the mesh's data-parallel axis is used, so DDP composes with tensor and pipeline
parallelism on the other axes.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait import comm, faults
from plait._torch_compat import eager, queue_end_of_backward
from plait.comm import average_gradients, broadcast_coalesced
from plait.ddp.buckets import params_reached_by, plan_buckets
from plait.materialize import is_meta
from plait.mesh import Mesh
from plait.placement.grads import reduce_expert_grads
from plait.placement.records import held, placement_of
from plait.placement.tp_params import gradient_assigned, hand_over
from plait.precision import precision_of
from plait.wrapped_state import WrappedModuleState

if TYPE_CHECKING:
    from plait.clip import GradParts

__all__ = ["DistributedDataParallel", "DDP", "average_gradients", "plan_buckets"]

_COMPRESSION = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class _Bucket:
    index: int
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    buffer: torch.Tensor
    slots: list[torch.Tensor] = field(default_factory=list)  # flat view of each parameter's range
    grads: list[torch.Tensor] = field(default_factory=list)  # the same ranges, shaped like the params
    pending: int = 0
    wire: torch.Tensor | None = None  # what is actually all-reduced (compressed copy or buffer)
    handle: comm.Handle | None = None
    ready: set[int] = field(default_factory=set)


def _check_experts_placed(module: nn.Module, named: list[tuple[str, nn.Parameter]]) -> None:
    """An MoE model's experts get gradients only where tokens were routed to them: refuse one
    whose experts `plait.expert_parallel` did not mark (DDP would wait for their gradients)."""
    from plait.models.moe import moe_layers

    if moe_layers(module) and not any(placement_of(p) is not None for _, p in named):
        raise ValueError("DistributedDataParallel: the model has MoE layers; apply "
                         "plait.expert_parallel(model, mesh) first (with ep=1 it only marks the experts, "
                         "whose gradients may be missing on a rank that routed them no token)")


class DistributedDataParallel(WrappedModuleState, nn.Module):
    """Data parallelism across the ``dp`` axis of ``mesh`` (``mesh=None``: every rank is dp).

    Args:
        module: any ``nn.Module``; tied weights, buffers and frozen parameters are supported.
        mesh: the device mesh; gradients are averaged over ``mesh.group(axis)``.
        bucket_cap_mb: the largest bucket, in MiB of gradient.
        find_unused_parameters: after each forward, walk the autograd graph and treat
            parameters it does not reach as finished (they contribute zeros; a parameter unused
            on every rank keeps ``grad=None``, as in a single process). When off, a parameter
            that receives no gradient is an error that names it.
        broadcast_buffers: broadcast buffers from the first rank before every forward.
        gradient_compression: ``None``, ``"bf16"`` or ``"fp16"``: all-reduce a half-precision
            copy of each bucket (half the bytes; gradients are pre-divided so fp16 does not
            overflow). On a module given `plait.mixed_precision`, the default follows the policy's
            reduce dtype (fp32: none; bf16/fp16: that copy); an explicit value must agree with it.
        axis: the mesh axis (or axes) to average over. The default, ``("dp", "cp")``, is the
            ``dp`` group when the mesh has no context parallelism; with it, gradients are averaged
            over the ranks holding other tokens of the sequence too.
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: Mesh | None = None,
        *,
        bucket_cap_mb: float = 25.0,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        gradient_compression: str | None = None,
        axis: str | tuple[str, ...] = ("dp", "cp"),
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedDataParallel(module=...) expects an nn.Module, got {type(module)}")
        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(
                f"DistributedDataParallel(mesh=...) expects a plait.Mesh or None, got {type(mesh)}"
            )
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        if gradient_compression not in _COMPRESSION:
            raise ValueError(
                f"gradient_compression must be one of None, 'bf16', 'fp16'; got {gradient_compression!r}"
            )
        if is_meta(module):
            raise ValueError("DistributedDataParallel needs a materialized module; this one has meta "
                             "parameters (use FullyShardedDataParallel for meta-device init)")
        # Over a tp model, DDP's buckets and hooks are over the plain leaves tp's DTensor parameters
        # stand on; the reduced gradients become the DTensors' (`gradient_assigned`).
        hand_over(module)
        self.module = module
        self.mesh = mesh if mesh is not None else Mesh(dp=-1)
        self.axis = axis
        self.group = self.mesh.group(axis)
        self.world = self.mesh.size(axis)
        self.src = self.mesh.group_ranks(axis)[0]
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.wire_dtype = _wire_dtype(module, gradient_compression)

        leaves = ((n, held(p)) for n, p in module.named_parameters())
        everything = list({id(t): (n, t) for n, t in leaves}.values())
        _check_experts_placed(module, everything)
        # Expert parameters (plait.expert_parallel) differ across ep ranks: reduced on their own.
        named = [(n, p) for n, p in everything if placement_of(p) is None]
        self._experts = [(n, p) for n, p in everything if placement_of(p) is not None and p.requires_grad]
        self._check_same_model_everywhere(named)
        self._broadcast_state()
        # Where every expert is held by exactly this DDP's ranks (ep=1 along its axis), its gradient
        # is summed over the same ranks as a dense one: it rides in the buckets, overlapped with
        # backward, instead of one blocking all-reduce after it. A rank that routed no token to an
        # expert contributes zeros, and a flag per expert keeps one process's "no gradient".
        self._bucketed_experts = self._experts if self._experts_share_buckets(find_unused_parameters) else []
        self._expert_index = {id(p): i for i, (_, p) in enumerate(self._bucketed_experts)}
        if self._bucketed_experts:  # from here on, _experts are those summed after backward
            self._experts = []
        trainable = [(n, p) for n, p in everything
                     if p.requires_grad and (placement_of(p) is None or id(p) in self._expert_index)]
        self._buckets = self._make_buckets(trainable, int(bucket_cap_mb * 2**20))
        self._where: dict[int, tuple[_Bucket, int]] = {
            id(p): (b, i) for b in self._buckets for i, p in enumerate(b.params)
        }
        self._expert_flags = torch.zeros(len(self._bucketed_experts), device=comm.device_of(self.group))
        # Through a weak reference: a hook holding the wrapper would tie it to its parameters in a
        # cycle through the tensors' C++ hooks that the collector cannot break, so a deleted DDP
        # (and its buckets) would never be freed.
        ready = weakref.WeakMethod(self._on_grad_ready)
        for _, p in trainable:  # bucketed experts included
            p.register_post_accumulate_grad_hook(lambda q, ready=ready: _call_alive(ready, q))
        expert_ready = weakref.WeakMethod(self._on_expert_grad)
        for _, p in self._experts:
            p.register_post_accumulate_grad_hook(lambda q, ready=expert_ready: _call_alive(ready, q))
        self._no_sync = False
        self._sync_this_backward = False
        self._callback_queued = False
        self._divisor = float(self.world)
        self._join: _JoinState | None = None
        self._used_flags: torch.Tensor | None = None

    # ------------------------------------------------------------------ construction
    def _experts_share_buckets(self, find_unused_parameters: bool) -> bool:
        """Whether every expert's gradient is summed over exactly this DDP's ranks (not with
        ``find_unused_parameters``, whose flags already stand for the parameters a rank skipped)."""
        if not self._experts or find_unused_parameters:
            return False
        ours = sorted(self.mesh.group_ranks(self.axis))
        placements = [placement_of(p) for _, p in self._experts]
        return all(w is not None and sorted(w.edp_ranks) == ours for w in placements)

    def _check_same_model_everywhere(self, named: list[tuple[str, nn.Parameter]]) -> None:
        mine = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in named]
        everyone = comm.all_gather_object(mine, self.group)
        ref = everyone[0]
        for r, theirs in enumerate(everyone):
            if theirs == ref:
                continue
            for i in range(max(len(ref), len(theirs))):
                a = ref[i] if i < len(ref) else None
                b = theirs[i] if i < len(theirs) else None
                if a != b:
                    raise ValueError(
                        "DistributedDataParallel: the model differs across ranks; parameter #"
                        f"{i} is {a} (name, shape, dtype, requires_grad) on dp rank 0 but {b} on dp "
                        f"rank {r}. Every rank must build the same model."
                    )

    @torch.no_grad()
    def _broadcast_state(self) -> None:
        dense = [held(p) for p in self.module.parameters() if placement_of(p) is None]
        tensors = dense + list(self.module.buffers())
        broadcast_coalesced(tensors, self.src, self.group)
        if self._experts:  # each expert from the first of the ranks holding it
            where = placement_of(self._experts[0][1])
            assert where is not None
            broadcast_coalesced([p for _, p in self._experts], where.edp_ranks[0], where.edp)

    def _make_buckets(self, trainable: list[tuple[str, nn.Parameter]], cap: int) -> list[_Bucket]:
        # Launch order is reverse registration order (roughly the order backward finishes
        # gradients); parameters of different dtypes or devices never share a bucket.
        by_kind: dict[tuple[torch.dtype, torch.device], list[tuple[str, nn.Parameter]]] = {}
        for name, p in reversed(trainable):
            by_kind.setdefault((p.dtype, p.device), []).append((name, p))
        buckets: list[_Bucket] = []
        for members in by_kind.values():
            sizes = [p.numel() * p.element_size() for _, p in members]
            for idx in plan_buckets(sizes, cap):
                buckets.append(self._new_bucket(len(buckets), [members[i] for i in idx]))
        return buckets

    @staticmethod
    def _new_bucket(index: int, members: list[tuple[str, nn.Parameter]]) -> _Bucket:
        offsets, total = [], 0
        for _, p in members:
            offsets.append(total)
            total += p.numel()
        p0 = members[0][1]
        buf = torch.zeros(total, dtype=p0.dtype, device=p0.device)
        # Views made once: the backward hooks are on the critical path and run once per parameter.
        slots = [buf[o : o + p.numel()] for o, (_, p) in zip(offsets, members)]
        grads = [v.view_as(p) for v, (_, p) in zip(slots, members)]
        return _Bucket(index, [p for _, p in members], [n for n, _ in members], offsets, buf, slots, grads)

    # ------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        sync = self._before_forward()
        out = self.module(*args, **kwargs)
        self._after_forward(out, sync)
        return out

    # Under torch.compile the wrapped module's forward is traced and the wrapper's own work runs
    # eagerly, around it (as torch's DDP keeps its reducer out of the graph): collectives and the
    # buckets' Python state are nothing a graph can hold. Two clean graph breaks per forward.
    @eager
    def _before_forward(self) -> bool:
        """Join and buffer broadcast; whether this forward's backward reduces."""
        sync = torch.is_grad_enabled() and not self._no_sync and bool(self._buckets)
        if self._join is not None:
            self._divisor = self._join.step(sync)
        if self.broadcast_buffers and self.world > 1:
            with comm.operation("DDP buffer broadcast"):
                broadcast_coalesced(list(self.module.buffers()), self.src, self.group)
        return sync

    @eager
    def _after_forward(self, out: Any, sync: bool) -> None:
        self._sync_this_backward = sync
        if sync:
            self._start_step()
            if self.find_unused_parameters:
                self._mark_unreachable(out)

    def _start_step(self) -> None:
        for b in self._buckets:
            b.pending, b.handle, b.wire = len(b.params), None, None
            b.ready.clear()
        self._expert_flags.zero_()
        self._callback_queued = False
        self._next_launch = 0
        self._used_flags = self._no_flags() if self.find_unused_parameters else None

    def _no_flags(self) -> torch.Tensor:
        """One flag per parameter, on the group's device (NCCL carries only device tensors)."""
        return torch.zeros(len(self._where), device=comm.device_of(self.group))

    def _mark_unreachable(self, out: Any) -> None:
        reached = params_reached_by(out)
        for p_id, (b, i) in self._where.items():
            if p_id not in reached:
                p = b.params[i]
                if p.grad is not None:  # detach a bucket-view grad before zeroing its slot
                    p.grad = p.grad.clone()
                    gradient_assigned(p)
                b.slots[i].zero_()
                self._mark_ready(b, i)
            else:
                assert self._used_flags is not None
                self._used_flags[self._flag_index(b, i)] = 1.0

    def _flag_index(self, b: _Bucket, i: int) -> int:
        return sum(len(x.params) for x in self._buckets[: b.index]) + i

    # ------------------------------------------------------------------ backward
    def _on_expert_grad(self, p: nn.Parameter) -> None:
        if self._sync_this_backward and not self._callback_queued:
            self._callback_queued = True
            queue_end_of_backward(self._finish_backward)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._sync_this_backward:
            return
        if not self._callback_queued:
            self._callback_queued = True
            queue_end_of_backward(self._finish_backward)
        b, i = self._where[id(p)]
        if i in b.ready:
            return
        assert p.grad is not None
        self._fill(b, i, p.grad)
        self._mark_ready(b, i)

    def _fill(self, b: _Bucket, i: int, grad: torch.Tensor) -> None:
        """Copy a gradient into its bucket slot, pre-divided (one pass over memory): the
        all-reduced sum is then the mean, and a half-precision wire format cannot overflow."""
        slot = b.slots[i]
        expert = self._expert_index.get(id(b.params[i]))
        if expert is not None:
            self._expert_flags[expert] = 1.0
        divisor = self._divisor + faults.active("ddp-divisor")  # an injected bug in tests only
        if grad.data_ptr() == slot.data_ptr():  # the grad already lives in the bucket
            slot.div_(divisor)
        else:
            torch.div(grad.reshape(-1), divisor, out=slot)

    def _mark_ready(self, b: _Bucket, i: int) -> None:
        b.ready.add(i)
        b.pending -= 1
        # Launch in index order only: every rank must issue the same collectives in the same order.
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            self._launch(self._next_launch)
            self._next_launch += 1

    def _launch(self, index: int) -> None:
        b = self._buckets[index]
        b.wire = b.buffer if self.wire_dtype is None else b.buffer.to(self.wire_dtype)
        with comm.operation(self._bucket_name(index)):
            b.handle = comm.all_reduce(b.wire, self.group, async_op=True, checked=self._checks_desync(index))

    def _checks_desync(self, index: int) -> bool:
        """Whether bucket ``index`` carries the backward's desync check. Only the last one does: its
        fingerprint covers every bucket before it, and `_finish_backward` reads its verdict before
        any bucket's result. A check per bucket cost about 4% of a step on 2 CPU ranks."""
        return index == len(self._buckets) - 1

    def _bucket_name(self, index: int) -> str:
        """What desync reports call the bucket (a joined rank mirrors it from another line)."""
        return f"DDP bucket {index + 1} of {len(self._buckets)}"

    def _finish_backward(self) -> None:
        self._sync_this_backward = False
        missing = [(b, i) for b in self._buckets for i in range(len(b.params)) if i not in b.ready]
        if self._bucketed_experts:
            # An expert this backward routed no token to on this rank: what earlier microbatches
            # accumulated (no_sync), or zeros flagged as no gradient.
            for b, i in [(b, i) for b, i in missing if id(b.params[i]) in self._expert_index]:
                grad = b.params[i].grad
                if grad is not None:
                    self._fill(b, i, grad)
                else:
                    b.slots[i].zero_()
                self._mark_ready(b, i)
            missing = [(b, i) for b, i in missing if i not in b.ready]
            with comm.operation("DDP expert gradient flags"):
                comm.all_reduce(self._expert_flags, self.group)
        if missing and self.find_unused_parameters:
            for b, i in missing:  # reachable in the graph, yet no gradient arrived: contribute zeros
                b.slots[i].zero_()
                self._mark_ready(b, i)
            missing = []
        if missing:
            names = [b.names[i] for b, i in missing]
            raise RuntimeError(
                f"DistributedDataParallel: {len(names)} parameter(s) received no gradient in this "
                f"backward, so their buckets cannot be all-reduced: {', '.join(names[:8])}"
                f"{' ...' if len(names) > 8 else ''}. If they are legitimately unused, pass "
                "find_unused_parameters=True; if they should not train, set requires_grad=False."
            )
        if self._experts:  # summed over the ranks holding the same experts, divided as the rest
            reduce_expert_grads([p for _, p in self._experts], self._divisor)
        globally_used = None
        if self._used_flags is not None:
            with comm.operation("DDP unused-parameter flags"):
                comm.all_reduce(self._used_flags, self.group)
            globally_used = self._used_flags
        flags = self._expert_flags.tolist() if self._bucketed_experts else []
        no_gradient = {id(p) for (_, p), f in zip(self._bucketed_experts, flags) if f == 0}
        # The last bucket first: its desync verdict covers them all (`_checks_desync`).
        for b in self._buckets[-1:] + self._buckets[:-1]:
            assert b.handle is not None and b.wire is not None
            b.handle.wait()
            if b.wire is not b.buffer:
                b.buffer.copy_(b.wire)
            for i, p in enumerate(b.params):
                if globally_used is not None and globally_used[self._flag_index(b, i)] == 0:
                    continue  # unused everywhere: leave grad as a single process would
                if id(p) in no_gradient:  # an expert no rank routed a token to: none, as in one process
                    p.grad = None
                    continue
                # The gradient becomes a view of its bucket: no copy back now, and if the user keeps
                # it (zero_grad(set_to_none=False), no_sync), the next backward accumulates in place.
                p.grad = b.grads[i]
                gradient_assigned(p)  # a tp DTensor's gradient, or a piece's mark (`plait.placement.pieces`)

    # ------------------------------------------------------------------ user API
    def grad_norm_parts(self) -> GradParts:
        """After the all-reduce every replica holds the same gradients: the wrapped module's parts,
        never summed over dp (`plait.clip`)."""
        from plait.clip import grad_norm_parts

        return grad_norm_parts(self.module)

    def prepare_for_backward(self) -> None:
        """Reduce the gradients of the next backward, whatever the forwards before it decided.

        A forward decides whether its backward communicates (outside `no_sync`); a pipeline runs
        the forwards of several microbatches before their backwards, in the order its schedule
        says, so only it knows which backward is a stage's last of the step. It runs every
        forward in `no_sync` and calls this just before that backward (torch's DDP reducer has a
        method of the same name for the same reason). Not with ``find_unused_parameters``, which
        needs the forward's outputs.
        """
        if self.find_unused_parameters:
            raise ValueError("DistributedDataParallel.prepare_for_backward: not available with "
                             "find_unused_parameters=True (unused parameters are found from a forward)")
        if self._buckets:
            self._start_step()
            self._sync_this_backward = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) for forwards run inside."""
        old, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = old

    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = True) -> Iterator[None]:
        """Let ranks with fewer batches finish early without hanging the others.

        Inside the block each forward first counts the ranks still training. A rank that
        leaves the block keeps answering the others' collectives with zeros until every rank
        has left; then every rank takes the parameters of the rank that trained longest.
        Gradients are divided by the initial world size (a finished rank contributes zero),
        or by the number of ranks still training with ``divide_by_initial_world_size=False``.
        """
        self._join = _JoinState(self, divide_by_initial_world_size)
        try:
            yield
        except BaseException:
            # The block failed (a desync, a timeout, the user's error): shadowing the others'
            # collectives now would only add a hang to the error.
            self._join = None
            raise
        state, self._join = self._join, None
        try:
            state.shadow_until_all_done()
        finally:
            self._divisor = float(self.world)


class _JoinState:
    def __init__(self, ddp: DistributedDataParallel, by_world: bool) -> None:
        self.ddp, self.by_world, self.steps = ddp, by_world, 0

    def step(self, sync: bool) -> float:
        """Called by each forward of a rank still training; returns the gradient divisor."""
        self.steps += 1
        counts = torch.tensor([1.0, float(sync)], device=comm.device_of(self.ddp.group))
        with comm.operation("DDP join count"):
            comm.all_reduce(counts, self.ddp.group)
        return float(self.ddp.world) if self.by_world else counts[0].item()

    @torch.no_grad()
    def shadow_until_all_done(self) -> None:
        ddp = self.ddp
        while True:
            counts = torch.zeros(2, device=comm.device_of(ddp.group))
            with comm.operation("DDP join count"):
                comm.all_reduce(counts, ddp.group)
            if counts[0] == 0:
                break
            if ddp.broadcast_buffers and ddp.world > 1:
                with comm.operation("DDP buffer broadcast"):
                    broadcast_coalesced(list(ddp.module.buffers()), ddp.src, ddp.group)
            if counts[1] > 0:  # the others run a synchronised backward: mirror its collectives
                for index, b in enumerate(ddp._buckets):
                    b.buffer.zero_()
                    wire = b.buffer if ddp.wire_dtype is None else b.buffer.to(ddp.wire_dtype)
                    with comm.operation(ddp._bucket_name(index)):
                        comm.all_reduce(wire, ddp.group, checked=ddp._checks_desync(index))
                if ddp._bucketed_experts:
                    with comm.operation("DDP expert gradient flags"):
                        comm.all_reduce(torch.zeros_like(ddp._expert_flags), ddp.group)
                if ddp.find_unused_parameters:
                    with comm.operation("DDP unused-parameter flags"):
                        comm.all_reduce(ddp._no_flags(), ddp.group)
        steps = comm.all_gather_object(self.steps, ddp.group)
        longest = max(range(len(steps)), key=lambda r: (steps[r], r))
        src = ddp.mesh.group_ranks(ddp.axis)[longest]
        broadcast_coalesced([held(p) for p in ddp.module.parameters()], src, ddp.group)


DDP = DistributedDataParallel


def _wire_dtype(module: nn.Module, compression: str | None) -> torch.dtype | None:
    """The dtype buckets are all-reduced in (None: the gradients' own), from ``gradient_compression``
    and the reduce dtype of the module's `plait.mixed_precision` policy, which must agree."""
    asked = _COMPRESSION[compression]
    policy = precision_of(module)
    if policy is None:
        return asked
    # The master gradients are fp32: reducing them "in fp32" is reducing them as they are.
    wanted = None if policy.wire_dtype == torch.float32 else policy.wire_dtype
    if wanted not in _COMPRESSION.values():
        raise ValueError(f"DistributedDataParallel: the module's mixed precision reduces gradients in "
                         f"{policy.wire_dtype}; DDP reduces the fp32 master gradients as they are or as a "
                         "bf16 / fp16 copy: use MixedPrecision(reduce_dtype=torch.float32, torch.bfloat16 "
                         "or torch.float16)")
    if compression is not None and asked != wanted:
        raise ValueError(f"DistributedDataParallel(gradient_compression={compression!r}) disagrees with the "
                         f"module's mixed precision, which reduces gradients in {policy.wire_dtype}: drop "
                         "the option (it follows the policy) or change the policy's reduce_dtype")
    return wanted


def _call_alive(method: weakref.WeakMethod, p: nn.Parameter) -> None:
    """Call a weakly held gradient hook if its wrapper still exists."""
    fn = method()
    if fn is not None:
        fn(p)
