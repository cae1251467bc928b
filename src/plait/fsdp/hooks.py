"""The hooks of plait's FSDP: gather before each unit runs, free after, reduce gradients as they arrive.

Forward: the wrapper's ``forward`` gathers the root unit (ZeRO-1/2: issues every unit's gather of
the shards the optimizer changed), and each other unit's forward pre-hook gathers that unit and
issues the next one's all-gather, in the order the previous step ran them; its forward hook frees
it again (ZeRO-3 with ``reshard_after_forward``) and hooks its outputs' gradients. Backward: the
first of those gradients to arrive gathers the unit again (and prefetches the unit backward reaches
next); each leaf's post-accumulate-grad hook reports to its flat group, whose reduction starts once
every leaf has reported; the end of backward awaits the reductions and reduces whatever some ranks
left without a gradient. A unit compiled in place (``block.compile()``) is gathered and freed
around its compiled call instead, and ``no_sync`` switches the reductions off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from plait._torch_compat import (
    compiled_call,
    eager,
    queue_end_of_backward,
    set_compiled_call,
    tree_flatten,
    tree_unflatten,
)
from plait.fsdp.flat import FlatParam
from plait.fsdp.layout import ShardCfg
from plait.fsdp.units import Unit
from plait.runtime import comm
from plait.state.placement.grads import reduce_expert_grads
from plait.state.precision import MixedPrecision

# What torch says when an op reads a tensor whose storage FSDP freed (resized to zero bytes).
_FREED_READ = ("storage of size 0", "data is not allocated yet")


class UnitHooks:
    """The forward and backward machinery of `plait.FullyShardedDataParallel` (its base)."""

    # What the wrapper sets before `_hook_units`.
    module: nn.Module
    units: list[Unit]
    cfg: ShardCfg
    zero_stage: int
    reshard_after_forward: bool
    backward_prefetch: bool
    _experts: list[nn.Parameter]
    _write_back: Callable[[], None]  # `plait.fsdp.model_state.ModelState`'s

    def _hook_units(self) -> None:
        """Hook every unit's forward (or wrap its compiled call) and every flat group's leaves, and
        start with no step in progress."""
        for unit in self.units[1:]:
            if compiled_call(unit.module) is not None:
                self._around_compiled_call(unit)
            else:
                unit.module.register_forward_pre_hook(self._make_pre_forward(unit), with_kwargs=True)
                unit.module.register_forward_hook(self._make_post_forward(unit))
        self._unit_of: dict[int, Unit] = {id(f): u for u in self.units for f in u.flats}
        for unit in self.units:
            for flat in unit.flats:
                flat.set_grad_hook(functools.partial(self._make_post_backward, flat))
        self._order: list[Unit] = []  # units in this forward's execution order
        # The last forward's order: what to prefetch. Nothing before the first forward: a prefetch
        # lands in the unit's buffer while in flight (`FlatParam.start_gather`), so a unit that
        # forward never enters (its module's method called by another unit) would be readable
        # there, where the refusal of a read outside a unit's own forward needs it freed.
        self._prev_order: list[Unit] = []
        self._sync = True  # False inside no_sync(); each unit has its own flag too (`Unit.sync`)
        self._backward_queued = False
        self._inflight: list[FlatParam] = []  # reductions issued and not yet awaited
        self._reduced: set[int] = set()  # ids of flats whose reduction this backward has issued

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (unsharded, no communication) for the enclosed backwards.

        The first backward after the block reduces everything accumulated, so ``k`` micro-steps
        cost one reduction. Stage 3 keeps a full-size gradient per unit meanwhile.
        """
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    # ------------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        args, kwargs = self._begin_forward(args, kwargs)
        try:
            out = self.module(*args, **kwargs)
        except RuntimeError as e:
            if not any(m in str(e) for m in _FREED_READ):
                raise
            raise RuntimeError(self._freed_read(), *e.args[1:]) from e
        return self._end_forward(out)

    def _freed_read(self) -> str:
        """Why a forward read a freed parameter, and what to do instead."""
        freed = [u.name or "(root)" for u in self.units if any(not f.gathered for f in u.flats)]
        return (f"FullyShardedDataParallel: the forward read a parameter of a sharding unit outside that "
                f"unit's own forward, after FSDP had freed it (units freed then: {freed}). A module that "
                "uses another's weight (a decoder reading encoder.embed.weight) must share the nn.Parameter "
                "itself (decoder.weight = encoder.embed.weight: FSDP keeps a tied parameter in the units' "
                "common ancestor, gathered for both), or sit in the same unit (units=[...])")

    # Under torch.compile the wrapper's own work runs eagerly between graphs, as torch's DDP runs
    # its reducer: gathers, reshards and the hooks that queue reductions are Python bookkeeping
    # around collectives, which Dynamo would otherwise try (and fail) to trace.
    @eager
    def _begin_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        root = self.units[0]
        self._order = []
        self._write_back()
        if self._backward_queued:  # the previous backward raised before its end callback
            for unit in self.units:
                for flat in unit.flats:
                    flat.abandon_backward()
        self._backward_queued = False
        if self.zero_stage < 3:
            # Shards changed by the optimizer are gathered again; all issued now, each unit
            # waits for its own in its pre-forward.
            for unit in self._prev_order:
                for flat in unit.flats:
                    flat.start_gather()
        self._pre_forward(root)
        return _cast_inputs(root.mp, (args, kwargs))

    @eager
    def _end_forward(self, out: Any) -> Any:
        out = self._post_forward(self.units[0], out)
        self._prev_order = list(self._order)
        return out

    @eager
    def _pre_forward(self, unit: Unit) -> None:
        unit.position = len(self._order)
        self._order.append(unit)
        for flat in unit.flats:  # requires_grad_ set after wrapping, on a parameter or its module
            flat.sync_requires_grad()
        unit.gather()
        if self.zero_stage < 3:
            return
        if unit.forward_prefetch is not None:  # set_modules_to_forward_prefetch
            for other in unit.forward_prefetch:
                other.prefetch()
            return
        nxt = unit.position + 1
        if nxt < len(self._prev_order):
            self._prev_order[nxt].prefetch()  # overlaps the next unit's all-gather with this compute

    @eager
    def _post_forward(self, unit: Unit, out: Any) -> Any:
        """Reshard (ZeRO-3), cast the outputs to the unit's ``output_dtype``, and hook the outputs'
        gradients to gather the unit again before its backward; returns the outputs."""
        if unit.mp is not None and unit.mp.output_dtype is not None:
            out = _cast_floats(out, unit.mp.output_dtype)
        grad_on = torch.is_grad_enabled()
        is_root = unit is self.units[0]
        if self.zero_stage == 3 and (not grad_on or self._reshards_after_forward(unit)):
            unit.reshard()
        if not grad_on:
            if is_root and self.zero_stage == 3:
                for u in self.units:
                    u.reshard()
            return out
        tensors = [t for t in _tensors(out) if t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda _grads, u=unit: self._pre_backward(u), mode="any")
        return out

    def _reshards_after_forward(self, unit: Unit) -> bool:
        """A unit's own setting (`set_reshard_after_forward`), else the wrapper's; the root keeps its
        parameters for backward unless told otherwise, as FSDP2's root."""
        if unit.reshard_after_forward is not None:
            return unit.reshard_after_forward
        return self.reshard_after_forward and unit is not self.units[0]

    def _around_compiled_call(self, unit: Unit) -> None:
        """A unit compiled in place (``block.compile()``): its module's hooks would run inside the
        compiled call, as eager islands, two graph breaks. Its gather and reshard run around the
        compiled call instead, where nothing is traced: the compiled block is one graph, as under
        torch's FSDP2."""
        compiled = compiled_call(unit.module)
        assert compiled is not None

        def call(*args: Any, **kwargs: Any) -> Any:
            self._pre_forward(unit)
            args, kwargs = _cast_inputs(unit.mp, (args, kwargs))
            out = compiled(*args, **kwargs)
            return self._post_forward(unit, out)

        set_compiled_call(unit.module, call)

    def _forward_method(self, unit: Unit, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method`` of ``unit``'s module run as its forward (`register_fsdp_forward_method`): the
        root's as the wrapper's forward, another unit's between its pre- and post-forward hooks."""
        if unit is self.units[0]:
            def call(*args: Any, **kwargs: Any) -> Any:
                args, kwargs = self._begin_forward(args, kwargs)
                return self._end_forward(method(*args, **kwargs))
        else:
            def call(*args: Any, **kwargs: Any) -> Any:
                self._pre_forward(unit)
                args, kwargs = _cast_inputs(unit.mp, (args, kwargs))
                return self._post_forward(unit, method(*args, **kwargs))
        return call

    def _make_pre_forward(self, unit: Unit) -> Callable[[nn.Module, tuple, dict], tuple[tuple, dict] | None]:
        def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            self._pre_forward(unit)
            if unit.mp is None or not unit.mp.cast_forward_inputs:
                return None
            # Each unit's inputs, as torch's FSDP2 casts them: an fp32 tensor made between units
            # (a buffer added to the activations) must not reach bf16 weights as it is.
            return _cast_inputs(unit.mp, (args, kwargs))
        return hook

    def _make_post_forward(self, unit: Unit):
        return lambda _mod, _args, out: self._post_forward(unit, out)

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, unit: Unit) -> None:
        if not self._backward_queued:
            self._backward_queued = True
            queue_end_of_backward(self._end_backward)  # reductions are awaited there
        if not self.backward_prefetch:
            # Sequential backward: the previous unit's gradient reduction lands (and frees its
            # full-size input) before this unit's parameters are gathered, so a rank never
            # holds one unit's unsharded gradients and another's gathered parameters at once.
            while self._inflight:
                self._inflight.pop(0).finish_reduce()
        unit.gather()
        if self.zero_stage < 3:
            return
        prev = unit.position - 1
        if unit.backward_prefetch is not None:  # set_modules_to_backward_prefetch
            nexts = unit.backward_prefetch
        elif self.backward_prefetch and 0 <= prev < len(self._order):
            nexts = [self._order[prev]]  # the unit that backward reaches next
        else:
            nexts = []
        for nxt in nexts:
            # Unless its gradients are already reduced (a pipeline's last stage: norm and head, the
            # root's only parameters, finish first): gathering it again would be wasted.
            if not all(id(f) in self._reduced for f in nxt.flats):
                nxt.prefetch()

    def _make_post_backward(self, flat: FlatParam, i: int):
        # Held weakly: autograd keeps a leaf's hooks on the C++ side, where the garbage collector
        # cannot see the cycle leaf -> hook -> flat -> leaf, so a strong reference would keep every
        # wrapped model (and its process groups, each with its Gloo threads) alive for good.
        me, flat_ref = weakref.ref(self), weakref.ref(flat)

        def hook(leaf: torch.Tensor) -> None:
            fsdp, alive = me(), flat_ref()
            if fsdp is not None and alive is not None:
                fsdp._post_backward(alive, i)
        return hook

    def _post_backward(self, flat: FlatParam, i: int) -> None:
        """A leaf of ``flat`` (its ``i``-th) has accumulated its gradient."""
        if not self._backward_queued:
            # A backward that entered no unit through its outputs (a pipeline's deferred
            # weight-gradient pass starts inside the stage): reductions are still awaited
            # when it ends.
            self._backward_queued = True
            queue_end_of_backward(self._end_backward)
        unit = self._unit_holding(flat)
        if not (self._sync and unit.sync):  # no_sync: unsharded gradients accumulate until a reduction
            flat.hold_unreduced(i)
            return
        if not flat.grad_ready(i):
            return  # the unit's other parameters have not reported yet
        flat.start_reduce()  # overlaps with the rest of backward
        self._reduced.add(id(flat))
        if self.zero_stage == 3 and unit.reshard_after_backward:
            flat.reshard()
        # Keep one reduction in flight: an issued reduce-scatter holds its full-size input
        # gradient until awaited, so waiting for the older one here bounds memory to about
        # one unit's unsharded gradient while the newest still overlaps with compute.
        self._inflight.append(flat)
        while len(self._inflight) > 1:
            self._inflight.pop(0).finish_reduce()

    def _unit_holding(self, flat: FlatParam) -> Unit:
        """The unit ``flat`` belongs to (the map is rebuilt when a conversion replaced the flats)."""
        unit = self._unit_of.get(id(flat))
        if unit is None or not any(f is flat for f in unit.flats):
            self._unit_of = {id(f): u for u in self.units for f in u.flats}
            unit = self._unit_of[id(flat)]
        return unit

    def _end_backward(self) -> None:
        self._backward_queued = False
        syncs = self._sync and any(u.sync for u in self.units)
        if syncs and self._experts:  # divided as the flat shards' reductions divide
            reduce_expert_grads(self._experts, float(self.cfg.world * self.cfg.replicas))
        self._inflight.clear()
        self._reduced.clear()
        if syncs:  # the units some of whose parameters got no gradient on this rank
            partial = [f for u in self.units if u.sync for f in u.flats
                       if f.requires_grad and f.pending is None and any(f.used())]
            for flat, unused in zip(partial, self._unused_everywhere(partial), strict=True):
                flat.start_reduce(unused)
        for unit in self.units:
            for flat in unit.flats:
                flat.finish_reduce()
            if self.zero_stage == 3 and unit.reshard_after_backward:
                unit.reshard()

    def _unused_everywhere(self, flats: list[FlatParam]) -> list[set[int]]:
        """For each flat, the slots that no rank used in this backward: they keep their gradient
        (None), as on one process, rather than receiving a zero one that moves them under momentum or
        weight decay. One small all-reduce of the slots' use flags over the shard group (and dp),
        only in a backward that left some unit's parameters without a gradient on this rank."""
        if not flats:
            return []
        used = torch.tensor([u for f in flats for u in f.used()], dtype=torch.int32, device=self.cfg.device)
        with comm.operation("FSDP use flags of " + ", ".join(f.label for f in flats)):
            comm.all_reduce(used, self.cfg.group)
            if self.cfg.dp_group is not None:
                comm.all_reduce(used, self.cfg.dp_group)
        out, at = [], 0
        for f in flats:
            out.append({i for i in range(len(f.slots)) if not used[at + i]})
            at += len(f.slots)
        return out


