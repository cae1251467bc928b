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

Which parameters count as used, what an unused one contributes and when ``.grad`` is left
alone follow torch's reducer (see `DistributedDataParallel` and docs/ddp.md).
Only the mesh's data-parallel axis is used, so DDP composes with tensor and pipeline
parallelism on the other axes.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from plait._torch_compat import eager, in_backward_optimizers, take_in_backward_hooks
from plait.ddp.buckets import (
    Bucket,
    BufferBroadcast,
    output_tensors,
    params_reached_by,
    plan_buckets,
    sparse_params,
)
from plait.ddp.hooks import CommHook, validate_hook
from plait.ddp.in_backward import BucketOptimizers, InBackward, check_spec, refuse_model
from plait.ddp.join import DDPJoinHook, common_rank, step_counts
from plait.ddp.reducer import Reducer
from plait.ddp.state import DDPOptions, check_experts_placed, ignored_names, refuse_torch_only, wire_dtype
from plait.runtime import comm
from plait.runtime.comm import broadcast_coalesced
from plait.runtime.mesh import Mesh
from plait.state.materialize import is_meta
from plait.state.placement.records import expert_of, plain_leaf
from plait.state.placement.tp_params import let_wrapper_assign_grads
from plait.state.wrapped_state import WrappedModuleState

if TYPE_CHECKING:
    from plait.state.clip import GradParts


