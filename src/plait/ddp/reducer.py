"""The backward half of `DistributedDataParallel`: what each gradient hook does, when buckets
launch, and the end-of-backward step (torch's reducer: usage flags, unused parameters, sparse
gradients, communication hooks, and a joined rank's mirror of it all).

`Reducer` is a mixin: `DistributedDataParallel` builds the buckets and the state it reads
(`DistributedDataParallel._build`); the attributes below are that state.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from plait._torch_compat import queue_end_of_backward
from plait.ddp.buckets import Bucket
from plait.ddp.hooks import CommHook, GradBucket, hook_result
from plait.ddp.in_backward import BucketOptimizers
from plait.runtime import comm, faults
from plait.state.placement.grads import reduce_expert_grads
from plait.state.placement.tp_params import gradient_assigned


class Reducer:
    """Gradient hooks and the end of a reducing backward, over the buckets of a DDP."""

    group: Any
    world: int
    wire_dtype: torch.dtype | None
    find_unused_parameters: bool
    static_graph: bool
    _buckets: list[Bucket]
    _where: dict[int, tuple[Bucket, int]]
    _flag_of: dict[int, int]
    _flagged: list[tuple[str, nn.Parameter]]
    _sparse: list[tuple[str, nn.Parameter]]
    _experts: list[tuple[str, nn.Parameter]]
    _bucketed_experts: list[tuple[str, nn.Parameter]]
    _expert_index: dict[int, int]
    _expert_flags: torch.Tensor
    _comm_hook: tuple[Any, CommHook] | None
    _divisor: float
    _sync_this_backward: bool
    _callback_queued: bool
    _hooks_seen: bool
    _next_launch: int
    _local_used: torch.Tensor
    _unused: list[int]
    _unused_marked: bool
    _static_used: torch.Tensor | None
    _static_hooks: list[int]
    _static_left: list[int]
    _sparse_ready: set[int]
    _spent_grads: list[torch.Tensor]
    _in_backward: BucketOptimizers | None

    def _start_step(self) -> None:
        for b in self._buckets:
            b.start()
        self._expert_flags.zero_()
        self._callback_queued = False
        self._hooks_seen = False
        self._next_launch = 0
        self._sparse_ready = set()
        self._unused = list(self._static_unused()) if self._static_done() else []
        self._static_left = list(self._static_hooks) if self._static_done() else []

    # ------------------------------------------------------------------ backward
    def _static_done(self) -> bool:
        return self._static_used is not None

    def _static_unused(self) -> list[int]:
        return [k for k, n in enumerate(self._static_hooks) if n == 0]

    def _tracks_usage(self) -> bool:
        """Whether gradients arriving now count as use (torch: find_unused_parameters without a
        static graph, or a static graph's first step)."""
        return (self.find_unused_parameters and not self.static_graph) or (
            self.static_graph and not self._static_done())

    def _queue_finish(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            queue_end_of_backward(self._finish_backward)

    def _on_expert_grad(self, p: nn.Parameter) -> None:
        if self._sync_this_backward:
            self._hooks_seen = True
            self._queue_finish()

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        k = self._flag_of[id(p)]
        # An undefined gradient (torch's UndefinedGrad, an unused output of a custom Function) fires
        # the hook with .grad None: not a use, and the gradient held (none) is what it contributes.
        if self._tracks_usage() and p.grad is not None:  # no_sync backwards count too (torch)
            self._local_used[k] = 1.0
        if not self._sync_this_backward:
            return
        self._hooks_seen = True
        self._queue_finish()
        if self.static_graph and not self._static_done():
            self._static_hooks[k] += 1  # the first step reduces everything at its end (as torch's)
            return
        self._mark_unused_once()
        if self._static_left:  # reentrant checkpointing: ready at the last of its known hooks
            self._static_left[k] -= 1
            if self._static_left[k] > 0:
                return
        if id(p) not in self._where:  # a sparse gradient, reduced on its own after backward
            if k in self._sparse_ready:
                raise self._ready_twice(self._name_of(k))
            self._sparse_ready.add(k)
            return
        b, i = self._where[id(p)]
        if i in b.ready:
            raise self._ready_twice(b.names[i])
        if p.grad is None:
            self._contribute_held(k)
            return
        self._fill(b, i, p.grad)
        if self._in_backward is not None:  # .grad is None after its step; autograd's copy is freed
            self._spent_grads.append(p.grad)  # before the next forward, as without (no page faults)
            p.grad = None
        self._mark_ready(b, i)

    def _name_of(self, k: int) -> str:
        return self._flagged[k][0]

    def _ready_twice(self, name: str) -> RuntimeError:
        if self.static_graph:
            return self._graph_changed([name], "got a gradient it did not get in the first step")
        return RuntimeError(
            f"DistributedDataParallel: parameter {name} got its gradient after DDP had counted it as "
            "unused or already reduced in this backward. Either it is used outside the wrapped module's "
            "forward (e.g. a temperature used only in the loss: find_unused_parameters walks the forward's "
            "outputs and cannot see it; use it inside forward, or drop find_unused_parameters if every "
            "parameter gets a gradient), or its gradient arrives twice (reentrant activation "
            "checkpointing: pass static_graph=True, or use_reentrant=False). torch's DDP refuses both.")

    def _mark_unused_once(self) -> None:
        """At a reducing backward's first hook (torch's moment): what the parameters its forward did
        not reach contribute, the gradient they hold (or zeros), without counting as use."""
        if self._unused_marked:
            return
        self._unused_marked = True
        for k in self._unused:
            self._contribute_held(k)

    def _contribute_held(self, k: int) -> None:
        p = self._param_at(k)
        if id(p) not in self._where:
            self._sparse_ready.add(k)
            return
        b, i = self._where[id(p)]
        grad = p.grad
        if grad is not None and grad.data_ptr() == b.slots[i].data_ptr():
            # Last step's reduced gradient lives in the bucket: keep it apart, so a parameter no
            # rank used keeps it untouched (torch's default copies gradients out of its buckets).
            p.grad = grad = grad.clone()
            gradient_assigned(p)
        if grad is None:
            b.slots[i].zero_()
        else:
            self._fill(b, i, grad)
        self._mark_ready(b, i)

    def _param_at(self, k: int) -> nn.Parameter:
        return self._flagged[k][1]

    def _fill(self, b: Bucket, i: int, grad: torch.Tensor) -> None:
        """Copy a gradient into its bucket slot, pre-divided (one pass over memory): the
        all-reduced sum is then the mean, and a half-precision wire format cannot overflow. With a
        communication hook, undivided: the hook divides (torch's contract)."""
        slot = b.slots[i]
        expert = self._expert_index.get(id(b.params[i]))
        if expert is not None:
            self._expert_flags[expert] = 1.0
        divisor = 1.0 if self._comm_hook is not None else self._divisor + faults.active("ddp-divisor")
        if grad.data_ptr() == slot.data_ptr():  # the grad already lives in the bucket
            if divisor != 1.0:
                slot.div_(divisor)
        elif grad.requires_grad:  # backward(create_graph=True): the reduced gradient carries no graph
            _warn_create_graph()
            with torch.no_grad():
                torch.div(grad.detach().reshape(-1), divisor, out=slot)
        else:
            torch.div(grad.reshape(-1), divisor, out=slot)

    def _mark_ready(self, b: Bucket, i: int) -> None:
        b.ready.add(i)
        b.pending -= 1
        # Launch in index order only: every rank must issue the same collectives in the same order.
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            self._launch(self._next_launch)
            self._next_launch += 1

    def _launch(self, index: int) -> None:
        b = self._buckets[index]
        if self._comm_hook is not None:
            state, hook = self._comm_hook
            count = len(self._buckets) + len(self._sparse)
            b.future = hook(state, GradBucket(index, count, b.buffer, b.params, b.offsets))
            return
        b.wire = b.buffer if self.wire_dtype is None else b.buffer.to(self.wire_dtype)
        with comm.operation(self._bucket_name(index)):
            b.handle = comm.all_reduce(b.wire, self.group, async_op=True, checked=self._checks_desync(index))

    def _checks_desync(self, index: int) -> bool:
        """Whether bucket ``index`` carries the backward's desync check. Only the last one does: its
        fingerprint covers every bucket before it, and `_finish_backward` reads its verdict before
        any bucket's result. A check per bucket cost about 4% of a step on 2 CPU ranks. With
        optimizer_in_backward every bucket does: each steps on its own result before the last lands."""
        return self._in_backward is not None or index == len(self._buckets) - 1

    def _bucket_name(self, index: int) -> str:
        """What desync reports call the bucket (a joined rank mirrors it from another line)."""
        return f"DDP bucket {index + 1} of {len(self._buckets)}"

    def _finish_backward(self) -> None:
        if not self._hooks_seen:  # a backward that reached no parameter (torch.autograd.grad of a
            self._callback_queued = False  # gradient penalty): the step's own backward is still to come
            return
        self._sync_this_backward = False
        self._mark_unused_once()
        static_first = self.static_graph and not self._static_done()
        missing = [(b, i) for b in self._buckets for i in range(len(b.params)) if i not in b.ready]
        missing_sparse = [k for _, p in self._sparse if (k := self._flag_of[id(p)]) not in self._sparse_ready]
        missing = self._fill_missing_experts(missing)
        if (missing or missing_sparse) and (self.find_unused_parameters or static_first):
            for b, i in missing:
                self._settle_missing(b.first + i, static_first)
            for k in missing_sparse:
                self._settle_missing(k, static_first)
            missing, missing_sparse = [], []
        if missing or missing_sparse:
            self._refuse_missing([b.names[i] for b, i in missing]
                                 + [self._name_of(k) for k in missing_sparse])
        if self._experts:  # summed over the ranks holding the same experts, divided as the rest
            reduce_expert_grads([p for _, p in self._experts], self._divisor)
        reduced = self._reduce_usage()
        used = None if reduced is None else reduced.tolist()  # one read, not one per parameter (NCCL)
        self._reduce_sparse(used)
        flags = self._expert_flags.tolist() if self._bucketed_experts else []
        no_gradient = {id(p) for (_, p), f in zip(self._bucketed_experts, flags) if f == 0}
        # The last bucket first: its desync verdict covers them all (`_checks_desync`). Stepping in
        # backward, in launch order: each bucket steps as soon as it lands, the later ones in flight.
        order = self._buckets if self._in_backward is not None else self._buckets[-1:] + self._buckets[:-1]
        for b in order:
            self._await(b)
            for i, p in enumerate(b.params):
                if used is not None and used[b.first + i] == 0:
                    continue  # no rank used it since the last reduction: .grad untouched (torch)
                if id(p) in no_gradient:  # an expert no rank routed a token to: none, as in one process
                    p.grad = None
                    continue
                # The gradient becomes a view of its bucket: no copy back now, and if the user keeps
                # it (zero_grad(set_to_none=False), no_sync), the next backward accumulates in place.
                if p.grad is not None and p.grad is not b.grads[i]:
                    self._spent_grads.append(p.grad)
                p.grad = b.grads[i]
                # a tp DTensor's gradient, or a piece's mark (`plait.state.placement.pieces`)
                gradient_assigned(p)
            if self._in_backward is not None:
                self._in_backward.step(b)

    def _fill_missing_experts(self, missing: list[tuple[Bucket, int]]) -> list[tuple[Bucket, int]]:
        if not self._bucketed_experts:
            return missing
        # An expert this backward routed no token to on this rank: what earlier microbatches
        # accumulated (no_sync), or zeros flagged as no gradient.
        for b, i in [(b, i) for b, i in missing if id(b.params[i]) in self._expert_index]:
            grad = b.params[i].grad
            if grad is not None:
                self._fill(b, i, grad)
            else:
                b.slots[i].zero_()
            self._mark_ready(b, i)
        with comm.operation("DDP expert gradient flags"):
            comm.all_reduce(self._expert_flags, self.group)
        return [(b, i) for b, i in missing if i not in b.ready]

    def _settle_missing(self, k: int, static_first: bool) -> None:
        """A parameter the forward reached that got no gradient (an output left out of the loss):
        torch's hook fires for it with the gradient it holds, which counts as use if defined. In a
        static graph's first step, what every parameter holds is reduced at the end."""
        p = self._param_at(k)
        if static_first and self._static_hooks[k] > 0 and p.grad is not None:
            if id(p) in self._where:
                b, i = self._where[id(p)]
                self._fill(b, i, p.grad)
                self._mark_ready(b, i)
            else:
                self._sparse_ready.add(k)
            return
        if not static_first and p.grad is not None:
            self._local_used[k] = 1.0
        self._contribute_held(k)

    def _graph_changed(self, names: list[str], what: str) -> RuntimeError:
        return RuntimeError(
            "DistributedDataParallel(static_graph=True): your training graph has changed in this "
            f"iteration: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''} {what} (or got it a "
            "different number of times). static_graph trusts the first reducing backward's graph; use "
            "find_unused_parameters=True for a graph that changes")

    def _refuse_missing(self, names: list[str]) -> None:
        if self.static_graph:
            raise self._graph_changed(names, "got no gradient, though it did in the first step")
        raise RuntimeError(
            f"DistributedDataParallel: {len(names)} parameter(s) received no gradient in this "
            f"backward, so their buckets cannot be all-reduced: {', '.join(names[:8])}"
            f"{' ...' if len(names) > 8 else ''}. If they are legitimately unused, pass "
            "find_unused_parameters=True; if they should not train, set requires_grad=False."
        )

    def _reduce_usage(self) -> torch.Tensor | None:
        """Which parameters some rank used since the last reduction (None: all of them)."""
        if not self._tracks_usage():
            return self._static_used
        used = self._local_used.to(comm.device_of(self.group), copy=True)
        with comm.operation("DDP unused-parameter flags"):
            comm.all_reduce(used, self.group)
        self._local_used.zero_()
        if self.static_graph:  # what the first step found stands for every later one
            self._static_used = used
        return used

    @torch.no_grad()
    def _reduce_sparse(self, used: list[float] | None) -> None:
        """Sparse gradients (nn.Embedding(sparse=True)) are all-reduced on their own, as sparse
        tensors, after the buckets (torch gives each its own bucket; a comm hook gets each as one
        bucket, numbered after the dense ones)."""
        for j, (name, p) in enumerate(self._sparse):
            if used is not None and used[self._flag_of[id(p)]] == 0:
                continue
            grad = p.grad
            if grad is None or not grad.is_sparse:
                grad = _empty_sparse(p) if grad is None else grad.to_sparse(1)
            p.grad = self._reduce_one_sparse(name, p, j, grad.coalesce())

    def _reduce_one_sparse(self, name: str, p: nn.Parameter, j: int, grad: torch.Tensor) -> torch.Tensor:
        """The averaged sparse gradient: the comm hook's result (undivided in, as torch's), or an
        all-reduce of the gradient divided by the divisor."""
        if self._comm_hook is not None:
            state, hook = self._comm_hook
            index = len(self._buckets) + j
            bucket = GradBucket(index, len(self._buckets) + len(self._sparse), grad, [p], [0])
            return hook_result(hook(state, bucket), grad, index)
        grad = grad / self._divisor
        with comm.operation(f"DDP sparse gradient {name}"):
            comm.all_reduce(grad, self.group)
        return grad

    def _await(self, b: Bucket) -> None:
        if b.future is not None:
            value = hook_result(b.future, b.buffer, b.index)
            b.future = None
            if value.data_ptr() != b.buffer.data_ptr() or value.dtype != b.buffer.dtype:
                b.buffer.copy_(value.reshape(-1))
            return
        assert b.handle is not None and b.wire is not None
        b.handle.wait()
        if b.wire is not b.buffer:
            b.buffer.copy_(b.wire)

    @torch.no_grad()
    def _shadow_backward(self) -> None:
        """A joined rank's side of one reducing backward of the others (torch's
        ``_match_all_reduce_for_bwd_pass``): zeros for every bucket, then the same flags."""
        for index, b in enumerate(self._buckets):
            zeros = torch.zeros_like(b.buffer)  # not the buffer: this rank's gradients view it
            if self._comm_hook is not None:
                state, hook = self._comm_hook
                count = len(self._buckets) + len(self._sparse)
                hook_result(hook(state, GradBucket(index, count, zeros, b.params, b.offsets)), zeros, index)
                continue
            wire = zeros if self.wire_dtype is None else zeros.to(self.wire_dtype)
            with comm.operation(self._bucket_name(index)):
                comm.all_reduce(wire, self.group, checked=self._checks_desync(index))
        if self._bucketed_experts:
            with comm.operation("DDP expert gradient flags"):
                comm.all_reduce(torch.zeros_like(self._expert_flags), self.group)
        reduced = self._static_used
        if self._tracks_usage():
            reduced = torch.zeros(len(self._flag_of), device=comm.device_of(self.group))
            with comm.operation("DDP unused-parameter flags"):
                comm.all_reduce(reduced, self.group)
        used = None if reduced is None else reduced.tolist()
        for j, (name, p) in enumerate(self._sparse):
            if used is None or used[self._flag_of[id(p)]] > 0:
                self._reduce_one_sparse(name, p, j, _empty_sparse(p))


def _empty_sparse(p: torch.Tensor) -> torch.Tensor:
    """A sparse zero gradient of ``p``'s shape (what a rank without one contributes), laid out as an
    embedding's: rows sparse, each row dense (Gloo fails on ranks that disagree on the layout)."""
    return torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long, device=p.device),
                                   torch.zeros(0, *p.shape[1:], dtype=p.dtype, device=p.device), p.shape)

def _warn_create_graph() -> None:
    warnings.warn("DistributedDataParallel: backward(create_graph=True): the averaged gradients carry no "
                  "autograd graph (higher-order terms are neither kept nor synchronized, as with torch's "
                  "DDP); "
                  "compute gradient penalties with torch.autograd.grad(..., create_graph=True) in the loss",
                  stacklevel=3)
