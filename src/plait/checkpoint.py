"""Training checkpoints that resume on a different number of ranks.

Model and optimizer state are written with `torch.distributed.checkpoint` (each rank writes
what it holds; replicated tensors are stored once) under one key layout for every data
layout::

    {"model": {fqn: tensor}, "optim": {f"{fqn}.{state_key}": tensor}}

FSDP supplies DTensor shards of that layout, tensor parallelism DTensors of its shards (over
the tp group), pipeline ranks the entries of their own stages; DDP, DataParallel and
single-process models supply plain tensors. Because the keys and full shapes are the same, a
checkpoint written by one layout loads into another (ZeRO-3 on 4 ranks -> DDP on 2 -> one
process, or a 2-stage pipeline x tp 2 -> FSDP x tp 2 -> one process). Small metadata (step, sampler
position, config) sits beside it in ``plait.json``.
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
from plait.pipeline.api import Pipeline
from plait.tensor_parallel import tp_info, tp_module
from plait.tp_state import checkpoint_entry, restore_entry
from plait.zero import ZeroRedundancyOptimizer

__all__ = ["save", "load", "latest", "state_dict", "load_state_dict"]

META = "plait.json"


def _view(model: Any) -> tuple[nn.Module, Any, dict[str, str]]:
    """(module whose state_dict has the shared layout's names, its TPInfo or None, renames).

    ``renames`` maps a parameter name to the name its optimizer state is stored under: a weight
    tied across pipeline ranks is held as a copy per rank, named after the module using it there,
    but has one optimizer state in the shared layout (under its first owner's name).
    """
    if isinstance(model, Pipeline):
        return model.state_module(), model.tp_info, model.tied_names
    if isinstance(model, (DistributedDataParallel, DataParallel)):
        model = model.module
    tp = tp_module(model)
    if tp is not None:
        return tp, tp_info(tp), {}
    return model, None, {}


def _steps(optimizer: Any, p: nn.Parameter) -> bool:
    """Whether this rank's optimizer steps ``p``: a ZeRO-1 wrapper holds (and writes, and
    reads back) the optimizer state of its own share of the parameters only."""
    return p.requires_grad and (not isinstance(optimizer, ZeroRedundancyOptimizer) or optimizer.owns(p))


def state_dict(model: nn.Module | Pipeline, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's view of the model and optimizer in the shared layout (also a `load` template).

    Tensor-parallel shards appear as DTensors of the full tensors (see `plait.tp_state`), a
    pipeline rank contributes the entries of its own stages.
    """
    if isinstance(model, FullyShardedDataParallel):
        return model.sharded_state_dict(optimizer)
    module, info, renames = _view(model)
    specs = info.specs if info is not None else {}
    layout = _state_layout(optimizer)
    optim: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        if not _steps(optimizer, p):
            continue
        state = optimizer.state.get(p, {})
        for key, kind in layout.items():
            out = f"{renames.get(name, name)}.{key}"
            if kind == "elem":
                value = torch.as_tensor(state.get(key, torch.zeros_like(p)))
                optim[out] = checkpoint_entry(value, specs.get(name), info, name)
            else:
                value = torch.as_tensor(state.get(key, torch.zeros((), dtype=torch.float32)))
                optim[out] = value.detach().clone()
    model_sd = {k: checkpoint_entry(v, specs.get(k), info, k) for k, v in module.state_dict().items()}
    return {"model": model_sd, "optim": optim}


@torch.no_grad()
def load_state_dict(model: nn.Module | Pipeline, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any]) -> None:
    """Put a filled `state_dict` template back into the model and optimizer."""
    if isinstance(model, FullyShardedDataParallel):
        model.load_sharded_state_dict(state, optimizer)
        return
    module, info, renames = _view(model)
    specs = info.specs if info is not None else {}
    own = module.state_dict(keep_vars=True)
    for key, target in own.items():
        restore_entry(target, state["model"][key], specs.get(key))
    layout = _state_layout(optimizer)
    for name, p in module.named_parameters():
        if not _steps(optimizer, p):
            continue
        restored = {}
        for key, kind in layout.items():
            value = state["optim"][f"{renames.get(name, name)}.{key}"]
            if kind == "elem":
                restored[key] = torch.zeros_like(p)
                restore_entry(restored[key], value, specs.get(name))
            else:
                restored[key] = value.clone()
        optimizer.state[p] = restored


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