class DistributedDataParallel(Reducer, WrappedModuleState, nn.Module, Joinable):
    """Data parallelism across the ``dp`` axis of ``mesh`` (``mesh=None``: every rank is dp).

    Args:
        module: any ``nn.Module`` with at least one parameter that requires a gradient; tied
            weights, buffers, frozen parameters and sparse embeddings are supported.
        mesh: the device mesh; gradients are averaged over ``mesh.group(axis)``.
        bucket_cap_mb: the largest bucket, in MiB of gradient.
        find_unused_parameters: as torch's: after each forward, walk the autograd graph from its
            outputs; a parameter it does not reach (or that gets no gradient) contributes the
            gradient it already holds, or zeros; one no rank used since the last reduction
            (``no_sync`` microbatches included) keeps its ``.grad`` untouched. When off, a
            parameter that receives no gradient is an error that names it.
        broadcast_buffers: broadcast buffers from the first rank before a forward that follows
            a reducing one (torch's rule); while joining, from the highest rank still training.
        gradient_compression: ``None``, ``"bf16"`` or ``"fp16"``: all-reduce a half-precision
            copy of each bucket (half the bytes; gradients are pre-divided so fp16 does not
            overflow). On a module given `plait.mixed_precision`, the default follows the policy's
            reduce dtype (fp32: none; bf16/fp16: that copy); an explicit value must agree with it.
        axis: the mesh axis (or axes) to average over. The default, ``("dp", "cp")``, is the
            ``dp`` group when the mesh has no context parallelism; with it, gradients are averaged
            over the ranks holding other tokens of the sequence too.
        static_graph: as torch's: the first reducing backward finds which parameters get
            gradients (and how many times: reentrant checkpointing); later steps trust it.
        params_and_buffers_to_ignore: names (as ``module.named_parameters()`` /
            ``named_buffers()`` give them) DDP neither broadcasts nor reduces; torch's
            ``_set_params_and_buffers_to_ignore_for_model`` adds to them.
        optimizer_in_backward: ``(optimizer class, keyword arguments)``, e.g.
            ``(torch.optim.AdamW, {"lr": 1e-3})``: DDP steps one such optimizer per bucket at the
            end of each reducing backward, as soon as that bucket's all-reduce lands, and drops
            the gradients (``.grad`` is None afterwards); there is no optimizer step to call.
            ``in_backward_optimizers`` lists them (state dicts, learning rates). See docs/ddp.md.

    torch's other arguments (``device_ids``, ``process_group``, ``mixed_precision``, ...) are
    refused by name with what to write instead, before any collective.
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
        static_graph: bool = False,
        params_and_buffers_to_ignore: Iterable[str] | None = None,
        optimizer_in_backward: InBackward | None = None,
        **torch_only: Any,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        refuse_torch_only(torch_only)
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedDataParallel(module=...) expects an nn.Module, got {type(module)}")
        options = DDPOptions(bucket_cap_mb, find_unused_parameters, broadcast_buffers, gradient_compression,
                             axis, static_graph, ignored_names(module, params_and_buffers_to_ignore),
                             check_spec(optimizer_in_backward))
        _check_module(module, mesh, options.ignored)
        if options.in_backward is not None or any(in_backward_optimizers(p) for p in module.parameters()):
            refuse_model(module, options.ignored, both=options.in_backward is not None)
        # Over a tp model, DDP's buckets and hooks are over the plain leaves tp's DTensor parameters
        # stand on; the reduced gradients become the DTensors' (`gradient_assigned`).
        let_wrapper_assign_grads(module)
        self.module = module
        self.mesh = mesh if mesh is not None else Mesh(dp=-1)
        self._build(options)
        self._check_same_model_everywhere(self._dense_named)
        self._broadcast_state()

    # ------------------------------------------------------------------ construction
    def _build(self, options: DDPOptions) -> None:
        """Everything but the collectives: options, buckets, hooks and step state (also after a
        copy: `__setstate__`)."""
        self._options = options
        self.axis = options.axis
        self.group = self.mesh.group(self.axis)
        self.world = self.mesh.size(self.axis)
        self.src = self.mesh.group_ranks(self.axis)[0]
        self.find_unused_parameters = options.find_unused_parameters
        self.static_graph = options.static_graph
        self.broadcast_buffers = options.broadcast_buffers
        self.wire_dtype = wire_dtype(self.module, options.gradient_compression)
        leaves = ((n, plain_leaf(p)) for n, p in self.module.named_parameters() if n not in options.ignored)
        everything = list({id(t): (n, t) for n, t in leaves}.values())
        check_experts_placed(self.module, everything)
        # Expert parameters (plait.expert_parallel) differ across ep ranks: reduced on their own.
        self._dense_named = [(n, p) for n, p in everything if expert_of(p) is None]
        self._experts = [(n, p) for n, p in everything if expert_of(p) is not None and p.requires_grad]
        self._setup_experts()
        sparse = sparse_params(self.module)
        trainable = [(n, p) for n, p in everything
                     if p.requires_grad and (expert_of(p) is None or id(p) in self._expert_index)]
        self._sparse = [(n, p) for n, p in trainable if id(p) in sparse]
        self._buckets = self._make_buckets([(n, p) for n, p in trainable if id(p) not in sparse],
                                           int(options.bucket_cap_mb * 2**20))
        self._where: dict[int, tuple[Bucket, int]] = {
            id(p): (b, i) for b in self._buckets for i, p in enumerate(b.params)}
        # Each reduced parameter's flag index: bucket order, then the sparse ones.
        self._flagged = [(n, p) for b in self._buckets for n, p in zip(b.names, b.params)] + self._sparse
        self._flag_of = {id(p): k for k, (_, p) in enumerate(self._flagged)}
        self._register_hooks(trainable)
        # Where each synced buffer lives (owner module, attribute), found once: a forward reads the
        # buffers there (so one replaced by .to() or an assignment is the one sent) without walking
        # the module tree, as torch's DDP keeps its list of buffers from construction.
        self._buffer_slots = _buffer_slots(self.module, options.ignored)
        self._buffer_broadcast = BufferBroadcast()
        self._in_backward = self._bucket_optimizers(options)
        self._comm_hook: tuple[Any, CommHook] | None = None
        self._reset_step_state()

    def _bucket_optimizers(self, options: DDPOptions) -> BucketOptimizers | None:
        """``optimizer_in_backward``'s optimizers, or those torch's ``_apply_optimizer_in_backward``
        attached to the parameters (its hooks removed: they would step with the local gradient)."""
        if options.in_backward is not None:
            return BucketOptimizers.from_spec(options.in_backward, self._buckets)
        marks = {id(plain_leaf(p)): opts for n, p in self.module.named_parameters()
                 if n not in options.ignored and (opts := in_backward_optimizers(p))}
        if not marks:
            return None
        for p in self.module.parameters():
            if id(plain_leaf(p)) in marks:
                take_in_backward_hooks(p)
        return BucketOptimizers.from_torch(self._buckets, marks)

    def _setup_experts(self) -> None:
        # Where every expert is held by exactly this DDP's ranks (ep=1 along its axis), its gradient
        # is summed over the same ranks as a dense one: it rides in the buckets, overlapped with
        # backward, instead of one blocking all-reduce after it. A rank that routed no token to an
        # expert contributes zeros, and a flag per expert keeps one process's "no gradient".
        self._bucketed_experts = self._experts if self._experts_share_buckets() else []
        self._expert_index = {id(p): i for i, (_, p) in enumerate(self._bucketed_experts)}
        if self._bucketed_experts:  # from here on, _experts are those summed after backward
            self._experts = []
        self._expert_flags = torch.zeros(len(self._bucketed_experts), device=comm.device_of(self.group))

    def _register_hooks(self, trainable: list[tuple[str, nn.Parameter]]) -> None:
        # Through a weak reference: a hook holding the wrapper would tie it to its parameters in a
        # cycle through the tensors' C++ hooks that the collector cannot break, so a deleted DDP
        # (and its buckets) would never be freed.
        ready = weakref.WeakMethod(self._on_grad_ready)
        for _, p in trainable:  # bucketed experts and sparse parameters included
            p.register_post_accumulate_grad_hook(lambda q, ready=ready: _call_alive(ready, q))
        expert_ready = weakref.WeakMethod(self._on_expert_grad)
        for _, p in self._experts:
            p.register_post_accumulate_grad_hook(lambda q, ready=expert_ready: _call_alive(ready, q))

    def _reset_step_state(self) -> None:
        self._no_sync = False
        self._sync_this_backward = False
        self._callback_queued = False
        self._hooks_seen = False
        self._divisor = float(self.world)
        self._join_by_world = True
        self._buffers_due = True  # torch's require_forward_param_sync
        n = len(self._flag_of)
        # Parameters that got a gradient since the last reduction, no_sync backwards included
        # (torch's local_used_map); all-reduced at the end of a reducing backward.
        self._local_used = torch.zeros(n, device="cpu")  # written by hooks: host memory, sent once
        self._unused: list[int] = []  # flag indices this step treats as unused from its first hook
        self._unused_marked = True
        self._static_used: torch.Tensor | None = None  # static_graph: global usage of its first step
        self._static_hooks = [0] * n  # static_graph: hooks per parameter in its first step
        self._static_left: list[int] = []
        self._sparse_ready: set[int] = set()
        self._spent_grads: list[torch.Tensor] = []

    def _experts_share_buckets(self) -> bool:
        """Whether every expert's gradient is summed over exactly this DDP's ranks (not with
        ``find_unused_parameters``, whose flags already stand for the parameters a rank skipped)."""
        if not self._experts or self.find_unused_parameters:
            return False
        ours = sorted(self.mesh.group_ranks(self.axis))
        placements = [expert_of(p) for _, p in self._experts]
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
        broadcast_coalesced([p for _, p in self._dense_named] + self._synced_buffers(), self.src, self.group)
        if self._experts:  # each expert from the first of the ranks holding it
            where = expert_of(self._experts[0][1])
            assert where is not None
            broadcast_coalesced([p for _, p in self._experts], where.edp_ranks[0], where.edp)

    def _synced_params(self) -> list[torch.Tensor]:
        """The parameters every replica holds alike (not ignored, not experts split over ep)."""
        return [p for _, p in [*self._dense_named, *self._bucketed_experts]]

    def _synced_buffers(self) -> list[torch.Tensor]:
        found = [m._buffers[name] for m, name in self._buffer_slots]
        return list({id(b): b for b in found if b is not None}.values())

    def _make_buckets(self, trainable: list[tuple[str, nn.Parameter]], cap: int) -> list[Bucket]:
        # Launch order is reverse registration order (roughly the order backward finishes
        # gradients); parameters of different dtypes or devices never share a bucket.
        by_kind: dict[tuple[torch.dtype, torch.device], list[tuple[str, nn.Parameter]]] = {}
        for name, p in reversed(trainable):
            by_kind.setdefault((p.dtype, p.device), []).append((name, p))
        buckets: list[Bucket] = []
        first = 0
        for members in by_kind.values():
            sizes = [p.numel() * p.element_size() for _, p in members]
            for idx in plan_buckets(sizes, cap):
                buckets.append(Bucket.make(len(buckets), first, [members[i] for i in idx]))
                first += len(idx)
        return buckets

    # ------------------------------------------------------------------ copies
    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy``, ``torch.save``) keeps the module and the options; buckets and
        hooks are rebuilt by `__setstate__`, and the mesh is found again by its shape."""
        from plait.ddp.state import mesh_key

        keep = {*nn.Module().__dict__, "_options"}  # the module's own attributes; the rest is rebuilt
        state = {k: v for k, v in self.__dict__.items() if k in keep}
        state["_mesh_key"] = mesh_key(self.mesh)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        from plait.ddp.state import mesh_for

        options, key = state.pop("_options"), state.pop("_mesh_key")
        nn.Module.__setstate__(self, state)
        Joinable.__init__(self)
        self.mesh = mesh_for(key)
        self._build(options)

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
        """Join notice, buffer broadcast, sync count (torch's order); whether this forward's
        backward reduces."""
        # The gradients autograd made in the last reducing backward, whose values live in the
        # buckets since: freed now, when this forward's activations can take their memory, as
        # torch's zero_grad frees its gradients. Freed at the end of backward, with the activations,
        # they left the top of the heap free for the allocator to give back to the system, and
        # every backward faulted its gradients in again: 18,500 page faults, 20 ms of the 25M GPT's
        # step at world 2.
        self._spent_grads = []
        sync = torch.is_grad_enabled() and not self._no_sync
        Join.notify_join_context(self)  # only inside an enabled join: counts, may throw
        self._sync_buffers()
        if self._join_config.enable:
            training, _ = step_counts(self, True, sync)
            self._divisor = float(self.world) if self._join_by_world else training
        return sync

    @torch.no_grad()
    def _sync_buffers(self, training: bool = True) -> None:
        """Broadcast the buffers before a forward that follows a reducing one (torch's rule); in
        a join, from the highest rank still training (a joined rank's are stale)."""
        if not (self._buffers_due and self.broadcast_buffers and self.world > 1):
            return
        buffers = self._synced_buffers()
        if not buffers:
            return
        src = common_rank(self, training) if self._join_config.enable else self.src
        with comm.operation("DDP buffer broadcast"):
            self._buffer_broadcast(buffers, src, self.group, self.mesh.global_rank)

    @eager
    def _after_forward(self, out: Any, sync: bool) -> None:
        self._buffers_due = sync
        self._sync_this_backward = sync
        if sync:
            self._start_step()
            self._watch_outputs(out)
            if self.find_unused_parameters and not self.static_graph:
                reached = params_reached_by(out)
                self._unused = [k for p_id, k in self._flag_of.items() if p_id not in reached]
            self._unused_marked = not self._unused

    def _watch_outputs(self, out: Any) -> None:
        """Queue the end of the step from the backward's own graph task, when a gradient first reaches
        an output: a parameter's hook may fire inside a nested backward (reentrant activation
        checkpointing), whose end is not the step's."""
        start = weakref.WeakMethod(self._on_output_grad)
        for t in output_tensors(out):
            if t.grad_fn is not None:  # not a leaf: a hook on a parameter returned as is would stay
                t.register_hook(lambda g, start=start: _call_alive(start, g))

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if self._sync_this_backward:
            self._queue_finish()

    # ------------------------------------------------------------------ user API
    @property
    def in_backward_optimizers(self) -> list[torch.optim.Optimizer]:
        """With ``optimizer_in_backward``: the optimizer of each bucket, in bucket order (each over
        its bucket's parameters): their state dicts, param groups and learning-rate schedulers.
        With torch's ``_apply_optimizer_in_backward``: the parameters' own, in the order stepped."""
        if self._in_backward is None:
            raise RuntimeError("DistributedDataParallel.in_backward_optimizers: this DDP was built "
                                 "without optimizer_in_backward")
        return self._in_backward.optimizers

    def grad_norm_parts(self) -> GradParts:
        """After the all-reduce every replica holds the same gradients: the wrapped module's parts,
        never summed over dp (`plait.state.clip`)."""
        if self._in_backward is not None:
            raise ValueError("DistributedDataParallel(optimizer_in_backward=...): gradients are stepped "
                             "and dropped bucket by bucket during backward, before the norm of all of them "
                             "exists, so they cannot be clipped by it; use an optimizer after backward to "
                             "clip")
        from plait.state.clip import grad_norm_parts

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
        self._start_step()
        self._unused_marked = not self._unused
        self._sync_this_backward = True

    def regroup(self, group: Any, size: int, divisor: float | None = None) -> None:
        """Average gradients over ``group`` (of ``size`` ranks) from the next backward on, instead of
        the mesh's axis: `plait.runtime.heal` rebuilds the group of live replicas after a failure, without
        a new DDP. ``divisor`` is what this rank's gradient is divided by before the sum (default
        ``size``, the mean of equal shares); a rank holding k of a global batch of B samples passes
        B / k, so the sum is the mean over the samples actually used. Call it between steps (or after
        a backward whose collectives failed: what it left in flight is dropped). Buffers are not
        broadcast over such a group (its ranks have no global rank to name the source)."""
        if not size >= 1 or (divisor is not None and not divisor > 0):
            raise ValueError(f"DistributedDataParallel.regroup: size {size} and divisor {divisor} must be "
                             "positive")
        self.group, self.world = group, size
        self.broadcast_buffers = False
        self._divisor = float(size if divisor is None else divisor)
        for b in self._buckets:  # a backward that failed on the old group leaves nothing in flight
            b.start()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) for forwards run inside."""
        old, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = old

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` instead of the built-in all-reduce
        (torch's contract: ``bucket`` is a `GradBucket` of undivided gradients, and the hook returns
        a ``torch.futures.Future`` of the reduced bucket). torch's hooks in
        ``torch.distributed.algorithms.ddp_comm_hooks`` run unchanged. Once, before training."""
        if self._comm_hook is not None:
            raise RuntimeError("DistributedDataParallel: register_comm_hook or register_builtin_comm_hook "
                               "can only be called once.")
        validate_hook(hook)
        if self.wire_dtype is not None:
            raise ValueError("DistributedDataParallel.register_comm_hook: this DDP already compresses its "
                             f"buckets to {self.wire_dtype} (gradient_compression or the mixed-precision "
                             "reduce dtype); use torch's fp16/bf16 compress hook instead of that option, "
                             "not both")
        self._comm_hook = (state, hook)

    # torch's Join protocol (torch.distributed.algorithms.Join): DDP is a Joinable.
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Let ranks with fewer batches finish early without hanging the others (torch's ``join``).

        A rank that leaves the block keeps answering the others' collectives with zeros until
        every rank has left; then every rank takes the parameters and buffers of the last rank
        to leave. Gradients are divided by the initial world size (a finished rank contributes
        zero), or by the number of ranks still training with
        ``divide_by_initial_world_size=False``. With ``throw_on_early_termination=True`` every
        rank raises as soon as one runs out of inputs. ``Join([ddp, other_joinables])`` works too.
        """
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> DDPJoinHook:
        return DDPJoinHook(self, bool(kwargs.get("divide_by_initial_world_size", True)))

    @property
    def join_device(self) -> torch.device:
        return comm.device_of(self.group)

    @property
    def join_process_group(self) -> Any:
        return self.group

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, names: Iterable[str]) -> None:
        """torch's way to name parameters and buffers DDP leaves alone, set on the module before
        wrapping it (plait also takes them as ``params_and_buffers_to_ignore=``)."""
        setattr(module, "_ddp_params_and_buffers_to_ignore", list(names))  # noqa: B010 (torch's name)


DDP = DistributedDataParallel


def _check_module(module: nn.Module, mesh: Mesh | None, ignored: frozenset[str]) -> None:
    """Refusals before any collective (making the default mesh is one)."""
    if not any(p.requires_grad for n, p in module.named_parameters() if n not in ignored):
        raise RuntimeError("DistributedDataParallel: the module has no parameter that requires a gradient "
                           "(outside params_and_buffers_to_ignore), so there is nothing to average; use "
                           "the module without DDP (torch refuses the same)")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"DistributedDataParallel(mesh=...) expects a plait.Mesh or None, got {type(mesh)}")
    if is_meta(module):
        raise ValueError("DistributedDataParallel needs a materialized module; this one has meta "
                         "parameters (use FullyShardedDataParallel for meta-device init)")




def _buffer_slots(module: nn.Module, ignored: frozenset[str]) -> list[tuple[nn.Module, str]]:
    """(owner, attribute) of each buffer ``module.named_buffers()`` gives, but the ignored ones."""
    owners = dict(module.named_modules(remove_duplicate=False))
    slots = []
    for name, _ in module.named_buffers():
        if name in ignored:
            continue
        owner, _, attr = name.rpartition(".")
        slots.append((owners[owner], attr))
    return slots


def _call_alive(method: weakref.WeakMethod, t: torch.Tensor) -> None:
    """Call a weakly held gradient hook if its wrapper still exists."""
    fn = method()
    if fn is not None:
        fn(t)
