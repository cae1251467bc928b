"""DTensors as containers for checkpoint entries: one DeviceMesh per process group, full strides.

FSDP shards and tensor-parallel shards are written to checkpoints as DTensors of the original
full tensors, so `torch.distributed.checkpoint` can reshard them onto any other layout. Only
the container is borrowed from torch: the strategies stay plait's own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from plait.runtime import comm

_meshes: dict[tuple[tuple[int, str], str], DeviceMesh] = {}


def mesh_of(group: dist.ProcessGroup, device: torch.device) -> DeviceMesh:
    """The one-dimensional DeviceMesh over ``group`` (made once per group and device type)."""
    key = (_key(group), _mesh_device(device))
    if key not in _meshes:
        _meshes[key] = DeviceMesh.from_group(group, key[1], mesh_dim_names=(_dim_name("group", group),))
    return _meshes[key]


def _dim_name(axis: str, group: dist.ProcessGroup) -> str:
    """A mesh dimension's name, with its group's: DTensor caches sharding decisions (holding their
    mesh) under meshes compared by ranks and names, so a mesh over a later group of the same ranks
    (a test pool's next task, a mesh made again) must not compare equal to one over a dead group."""
    return f"{axis}:{getattr(group, 'group_name', id(group))}"


# Every live group a mesh was made for, kept so that its id is not reused by a later group while
# a mesh is keyed on it (a mesh over a destroyed group cannot run collectives). `_forget` drops a
# group and its meshes when the group is destroyed: held for ever, every group a long process
# (a test pool, a job that rebuilds its layout) ever made kept its Gloo threads, each waking
# many times a second.
_held: list[dist.ProcessGroup] = []


def _forget(group: dist.ProcessGroup) -> None:
    if not any(g is group for g in _held):
        return
    _held[:] = [g for g in _held if g is not group]
    dropped = [_meshes.pop(k) for k in [k for k in _meshes if k[0][0] == id(group)]]
    dropped += [_grids.pop(k) for k in [k for k in _grids if any(i == id(group) for i, _ in k[0])]]
    # DTensor's caches of sharding decisions may keep a dropped mesh a while longer; the mesh
    # holds its groups by name (torch's `_pg_registry`): unhooked, the group can be freed now.
    for mesh in dropped:
        getattr(mesh, "_pg_registry", {}).pop(getattr(group, "group_name", None), None)


comm.on_destroy(_forget)


def _key(group: dist.ProcessGroup) -> tuple[int, str]:
    """A group's identity: its object (held, see `_held`) and its name."""
    if not any(g is group for g in _held):
        _held.append(group)
    return id(group), getattr(group, "group_name", "")


def _mesh_device(device: torch.device) -> str:
    """The mesh's device type: a meta-device model (a rehearsal's) computes as the CPU would."""
    return "cpu" if device.type == "meta" else device.type


def local_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of a DTensor (``t`` itself when it is a plain tensor)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (a DTensor's global stride)."""
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


_grids: dict[tuple[tuple[tuple[int, str], ...], str], DeviceMesh] = {}


def mesh_over(groups: tuple[dist.ProcessGroup, ...], names: tuple[str, ...],
              device: torch.device) -> DeviceMesh:
    """The DeviceMesh whose dimension ``i`` is ``groups[i]`` (made once per groups and device type).

    The groups are axes of one plait mesh through this rank, so the rank at coordinates
    ``(i_0, i_1, ...)`` is this rank moved along each axis: ``me + sum_k (ranks_k[i_k] - me)``
    (no communication needed to lay the grid out)."""
    if len(groups) == 1:
        return mesh_of(groups[0], device)
    key = (tuple(_key(g) for g in groups), _mesh_device(device))
    if key not in _grids:
        me = dist.get_rank()
        grid = torch.full((), me, dtype=torch.long)
        for g in groups:
            step = torch.tensor(dist.get_process_group_ranks(g), dtype=torch.long) - me
            grid = grid.unsqueeze(-1) + step
        dims = tuple(_dim_name(n, g) for n, g in zip(names, groups, strict=True))
        _grids[key] = DeviceMesh.from_group(list(groups), key[1], mesh=grid, mesh_dim_names=dims)
    return _grids[key]
