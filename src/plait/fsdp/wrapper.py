"""Fully Sharded Data Parallel: ZeRO stages 1, 2 and 3 over the mesh's ``fsdp`` axis.

ZeRO (Rajbhandari et al. 2020) removes the redundancy of data parallelism in three steps:
stage 1 shards the optimizer state, stage 2 also the gradients (a reduce-scatter replaces
DDP's all-reduce), stage 3 also the parameters, which are all-gathered just before a unit's
forward and again before its backward and freed right after (the PyTorch FSDP paper, Zhao et
al. 2023, calls this a *sharding unit*). With ``dp > 1`` on the mesh it is hybrid sharding:
shards live within the ``fsdp`` axis and are replicated across ``dp`` (gradients get one more
all-reduce over ``dp``).

What moves per step, for Ψ parameters on N ranks (ring wire bytes per rank):

    forward   all-gather of each unit (stage 3; stages 1-2 once after each optimizer step)
    backward  all-gather again (stage 3 with reshard_after_forward), reduce-scatter of grads
              (stage 1: all-reduce, like DDP)

so stage 3 moves 3(N-1)/N·Ψ against DDP's 2(N-1)/N·Ψ: 1.5x. In forward the next unit's
all-gather is issued while the current unit computes. In backward, ``backward_prefetch=True``
(the default) does the same and lets each reduce-scatter run on while backward continues into
earlier units; ``False`` waits for each unit's reduction before gathering the next unit, so
backward holds one gathered unit at a time (lowest peak memory; on CPU, where Gloo's
collectives share the cores with the compute, the lost overlap costs only a few percent).
Either way a unit's gradients are moved into its gathered buffer as they arrive (see
`plait.fsdp.flat`), never held twice.

The training loop stays plain PyTorch: build any optimizer on ``model.parameters()`` *after*
wrapping, call ``loss.backward()``, ``opt.step()``. The parameters are the model's own, under
its names (prefixed ``module.``, as DDP's) and at their full shapes, each a DTensor ``Shard(0)``
over fsdp whose local tensor is this rank's rows (`plait.fsdp.flat`), so param groups by name or
shape, matrix optimizers, ``torch.nn.utils.clip_grad_norm_`` and
``torch.distributed.checkpoint.save(model.state_dict())`` work as on torch's FSDP2.

State: `full_state_dict` (gathered, CPU, original names) for export; `sharded_state_dict`
(per-parameter ``Shard(0)`` DTensors under the original names, optionally with the optimizer's
state) for `torch.distributed.checkpoint`, loadable at another world size, and
`plait.checkpoint`'s protocol (``checkpoint_state``). ``state_dict()`` is nn.Module's: the
DTensor parameters and the buffers, under the model's own names (`plait.fsdp.names`).

Activation checkpointing (`plait.activation_checkpointing`, applied before wrapping) replaces a
block's forward inside the unit's hooks, so its recomputation, in backward, runs after the unit's
pre-backward hook has gathered the unit again (or kept it, ``reshard_after_forward=False``) and
never re-enters the unit's own hooks; units nested inside a checkpointed block are called by the
recomputation, hooks and all (one more gather and reshard each). Parameters of a unit that some
ranks used and others did not are reduced at the end of backward, after one all-reduce of use
flags; a unit skipped entirely on some ranks only makes their collectives differ, which the
desync check reports by unit name (each flat group's collectives carry it, `FlatParam.label`).
fp16 needs loss scaling: `plait.GradScaler`.

GPU behaviour (CPU offload): shards, their gradients and the optimizer state stay in host
memory, the parameter shards pinned; each unit's shard is copied to the GPU (non-blocking) just before its
all-gather, reduced gradient shards are copied back, and the optimizer steps on the CPU. On
a CPU-only machine the same copies run host-to-host, so tests can check the data path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from plait import comm
from plait._torch_compat import (
    compiled_call,
    eager,
    queue_end_of_backward,
    set_compiled_call,
    tree_flatten,
    tree_unflatten,
)
from plait.dtensors import mesh_over
from plait.env import device as default_device
from plait.fsdp.controls import FSDPControls, PlacementFn, check_placements, ignored_grads, ignored_ids
from plait.fsdp.conversions import Conversions
from plait.fsdp.flat import FlatParam, Placing, ShardCfg, Slot
from plait.fsdp.names import own_names, report_own_names, top_level_names, wrapped_names
from plait.fsdp.units import Policies, Unit, build_units, check_no_optimizer, unit_policies
from plait.mesh import Mesh
from plait.placement.grads import reduce_expert_grads
from plait.placement.pieces import mark_piece, piece_of
from plait.placement.records import TPInfo, ep_info, expert_of, tp_info
from plait.placement.tp_params import to_plain_parameters
from plait.precision import MixedPrecision, precision_of

if TYPE_CHECKING:
    from plait.clip import GradParts

# Parameters are sharded over fsdp and cp together: context-parallel ranks hold the same
# replicas and see different tokens of the same batch, like data-parallel ones (torchtitan's
# layout), so they may as well hold different shards. With cp=1 this is the fsdp group.
SHARD_AXES = ("fsdp", "cp")

# What torch says when an op reads a tensor whose storage FSDP freed (resized to zero bytes).
_FREED_READ = ("storage of size 0", "data is not allocated yet")

class FullyShardedDataParallel(Conversions, FSDPControls):
    """Shard ``module``'s parameters, gradients and optimizer state across ``mesh``'s fsdp axis.

    Args:
        module: the model, on the meta device (only the local shard is ever materialized, with
            the values ``plait.init_weights(model, seed)`` would give that slice) or real.
        mesh: a `plait.Mesh`; shards over ``fsdp``, replicates over ``dp`` (hybrid).
        zero_stage: 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters).
        units: module classes or qualified-name patterns that form sharding units (the root
            is always one). Default: the repeated blocks (`plait.blocks`: every child of an
            ``nn.ModuleList``, or of an ``nn.ModuleDict`` or ``nn.Sequential`` of blocks of one
            class); with none, the root alone, and a warning says so.
        reshard_after_forward: stage 3: free a unit's parameters after its forward and
            gather them again for backward (False keeps them until backward).
        backward_prefetch: stage 3: gather the unit that backward reaches next while the
            current one computes, and let each gradient reduction run on during the next unit's
            backward (True: overlap, one extra gathered unit and one in-flight full-size gradient
            at a time; the default); False: wait for each reduction, then gather the next unit
            (lowest peak memory, communication not hidden in backward; on CPU, where the
            collectives share the cores with the compute, it costs only a few percent).
        mixed_precision: `MixedPrecision`, ``"bf16"``/``"fp16"`` or None (fp32), for every unit; or a
            mapping from unit-name patterns to those, one policy per unit as torch's
            ``fully_shard(submodule, mp_policy=...)`` (the key ``""`` names the root; a unit no key
            names takes its closest enclosing unit's policy; see `plait.fsdp.units.unit_policies`).
        offload: keep shards, gradients and optimizer state in CPU memory.
        seed: initialisation seed for a meta-device module.
        ignored_params: parameters left whole, plain and unsynchronised (torch's FSDP2 argument).
        shard_placement_fn: torch's FSDP2 argument; plait honours ``None`` and ``Shard(0)`` only
            and refuses others by name.

    torch's FSDP2 controls (`plait.fsdp.controls`): ``set_requires_gradient_sync``,
    ``set_reshard_after_forward``, ``set_reshard_after_backward``, ``set_is_last_backward``,
    ``set_modules_to_forward_prefetch``, ``set_modules_to_backward_prefetch``, ``unshard`` and
    ``reshard``, on the root unit (with ``recurse=True`` every unit); ``model.unit(block)`` gives
    them for one unit.
    """

    casts_parameters = True  # its own mixed precision: `plait.mixed_precision` refuses to cast on top

    def __init__(
        self,
        module: nn.Module,
        mesh: Mesh,
        zero_stage: int = 3,
        *,
        units: Sequence[type | str] | None = None,
        reshard_after_forward: bool = True,
        backward_prefetch: bool = True,
        mixed_precision: Policies = None,
        offload: bool = False,
        seed: int = 0,
        ignored_params: Iterable[nn.Parameter] | None = None,
        shard_placement_fn: PlacementFn | None = None,
    ) -> None:
        super().__init__()
        # Every check runs before the first collective, so bad input never leaves ranks hanging.
        if zero_stage not in (1, 2, 3):
            raise ValueError(f"FullyShardedDataParallel(zero_stage=...) must be 1, 2 or 3, "
                             f"got {zero_stage!r}")
        if not isinstance(mesh, Mesh):
            raise TypeError(f"FullyShardedDataParallel(mesh=...) expects a plait.Mesh, "
                            f"got {type(mesh).__name__}")
        if mesh.size(SHARD_AXES) == 1 and mesh.size("dp") > 1:
            raise ValueError(
                f"FullyShardedDataParallel shards over the mesh's 'fsdp' axis, but {mesh} has fsdp=1 "
                f"and dp={mesh.size('dp')}: nothing would be sharded; use Mesh(fsdp=...) (hybrid: "
                "dp=replicas, fsdp=shards) or plait.DDP")
        if not isinstance(module, nn.Module):
            raise TypeError(f"FullyShardedDataParallel(module=...) expects an nn.Module, "
                            f"got {type(module).__name__}")
        if not isinstance(backward_prefetch, bool):
            raise TypeError(f"FullyShardedDataParallel(backward_prefetch=...) expects True or False, "
                            f"got {backward_prefetch!r}")
        check_no_optimizer(module)
        check_placements(module, shard_placement_fn)
        self._ignored = ignored_ids(module, ignored_params)
        if precision_of(module) is not None:
            raise ValueError("FullyShardedDataParallel: the module was given plait.mixed_precision, whose "
                             "casts FSDP's gathered parameters would bypass; pass "
                             "FullyShardedDataParallel(..., mixed_precision=...) instead")
        policies = unit_policies(module, units, mixed_precision)
        self.mp = policies[""]  # the root's policy: the model's inputs and outputs
        self.zero_stage, self.reshard_after_forward, self.mesh = zero_stage, reshard_after_forward, mesh
        dp = mesh.size("dp")
        self.cfg = ShardCfg(
            stage=zero_stage, group=mesh.group(SHARD_AXES), dp_group=mesh.group("dp") if dp > 1 else None,
            world=mesh.size(SHARD_AXES), rank=mesh.rank(SHARD_AXES), replicas=dp, device=default_device(),
            param_dtype=self.mp.param_dtype if self.mp else None,
            reduce_dtype=self.mp.reduce_dtype if self.mp else None, offload=offload)
        mixed = any(mp is not None for mp in policies.values())
        self.backward_prefetch = backward_prefetch
        # A tensor-parallel module (plait.tp, applied first): its tp shards are this
        # wrapper's parameters like any other; only the gradient norm needs the tp layout.
        self.tp: TPInfo | None = tp_info(module)
        to_plain_parameters(module)  # FSDP shards the plain tp shards into its own DTensors over (fsdp, tp)
        if placed_experts(module) and (mixed or offload):
            raise ValueError("FullyShardedDataParallel: expert-parallel experts stay whole on the device, "
                             "outside FSDP's shards, so FSDP's mixed precision and offloading would not "
                             "reach them; train them in fp32 on the device (drop mixed_precision / offload)")
        self.cfg.placing = self._placing()
        self.units: list[Unit] = build_units(module, units, self.cfg, seed, self._ignored, policies)
        # Experts (plait.expert_parallel) stay the module's own parameters, whole: ranks of the
        # shard group hold different ones. Their gradients are summed over edp at backward's end.
        self._experts = [p for p in placed_experts(module) if p.requires_grad]
        self._mark_whole_experts(module)
        self.module = module  # its parameters, under their own names, are the DTensor shards
        for unit in self.units[1:]:
            if compiled_call(unit.module) is not None:
                self._around_compiled_call(unit)
            else:
                unit.module.register_forward_pre_hook(self._make_pre_forward(unit), with_kwargs=True)
                unit.module.register_forward_hook(self._make_post_forward(unit))
        self._unit_of: dict[int, Unit] = {id(f): u for u in self.units for f in u.flats}
        for unit in self.units:
            for flat in unit.flats:
                flat.bind_views()
                flat.set_grad_hook(functools.partial(self._make_post_backward, flat))
        self._order: list[Unit] = []  # units in this forward's execution order
        self._prev_order: list[Unit] = list(self.units)  # last forward's order: what to prefetch
        self._sync = True  # False inside no_sync(); each unit has its own flag too (`Unit.sync`)
        self.reshard_after_backward = True  # ZeRO-3: the default of `set_reshard_after_backward`
        self._backward_queued = False
        self._inflight: list[FlatParam] = []  # reductions issued and not yet awaited
        self._reduced: set[int] = set()  # ids of flats whose reduction this backward has issued
        # State dicts under the model's own names, as torch's FSDP1 and FSDP2 write them.
        self.register_state_dict_post_hook(own_names)
        self.register_load_state_dict_pre_hook(wrapped_names)
        self.register_load_state_dict_post_hook(report_own_names)

    def _placing(self) -> Placing:
        """How each parameter's DTensor is placed: ``Shard(0)`` over fsdp (HSDP: replicated over
        dp first); over tensor parallelism the tp split comes before fsdp's (a colwise weight's
        rows are split over tp, then each tp shard's rows over fsdp), so the mesh is
        (dp, tp, fsdp) and a tp-sharded parameter ``Shard(d)`` over tp."""
        cfg, tp = self.cfg, self.tp
        axes: list[tuple[str, dist.ProcessGroup]] = []
        if cfg.dp_group is not None:
            axes.append(("dp", cfg.dp_group))
        if tp is not None and tp.size > 1:
            axes.append(("tp", tp.group))
        axes.append(("fsdp", cfg.group))
        names = tuple(n for n, _ in axes)
        mesh = mesh_over(tuple(g for _, g in axes), names, cfg.device)

        def place(slot: Slot) -> tuple[DeviceMesh, tuple[Placement, ...], torch.Size]:
            spec = _tp_spec(tp, slot) if tp is not None and tp.size > 1 else None
            shape = list(slot.shape)
            out: list[Placement] = []
            for n in names:
                if n == "fsdp" and not slot.replicated:
                    out.append(Shard(0))
                elif n == "tp" and spec is not None:
                    out.append(Shard(spec.dim))
                    shape[spec.dim] = spec.local * tp.size  # type: ignore[union-attr]
                else:
                    out.append(Replicate())
            return mesh, tuple(out), torch.Size(shape)

        return place

    def _torch_state_refusal(self) -> str | None:
        """Why ``state_dict()`` (what torch.distributed.checkpoint saves) cannot hold this model's
        own tensors, or None: a fused or padded tp split, or experts held whole on some ranks."""
        if self._experts or placed_experts(self.module):
            return ("its expert-parallel experts are plain tensors under the same names on every ep "
                    "rank, holding different experts (DCP would keep one rank's copy)")
        if self.tp is None or self.tp.size == 1:
            return None
        odd = [n for n, spec in self.tp.specs.items()
               if not spec.contiguous or spec.local * self.tp.size != spec.full]
        if odd:
            return (f"tensor parallelism splits {odd[:4]} fused (parts) or padded, which a DTensor "
                    "placement cannot describe")
        return None

    def state_dict(self, *args, **kwargs):
        """nn.Module's: the DTensor parameters and the buffers under the model's own names (no
        ``module.``, as torch's FSDP1 and FSDP2: `plait.fsdp.names`), which `torch.save` pickles and
        `torch.distributed.checkpoint` saves and reshards. Refused where a DTensor cannot describe a
        parameter (see `_torch_state_refusal`)."""
        self._write_back()
        why = self._torch_state_refusal()
        if why is not None:
            raise ValueError(
                f"FullyShardedDataParallel.state_dict(): {why}, so torch.distributed.checkpoint would "
                "save wrong values; save model.sharded_state_dict(optimizer) (plait.checkpoint) or "
                "plait.full_state_dict(model) instead")
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """nn.Module's, under the model's own names (`plait.fsdp.names`). ``assign=True`` (torch's
        idiom for a model built on the meta device) copies the values in instead: FSDP materialized
        the shards when it wrapped the model, and a parameter assigned in place of a shard would be
        cut off the flat vector that forward reads."""
        return super().load_state_dict(state_dict, strict=strict, assign=False)

    def _write_back(self) -> None:
        for unit in self.units:
            for flat in unit.flats:
                flat.write_back()

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The DTensor shards under the model's own names, without the wrapper's ``module.`` (as
        torch's FSDP1 and FSDP2 name them), so param groups, `get_optimizer_state_dict` and the
        state dict agree on one name per parameter."""
        yield from self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's buffers under its own names (as `named_parameters`)."""
        yield from self.module.named_buffers(prefix, recurse, remove_duplicate)

    def _fqn_modifiers(self) -> dict[str, str]:
        """torch.distributed.checkpoint.state_dict's contract for a module whose state-dict keys
        skip a level: the model's top-level names stand for ``module.<name>``."""
        return top_level_names(self.module)

    # ------------------------------------------------------------------ forward
    def __getattr__(self, name: str) -> Any:
        """The wrapped model's submodules, parameters and buffers through the wrapper: the state
        dict's names are the model's own, and torch's state-dict functions (torch 2.6's
        ``get_model_state_dict``) find each name's module by attribute from the wrapper. Other
        attributes stay the wrapper's own (plait reads its marks on the model it was given)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self._modules.get("module")  # None while __init__ has not registered it
            owned = (inner._modules, inner._parameters, inner._buffers) if inner is not None else ()
            if not any(name in d for d in owned):
                raise
            return getattr(inner, name)

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

    @staticmethod
    def _mark_whole_experts(module: nn.Module) -> None:
        """Experts every rank holds whole (no ep split) stay plain beside the DTensor shards:
        torch's clip fails inside DTensor on that mix, so it refuses them by name instead (see
        `plait.placement.pieces`). Split experts are marked as pieces already."""
        for name, p in module.named_parameters():
            if expert_of(p) is not None and p.requires_grad and piece_of(p) is None:
                mark_piece(p, f"the whole expert {name!r}", kept_whole=True)

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

    # ------------------------------------------------------------------ user API
    @property
    def experts(self) -> list[nn.Parameter]:
        """The expert parameters kept whole outside the flat shards (`plait.expert_parallel`)."""
        return list(self._experts)

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

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale this rank's gradient shards so the *global* gradient norm is at most ``max_norm``;
        returns the total norm before clipping, the same on every rank (`plait.clip`)."""
        from plait.clip import clip_grad_norm_

        return clip_grad_norm_(self, max_norm, norm_type)

    def grad_norm_parts(self) -> GradParts:
        """This rank's gradient shards, disjoint over fsdp (dp replicas hold the same shards, so
        they are not summed over dp); on a tensor-parallel module the tp-sharded slots are also
        disjoint over tp, while replicated ones, equal on every tp rank, count once."""
        tp = self.tp if self.tp is not None and self.tp.size > 1 else None
        parts: GradParts = {(self.cfg.group,): [], (): []}
        if tp is not None:
            parts[(self.cfg.group, tp.group)] = []
            parts[(tp.group,)] = []
        for u in self.units:
            for f in u.flats:
                for s, p in zip(f.slots, f.params, strict=True):
                    if p.grad is None:
                        continue
                    key = () if s.replicated else (self.cfg.group,)
                    if tp is not None and _tp_spec(tp, s) is not None:
                        key = (*key, tp.group)
                    parts[key].append(_local(p.grad))
        parts[()] += [_local(g) for g in ignored_grads(self.module, self._ignored)]  # each rank's own
        return {**parts, **_expert_parts(self.module, self._experts)}

    # The state-dict functions are imported when called: they need plait.checkpoint, whose
    # torch.distributed.checkpoint would otherwise load with every `import plait`.
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and persistent buffer gathered in full, on CPU, under the original names,
        the same on every rank (over tensor parallelism, tp shards are gathered over tp too)."""
        from plait.fsdp.state_dict import full_state_dict

        return full_state_dict(self)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load full tensors (original names and shapes): each rank keeps its shard. No communication."""
        from plait.fsdp.state_dict import load_full_state_dict

        load_full_state_dict(self, state)

    def sharded_state_dict(self, optimizer: torch.optim.Optimizer | None = None) -> dict:
        """Parameters (and optimizer state) as DTensors of the original model's tensors, for
        torch.distributed.checkpoint: Shard(0) over fsdp, or, over tensor parallelism, each tp
        shard over tp (see `plait.fsdp.state_dict`)."""
        from plait.fsdp.state_dict import sharded_state_dict

        return sharded_state_dict(self, optimizer)

    def load_sharded_state_dict(self, state: dict, optimizer: torch.optim.Optimizer | None = None) -> None:
        from plait.fsdp.state_dict import load_sharded_state_dict

        load_sharded_state_dict(self, state, optimizer)

    # The checkpoint protocol (`plait.checkpoint.protocol`): the sharded state dict is the entry.
    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return self.sharded_state_dict(optimizer)

    def load_checkpoint_state(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        self.load_sharded_state_dict(state, optimizer)

    def offload_bytes(self) -> dict[str, int]:
        """Bytes copied host->device and device->host by CPU offload since wrapping."""
        out = {"to_device": 0, "to_host": 0}
        for unit in self.units:
            for flat in unit.flats:
                for k, v in flat.offload_bytes.items():
                    out[k] += v
        return out


FSDP = FullyShardedDataParallel


def placed_experts(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if expert_of(p) is not None]


def _expert_parts(module: nn.Module, experts: list[nn.Parameter]) -> GradParts:
    """Expert gradients for the norm: whole and disjoint over ep (equal over edp)."""
    info = ep_info(module)
    if info is None:
        return {}
    grads = [p.grad for p in experts if p.grad is not None]
    return {(info.placement.ep,) if info.placement.ep_size > 1 else (): grads}


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of model state this rank holds: parameters, gradients, optimizer state.

    Counted from the tensors' storages (each storage once, so a shard that is a window on a
    gathered vector is not double counted); a freed (resized-to-zero) storage counts zero.
    """
    seen: set[int] = set()

    def add(ts: Iterable[torch.Tensor]) -> int:
        n = 0
        for t in ts:
            st = t.untyped_storage()
            key = st.data_ptr() if st.nbytes() else id(st)
            if key not in seen:
                seen.add(key)
                n += st.nbytes()
        return n

    params: list[torch.Tensor] = [_local(p) for p in model.parameters()]
    if isinstance(model, FullyShardedDataParallel):
        params += [t for u in model.units for f in u.flats for t in (f.buf, f.shard)]
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    out = {"params": add(params), "grads": add(grads)}
    state = [_local(v) for s in (optimizer.state.values() if optimizer else []) for v in s.values()
             if torch.is_tensor(v)]
    out["optimizer"] = add(state)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def _tp_spec(tp: TPInfo, slot: Slot):
    """The tp split of a slot's parameter (under any of its tied names), or None: replicated."""
    return next((tp.specs[n] for n in (slot.fqn, *slot.aliases) if n in tp.specs), None)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


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
