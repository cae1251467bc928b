"""This machine's CPU figures for `plait plan`, measured (`plait plan --calibrate FILE --nproc N`).

Small probes on every rank at once, in lockstep (a matmul rate, the host time per op of a small
model's step beyond its FLOPs, an all-reduce's latency and bandwidth at two sizes, the memory
bandwidth an update sees), then one real training step (`reference_flags`: plait's small GPT,
data parallel) fits the FLOP rate, so that the step is predicted as measured: what the cores do
when every rank computes and Gloo's threads wait beside them, which the probes do not see.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from plait.app.plan.cluster import Cluster


def _lockstep(fn: Any, repeat: int) -> float:
    """Seconds per ``fn()``, the mean over ``repeat`` back-to-back calls that every rank starts at
    once (after a warm-up and a barrier): the throughput of a rank while all of them work, as in
    a training step, not of one that runs while its peers wait."""
    import torch.distributed as dist

    fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    elapsed = time.perf_counter() - t0
    dist.barrier()
    return elapsed / repeat


def _calibration_job(args: dict[str, Any]) -> dict[str, float]:
    """On every rank at once (the cores are shared as in a real job): a matmul rate, the host time
    per op, an all-reduce at two sizes, and a memory-bound update."""
    import torch.distributed as dist

    from plait.runtime import comm

    n = args["matmul"]
    a, b = torch.randn(n, n, device="cpu"), torch.randn(n, n, device="cpu")
    out = {"flops_per_s": 2 * n**3 / _lockstep(lambda: a @ b, 40)}
    dev = comm.device_of(None)
    small, large = torch.zeros(256, device=dev), torch.zeros(args["allreduce_floats"], device=dev)
    if dist.get_world_size() > 1:
        t_small = _lockstep(lambda: comm.all_reduce(small), 50)
        t_large = _lockstep(lambda: comm.all_reduce(large), 5)
        w = dist.get_world_size()
        wire = 2 * (w - 1) / w * large.numel() * 4  # what one rank sends in a ring all-reduce
        out.update(latency_s=t_small, bytes_per_s=wire / max(t_large - t_small, 1e-9))
    big = torch.zeros(args["allreduce_floats"], device="cpu")
    other = torch.ones_like(big)
    out["memory_bytes_per_s"] = 3 * big.numel() * 4 / _lockstep(lambda: big.add_(other), 20)  # 2 in, 1 out
    out["op_overhead_s"] = _op_overhead(out["flops_per_s"])
    return out


def _op_overhead(flops_per_s: float) -> float:
    """Host seconds per op beyond its FLOPs: a small model's training step (plait's tiny GPT, one
    process per rank, AdamW) timed on every rank at once, less its FLOPs at the matmul rate, over
    its op count."""
    import plait
    from plait.app.plan.rehearse import StepMeter
    from plait.models.gpt import GPT, PRESETS, lm_loss

    model = plait.init_weights(GPT(PRESETS["tiny"]), 0)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 256, (4, 64), device="cpu")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        lm_loss(model(x), x).backward()
        opt.step()

    step()
    meter = StepMeter("cpu")
    with meter:
        step()
    t = _lockstep(step, 10)
    return max(0.0, (t - meter.flops / flops_per_s) / max(meter.ops, 1))


REFERENCE_STEP: dict[str, Any] = {"model": "small", "batch_size": 8}  # the calibration's training step


def reference_flags(world: int) -> dict[str, Any]:
    """`plait train` flags of the step `calibrate` times: plait's small GPT, data parallel."""
    return {**REFERENCE_STEP, "nproc": world, "strategy": "ddp" if world > 1 else "none"}


def calibrate(world: int, memory_gib: float = 8.0, matmul: int = 512,
              allreduce_floats: int = 1 << 22) -> Cluster:
    """This machine's CPU figures with ``world`` ranks running at once: measured by small probes
    (matmul rate, host time per op, all-reduce latency and bandwidth, memory bandwidth), then the
    compute figures scaled so that one real training step (`reference_flags`: what the cores do
    when every rank computes and Gloo's threads wait beside them, which probes do not see) is
    predicted as measured (the FLOP rate is fitted)."""
    from plait.app.config import TrainConfig
    from plait.app.plan.predict import predict
    from plait.app.plan.rehearse import measured, rehearse_layout
    from plait.testing import RankPool

    pool = RankPool(world, timeout_s=300)
    try:
        res = pool.run(_calibration_job, {"matmul": matmul, "allreduce_floats": allreduce_floats})
        flags = reference_flags(world)
        ref = pool.run(measured, {"flags": flags, "timed": 5})
    finally:
        pool.close()

    def mean(key: str, default: float) -> float:
        vals = [r[key] for r in res if key in r]
        return sum(vals) / len(vals) if vals else default

    latency, bw = mean("latency_s", 50e-6), mean("bytes_per_s", 1e9)
    probed = Cluster(name=f"cpu-calibrated-{world}", devices_per_node=world, nodes=1, memory_gib=memory_gib,
                     peak_tflops=mean("flops_per_s", 1e10) / 1e12, efficiency=1.0, intra_gbps=bw / 1e9,
                     intra_latency_us=latency * 1e6, inter_gbps=bw / 1e9, inter_latency_us=latency * 1e6,
                     memory_gbps=mean("memory_bytes_per_s", 1e10) / 1e9, overlap=0.0,
                     op_overhead_us=mean("op_overhead_s", 20e-6) * 1e6)
    cfg = TrainConfig.from_flags(**flags)
    stages = rehearse_layout(cfg)
    pred = predict(cfg, stages, probed)
    step = sorted(ref[0]["times"])[len(ref[0]["times"]) // 2]
    # Only the FLOP rate is fitted: the host time per op is the probe's (a small model's step
    # measures it), and the reference step is matmul-bound.
    flops_s = stages[0].flops / probed.flops_per_s()
    rest = pred.step_s - flops_s
    scale = max(step - rest, 0.1 * flops_s) / flops_s
    return dataclasses.replace(probed, peak_tflops=probed.peak_tflops / scale)
