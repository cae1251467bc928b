"""plait ZeRO-3 against PyTorch FSDP2 (``fully_shard`` per block and root), world 2 by default.

Reports:

* step time plait / torch, steps strictly alternating in the same processes (plait with its
  defaults, plait with ``backward_prefetch=False``, torch): the median of the per-step ratios
  (step i of plait over step i of torch, which ran back to back), their interquartile range and
  10th-90th percentiles, over ``--iters`` steps (default 30) after warm-up;
* peak live memory per rank, measured separately for each implementation in its own fresh
  processes so neither sees the other's tensors: on CUDA the allocator's peak; on CPU one
  tracker of live tensor-storage bytes (`bench.live_memory.LiveStorageBytes`) applied identically to
  both, plus each process's peak RSS;
* on CPU, the phase of each peak and the live bytes at backward start (model state plus every
  activation: the floor that one gathered block is added to);
* ZeRO-3 wire bytes per step / DDP's (one all-reduce of every gradient): theory 1.5;
* model-state bytes per rank for ZeRO-1/2/3 against the fp32-Adam formula.

Run: ``plait bench fsdp`` (``--help`` for sizes; defaults keep it to a few minutes on 2 CPUs).
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch

from bench.common import (
    Spread,
    alternate,
    cpu_timed,
    gpt_config,
    markdown_table,
    median,
    paired_ratios,
    peak_rss_mib,
    spread,
    write_section,
)
from bench.live_memory import LiveStorageBytes

MIB = 2**20
IMPLS = ("plait", "plait_lowmem", "torch")


# ---------------------------------------------------------------- building both sides
def _batch(args: dict, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    b = torch.randint(0, 256, (args["batch"], args["seq_len"] + 1), generator=g).chunk(args["world"])[rank]
    return b[:, :-1], b[:, 1:]


def build(impl: str, args: dict, stage: int | None = None):
    """impl: "plait" (defaults), "plait_lowmem" (backward_prefetch=False) or "torch"."""
    import torch.distributed as dist

    import plait
    from plait.fsdp.wrapper import FSDP, MixedPrecision
    from plait.models.gpt import GPT
    from plait.testing import cached_mesh

    cfg = gpt_config(args)
    mp = args["mixed_precision"]
    if impl.startswith("plait"):
        with torch.device("meta"):
            model = GPT(cfg)
        model = FSDP(model, cached_mesh(fsdp=args["world"]), stage or args["zero_stage"],
                     offload=args["offload"], backward_prefetch=impl != "plait_lowmem",
                     mixed_precision=MixedPrecision(torch.bfloat16) if mp else None)
    else:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        # Same values as plait's meta init (each rank builds the full model first: FSDP2 then
        # shards it in place; init is not what is measured).
        model = plait.init_weights(GPT(cfg), 0)
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda" if torch.cuda.is_available() else "cpu")
        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mp else MixedPrecisionPolicy()
        # FSDP2's CPUOffloadPolicy needs an accelerator; on a CPU-only machine torch runs unoffloaded.
        offload = args["offload"] and torch.cuda.is_available()
        # ZeRO-3 frees gathered blocks after forward; FSDP2's ZeRO-2-like mode keeps them.
        kw = dict(mesh=mesh, reshard_after_forward=args["zero_stage"] == 3,
                  offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy(),
                  mp_policy=policy)
        for layer in model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return model, opt


def _step_fn(model, opt, x, y, losses: list[float], tracker: LiveStorageBytes | None = None):
    from plait.models.gpt import lm_loss

    def phase(name: str) -> None:
        if tracker is not None:
            tracker.phase = name

    def step() -> None:
        phase("forward")
        loss = lm_loss(model(x), y)
        phase("backward")
        loss.backward()
        phase("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return step


# ---------------------------------------------------------------- per-rank jobs
def timing_job(args: dict) -> dict:
    import torch.distributed as dist

    from plait import comm

    rank = dist.get_rank()
    x, y = _batch(args, rank)
    losses: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    models = {impl: build(impl, args) for impl in IMPLS}
    steps = {impl: _step_fn(*models[impl], x, y, losses[impl]) for impl in models}
    cpu: dict[str, list[float]] = {impl: [] for impl in steps}
    times = alternate({impl: cpu_timed(fn, cpu[impl]) for impl, fn in steps.items()},
                      warmup=args["warmup"], iters=args["iters"])
    # Communication of one plait step against DDP's one all-reduce of every gradient.
    with comm.counting() as s:
        steps["plait"]()
    zero3 = sum(s.total(op, None, "wire_bytes") for op in ("all_gather", "reduce_scatter", "all_reduce"))
    psi = sum(p.numel() for p in models["torch"][0].parameters())  # DTensor numel is the global size
    with comm.counting() as counts:
        comm.all_reduce(torch.zeros(psi), dist.group.WORLD)
    ddp = counts.total("all_reduce", None, "wire_bytes")
    return {"times": times, "cpu": {impl: xs[args["warmup"]:] for impl, xs in cpu.items()}, "losses": losses,
            "zero3_wire": zero3, "ddp_wire": ddp, "psi": psi}


def memory_job(impl: str, args: dict) -> dict:
    import torch.distributed as dist

    from plait.fsdp.wrapper import model_state_bytes

    x, y = _batch(args, dist.get_rank())
    model, opt = build(impl, args)
    _step_fn(model, opt, x, y, [])()  # optimizer state exists from here on, as in steady-state training
    gc.collect()
    out: dict = {"phase": None, "bwd_start": None}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        _step_fn(model, opt, x, y, [])()
        peak = torch.cuda.max_memory_allocated()
    else:
        with LiveStorageBytes() as tracker:
            _step_fn(model, opt, x, y, [], tracker)()
        peak = tracker.peak
        # Model state plus every activation, just before backward's first gather.
        out.update(phase=tracker.peak_phase, bwd_start=tracker.at_phase_start.get("backward"))
    out.update(peak_live=peak, rss_mib=peak_rss_mib())
    if impl == "plait":
        from plait.models.gpt import lm_loss

        # The largest gathered unit (one block): what ZeRO-3 must add to the backward-start floor.
        out["block"] = max(f.padded * f.buf.element_size() for u in model.units[1:] for f in u.flats)
        del model, opt
        stages = {}
        for stage in (1, 2, 3):
            m, o = build("plait", args, stage)
            _step_fn(m, o, x, y, [])()  # optimizer state exists
            lm_loss(m(x), y).backward()  # gradients present, as the ZeRO formula counts them
            stages[stage] = model_state_bytes(m, o)["total"]
            del m, o
            gc.collect()
        out["stages"] = stages
        out["psi"] = sum(p.numel() for p in _build_meta_params(args))
    return out


def _build_meta_params(args: dict):
    from plait.models.gpt import GPT

    with torch.device("meta"):
        return list(GPT(gpt_config(args)).parameters())


# ---------------------------------------------------------------- driver
def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="plait bench fsdp", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="25m", help="GPT preset (default 25m)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="global batch (split over the 2 ranks)")
    p.add_argument("--iters", type=int, default=30, help="timed steps per side (default 30)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--fsdp", type=int, default=2, help="ranks (the fsdp axis), default 2")
    p.add_argument("--zero-stage", type=int, default=3, choices=(1, 2, 3),
                   help="plait's stage in the timed comparison (torch: reshard_after_forward=stage==3)")
    p.add_argument("--mixed-precision", action="store_true", help="bf16 compute on both sides")
    p.add_argument("--offload", action="store_true", help="CPU offload on both sides")
    p.add_argument("--no-write", action="store_true", help="print only; do not update bench/results")
    a = p.parse_args(argv)
    args = {k: getattr(a, k) for k in ("model", "seq_len", "batch", "iters", "warmup", "mixed_precision",
                                       "offload", "zero_stage")}
    args["world"] = a.fsdp
    from bench.common import rank_pool

    t0, load0 = time.time(), os.getloadavg()[0]
    pool = rank_pool(args["world"], timeout_s=900)
    try:
        timing = pool.run(timing_job, args)[0]
    finally:
        pool.close()
    mem = {}
    for impl in IMPLS:  # fresh processes each: none sees another's memory
        pool = rank_pool(args["world"], timeout_s=900)
        try:
            mem[impl] = pool.run(memory_job, impl, args)
        finally:
            pool.close()
    args["load"] = (load0, os.getloadavg()[0])  # other jobs share the cores: times are relative
    body = _report(args, timing, mem, time.time() - t0)
    print(body)
    if not a.no_write:
        write_section("fsdp", f"FSDP: plait ZeRO-{a.zero_stage} vs PyTorch FSDP2 (fully_shard)", body,
                      command=" ".join(["plait bench fsdp", *argv]))
    return 0


def _range(r: Spread) -> str:
    return f"{r.p25:.3f}-{r.p75:.3f}; {r.p10:.3f}-{r.p90:.3f}"


def _report(args: dict, timing: dict, mem: dict, wall: float) -> str:
    st = args["zero_stage"]
    t = {k: median(v) for k, v in timing["times"].items()}
    peak = {k: max(r["peak_live"] for r in v) for k, v in mem.items()}
    rss = {k: max(r["rss_mib"] for r in v) for k, v in mem.items()}
    cpu = not torch.cuda.is_available()
    kind = "live tensor storage (CPU tracker)" if cpu else "CUDA allocator peak"
    psi, n = mem["plait"][0]["psi"], args["world"]
    off_note = " (plait only: FSDP2 offload needs an accelerator)" if (args["offload"] and cpu) else ""
    k = len(timing["losses"]["torch"])  # plait ran one extra step (the communication count)
    lp, lq, lt = timing["losses"]["plait"][:k], timing["losses"]["plait_lowmem"], timing["losses"]["torch"]
    step = {impl: spread(paired_ratios(timing["times"][impl], timing["times"]["torch"]))
            for impl in ("plait", "plait_lowmem")}
    cpu = {impl: median(xs) for impl, xs in timing["cpu"].items()}
    cpu_ratio = spread(paired_ratios(timing["cpu"]["plait"], timing["cpu"]["torch"]))
    rows = [
        ["step time (s): medians; ratio: median per-step ratio", t["plait"], t["torch"], step["plait"].median,
         _range(step["plait"]), "<= 1.0"],
        ["CPU time per step, rank 0's process, every thread (s); ratio as above", cpu["plait"], cpu["torch"],
         cpu_ratio.median, _range(cpu_ratio), ""],
        [f"peak live memory / rank (MiB), {kind}", peak["plait"] / MIB, peak["torch"] / MIB,
         peak["plait"] / peak["torch"], "", "<= 0.9"],
        ["peak RSS / rank (MiB)", rss["plait"], rss["torch"], rss["plait"] / rss["torch"], "", ""],
        [f"ZeRO-{st} wire bytes / DDP wire bytes", timing["zero3_wire"] / MIB, timing["ddp_wire"] / MIB,
         timing["zero3_wire"] / timing["ddp_wire"], "", {1: "1.5", 2: "1.0", 3: "1.5"}[st] + " (theory)"],
        ["backward_prefetch=False: step time (s), as above", t["plait_lowmem"], t["torch"],
         step["plait_lowmem"].median, _range(step["plait_lowmem"]), ""],
        ["backward_prefetch=False: peak live memory / rank (MiB)", peak["plait_lowmem"] / MIB,
         peak["torch"] / MIB, peak["plait_lowmem"] / peak["torch"], "", ""],
    ]
    table = markdown_table(["metric", "plait", "torch / reference", "ratio",
                            "per-step ratio: IQR; p10-p90", "target"], rows)
    formula = {1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}
    srows = [[f"ZeRO-{s}", mem["plait"][0]["stages"][s] / MIB, formula[s] / MIB,
              mem["plait"][0]["stages"][s] / formula[s]] for s in (1, 2, 3)]
    stable = markdown_table(["stage", "measured MiB / rank", "formula MiB (fp32 Adam, no offload)", "ratio"],
                            srows)
    where = ""
    if cpu:
        names = {"plait": "plait (default)", "plait_lowmem": "plait, backward_prefetch=False",
                 "torch": "torch FSDP2"}
        prow = []
        for impl, name in names.items():
            r = max(mem[impl], key=lambda r: r["peak_live"])
            prow.append([name, r["phase"], r["bwd_start"] / MIB, r["peak_live"] / MIB,
                         (r["peak_live"] - r["bwd_start"]) / MIB])
        where = "Where the peak falls (the rank with the higher peak):\n\n" + markdown_table(
            ["run", "peak phase", "live at backward start (MiB)", "peak (MiB)", "peak - backward start"],
            prow)
        block = mem["plait"][0]["block"] / MIB
        floor = max(r["bwd_start"] for r in mem["plait"]) / MIB + block
        where += f"""

