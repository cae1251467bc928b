"""`plait plan --search`: every layout of a world size, checked, rehearsed and ranked.

Candidates are the data-parallel strategies (DDP; FSDP at ZeRO-1, 2 and 3) crossed with the
tensor-parallel degrees that fit in a node (with sequence parallelism), the pipeline degrees
(the given ``--schedule``, 1F1B by default, with 4 microbatches per stage), and context
parallelism for sequences of 32k tokens and more. Each is refused first by `plait train`'s own
checks (the reason is theirs), then by a lower bound on its model states (parameters, gradients
and Adam's moments, the ZeRO paper's count) against the memory, and only then rehearsed; a
rehearsed layout over the memory is rehearsed again with full activation checkpointing (unless
``--ac`` was given), and rejected with its peak if that does not fit either.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from plait.app.plan.cluster import Cluster
from plait.app.plan.predict import Prediction, layout_flags, predict, size
from plait.app.plan.rehearse import rehearse_layout


@dataclass
class SearchResult:
    ranked: list[Prediction] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)  # flags and reason


def _powers_of_two(limit: int) -> list[int]:
    out, d = [], 1
    while d <= limit:
        out.append(d)
        d *= 2
    return out


def candidates(world: int, devices_per_node: int, seq_len: int, schedule: str = "1f1b",
               long_sequence: int = 32768) -> list[dict[str, Any]]:
    """Layout flags to try for ``world`` ranks (the rest of each layout is the given flags')."""
    out: list[dict[str, Any]] = []
    for tp in _powers_of_two(min(devices_per_node, world)):
        for pp in [p for p in _powers_of_two(world // tp) if p <= 16]:
            for cp in [c for c in (1, 2, 4, 8) if world % (tp * pp * c) == 0
                       and (c == 1 or seq_len >= long_sequence)]:
                data = world // (tp * pp * cp)
                strategies: list[dict[str, Any]] = [{"strategy": "ddp", "zero_stage": 3}]
                if data > 1 or cp > 1:
                    strategies += [{"strategy": "fsdp", "zero_stage": z} for z in (1, 2, 3)]
                for strat in strategies:
                    base = dict(nproc=world, tp=tp, pp=pp, cp=cp, sequence_parallel=tp > 1, dp=1, chunks=1,
                                **strat)
                    out.append(base if pp == 1 else dict(base, schedule=schedule, microbatches=4 * pp))
    return out


def model_states_bound(n_params: int, flags: dict[str, Any], mixed: bool) -> float:
    """Bytes per rank of parameters, gradients and Adam's two moments alone (the ZeRO paper's count:
    fp32 16 bytes per parameter, mixed precision the same plus 2 for the low-precision copy),
    split by the layout; a lower bound on the peak."""
    shard = n_params / (flags.get("tp", 1) * flags.get("pp", 1))
    data = flags["nproc"] // (flags.get("tp", 1) * flags.get("pp", 1) * flags.get("cp", 1))
    n = data * flags.get("cp", 1)
    if flags["strategy"] == "ddp":
        return 16 * shard
    per_param = {1: 8 + 8 / n, 2: 4 + 12 / n, 3: 16 / n}[flags.get("zero_stage", 3)]
    return (per_param + (2 / n if mixed else 0)) * shard


def search(cfg: Any, cluster: Cluster, world: int, progress: bool = True) -> SearchResult:
    """Rank the layouts of ``world`` ranks for ``cfg``'s model and batch (a `PlanConfig`)."""
    from tqdm import tqdm

    result = SearchResult()
    base = cfg.train_config(nproc=1, tp=1, pp=1, cp=1)
    n_params = _parameter_count(base)
    tried = candidates(world, cluster.devices_per_node, base.seq_len, cfg.parallel.schedule)
    checkpointing = [cfg.parallel.ac] if "ac" in cfg.given else ["none", "full"]
    for flags in tqdm(tried, desc="plait plan --search", disable=not progress, unit="layout"):
        for ac in checkpointing:
            verdict = _try(cfg, dict(flags, ac=ac), n_params, cluster)
            if isinstance(verdict, Prediction):
                result.ranked.append(verdict)
                break
            if ac == checkpointing[-1] or not verdict.get("memory"):  # only memory is worth a retry
                result.rejected.append(verdict)
                break
    result.ranked.sort(key=lambda p: p.step_s)
    return result


def _try(cfg: Any, flags: dict[str, Any], n_params: int, cluster: Cluster) -> Prediction | dict[str, Any]:
    """The prediction of one layout, or why it was rejected (``memory``: for want of memory)."""
    try:
        train = cfg.train_config(**flags)
    except ValueError as e:
        return {"flags": flags, "reason": str(e)}
    bound = model_states_bound(n_params, flags, train.parallel.mixed_precision is not None)
    if bound > cluster.memory_bytes:
        # Checkpointing changes activations only: no retry.
        return {"flags": layout_flags(train), "reason": (
            f"model states alone need {size(bound)} per rank, the device has {cluster.memory_gib:g} GiB")}
    try:
        p = predict(train, rehearse_layout(train), cluster)
    except (ValueError, RuntimeError) as e:
        return {"flags": layout_flags(train), "reason": str(e).splitlines()[0]}
    if not p.fits:
        return {"flags": p.flags, "memory": True, "reason": p.reasons[0]}
    return p


def _parameter_count(train: Any) -> int:
    from plait.app.step import unwrapped_model

    with torch.device("meta"):
        model = unwrapped_model(dataclasses.replace(train), "meta")
    return sum(p.numel() for p in model.parameters())
