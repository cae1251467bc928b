"""Training checkpoints that resume on a different number of ranks.

Model and optimizer state are written with `torch.distributed.checkpoint` (each rank writes
what it holds; replicated tensors are stored once) under one key layout for every data
layout::

    {"model": {fqn: tensor}, "optim": {f"{fqn}.{state_key}": tensor}}

FSDP supplies DTensor shards of that layout; DDP, DataParallel and single-process models
supply plain tensors. Because the keys and full shapes are the same, a checkpoint written by
one layout loads into another (ZeRO-3 on 4 ranks -> DDP on 2 -> one process). Small
metadata (step, sampler position, config) sits beside it in ``plait.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from plait.data_parallel import DataParallel
from plait.ddp import DistributedDataParallel
from plait.fsdp import FullyShardedDataParallel
from plait.fsdp_state_dict import _state_layout

__all__ = ["save", "load", "latest", "state_dict", "load_state_dict"]

META = "plait.json"


def _plain(model: nn.Module) -> nn.Module:
    if isinstance(model, (DistributedDataParallel, DataParallel)):
        model = model.module
    if getattr(model, "_plait_tp", None) is not None:
        raise ValueError("checkpoints of tensor-parallel models are not supported yet; use "
                         "plait.tp_state.full_state_dict for export")
    return model


def state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's view of the model and optimizer in the shared layout (also a `load` template)."""
    if isinstance(model, FullyShardedDataParallel):
        return model.sharded_state_dict(optimizer)
    module = _plain(model)
    layout = _state_layout(optimizer)
    optim: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        state = optimizer.state.get(p, {})
        for key, kind in layout.items():
            default = torch.zeros_like(p) if kind == "elem" else torch.zeros((), dtype=torch.float32)
            optim[f"{name}.{key}"] = torch.as_tensor(state.get(key, default)).detach().clone()
    model_sd = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"model": model_sd, "optim": optim}


@torch.no_grad()
def load_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Put a filled `state_dict` template back into the model and optimizer."""
    if isinstance(model, FullyShardedDataParallel):
        model.load_sharded_state_dict(state, optimizer)
        return
    module = _plain(model)
    module.load_state_dict(state["model"])
    layout = _state_layout(optimizer)
    for name, p in module.named_parameters():
        if p.requires_grad:
            optimizer.state[p] = {key: state["optim"][f"{name}.{key}"].clone() for key in layout}


def save(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
         meta: dict[str, Any]) -> Path:
    """Write a checkpoint (a collective: every rank calls it) and its metadata."""
    path = Path(directory)
    dcp.save(state_dict(model, optimizer), checkpoint_id=str(path))
    if dist.get_rank() == 0:
        (path / META).write_text(json.dumps(meta, indent=1))
    dist.barrier()  # nobody reads the metadata before it exists
    return path


def load(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load a checkpoint written by `save`, on any number of ranks and layout; return its metadata."""
    path = Path(directory)
    if not (path / META).exists():
        raise FileNotFoundError(f"no plait checkpoint at {path} (missing {META})")
    template = state_dict(model, optimizer)
    dcp.load(template, checkpoint_id=str(path))
    load_state_dict(model, optimizer, template)
    return json.loads((path / META).read_text())


def latest(directory: str | Path) -> Path | None:
    """The newest ``step_*`` checkpoint under ``directory`` that finished writing."""
    done = [p for p in Path(directory).glob("step_*") if (p / META).exists()]
    return max(done, key=lambda p: int(p.name.split("_")[1])) if done else None