Live memory at backward start is the model state (parameter and AdamW shards) plus every
activation, identical on both sides; the first block's backward then needs that block gathered
({block:.2f} MiB) plus its first gradient. With blocks as sharding units (as FSDP2 here) no
schedule peaks below about {floor:.1f} MiB, i.e. {floor * MIB / peak["torch"]:.3f} of torch's peak; the 0.9
target ({0.9 * peak["torch"] / MIB:.1f} MiB) would need smaller units or fewer saved activations
(recomputation), which this comparison does not use."""
    return f"""
GPT preset `{args['model']}` (Ψ = {psi / 1e6:.1f}M parameters), seq {args['seq_len']}, global batch
{args['batch']}, world {args['world']} (Gloo, one thread per rank), AdamW; mixed precision
{args['mixed_precision']}, offload {args['offload']}{off_note}; {args['iters']} timed steps per side after
{args['warmup']} warm-up, strictly alternating (plait, plait with backward_prefetch=False, torch), so
step i of each ran back to back. Step-time ratios are per step (step i of plait over step i of
torch), reported as their median, interquartile range and 10th-90th percentiles over
{len(timing['times']['torch'])} pairs; the ratio of the median step times is {t['plait'] / t['torch']:.3f}
({t['plait_lowmem'] / t['torch']:.3f} with backward_prefetch=False). Total wall {wall:.0f} s;
1-minute load average {args['load'][0]:.1f} at the start, {args['load'][1]:.1f} at the end
({os.cpu_count()} cores, shared with other jobs: compare ratios, not absolute times).

