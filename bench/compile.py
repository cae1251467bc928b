"""torch.compile on plait's layouts against torch's own, same model, batch and world, one run.

Three layouts, world 2 by default, GPT ``25m`` at sequence 256 (where compilation shows on a CPU):

* DDP compiled whole after wrapping: ``torch.compile(plait.DDP(model))`` against
  ``torch.compile(torch DDP(model))`` (torch's DDP splits its graph at bucket boundaries);
* ZeRO-3 with each block compiled before wrapping, torchtitan's way: ``block.compile()`` for every
  block, then plait's FSDP against torch's FSDP2 (``fully_shard`` per block and root);
* TP over the whole world, compiled whole after sharding: ``plait.tensor_parallel`` with
  ``plait.gpt_plan`` against torch's DTensor TP (``parallelize_module``, the same Megatron plan as
  ``plait bench tp``), each with its vocabulary-parallel loss outside the compiled model.

Each layout builds four models from identical weights in the same processes (plait eager, plait
compiled, torch eager, torch compiled); after warm-up (which compiles) their steps alternate, each
step's time the slowest rank's. Reported per layout: compiled / eager of each side (median of the
per-step ratios of neighbouring steps, and their spread), plait compiled / torch compiled, and the
graph breaks Dynamo counted while compiling each side.

Run: ``plait bench compile`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from bench.common import (
    alternate,
    markdown_table,
    median,
    paired_ratios,
    preset_gpt,
    rank_batch,
    write_section,
)

IMPLS = ("plait eager", "plait compiled", "torch eager", "torch compiled")


Built = tuple[torch.nn.Module, Callable[..., torch.Tensor] | None]  # the model, its loss (None: lm_loss)


def _step_fn(built: Built, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    from plait.models.gpt import lm_loss

    model, loss_fn = built
    loss_fn = loss_fn or lm_loss
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        if hasattr(loss, "full_tensor"):  # torch's loss_parallel: its backward runs in the context too
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():
                loss.backward()
        else:
            loss.backward()
        opt.step()

    return step


def _ddp(impl: str, preset: str, seq: int) -> Built:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from plait.ddp.wrapper import DDP
    from plait.testing import cached_mesh

    model = preset_gpt(preset, seq)
    wrapped = DDP(model, cached_mesh(dp=dist.get_world_size())) if impl.startswith("plait") else \
        TorchDDP(model)
    return (torch.compile(wrapped) if impl.endswith("compiled") else wrapped), None


def _zero3(impl: str, preset: str, seq: int) -> Built:
    from plait.fsdp.wrapper import FSDP
    from plait.testing import cached_mesh

    model = preset_gpt(preset, seq)
    if impl.endswith("compiled"):
        for block in model.layers:
            block.compile()
    if impl.startswith("plait"):
        return FSDP(model, cached_mesh(fsdp=dist.get_world_size()), 3), None
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda" if torch.cuda.is_available() else "cpu")
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, None


def _tp(impl: str, preset: str, seq: int) -> Built:
    import bench.tp

    if impl.startswith("plait"):
        import plait
        from plait.testing import cached_mesh
        from plait.tp.apply import loss_fn_for

        model = preset_gpt(preset, seq)
        plait.tensor_parallel(model, cached_mesh(tp=dist.get_world_size()), plait.gpt_plan(model))
        loss_fn = loss_fn_for(model)
    else:  # the same weights (seed 0), sharded by torch
        model, loss_fn = bench.tp._build_torch({"model": preset, "seq_len": seq})
    return (torch.compile(model) if impl.endswith("compiled") else model), loss_fn


# layout -> (builder, whether ranks split the batch: data parallel; tp ranks share theirs)
LAYOUTS: dict[str, tuple[Callable[[str, str, int], Built], bool]] = {
    "DDP, compiled whole after wrapping": (_ddp, True),
    "ZeRO-3, each block compiled before wrapping": (_zero3, True),
    "TP, compiled whole after sharding": (_tp, False)}


def _timing(layout: str, preset: str, seq: int, global_batch: int, warmup: int, iters: int) -> dict:
    from torch._dynamo.utils import counters

    build, split = LAYOUTS[layout]
    x, y = rank_batch(global_batch, seq, split)
    steps, breaks = {}, {}
    for impl in IMPLS:
        torch._dynamo.reset()
        counters.clear()
        step = _step_fn(build(impl, preset, seq), x, y)
        for _ in range(warmup):  # compiles here, alone, so the counters are this side's
            step()
        breaks[impl] = sum(counters["graph_break"].values())
        steps[impl] = step
    times = alternate(steps, 1, iters)
    return {"times": times, "breaks": breaks}


def _cell(r: list[float]) -> str:
    return f"{median(r):.3f} ({min(r):.3f}-{max(r):.3f})"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="plait bench compile")
    p.add_argument("--model", default="25m")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2, help="steps per model before timing (compilation)")
    p.add_argument("--iters", type=int, default=8)
    args = p.parse_args(argv)

    from bench.common import rank_pool

    load0 = os.getloadavg()[0]
    rows = []
    for layout in LAYOUTS:
        pool = rank_pool(args.world, timeout_s=1800)
        try:
            out = pool.run(_timing, layout, args.model, args.seq, args.batch, args.warmup, args.iters)[0]
        finally:
            pool.close()
        t = out["times"]
        rows.append([layout, _cell(paired_ratios(t["plait compiled"], t["plait eager"])),
                     _cell(paired_ratios(t["torch compiled"], t["torch eager"])),
                     _cell(paired_ratios(t["plait compiled"], t["torch compiled"])),
                     f"{median(t['plait compiled']):.3f} / {median(t['torch compiled']):.3f}",
                     f"{out['breaks']['plait compiled']} / {out['breaks']['torch compiled']}"])
    load1 = os.getloadavg()[0]
    body = (
        f"GPT `{args.model}` at sequence {args.seq}, world {args.world}, global batch {args.batch}, inductor "
        f"on the CPU; {args.iters} timed steps of each of the four models, alternating, after "
        f"{args.warmup} warm-up steps each (compilation included there); 1-minute load average "
        f"{load0:.1f} at the start, {load1:.1f} at the end (2 shared cores). Ratios: median of the "
        "per-step ratios (spread); below 1.0 compiled is faster, or plait is.\n\n"
        + markdown_table(["layout", "plait compiled / eager", "torch compiled / eager",
                          "plait / torch, both compiled", "median step s, plait / torch compiled",
                          "graph breaks, plait / torch"], rows)
        + "\n")
    print(body)
    write_section("compile", "torch.compile: plait vs torch, each compiled and eager", body)
    return 0
