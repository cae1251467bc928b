"""The machines a plan is for: devices, memory, speed and links, with presets for common GPUs.

Figures are per device. ``peak_tflops`` is the dense matmul peak in the training dtype (bf16 on
GPUs, fp32 on CPUs) and ``efficiency`` the share of it a training step reaches on matmul-heavy
work; bandwidths are what one device sends per second in a ring collective (bus bandwidth),
within a node (NVLink) and between nodes (one network adapter per device). ``overlap`` is the
share of data-parallel communication hidden behind compute (asynchronous buckets and prefetched
gathers on separate streams; about none on CPU, where Gloo's threads share the cores).

`plait.app.plan.calibrate` measures the CPU figures of this machine with one short job (`plait plan
--calibrate`): a matmul rate, the host time per op of a small model's step beyond its FLOPs, an
all-reduce's latency and bandwidth at two sizes, and the memory bandwidth an optimizer step sees,
every rank at once; then one real training step (plait's small GPT, data parallel) scales the
compute figures so that it is predicted as measured.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 2**30


@dataclass
class Cluster:
    name: str = "h100"
    devices_per_node: int = 8
    nodes: int = 1
    memory_gib: float = 79.6
    peak_tflops: float = 989.0
    efficiency: float = 0.45
    intra_gbps: float = 360.0
    intra_latency_us: float = 10.0
    inter_gbps: float = 45.0
    inter_latency_us: float = 25.0
    memory_gbps: float = 3350.0
    overlap: float = 0.8
    op_overhead_us: float = 0.0  # host time per op not hidden behind the device (GPUs queue kernels ahead)

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    def flops_per_s(self) -> float:
        return self.peak_tflops * 1e12 * self.efficiency

    def link(self, within_node: bool) -> tuple[float, float]:
        """(latency in seconds, bandwidth in bytes/s) of a link within a node or between nodes."""
        if within_node:
            return self.intra_latency_us * 1e-6, self.intra_gbps * 1e9
        return self.inter_latency_us * 1e-6, self.inter_gbps * 1e9

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Public figures: dense bf16 peaks, NVLink / InfiniBand bus bandwidths reached by NCCL's ring
# all-reduce (about 80% of the links' rate), HBM bandwidths.
PRESETS: dict[str, Cluster] = {
    "h100": Cluster(),
    "h200": Cluster(name="h200", memory_gib=139.8, memory_gbps=4800.0),
    "a100-80g": Cluster(name="a100-80g", memory_gib=79.2, peak_tflops=312.0, efficiency=0.5, intra_gbps=230.0,
                        inter_gbps=22.0, memory_gbps=2039.0),
    "a100-40g": Cluster(name="a100-40g", memory_gib=39.4, peak_tflops=312.0, efficiency=0.5, intra_gbps=230.0,
                        inter_gbps=22.0, memory_gbps=1555.0),
    # A laptop-class CPU node: one process per core; `calibrate` measures the real figures.
    "cpu": Cluster(name="cpu", devices_per_node=2, memory_gib=8.0, peak_tflops=0.05, efficiency=1.0,
                   intra_gbps=2.0, intra_latency_us=50.0, inter_gbps=1.0, inter_latency_us=100.0,
                   memory_gbps=10.0, overlap=0.0, op_overhead_us=20.0),
}


def load_cluster(preset: str, overrides: dict[str, Any]) -> Cluster:
    """A preset name or a JSON file (as `calibrate` writes), with any field overridden."""
    if preset in PRESETS:
        base = PRESETS[preset]
    elif Path(preset).is_file():
        try:
            base = Cluster(**json.loads(Path(preset).read_text()))
        except (TypeError, ValueError) as e:
            raise ValueError(f"--cluster {preset}: not a cluster file ({e})") from None
    else:
        raise ValueError(f"--cluster {preset}: neither a preset ({', '.join(PRESETS)}) nor a JSON file")
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = set(given) - {f.name for f in dataclasses.fields(Cluster)}
    if unknown:
        raise ValueError(f"unknown cluster fields {sorted(unknown)}")
    for k, v in given.items():
        if k not in ("name", "overlap", "op_overhead_us") and not v > 0:
            raise ValueError(f"--{k.replace('_', '-')} {v}: must be > 0")
    return dataclasses.replace(base, **given)
