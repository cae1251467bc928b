"""plait DDP vs torch.nn.parallel.DistributedDataParallel, same model, batch and world, one run.

Both wrappers are built in the same processes from identical weights. After warm-up their
training steps alternate, and each step's time is the slowest rank's. Memory is measured in
fresh processes per implementation (peak RSS only grows, so one process cannot measure two).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from bench.common import (
    alternate,
    cpu_timed,
    markdown_table,
    median,
    peak_rss_mib,
    preset_gpt,
    rank_batch,
    write_section,
)

STRAGGLER_EVERY = 10  # `plait train --straggler-every`'s default


def _step_fn(model, opt, x, y):
    from plait.models.gpt import lm_loss

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        lm_loss(model(x), y).backward()
        opt.step()

    return step


def _timing(preset: str, seq: int, global_batch: int, warmup: int, iters: int, bucket_mb: float) -> dict:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from plait import comm
    from plait.ddp.wrapper import DDP
    from plait.testing import cached_mesh

    x, y = rank_batch(global_batch, seq)
    ours = DDP(preset_gpt(preset, seq), cached_mesh(dp=dist.get_world_size()), bucket_cap_mb=bucket_mb)
    theirs = TorchDDP(preset_gpt(preset, seq), bucket_cap_mb=bucket_mb)
    opt_a = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    opt_b = torch.optim.AdamW(theirs.parameters(), lr=1e-4)
    plait_step = _step_fn(ours, opt_a, x, y)

    def unchecked() -> None:  # the same plait step without the default desync check
        with comm.desync_check("off"):
            plait_step()

    from plait.models.gpt import lm_loss
    from plait.runtime.straggler import StragglerTracker

    tracker, blamed_steps = StragglerTracker(), [0]

    def blamed() -> None:  # the same plait step as `plait train` runs it, with straggler blame
        with comm.phase("forward"):
            loss = lm_loss(ours(x), y)
        with comm.phase("backward"):
            loss.backward()
        with comm.phase("optimizer"):
            opt_a.step()
            opt_a.zero_grad(set_to_none=True)
        tracker.step()
        blamed_steps[0] += 1
        if blamed_steps[0] % STRAGGLER_EVERY == 0:
            tracker.blame()  # every rank: one gather of the ranks' waits

    # The same model and optimizer with no wrapper and no communication: the floor any DDP's step
    # could reach if its all-reduces cost nothing at all.
    alone = preset_gpt(preset, seq)
    alone_step = _step_fn(alone, torch.optim.AdamW(alone.parameters(), lr=1e-4), x, y)
    # The same AdamW stepped bucket by bucket at the end of backward, as each all-reduce lands.
    in_backward = DDP(preset_gpt(preset, seq), cached_mesh(dp=dist.get_world_size()), bucket_cap_mb=bucket_mb,
                      optimizer_in_backward=(torch.optim.AdamW, {"lr": 1e-4}))

    def in_backward_step() -> None:
        lm_loss(in_backward(x), y).backward()

    steps = {"plait": plait_step, "torch": _step_fn(theirs, opt_b, x, y), "plait_unchecked": unchecked,
             "plait_blamed": blamed, "alone": alone_step, "plait_in_backward": in_backward_step}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    times = alternate({name: cpu_timed(fn, cpu[name]) for name, fn in steps.items()}, warmup, iters)
    with comm.counting() as counts:
        steps["plait"]()
    n_params = sum(p.numel() for p in ours.parameters())
    reduced = counts.total("all_reduce", "dp")
    return {"times": times, "cpu": {name: xs[warmup:] for name, xs in cpu.items()}, "n_params": n_params,
            "bytes_ratio": reduced / (4 * n_params), "buckets": len(ours._buckets)}


def _memory(impl: str, preset: str, seq: int, global_batch: int, bucket_mb: float) -> float:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from plait.ddp.wrapper import DDP
    from plait.testing import cached_mesh

    x, y = rank_batch(global_batch, seq)
    model = preset_gpt(preset, seq)
    if impl == "plait":
        model = DDP(model, cached_mesh(dp=dist.get_world_size()), bucket_cap_mb=bucket_mb)
    else:
        model = TorchDDP(model, bucket_cap_mb=bucket_mb)
    step = _step_fn(model, torch.optim.AdamW(model.parameters(), lr=1e-4), x, y)
    for _ in range(3):
        step()
    return peak_rss_mib()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="plait bench ddp")
    p.add_argument("--model", default="25m")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--profile", action="store_true",
                   help="time each phase of the step instead (bench/ddp_profile.py)")
    args = p.parse_args(argv)

    from bench.common import rank_pool

    if args.profile:
        from bench.ddp_profile import profile, report

        pool = rank_pool(args.world, timeout_s=900)
        try:
            prof = pool.run(profile, args.model, args.seq, args.batch, args.warmup, args.iters,
                            args.bucket_mb)[0]
        finally:
            pool.close()
        body = report(prof, args)
        print(body)
        write_section("ddp_profile", "DistributedDataParallel: where the step's time goes, plait vs "
                      "torch DDP", body)
        return 0

    load0 = os.getloadavg()[0]  # other jobs share the cores: the ratios are only as quiet as this
    pool = rank_pool(args.world, timeout_s=900)
    try:
        out = pool.run(_timing, args.model, args.seq, args.batch, args.warmup, args.iters, args.bucket_mb)[0]
    finally:
        pool.close()
    rss = {}
    for impl in ("plait", "torch"):
        pool = rank_pool(args.world, timeout_s=900)
        try:
            rss[impl] = max(pool.run(_memory, impl, args.model, args.seq, args.batch, args.bucket_mb))
        finally:
            pool.close()

    load1 = os.getloadavg()[0]
    t_plait, t_torch = median(out["times"]["plait"]), median(out["times"]["torch"])
    paired = [a / b for a, b in zip(out["times"]["plait"], out["times"]["torch"])]
    unchecked = out["times"]["plait_unchecked"]
    check_cost = [a / b for a, b in zip(out["times"]["plait"], unchecked)]
    alone = [a / b for a, b in zip(out["times"]["alone"], out["times"]["torch"])]
    in_bw = [a / b for a, b in zip(out["times"]["plait_in_backward"], out["times"]["torch"])]
    in_bw_plait = [a / b for a, b in zip(out["times"]["plait_in_backward"], out["times"]["plait"])]
    cpu = out["cpu"]
    cpu_paired = [a / b for a, b in zip(cpu["plait"], cpu["torch"])]
    cpu_in_bw = [a / b for a, b in zip(cpu["plait_in_backward"], cpu["torch"])]
    cpu_alone = [a / b for a, b in zip(cpu["alone"], cpu["torch"])]
    blamed = out["times"]["plait_blamed"]
    blame_cost = [a / b for a, b in zip(blamed, out["times"]["plait"])]
    tokens = args.batch * args.seq
    rows = [
        ["median step time (s)", t_plait, t_torch, t_plait / t_torch],
        ["median of paired step ratios (spread)", "", "",
         f"{median(paired):.3f} ({min(paired):.3f}-{max(paired):.3f})"],
        ["no communication (the model alone on each rank) / torch DDP, paired", "", "",
         f"{median(alone):.3f} ({min(alone):.3f}-{max(alone):.3f})"],
        ["plait with optimizer_in_backward / torch DDP, paired", "", "",
         f"{median(in_bw):.3f} ({min(in_bw):.3f}-{max(in_bw):.3f})"],
        ["plait with optimizer_in_backward / plait, paired", "", "",
         f"{median(in_bw_plait):.3f} ({min(in_bw_plait):.3f}-{max(in_bw_plait):.3f})"],
        ["CPU time per step, rank 0, every thread (s); paired ratio (spread)", median(cpu["plait"]),
         median(cpu["torch"]), f"{median(cpu_paired):.3f} ({min(cpu_paired):.3f}-{max(cpu_paired):.3f})"],
        ["CPU time: optimizer_in_backward / torch DDP; the model alone / torch DDP, paired", "", "",
         f"{median(cpu_in_bw):.3f}; {median(cpu_alone):.3f}"],
        ["tokens/s", tokens / t_plait, tokens / t_torch, t_torch / t_plait],
        ["peak RSS per rank (MiB)", rss["plait"], rss["torch"], rss["plait"] / rss["torch"]],
    ]
    body = (
        f"GPT `{args.model}` ({out['n_params'] / 1e6:.1f}M parameters), world {args.world}, global batch "
        f"{args.batch} x {args.seq} tokens, bucket cap {args.bucket_mb} MiB "
        f"({out['buckets']} plait buckets), "
        f"{args.iters} alternating timed steps after {args.warmup} warm-up steps each; 1-minute load "
        f"average {load0:.1f} at the start, {load1:.1f} at the end (2 shared cores).\n\n"
        + markdown_table(["", "plait", "torch DDP", "plait / torch"], rows)
        + f"\n\nBytes all-reduced per step / (parameters x 4 bytes): **{out['bytes_ratio']:.2f}** "
        "(theory 1.00).\n"
        + "\nCPU time is the seconds rank 0's process spent computing in each step, on every thread (the "
        "training thread and Gloo's): other jobs on the machine stretch wall time but hardly this, so on a "
        "busy machine it is the steadier comparison of the work each DDP does.\n"
        + "\nThe step with no communication at all (the bare model and optimizer, each rank on its own "
        "half batch) is the floor of any DDP on this machine: a DDP step can be faster than torch's by "
        f"at most 1 - {median(alone):.3f}, the share of torch's step its all-reduces cost. On two CPU "
        "ranks Gloo's reductions and copies run on the same cores as the backward, so overlapping them "
        "with it saves little.\n"
        + "\n`optimizer_in_backward=(torch.optim.AdamW, {...})`: the same AdamW stepped bucket by bucket at "
        "the end of backward, each bucket as soon as its all-reduce lands (the later ones still on the "
        "wire), with a desync check per bucket; no optimizer step after backward. torch's DDP does not "
        "do this by default (its `_apply_optimizer_in_backward` does).\n"
        + "\nDesync check (on by default: one 16-byte fingerprint all-reduce on a companion Gloo "
        "group per backward for the buckets, per collective otherwise), plait step with the check / "
        "the same step without it, alternated in "
        f"this run: median of paired ratios **{median(check_cost):.3f}** (spread "
        f"{min(check_cost):.3f}-{max(check_cost):.3f}; median step {median(unchecked):.3f} s "
        "unchecked).\n"
        + "\nStraggler blame (`plait train`'s: waits filed by phase, one gather of every rank's waits "
        f"every {STRAGGLER_EVERY} steps), plait step with it / without it, both with the desync check, "
        f"alternated in this run: median of paired ratios **{median(blame_cost):.3f}** (spread "
        f"{min(blame_cost):.3f}-{max(blame_cost):.3f}); total time of its {len(blamed)} steps, gathers "
        f"included, over the plain steps' **{sum(blamed) / sum(out['times']['plait']):.3f}**. Against the "
        f"step with no check at all: **{sum(blamed) / sum(unchecked):.3f}**.\n"
    )
    print(body)
    name, title = ("ddp", "") if args.world == 2 else (f"ddp_world{args.world}", f", world {args.world}")
    write_section(name, f"DistributedDataParallel: plait vs torch DDP{title}", body)
    return 0
