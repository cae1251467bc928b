"""DTensors as containers for checkpoint entries: one DeviceMesh per process group, full strides.

FSDP shards and tensor-parallel shards are written to checkpoints as DTensors of the original
full tensors, so `torch.distributed.checkpoint` can reshard them onto any other layout. Only
the container is borrowed from torch: the strategies stay plait's own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["mesh_of", "contiguous_stride"]

_meshes: dict[tuple[int, str], DeviceMesh] = {}


def mesh_of(group: dist.ProcessGroup, device: torch.device) -> DeviceMesh:
    """The one-dimensional DeviceMesh over ``group`` (made once per group and device type)."""
    key = (id(group), device.type)
    if key not in _meshes:
        _meshes[key] = DeviceMesh.from_group(group, device.type)
    return _meshes[key]


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (a DTensor's global stride)."""
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))
