"""What a `DistributedDataParallel` is built from, checked before any collective: its options,
the names it ignores, the dtype its buckets travel in, and the mesh a copy attaches to."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from plait.ddp.in_backward import InBackward
from plait.runtime.mesh import Mesh
from plait.state.placement.records import expert_of
from plait.state.precision import precision_of

COMPRESSION = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class DDPOptions:
    bucket_cap_mb: float
    find_unused_parameters: bool
    broadcast_buffers: bool
    gradient_compression: str | None
    axis: str | tuple[str, ...]
    static_graph: bool
    ignored: frozenset[str]
    in_backward: InBackward | None = None

    def __post_init__(self) -> None:
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if self.gradient_compression not in COMPRESSION:
            raise ValueError("gradient_compression must be one of None, 'bf16', 'fp16'; got "
                             f"{self.gradient_compression!r}")


# torch's DistributedDataParallel arguments plait's takes otherwise, with what to write instead.
_TORCH_ONLY = {
    "device_ids": "plait's DDP runs where the module is: move it first (plait.init() returns the device)",
    "output_device": "outputs stay on the module's device",
    "dim": "each rank runs its own batch: nothing is scattered",
    "process_group": "pass mesh=plait.Mesh(...) and axis=: the group is mesh.group(axis)",
    "gradient_as_bucket_view": ".grad is always a view of its bucket (torch's True); drop the option",
    "mixed_precision": "apply plait.mixed_precision(model, ...) before wrapping",
    "init_sync": "the model is always checked and broadcast at construction",
    "delay_all_reduce_named_params": "not supported",
    "device_mesh": "pass mesh=plait.Mesh(...)",
    "skip_all_reduce_unused_params": "not supported: unused parameters are all-reduced as torch's default",
}


def refuse_torch_only(given: dict) -> None:
    """Refuse torch's DDP arguments plait does not take, naming each with its replacement."""
    if not given:
        return
    lines = [f"{k}: {_TORCH_ONLY.get(k, 'not an argument of torch DDP either')}" for k in sorted(given)]
    raise TypeError("DistributedDataParallel got arguments plait's DDP does not take: " + "; ".join(lines))


def ignored_names(module: nn.Module, names: Iterable[str] | None) -> frozenset[str]:
    """The parameter and buffer names DDP leaves alone: ``names`` and those torch's
    ``_set_params_and_buffers_to_ignore_for_model`` put on the module. A name that is neither
    a parameter nor a buffer is refused (a typo would silently reduce what it meant to skip)."""
    if isinstance(names, str):
        raise TypeError("params_and_buffers_to_ignore takes a list of names, not one string")
    given = set(names or ())
    known = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
    unknown = sorted(given - known)
    if unknown:
        raise ValueError(f"DistributedDataParallel(params_and_buffers_to_ignore=...): {unknown} name no "
                         "parameter or buffer of the module (names as module.named_parameters() gives them)")
    return frozenset(given | set(getattr(module, "_ddp_params_and_buffers_to_ignore", ())))


def wire_dtype(module: nn.Module, compression: str | None) -> torch.dtype | None:
    """The dtype buckets are all-reduced in (None: the gradients' own), from ``gradient_compression``
    and the reduce dtype of the module's `plait.mixed_precision` policy, which must agree."""
    asked = COMPRESSION[compression]
    policy = precision_of(module)
    if policy is None:
        return asked
    # The master gradients are fp32: reducing them "in fp32" is reducing them as they are.
    wanted = None if policy.wire_dtype == torch.float32 else policy.wire_dtype
    if wanted not in COMPRESSION.values():
        raise ValueError(f"DistributedDataParallel: the module's mixed precision reduces gradients in "
                         f"{policy.wire_dtype}; DDP reduces the fp32 master gradients as they are or as a "
                         "bf16 / fp16 copy: use MixedPrecision(reduce_dtype=torch.float32, torch.bfloat16 "
                         "or torch.float16)")
    if compression is not None and asked != wanted:
        raise ValueError(f"DistributedDataParallel(gradient_compression={compression!r}) disagrees with the "
                         f"module's mixed precision, which reduces gradients in {policy.wire_dtype}: drop "
                         "the option (it follows the policy) or change the policy's reduce_dtype")
    return wanted


def check_experts_placed(module: nn.Module, named: list[tuple[str, nn.Parameter]]) -> None:
    """An MoE model's experts get gradients only where tokens were routed to them: refuse one
    whose experts `plait.expert_parallel` did not mark (DDP would wait for their gradients)."""
    from plait.models.moe import moe_layers

    if moe_layers(module) and not any(expert_of(p) is not None for _, p in named):
        raise ValueError("DistributedDataParallel: the model has MoE layers; apply "
                         "plait.expert_parallel(model, mesh) first (with ep=1 it only marks the experts, "
                         "whose gradients may be missing on a rank that routed them no token)")


# The meshes DDP wrappers were built on in this process, by shape: a copy of a wrapper
# (deepcopy, torch.load) attaches to the live one instead of making process groups again.
_MESHES: weakref.WeakValueDictionary[tuple, Mesh] = weakref.WeakValueDictionary()


def mesh_key(mesh: Mesh) -> tuple:
    key = (tuple(sorted(mesh.shape.items())), mesh.ep, mesh.world_size)
    _MESHES[key] = mesh
    return key


def mesh_for(key: tuple) -> Mesh:
    """The live mesh of that shape, or a new one (made by every rank, as torch.load on every rank
    makes it: a mesh's groups are made collectively)."""
    mesh = _MESHES.get(key)
    if mesh is None:
        shape, ep, _ = key
        mesh = Mesh(**dict(shape), ep=ep)
        _MESHES[key] = mesh
    return mesh