def _is_dataclass(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a block's output: what torch's pytree knows (lists, tuples, named tuples,
    dicts, registered classes such as transformers' outputs) and plain dataclasses' fields, so
    the pre-backward hook sees every tensor that carries gradients back into the unit."""
    out: list[torch.Tensor] = []
    for leaf in tree_flatten(obj)[0]:
        if torch.is_tensor(leaf):
            out.append(leaf)
        elif _is_dataclass(leaf):
            out += [t for f in dataclasses.fields(leaf) for t in _tensors(getattr(leaf, f.name))]
    return out


def _cast_inputs(mp: MixedPrecision | None, obj: Any) -> Any:
    """A unit's forward inputs cast to its policy's ``param_dtype`` (left as they are without a
    policy, or with ``cast_forward_inputs=False``)."""
    if mp is None or not mp.cast_forward_inputs:
        return obj
    return _cast_floats(obj, mp.param_dtype)


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with its floating-point tensors cast to ``dtype`` (structure kept, named tuples and
    dataclasses included), as torch's FSDP2 casts each sharded module's inputs."""
    def cast(x: Any) -> Any:
        if torch.is_tensor(x):
            return x.to(dtype) if x.is_floating_point() else x
        if _is_dataclass(x):
            return dataclasses.replace(x, **{f.name: _cast_floats(getattr(x, f.name), dtype)
                                             for f in dataclasses.fields(x) if f.init})
        return x

    leaves, spec = tree_flatten(obj)
    return tree_unflatten([cast(x) for x in leaves], spec)
