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

Where the pieces live: this module checks the arguments, builds the units (`plait.fsdp.units`) and
places their parameters; `plait.fsdp.hooks` runs each step's gathers, reshards and reductions;
`plait.fsdp.model_state` saves and loads; `plait.fsdp.flat` (its gradient side in
`plait.fsdp.reduction`) holds one flat group's storage and collectives; `plait.fsdp.controls` and
`plait.fsdp.conversions` are torch's FSDP2 methods and nn.Module's conversions on the wrapper.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from plait.fsdp.controls import FSDPControls, PlacementFn, check_placements, ignored_grads, ignored_ids
from plait.fsdp.conversions import Conversions
from plait.fsdp.hooks import UnitHooks
from plait.fsdp.layout import Placing, ShardCfg, Slot
from plait.fsdp.model_state import ModelState, placed_experts
from plait.fsdp.names import own_names, report_own_names, wrapped_names
from plait.fsdp.units import Policies, Unit, build_units, check_no_optimizer, unit_policies
from plait.runtime.env import device as default_device
from plait.runtime.mesh import Mesh
from plait.state.dtensors import mesh_over
from plait.state.placement.pieces import mark_piece, piece_of
from plait.state.placement.records import TPInfo, ep_info, expert_of, tp_info
from plait.state.placement.tp_params import to_plain_parameters
from plait.state.precision import MixedPrecision, precision_of

if TYPE_CHECKING:
    from plait.state.clip import GradParts

# Parameters are sharded over fsdp and cp together: context-parallel ranks hold the same
# replicas and see different tokens of the same batch, like data-parallel ones (torchtitan's
# layout), so they may as well hold different shards. With cp=1 this is the fsdp group.
SHARD_AXES = ("fsdp", "cp")


class FullyShardedDataParallel(UnitHooks, ModelState, Conversions, FSDPControls):
    """Shard ``module``'s parameters, gradients and optimizer state across ``mesh``'s fsdp axis.

    Args:
        module: the model, on the meta device (only the local shard is ever materialized, with
            the values ``plait.init_weights(model, seed)`` would give that slice) or real.
        mesh: a `plait.Mesh`; shards over ``fsdp``, replicates over ``dp`` (hybrid).
        zero_stage: 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters).
        units: module classes or qualified-name patterns that form sharding units (the root
            is always one). Default: the repeated blocks (`plait.state.blocks`: every child of an
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
        _check_arguments(module, mesh, zero_stage, backward_prefetch)
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
        self.cfg = _shard_cfg(mesh, zero_stage, self.mp, offload)
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
        for unit in self.units:
            for flat in unit.flats:
                flat.bind_views()
        self._hook_units()  # `plait.fsdp.hooks`: gather, reshard and reduce around each unit
        self._take_conversions()  # `plait.fsdp.conversions`: .to(dtype), to_empty keep the flat groups
        self.reshard_after_backward = True  # ZeRO-3: the default of `set_reshard_after_backward`
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

    @staticmethod
    def _mark_whole_experts(module: nn.Module) -> None:
        """Experts every rank holds whole (no ep split) stay plain beside the DTensor shards:
        torch's clip fails inside DTensor on that mix, so it refuses them by name instead (see
        `plait.state.placement.pieces`). Split experts are marked as pieces already."""
        for name, p in module.named_parameters():
            if expert_of(p) is not None and p.requires_grad and piece_of(p) is None:
                mark_piece(p, f"the whole expert {name!r}", kept_whole=True)

    # ------------------------------------------------------------------ user API
    @property
    def experts(self) -> list[nn.Parameter]:
        """The expert parameters kept whole outside the flat shards (`plait.expert_parallel`)."""
        return list(self._experts)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale this rank's gradient shards so the *global* gradient norm is at most ``max_norm``;
        returns the total norm before clipping, the same on every rank (`plait.state.clip`)."""
        from plait.state.clip import clip_grad_norm_

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

    def offload_bytes(self) -> dict[str, int]:
        """Bytes copied host->device and device->host by CPU offload since wrapping."""
        out = {"to_device": 0, "to_host": 0}
        for unit in self.units:
            for flat in unit.flats:
                for k, v in flat.offload_bytes.items():
                    out[k] += v
        return out


FSDP = FullyShardedDataParallel


def _check_arguments(module: nn.Module, mesh: Mesh, zero_stage: int, backward_prefetch: bool) -> None:
    """Refuse arguments of the wrong type or value, before anything is built or communicated."""
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


def _shard_cfg(mesh: Mesh, zero_stage: int, mp: MixedPrecision | None, offload: bool) -> ShardCfg:
    """What every flat group shares: shards over fsdp x cp, replicas over dp (hybrid), and the
    root's mixed-precision dtypes (each unit's own policy replaces them, `build_units`)."""
    dp = mesh.size("dp")
    return ShardCfg(
        stage=zero_stage, group=mesh.group(SHARD_AXES), dp_group=mesh.group("dp") if dp > 1 else None,
        world=mesh.size(SHARD_AXES), rank=mesh.rank(SHARD_AXES), replicas=dp, device=default_device(),
        param_dtype=mp.param_dtype if mp else None,
        reduce_dtype=mp.reduce_dtype if mp else None, offload=offload)


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
