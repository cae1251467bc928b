"""plait's ZeRO-1/2/3 against DeepSpeed's (and PyTorch FSDP2 at stage 3), world 2 by default.

The library many users would pick instead of plait is DeepSpeed, and it runs on CPUs: its CPU
accelerator (``DS_ACCELERATOR=cpu``) on the Gloo group plait made, with a torch AdamW passed as the
client optimizer (``zero_force_ds_cpu_optimizer: false``), so both sides run the same optimizer.
For each stage the implementations are built in the same processes and their steps alternate
after warm-up (plait, DeepSpeed, and at stage 3 torch's FSDP2); peak memory is measured for each in
fresh processes of its own, with one tracker of live tensor storage applied alike.

With ``--ulysses``: plait's context parallelism with Ulysses all-to-alls (`ParallelPlan(cp="ulysses")`
on ``Mesh(cp=2)``) against DeepSpeed-Ulysses (`deepspeed.sequence.layer.DistributedAttention` around
the same GPT's attention, DeepSpeed's engine at ZeRO-0 averaging gradients over the two ranks) on
the long-sequence setting of `plait bench cp`; if DeepSpeed's side fails, its exact error is reported.

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

from bench.common import (
    alternate,
    cpu_timed,
    gpt_config,
    markdown_table,
    median,
    paired_ratios,
    spread,
    write_section,
)
from bench.live_memory import LiveStorageBytes

MIB = 2**20
CP_SIZES = {"model": "small", "seq_len": 1024, "batch": 2}  # plait bench cp's defaults
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
    if impl == "floor":
        from bench.floors import zero_floor

        floor = zero_floor(args, x, y)
        return lambda: losses.append(floor())
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


def _alternate(steps: dict, args: dict) -> dict:
    """Wall times (``times``) and this rank's CPU seconds (``cpu``, timed steps only) of ``steps``
    in strict alternation after warm-up."""
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    times = alternate({name: cpu_timed(fn, cpu[name]) for name, fn in steps.items()},
                      warmup=args["warmup"], iters=args["iters"])
    return {"times": times, "cpu": {name: xs[args["warmup"]:] for name, xs in cpu.items()}}


def timing_job(args: dict) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    out = {}
    for stage in args["stages"]:
        impls = _impls(stage) + (("floor",) if args["floor"] else ())
        losses: dict[str, list[float]] = {impl: [] for impl in impls}
        steps = {impl: _step_fn(impl, args, stage, losses[impl]) for impl in impls}
        out[stage] = {**_alternate(steps, args), "losses": losses}
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

    steps = {"plait": plait_step, "deepspeed": ds_step}
    if args["floor"]:
        from bench.floors import stage_floor

        own = segments(plait.init_weights(GPT(cfg), 0))  # the floor's own copy: the engine trains segs
        steps["floor"] = stage_floor(args, own, list(ds_model.parts), micro)
    # 1F1B's fill and drain: with equal stages its step is (m + p - 1) stage-microbatch slots, of
    # which the floor (each stage's compute alone) holds m.
    bubble = (m + world - 1) / m
    return {**_alternate(steps, args), "losses": losses, "starts": starts, "schedule_factor": bubble}


class _UlyssesAttention(torch.nn.Module):
    """plait GPT's attention computed as DeepSpeed-Ulysses computes it: this rank's contiguous chunk
    of every sequence is projected, rotated at its global positions, and DeepSpeed's
    `DistributedAttention` all-to-alls q, k and v to whole sequences over half the heads, runs the
    causal kernel and all-to-alls the output back."""

    def __init__(self, attn: torch.nn.Module, group: object, floor: bool = False) -> None:
        from deepspeed.sequence.layer import DistributedAttention

        from bench.floors import local_ulysses

        super().__init__()
        self.attn = attn
        # The floor: the same attention with its all-to-alls replaced by local reshuffles.
        self.dist_attn = (local_ulysses if floor else
                          DistributedAttention(_causal_sdpa, group, scatter_idx=2, gather_idx=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        a = self.attn
        b, s, _ = x.shape
        start = dist.get_rank() * s  # contiguous chunks, in rank order
        q, k, v = (proj(x).view(b, s, -1, a.head_dim) for proj in (a.q_proj, a.k_proj, a.v_proj))
        q, k = a.rotary(q, start=start), a.rotary(k, start=start)
        y = self.dist_attn(q, k, v, 0)  # (b, s, heads, head_dim): batch dim 0
        return a.o_proj(y.reshape(b, s, -1))


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: object,
                 **kwargs: object) -> torch.Tensor:
    """DeepSpeed's local attention: (batch, whole sequence, local heads, head_dim) in and out."""
    import torch.nn.functional as F

    y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    return y.transpose(1, 2)


