"""`plait plan`: memory and step time of a layout before any GPU is rented; the best layouts.

    plait plan --model llama3-8b --nproc 64 --strategy fsdp --tp 2 --ac full --batch-size 64
    plait plan --model llama3-70b --cluster h100 --nodes 16 --batch-size 256 --search
    plait plan --model llama3-70b --nproc 4096 --tp 8 --pp 8 --strategy fsdp --dry-run
    plait plan mymodels:build --nproc 8 --strategy fsdp --seq-len 2048 --batch-size 16

The layout flags are `plait train`'s (the same names, checks and refusals). The prediction is a
rehearsal of the step on the meta device (`plait.app.plan.rehearse`): exact memory and bytes for
plait's own code, time from a model over them (`plait.app.plan.predict`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import tyro

from plait.app.config import DataSection, ModelSection, ParallelSection, TrainConfig
from plait.app.plan.cluster import Cluster, load_cluster


@dataclass
class ClusterSection:
    """The machines: a preset (or a JSON file from --calibrate) and any figure overridden."""

    cluster: str = "h100"
    """h100 | h200 | a100-80g | a100-40g | cpu, or a cluster JSON file"""
    nodes: int | None = None
    """nodes; None: enough for --nproc (or the preset's)"""
    devices_per_node: int | None = None
    """devices per node"""
    memory_gib: float | None = None
    """memory per device (GiB)"""
    peak_tflops: float | None = None
    """dense matmul peak per device in the training dtype (TFLOP/s)"""
    efficiency: float | None = None
    """share of the peak a step reaches on matmuls"""
    intra_gbps: float | None = None
    """bus bandwidth per device within a node (GB/s)"""
    inter_gbps: float | None = None
    """bus bandwidth per device between nodes (GB/s)"""
    intra_latency_us: float | None = None
    """latency of one collective step within a node (µs)"""
    inter_latency_us: float | None = None
    """latency of one collective step between nodes (µs)"""


@dataclass
class PlanSection:
    """What to predict and how to show it."""

    batch_size: int = 8
    """the global batch, in sequences"""
    search: bool = False
    """rank every valid layout of --nproc ranks (the cluster's devices without --nproc) by step time"""
    top: int = 5
    """with --search: layouts shown"""
    dry_run: bool = False
    """build the layout on the meta device as rank 0 of the full world and report its true per-rank
    parameter, gradient and optimizer bytes (no step; any world size)"""
    json: bool = False
    """print JSON instead of tables"""
    picture: str | None = None
    """write a picture of the memory per rank (PNG or SVG) to this path"""
    calibrate: str | None = None
    """measure this machine's CPU figures with --nproc ranks and write them to this JSON file (a
    --cluster for later plans)"""


@dataclass
class PlanConfig:
    factory: Annotated[str | None, tyro.conf.Positional, tyro.conf.arg(metavar="FACTORY")] = None
    """package.module:function returning the model to plan instead of --model (built on the meta device)"""
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    plan: PlanSection = field(default_factory=PlanSection)
    given: frozenset[str] = frozenset()

    def train_config(self, **parallel: Any) -> TrainConfig:
        """The `plait train` config these flags stand for (its checks refuse what cannot run)."""
        par = dataclasses.replace(self.parallel, **parallel)
        data = DataSection(batch_size=self.plan.batch_size)
        if self.factory is not None:
            from plait.app.plan.factory import FactoryTrainConfig

            return FactoryTrainConfig(model=self.model, parallel=par, data=data, factory=self.factory)
        return TrainConfig(model=self.model, parallel=par, data=data)

    def cluster_for(self, world: int | None) -> Cluster:
        c = self.cluster
        overrides = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name != "cluster"}
        base = load_cluster(c.cluster, {})
        if overrides["nodes"] is None and world is not None:
            per = overrides["devices_per_node"] or base.devices_per_node
            overrides["nodes"] = max(1, -(-world // per))
        return load_cluster(c.cluster, overrides)


def parse_args(argv: list[str]) -> PlanConfig:
    try:
        cfg = tyro.cli(PlanConfig, args=argv, prog="plait plan", config=(tyro.conf.OmitArgPrefixes,),
                       description=__doc__.split("\n\n")[0] if __doc__ else None)
    except ValueError as e:
        print(f"plait plan: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    from plait.app.config import given_flags

    return dataclasses.replace(cfg, given=frozenset(given_flags(argv)))


def _one(cfg: PlanConfig) -> int:
    from plait.app.plan.predict import predict
    from plait.app.plan.rehearse import rehearse_layout
    from plait.app.plan.report import format_prediction, write_picture

    train = cfg.train_config()
    cluster = cfg.cluster_for(train.parallel.nproc)
    if train.parallel.nproc > cluster.world_size:
        raise ValueError(f"--nproc {train.parallel.nproc}: the cluster has {cluster.world_size} devices "
                         f"({cluster.nodes} nodes x {cluster.devices_per_node})")
    p = predict(train, rehearse_layout(train), cluster)
    if cfg.plan.picture:
        write_picture([p], cfg.plan.picture)
    if cfg.plan.json:
        print(json.dumps({"cluster": cluster.as_dict(), "prediction": p.as_dict()}, indent=2))
    else:
        print(format_prediction(p, cluster, train))
    return 0


def _dry_run(cfg: PlanConfig) -> int:
    from plait.app.plan.rehearse import build_only
    from plait.app.plan.report import format_dry_run

    train = cfg.train_config()
    report = build_only(train)
    print(json.dumps(report, indent=2) if cfg.plan.json else format_dry_run(report, train))
    return 0


def _search(cfg: PlanConfig) -> int:
    from plait.app.plan.report import format_search, write_picture
    from plait.app.plan.search import search

    world = cfg.parallel.nproc if "nproc" in cfg.given else None
    cluster = cfg.cluster_for(world)
    result = search(cfg, cluster, world or cluster.world_size, progress=not cfg.plan.json)
    if cfg.plan.picture and result.ranked:
        write_picture(result.ranked[: cfg.plan.top], cfg.plan.picture)
    if cfg.plan.json:
        print(json.dumps({"cluster": cluster.as_dict(), "ranked": [p.as_dict() for p in result.ranked],
                          "rejected": result.rejected}, indent=2))
    else:
        print(format_search(result, cluster, cfg.plan.top))
    return 0 if result.ranked else 1


def cli_main(argv: list[str]) -> int:
    cfg = parse_args(argv)
    if os.getcwd() not in sys.path:  # FACTORY names a module the way `python -m` would find it
        sys.path.insert(0, os.getcwd())
    try:
        if cfg.plan.calibrate:
            from plait.app.plan.calibrate import calibrate

            found = calibrate(cfg.parallel.nproc)
            Path(cfg.plan.calibrate).write_text(json.dumps(found.as_dict(), indent=2) + "\n")
            figures = (f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in found.as_dict().items())
            print(f"wrote {cfg.plan.calibrate}: " + ", ".join(figures))
            return 0
        if cfg.plan.search:
            return _search(cfg)
        if cfg.plan.dry_run:
            return _dry_run(cfg)
        return _one(cfg)
    except ValueError as e:
        print(f"plait plan: error: {e}", file=sys.stderr)
        return 2
