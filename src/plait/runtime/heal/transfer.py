"""The live state of a replica, sent from a healthy one to those that lack it, tensor by tensor.

A replica that joins (a replacement, or one that was dropped) takes the parameters, buffers,
optimizer state, step count and RNG state of a peer over the new epoch's process group, not
from disk. Each tensor is received straight into the receiver's own tensor (optimizer state it
does not have yet is allocated once, at its final size), so no rank ever holds a second copy of
the model: the sender sends its own tensors, one at a time.

Sharded parameters (HSDP: DTensors over the replica's processes) move as this process's shards:
process i of a replica sends to process i of the joiner, whose shards are the same rows.

The messages are point-to-point on the epoch's group, with group ranks: the heal groups are
built per epoch outside torch's world (every replica is a world of its own, so that no replica's
death breaks a group it cannot leave), and torch's rank translation does not know them.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

_TAG = 48


@dataclass
class LiveState:
    """What a replica trains with: all of it moves to a joiner. ``step``: the steps completed."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: int = 0


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def _layout(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Per optimized parameter: each state entry's shape and dtype (tensors) or value."""
    out = []
    for p in _params(opt):
        entries: dict[str, tuple[Any, ...]] = {}
        for key, value in sorted(opt.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor):
                entries[key] = ("tensor", tuple(value.shape), str(value.dtype).removeprefix("torch."))
            else:
                entries[key] = ("value", value)
        out.append(entries)
    return out


def _make_state(opt: torch.optim.Optimizer, layout: list[dict[str, Any]]) -> None:
    """Give this optimizer the sender's state entries, reusing tensors of the right size."""
    for p, entries in zip(_params(opt), layout):
        if not entries:
            opt.state.pop(p, None)
            continue
        mine = opt.state.get(p, {})
        state: dict[str, Any] = {}
        for key, (kind, *rest) in entries.items():
            if kind == "value":
                state[key] = rest[0]
                continue
            shape, dtype = tuple(rest[0]), getattr(torch, rest[1])
            old = mine.get(key)
            fits = isinstance(old, torch.Tensor) and tuple(old.shape) == shape and old.dtype == dtype
            if not fits:  # placed as the parameter where it has its shape (AdamW's moments of a DTensor)
                old = (torch.zeros_like(p, dtype=dtype) if shape == tuple(p.shape)
                       else torch.empty(shape, dtype=dtype, device=local(p).device))
            state[key] = old
        opt.state[p] = state


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of ``t``: its shard of a DTensor, or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _tensors(state: LiveState) -> Iterator[torch.Tensor]:
    """Every tensor of the state, in the same order on every replica."""
    yield from map(local, state.model.parameters())
    yield from map(local, state.model.buffers())
    for p in _params(state.optimizer):
        for _, value in sorted(state.optimizer.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor):
                yield local(value)


def send_state(pg: dist.ProcessGroup, state: LiveState, receivers: list[int]) -> None:
    """Send this replica's state to the group ranks ``receivers`` (they call `recv_state`)."""
    meta = pickle.dumps({"step": state.step, "rng": torch.get_rng_state(),
                         "optimizer": _layout(state.optimizer)})
    payload = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    for dst in receivers:
        _send(pg, length, dst)
        _send(pg, payload, dst)
    with torch.no_grad():
        for t in _tensors(state):
            for dst in receivers:
                _send(pg, t, dst)


def recv_state(pg: dist.ProcessGroup, state: LiveState, src: int) -> None:
    """Replace this replica's state by the one group rank ``src`` sends (`send_state`), in place."""
    length = torch.zeros(1, dtype=torch.int64)
    _recv(pg, length, src)
    payload = torch.empty(int(length[0]), dtype=torch.uint8)
    _recv(pg, payload, src)
    meta = pickle.loads(payload.numpy().tobytes())
    _make_state(state.optimizer, meta["optimizer"])
    with torch.no_grad():
        for t in _tensors(state):
            _recv(pg, t, src)
    state.step = int(meta["step"])
    torch.set_rng_state(meta["rng"])


def _send(pg: dist.ProcessGroup, t: torch.Tensor, dst: int) -> None:
    """One tensor to group rank ``dst`` (contiguous: it is sent from its own storage)."""
    pg.send([_contiguous(t)], dst, _TAG).wait()


def _recv(pg: dist.ProcessGroup, t: torch.Tensor, src: int) -> None:
    """One tensor from group rank ``src``, written into ``t`` itself."""
    pg.recv([_contiguous(t)], src, _TAG).wait()


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"plait.runtime.heal: a {tuple(t.shape)} state tensor is not contiguous; it cannot "
                         "be sent or received in place")
    return t.detach()