def _deepspeed_ulysses(a: dict, x: torch.Tensor, y: torch.Tensor, floor: bool = False):
    """DeepSpeed-Ulysses' step on this rank's contiguous chunk of every sequence (the batch whole);
    ``floor``: the same model without communication (no all-to-all, no engine, torch's AdamW)."""
    import deepspeed
    import torch.distributed as dist

    import plait
    from plait.models.gpt import GPT, Attention, lm_loss

    deepspeed.init_distributed(dist_backend="gloo")
    model = plait.init_weights(GPT(gpt_config(a)), 0)  # the values plait's meta-device init gives
    group = dist.group.WORLD
    for block in model.layers:
        assert isinstance(block.attn, Attention)
        block.attn = _UlyssesAttention(block.attn, group, floor)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    mine = x.chunk(dist.get_world_size(), dim=1)[dist.get_rank()].contiguous()
    target = y.chunk(dist.get_world_size(), dim=1)[dist.get_rank()].contiguous()
    losses: list[float] = []
    if floor:
        def floor_step() -> None:
            loss = lm_loss(model(mine), target)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return floor_step, losses
    config = {"train_micro_batch_size_per_gpu": a["batch"], "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 0}, "zero_force_ds_cpu_optimizer": False,
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step() -> None:
        loss = lm_loss(engine(mine), target)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return step, losses


def ulysses_job(a: dict) -> dict:
    """plait's Ulysses context parallelism at cp 2 against DeepSpeed-Ulysses, steps alternating; if
    DeepSpeed's side fails its first step, the error instead (raised alike on every rank)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from bench.cp import global_batch, plait_runner
    from plait.testing import cached_mesh

    x, y = global_batch(a)
    runner = plait_runner(a, cached_mesh(cp=2), "ulysses", x, y)
    try:
        ds_step, ds_losses = _deepspeed_ulysses(a, x, y)
        ds_step()
    except Exception as e:  # noqa: BLE001 (reported, not hidden: the bench says it does not run)
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
    runner.step()  # the same number of steps on both sides before timing
    # The same layout with plait's desync check off (on by default: a fingerprint all-reduce before
    # each collective, here 4 all-to-alls per attention in forward and 4 in backward), apart.
    unchecked = plait_runner(a, cached_mesh(cp=2), "ulysses", x, y)
    unchecked.step()

    def unchecked_step() -> None:
        from plait.runtime import comm

        with comm.desync_check("off"):
            unchecked.step()
    steps = {"plait": runner.step, "deepspeed": ds_step, "plait_unchecked": unchecked_step}
    if a["floor"]:
        steps["floor"] = _deepspeed_ulysses(a, x, y, floor=True)[0]
    timed = _alternate(steps, a)
    # Each rank's loss is over its own tokens: the mean over the ranks is the global batch's.
    import torch.distributed as dist

    means = {}
    for side, ls in (("plait", runner.losses), ("deepspeed", ds_losses)):
        t = torch.tensor(ls, dtype=torch.float64)
        dist.all_reduce(t)
        means[side] = (t / dist.get_world_size()).tolist()
    return {**timed, "losses": means}


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
    p.add_argument("--ulysses", action="store_true",
                   help="also plait's cp=2 with Ulysses against DeepSpeed-Ulysses (plait bench cp's sizes)")
    p.add_argument("--floor", action="store_true",
                   help="also time each layout's floor: its compute, nothing communicated (bench/floors.py)")
    p.add_argument("--no-write", action="store_true", help="print only; do not update bench/results")
    a = p.parse_args(argv)
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise SystemExit("plait bench deepspeed needs DeepSpeed: pip install deepspeed "
                         "(the bench extra)") from None
    args = {"model": a.model, "seq_len": a.seq_len, "batch": a.batch, "iters": a.iters, "warmup": a.warmup,
            "world": a.world, "stages": [] if a.stages == "none" else [int(s) for s in a.stages.split(",")],
            "microbatches": a.microbatches, "floor": a.floor}
    from bench.common import rank_pool

    t0, load0 = time.time(), os.getloadavg()[0]
    pool = rank_pool(args["world"], timeout_s=1800)
    try:
        timing = pool.run(timing_job, args)[0]
        piped = pool.run(pipeline_job, args)[0] if a.pipeline else None
        uly_args = {**CP_SIZES, "iters": a.iters, "warmup": a.warmup, "floor": a.floor}
        ulysses = pool.run(ulysses_job, uly_args)[0] if a.ulysses else None
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
    body = (_report(args, timing, mem, time.time() - t0) if args["stages"] else "")
    body += _pipeline_report(args, piped) if piped else ""
    if a.floor and body:
        pairs = [(f"ZeRO-{stage}", timing[stage]) for stage in args["stages"]]
        body += _floors_section(pairs + ([("1F1B, pp 2", piped)] if piped else []))
    command = " ".join(["plait bench deepspeed", *argv])
    if body:
        print(body)
        if not a.no_write:
            write_section("deepspeed", "ZeRO 1/2/3: plait against DeepSpeed (and FSDP2)", body,
                          command=command)
    if ulysses:  # a section of its own: a run of the ZeRO stages alone leaves it as it is
        uly_args["load"] = args["load"]
        uly_body = _ulysses_report(uly_args, ulysses)
        print(uly_body)
        if not a.no_write:
            write_section("deepspeed_ulysses", "Sequence parallelism: plait's cp with Ulysses against "
                          "DeepSpeed-Ulysses", uly_body, command=command)
    return 0


def _floors_section(pairs: list[tuple[str, dict]]) -> str:
    from bench.floors import FLOOR_NOTE, floor_table

    return f"\n### Floors: each layout's step without communication\n\n{floor_table(pairs)}\n\n{FLOOR_NOTE}\n"


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


def _ulysses_report(a: dict, out: dict) -> str:
    head = f"""
GPT preset `{a['model']}`, {a['batch']} sequences of {a['seq_len']} tokens (`plait bench cp`'s setting),
world 2, {a['iters']} timed steps per side after {a['warmup']} warm-up, strictly alternating; 1-minute
load average {a['load'][0]:.1f} at the start, {a['load'][1]:.1f} at the end ({os.cpu_count()} cores).
plait: `ParallelPlan(cp="ulysses")` on `Mesh(cp=2)` (each rank holds the zigzag halves of every
sequence; one all-to-all of q, k and v together and one of the output in each attention; its DDP
over cp). DeepSpeed:
`deepspeed.sequence.layer.DistributedAttention` around the same attention projections and kernel
(each rank holds one contiguous half of every sequence), its engine at ZeRO-0 averaging gradients
over the two ranks. torch's AdamW on both.
"""
    if "error" in out:
        return head + f"\nDeepSpeed-Ulysses does not run here: `{out['error']}`\n"
    table = _paired_table("sequence parallelism", "Ulysses, cp 2", out, last="last step")
    t = out["times"]
    if "plait_unchecked" in t:
        off, cost = (spread(paired_ratios(t["plait_unchecked"], t[side])) for side in ("deepspeed", "plait"))
        table += (f"\n\nWith plait's desync check off (on by default: a fingerprint all-reduce before each "
                  f"collective, here 2 all-to-alls per attention forward (Q, K and V together; the output) "
                  f"and 2 backward), in the same "
                  f"alternation: {off.median:.3f} of DeepSpeed's step (IQR {off.p25:.3f}-{off.p75:.3f}); "
                  f"the unchecked step over the checked one {cost.median:.3f} (IQR {cost.p25:.3f}-"
                  f"{cost.p75:.3f}).")
    if "floor" in out["times"]:
        from bench.floors import FLOOR_NOTE, floor_table

        table += f"\n\nFloor:\n\n{floor_table([('Ulysses, cp 2', out)])}\n\n{FLOOR_NOTE}"
    return head + f"""
{table}

Losses are the mean over the two ranks of each rank's own tokens' loss: the global batch's, the same
initial values and tokens on both sides. They agree at the first step; then DeepSpeed's falls faster,
as at every ZeRO stage above (its losses part from one process's from the third step, where plait's
and FSDP2's do not; plait's Ulysses is checked against one process by tests/test_context_parallel.py).
"""


def _paired_table(kind: str, label: str, out: dict, last: str = "loss last step") -> str:
    """One row: plait's and DeepSpeed's median steps, their paired ratio and its spread, and the first
    and last losses of each side."""
    t, losses = out["times"], out["losses"]
    r = spread(paired_ratios(t["plait"], t["deepspeed"]))
    row = [label, median(t["plait"]), median(t["deepspeed"]), r.median,
           f"{r.p25:.3f}-{r.p75:.3f}; {r.p10:.3f}-{r.p90:.3f}",
           f"{losses['plait'][0]:.4f} / {losses['deepspeed'][0]:.4f}",
           f"{losses['plait'][-1]:.4f} / {losses['deepspeed'][-1]:.4f}"]
    return markdown_table([kind, "plait step (s)", "DeepSpeed step (s)", "step ratio (median of pairs)",
                           "ratio IQR; p10-p90", "loss step 1 (plait / DeepSpeed)", last], [row])


def _pipeline_report(args: dict, piped: dict) -> str:
    table = _paired_table("schedule", "1F1B, pp 2", piped)
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
