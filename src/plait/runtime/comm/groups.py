"""The process groups plait makes and knows, and the settings they are made with.

Each group is registered with its mesh-axis name, its global ranks, the device its tensors live on
and, for the desync check, a companion Gloo group that carries the fingerprints (`plait.runtime.comm.guard`).
Nothing here moves data: making a group is collective over the world, and the rest is bookkeeping
that names groups in statistics, checks and errors.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from plait.runtime.desync import MODES, GroupLog


@dataclass
class GroupInfo:
    """What plait knows about a process group: its axis name, ranks, device and history."""

    label: str
    ranks: tuple[int, ...]
    device: torch.device
    desync_group: dist.ProcessGroup | None  # companion Gloo group the desync check runs on
    log: GroupLog = field(default_factory=GroupLog)


# Set by `plait.init` through `configure`: comm reads no environment of its own. A dry run
# (`plait.runtime.comm.dryrun`) puts them aside with the groups below and brings them back after.
settings: dict[str, Any] = {"mode": "fast", "run_dir": "runs", "timeout_s": 300.0,
                            "device": torch.device("cpu")}
_groups: dict[int, GroupInfo] = {}
_made: list[dist.ProcessGroup] = []  # every group plait created, in creation order (for teardown)
_on_destroy: list[Callable[[dist.ProcessGroup], None]] = []


def configure(desync_check: str | None = None, run_dir: str | None = None, timeout_s: float | None = None,
              device: torch.device | None = None) -> None:
    """Process-wide settings, from `plait.init`: the desync check mode, the folder for flight
    records, the timeout of every group plait makes and the device collectives carry."""
    if timeout_s is not None:
        settings["timeout_s"] = float(timeout_s)
    if device is not None:
        settings["device"] = device
    if desync_check is not None:
        if desync_check not in MODES:
            raise ValueError(f"desync_check must be one of {MODES}, got {desync_check!r}")
        settings["mode"] = desync_check
    if run_dir is not None:
        settings["run_dir"] = run_dir


def timeout() -> _dt.timedelta:
    """The collective timeout `plait.init` was given (for every group plait creates)."""
    return _dt.timedelta(seconds=settings["timeout_s"])


@dataclass
class SetAside:
    """This process's settings and groups while a dry run stands in for them (`set_aside`)."""

    settings: dict[str, Any]
    groups: dict[int, GroupInfo]
    made: list[dist.ProcessGroup]


def set_aside() -> SetAside:
    """Put this process's groups and settings aside (a dry run's fake groups replace them) and
    start with none; `restore` brings them back."""
    saved = SetAside(dict(settings), dict(_groups), list(_made))
    _groups.clear()
    _made.clear()
    return saved


def restore(saved: SetAside) -> None:
    """Bring back what `set_aside` put aside, dropping what was registered since."""
    settings.clear()
    settings.update(saved.settings)
    _groups.clear()
    _groups.update(saved.groups)
    _made[:] = saved.made


def new_group(ranks: Sequence[int], label: str, checked: bool = True) -> dist.ProcessGroup | None:
    """Create a process group with `init`'s timeout, plus its companion check group.

    Collective over the whole world: every rank calls it with the same ``ranks`` in the same
    order. Returns the group on its members and None elsewhere. ``checked=False`` (groups that
    carry only point-to-point messages, which are not compared across ranks) skips the
    companion.
    """
    ranks = sorted(ranks)
    pg = dist.new_group(ranks, timeout=timeout())
    # A dry run's fake groups carry nothing to compare (and a Gloo companion would wait for peers).
    with_desync_group = checked and len(ranks) > 1 and settings["device"].type != "meta"
    desync_group = dist.new_group(ranks, timeout=timeout(), backend="gloo") if with_desync_group else None
    if dist.get_rank() not in ranks:
        return None
    _made.extend(g for g in (pg, desync_group) if g is not None)
    register_group(pg, label, ranks, desync_group=desync_group)
    return pg


def new_local_group(rank: int, label: str) -> dist.ProcessGroup:
    """A group of this rank alone, made by this rank only (no other rank takes part, so nothing
    can deadlock and no rank pays for the others' one-rank groups). Collectives on it are local."""
    pg = dist.new_group([rank], timeout=timeout(), use_local_synchronization=True)
    _made.append(pg)
    register_group(pg, label, [rank])
    return pg


def on_destroy(forget: Callable[[dist.ProcessGroup], None]) -> None:
    """Call ``forget(group)`` before each `destroy_group`: what keeps a group (a cache keyed on it)
    must let it go, or its Gloo threads and connections outlive it."""
    _on_destroy.append(forget)


def destroy_group(pg: dist.ProcessGroup) -> None:
    """Destroy a group `new_group` made, with its companion, and forget it. Local to this rank:
    call it where no collective on the group is in flight on any of its ranks."""
    for forget in _on_destroy:
        forget(pg)
    info = _groups.pop(id(pg), None)
    for g in (pg, None if info is None else info.desync_group):
        if g is None:
            continue
        if g in _made:
            _made.remove(g)
        with contextlib.suppress(ValueError):  # destroyed already
            dist.destroy_process_group(g)


def is_registered(pg: dist.ProcessGroup) -> bool:
    """Whether ``pg`` is a group `new_group` made (or `register_group` named), not a companion."""
    return id(pg) in _groups


def created_groups() -> list[dist.ProcessGroup]:
    """Every group `new_group` made on this rank, oldest first."""
    return list(_made)


def registered() -> list[GroupInfo]:
    """What plait knows of every group it has named on this rank, in registration order."""
    return list(_groups.values())


def register_group(group: dist.ProcessGroup, label: str, ranks: Sequence[int],
                   desync_group: dist.ProcessGroup | None = None) -> None:
    """Name a process group (its mesh axis) for accounting, checks and error messages.

    Without a ``desync_group`` (a group made outside `new_group`), the fast desync check runs on the
    group itself when it is a Gloo group, and not at all otherwise.
    """
    _groups[id(group)] = GroupInfo(label, tuple(ranks), settings["device"], desync_group)


def info_of(group: dist.ProcessGroup | None) -> GroupInfo:
    """What plait knows of ``group`` (None: the default group); a group met for the first time is
    registered as "world" or "unnamed", checked on itself when it is a Gloo group."""
    group = dist.group.WORLD if group is None else group
    info = _groups.get(id(group))
    if info is None:
        label = "world" if group is dist.group.WORLD else "unnamed"
        ranks = tuple(dist.get_process_group_ranks(group))
        gloo = dist.get_backend(group) == "gloo"
        info = _groups[id(group)] = GroupInfo(label, ranks, settings["device"], group if gloo else None)
    return info


def group_label(group: dist.ProcessGroup | None) -> str:
    """The mesh-axis name of ``group`` ("world" for an unregistered default group)."""
    return info_of(group).label


def device_of(group: dist.ProcessGroup | None) -> torch.device:
    """The device whose tensors ``group`` carries: where bookkeeping tensors must be made."""
    return info_of(group).device


def describe(group: dist.ProcessGroup | None) -> str:
    """"axis 'dp' (global ranks [0, 1])": how errors name a group."""
    info = info_of(group)
    return f"axis '{info.label}' (global ranks {list(info.ranks)})"
