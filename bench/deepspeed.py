"""plait's ZeRO-1/2/3 against DeepSpeed's (and PyTorch FSDP2 at stage 3), world 2 by default.

The library many users would pick instead of plait is DeepSpeed, and it runs on CPUs: its CPU
accelerator (``DS_ACCELERATOR=cpu``) on the Gloo group plait made, with a torch AdamW passed as the
client optimizer (``zero_force_ds_cpu_optimizer: false``), so both sides run the same optimizer.
For each stage the implementations are built in the same processes and their steps alternate
after warm-up (plait, DeepSpeed, and at stage 3 torch's FSDP2); peak memory is measured for each in
fresh processes of its own, with one tracker of live tensor storage applied alike.

Reports, per stage: the median of the per-step ratios plait / DeepSpeed (and plait / FSDP2 at
stage 3) with their spread, the peak live memory per rank, and the loss after the first and last
step on each side (same initial values, same batch). Needs ``pip install deepspeed`` (the
``bench`` extra); never part of the test suite.

Run: ``plait bench deepspeed`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch

from bench.common import alternate, gpt_config, markdown_table, median, paired_ratios, spread, write_section
from bench.live_memory import LiveStorageBytes

MIB = 2**20
BUCKET_ELEMENTS = 25 * MIB // 4


def _batch(args: dict, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    b = torch.randint(0, 256, (args["batch"], args["seq_len"] + 1), generator=g).chunk(args["world"])[rank]
    return b[:, :-1], b[:, 1:]


def _deepspeed_engine(args: dict, stage: int):
    import deepspeed

    import plait
    from plait.models.gpt import GPT

    deepspeed.init_distributed(dist_backend="gloo")  # adopts the default group plait made
    model = plait.init_weights(GPT(gpt_config(args)), 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    # Buckets of plait DDP's default size (25 MiB of fp32 gradient) rather than DeepSpeed's 5e8
    # elements (2 GB, allocated in full): the same communication granularity on both sides.
    buckets = {"reduce_bucket_size": BUCKET_ELEMENTS, "allgather_bucket_size": BUCKET_ELEMENTS}
    config = {"train_micro_batch_size_per_gpu": args["batch"] // args["world"],
              "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage, **buckets}, "zero_force_ds_cpu_optimizer": False,
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def _step_fn(impl: str, args: dict, stage: int, losses: list[float], tracker: LiveStorageBytes | None = None):
    """One training step of ``impl`` ("plait", "deepspeed" or "torch") at ``stage``."""
    import torch.distributed as dist

    from plait.models.gpt import lm_loss

    x, y = _batch(args, dist.get_rank())
    if impl == "deepspeed":
        engine = _deepspeed_engine(args, stage)

        def ds_step() -> None:
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return ds_step
    from bench.fsdp import build

    plain = {**args, "zero_stage": stage, "offload": False, "mixed_precision": False}
    model, opt = build(impl, plain, stage)

    def step() -> None:
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return step


def _impls(stage: int) -> tuple[str, ...]:
    return ("plait", "deepspeed", "torch") if stage == 3 else ("plait", "deepspeed")


def timing_job(args: dict) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    out = {}
    for stage in args["stages"]:
        losses: dict[str, list[float]] = {impl: [] for impl in _impls(stage)}
        steps = {impl: _step_fn(impl, args, stage, losses[impl]) for impl in _impls(stage)}
        out[stage] = {"times": alternate(steps, warmup=args["warmup"], iters=args["iters"]), "losses": losses}
        del steps
        gc.collect()
    return out


def memory_job(impl: str, stage: int, args: dict) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    step = _step_fn(impl, args, stage, [])
    step()  # the optimizer state exists from here on, as in steady-state training
    gc.collect()
    with LiveStorageBytes() as tracker:
        step()
    return {"peak_live": tracker.peak}


def pipeline_job(args: dict) -> dict:
    """plait's 1F1B against DeepSpeed's pipeline engine (`PipelineModule`, its own 1F1B), pp 2, the same
    segments in each stage (DeepSpeed's balance by parameters, given to plait as its split)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import plait
    from plait.models.gpt import GPT, lm_loss
    from plait.pipeline import pipeline
    from plait.pipeline.split import segments
    from plait.testing import cached_mesh

    deepspeed.init_distributed(dist_backend="gloo")
    cfg, m, world = gpt_config(args), args["microbatches"], dist.get_world_size()
    segs = segments(plait.init_weights(GPT(cfg), 0))
    ds_model = PipelineModule(layers=[mod for _, mod in segs], num_stages=world, loss_fn=lm_loss,
                              partition_method="parameters")
    starts = [segs[i][0] for i in ds_model.parts[1:-1]]
    config = {"train_micro_batch_size_per_gpu": args["batch"] // m, "gradient_accumulation_steps": m,
              "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}
    trained = [p for p in ds_model.parameters() if p.requires_grad]
    ds_opt = torch.optim.AdamW(trained, lr=1e-3, weight_decay=0.1)
    engine, _, _, _ = deepspeed.initialize(model=ds_model, optimizer=ds_opt, config=config)
    with torch.device("meta"):
        meta = GPT(cfg)
    pipe = pipeline(meta, cached_mesh(pp=world), split=starts, schedule="1f1b", microbatches=m,
                    loss_fn=lm_loss)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, 256, (args["batch"], args["seq_len"] + 1), generator=g)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    micro = list(zip(x.chunk(m), y.chunk(m), strict=True))
    losses: dict[str, list[float]] = {"plait": [], "deepspeed": []}

    def plait_step() -> None:
        opt.zero_grad(set_to_none=True)
        losses["plait"].append(float(pipe.step(x, y)))
        opt.step()

    def ds_step() -> None:
        losses["deepspeed"].append(float(engine.train_batch(data_iter=iter(micro))))

    times = alternate({"plait": plait_step, "deepspeed": ds_step}, warmup=args["warmup"], iters=args["iters"])
    return {"times": times, "losses": losses, "starts": starts}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="plait bench deepspeed", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="25m", help="GPT preset (default 25m)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="global batch (split over the ranks)")
    p.add_argument("--iters", type=int, default=20, help="timed steps per side and stage (default 20)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--stages", default="1,2,3", help="ZeRO stages to compare (default 1,2,3; or 'none')")
    p.add_argument("--pipeline", action="store_true",
                   help="also 1F1B at pp 2 against DeepSpeed's pipeline engine")
    p.add_argument("--microbatches", type=int, default=4, help="pipeline microbatches (default 4)")
    p.add_argument("--no-write", action="store_true", help="print only; do not update bench/results")
    a = p.parse_args(argv)
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise SystemExit("plait bench deepspeed needs DeepSpeed: pip install deepspeed "
                         "(the bench extra)") from None
    args = {"model": a.model, "seq_len": a.seq_len, "batch": a.batch, "iters": a.iters, "warmup": a.warmup,
            "world": a.world, "stages": [] if a.stages == "none" else [int(s) for s in a.stages.split(",")],
            "microbatches": a.microbatches}
    from bench.common import rank_pool

    t0, load0 = time.time(), os.getloadavg()[0]
    pool = rank_pool(args["world"], timeout_s=1800)
    try:
        timing = pool.run(timing_job, args)[0]
        piped = pool.run(pipeline_job, args)[0] if a.pipeline else None
    finally:
        pool.close()
    mem: dict[tuple[int, str], int] = {}
    for stage in args["stages"]:
        for impl in _impls(stage):  # fresh processes each: none sees another's tensors
            pool = rank_pool(args["world"], timeout_s=1800)
            try:
                mem[stage, impl] = max(r["peak_live"] for r in pool.run(memory_job, impl, stage, args))
            finally:
                pool.close()
    args["load"] = (load0, os.getloadavg()[0])
    body = _report(args, timing, mem, time.time() - t0) + (_pipeline_report(args, piped) if piped else "")
    print(body)
    if not a.no_write:
        write_section("deepspeed", "ZeRO 1/2/3: plait against DeepSpeed (and FSDP2)", body,
                      command=" ".join(["plait bench deepspeed", *argv]))
    return 0


def _report(args: dict, timing: dict, mem: dict, wall: float) -> str:
    import deepspeed

    rows = []
    for stage in args["stages"]:
        t = timing[stage]["times"]
        for other in _impls(stage)[1:]:
            r = spread(paired_ratios(t["plait"], t[other]))
            losses = timing[stage]["losses"]
            rows.append([f"ZeRO-{stage}", other, median(t["plait"]), median(t[other]), r.median,
                         f"{r.p25:.3f}-{r.p75:.3f}; {r.p10:.3f}-{r.p90:.3f}", mem[stage, "plait"] / MIB,
                         mem[stage, other] / MIB, mem[stage, "plait"] / mem[stage, other],
                         f"{losses['plait'][0]:.4f} / {losses[other][0]:.4f}",
                         f"{losses['plait'][-1]:.4f} / {losses[other][-1]:.4f}"])
    table = markdown_table(["stage", "against", "plait step (s)", "their step (s)",
                            "step ratio (median of pairs)",
                            "ratio IQR; p10-p90", "plait peak MiB", "their peak MiB", "peak ratio",
                            "loss step 1 (plait / theirs)", "loss last step"], rows)
    return f"""
GPT preset `{args['model']}`, seq {args['seq_len']}, global batch {args['batch']}, world {args['world']}
(Gloo; DeepSpeed {deepspeed.__version__} with its CPU accelerator), AdamW (torch's, on every side),
float32. {args['iters']} timed steps per side and stage after {args['warmup']} warm-up, strictly
alternating, so step i of each ran back to back: ratios are per step (plait's step i over the
other's), reported as their median, interquartile range and 10th-90th percentiles. Peak live tensor
storage per rank is measured in fresh processes per implementation, one step after a warm-up step
(optimizer state allocated). Goal: step ratio at most 0.8, peak ratio at most 1.0. Total wall
{wall:.0f} s; 1-minute load average {args['load'][0]:.1f} at the start, {args['load'][1]:.1f} at the end
({os.cpu_count()} cores).

{table}

Same initial values and batch on every side. plait's losses equal FSDP2's; DeepSpeed's part from
them from the third step on, lower: measured apart on a tiny GPT (2 ranks, AdamW, 5 steps), DeepSpeed's
rank-0 loss equals one process's on the same rows for two steps, then is lower (5.167 against 5.183
at step 3), alike at ZeRO stages 0, 1 and 3 and with DeepSpeed's own optimizer entry (torch_adam):
DeepSpeed does not reproduce one process here, while plait and FSDP2 do. Its step still does the
same work (forward, backward, the same collectives, an AdamW step), which is what is timed.
"""


def _pipeline_report(args: dict, piped: dict) -> str:
    t, losses = piped["times"], piped["losses"]
    r = spread(paired_ratios(t["plait"], t["deepspeed"]))
    row = ["1F1B, pp 2", median(t["plait"]), median(t["deepspeed"]), r.median,
           f"{r.p25:.3f}-{r.p75:.3f}; {r.p10:.3f}-{r.p90:.3f}",
           f"{losses['plait'][0]:.4f} / {losses['deepspeed'][0]:.4f}",
           f"{losses['plait'][-1]:.4f} / {losses['deepspeed'][-1]:.4f}"]
    table = markdown_table(["schedule", "plait step (s)", "DeepSpeed step (s)",
                            "step ratio (median of pairs)", "ratio IQR; p10-p90",
                            "loss step 1 (plait / DeepSpeed)", "loss last step"], [row])
    return f"""
### Pipelines: plait's 1F1B against DeepSpeed's pipeline engine

Two stages, {args['microbatches']} microbatches of the same global batch; DeepSpeed's `PipelineModule`
over the model's segments balanced by parameters (second stage from `{piped['starts'][0]}`), the same
split given to `plait.pipeline`; torch's AdamW on both, steps alternating as above.

{table}
"""


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