{table}

Model-state bytes per rank (parameters + gradients + AdamW state, counted from the tensors each
rank holds; DDP would be 16Ψ = {16 * psi / MIB:.0f} MiB):

{stable}

Sanity: same initial values and batch on all sides; loss after step 1 plait {lp[0]:.6f},
low-memory plait {lq[0]:.6f}, torch {lt[0]:.6f}; after step {len(lp)} plait {lp[-1]:.6f},
low-memory plait {lq[-1]:.6f}, torch {lt[-1]:.6f}.
Peak memory is measured in separate fresh processes per implementation, one step after a
warm-up step (optimizer state allocated).

{where}

How plait gets there (ZeRO-3): each parameter's gradient is moved into its own range of the
block's gathered buffer as soon as autograd has accumulated it (those parameter values are
dead by then), so a block never holds its gathered parameters and a second full-size copy of
its gradients; that buffer is the reduction's input, and on Gloo it is all-reduced in place
(torch's Gloo reduce-scatter clones its input first and is also an all-reduce underneath, so
wire bytes are counted the same way for both). By default (`backward_prefetch=True`) the next
block is gathered while one computes and a reduction stays in flight, like FSDP2, whose peak
here holds three blocks (the one computing, the prefetched one, and the previous block's
reduce-scatter input). With `backward_prefetch=False` each block's reduction lands and frees its
buffer before the next block is gathered, so backward never holds more than one block; on CPU
the collectives run on the same cores as the compute, so the lost overlap costs little (its
step-time row). The ZeRO-3 wire ratio is below 1.5
because the root unit (embedding, final norm, head) stays gathered from forward into backward.
"""


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
