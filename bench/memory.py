"""Peak live memory per rank under every layout, with and without activation checkpointing, in
fp32 and bf16; plait against torch's own equivalents in the same run. World 2 by default.

* Layouts (plait): DDP, ZeRO-1/2/3, TP (tp=2), TP with sequence parallelism, PP (pp=2, 1F1B), each
  with no activation checkpointing, ``"full"`` and ``"selective"`` (`plait.activation_checkpointing`
  through ``ParallelPlan(ac=...)``), in fp32 and in bf16 (``ParallelPlan(mixed_precision="bf16")``).
* torch, same model, values, batch and world: `torch.nn.parallel.DistributedDataParallel` and FSDP2
  (``fully_shard`` per block and root, ``MixedPrecisionPolicy`` in bf16), each block checkpointed
  with `torch.utils.checkpoint.checkpoint` (non-reentrant; ``"selective"``: the same op list as
  plait's, through ``create_selective_checkpoint_contexts``); torch DDP's bf16 is ``torch.autocast``.
* Activation bytes per block (live bytes at consecutive block entries during forward) against
  Korthikanti et al.'s formula and against the same derivation for plait's block
  (`bench.memory_theory`); model-state bytes against the ZeRO formulas.
* Step time of each policy against none (DDP, alternating steps), as a fraction of forward time.

Memory is measured by `bench.live_memory.PeakMeter` (CPU: live tensor storage; CUDA: the
allocator), one step after a warm-up step. Run: ``plait bench memory`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from bench.common import alternate, gpt_config, write_section
from bench.live_memory import LiveStorageBytes, PeakMeter

LAYOUTS = ("ddp", "zero1", "zero2", "zero3", "tp", "tp_sp", "pp")
POLICIES = (None, "full", "selective")
TORCH_LAYOUTS = {"ddp": "torch DDP", "zero3": "torch FSDP2"}


def _cfg(a: dict):
    return gpt_config(a, dropout=a["dropout"])


def _batch(a: dict, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch: data-parallel layouts split the global batch, TP and PP take all of it."""
    g = torch.Generator().manual_seed(1234)
    b = torch.randint(0, 256, (a["batch"], a["seq_len"] + 1), generator=g)
    if layout in ("ddp", "zero1", "zero2", "zero3"):
        b = b.chunk(dist.get_world_size())[dist.get_rank()]
    return b[:, :-1].contiguous(), b[:, 1:].contiguous()


class Runner:
    """One built layout: ``step(meter)`` trains one step; ``forward()`` runs forward and loss only."""

    def __init__(self, model: Any, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                 loss_fn: Callable[..., torch.Tensor], autocast: bool = False) -> None:
        self.model, self.opt, self.x, self.y, self.loss_fn = model, opt, x, y, loss_fn
        self.autocast = autocast
        self.losses: list[float] = []
        self.states: dict[str, int] | None = None  # model-state bytes after backward (when asked)

    def _ctx(self) -> contextlib.AbstractContextManager[Any]:
        return torch.autocast("cpu", torch.bfloat16) if self.autocast else contextlib.nullcontext()

    def forward(self) -> torch.Tensor:
        with self._ctx():
            return self.loss_fn(self.model(self.x), self.y)

    def step(self, meter: PeakMeter | None = None, count_states: bool = False) -> None:
        phase = meter.phase if meter is not None else (lambda _name: None)
        phase("forward")
        if hasattr(self.model, "step"):  # a plait Pipeline: forward and backward of every microbatch
            phase("pipeline")
            loss = self.model.step(self.x, self.y)
        else:
            loss = self.forward()
            phase("backward")
            loss.backward()
        if count_states:
            from plait.fsdp.wrapper import model_state_bytes

            self.states = model_state_bytes(self.model, self.opt)
        phase("optimizer")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(float(loss.item()))


# ---------------------------------------------------------------- building each side
def build(impl: str, layout: str, ac: str | None, bf16: bool, a: dict) -> Runner:
    """``impl`` "plait" or "torch" (DDP and ZeRO-3 only) of ``layout``, checkpointed with ``ac``."""
    from plait.models.gpt import lm_loss

    x, y = _batch(a, layout)
    if impl == "torch":
        model, autocast = _torch_model(layout, ac, bf16, a)
        return Runner(model, _adamw(model.parameters()), x, y, lm_loss, autocast)
    model, loss_fn = _plait_model(layout, ac, bf16, a)
    return Runner(model, _adamw(model.parameters()), x, y, loss_fn)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def _plait_model(layout: str, ac: str | None, bf16: bool, a: dict) -> tuple[Any, Callable[..., Any]]:
    from plait.compose.parallelize import ParallelPlan, parallelize
    from plait.models.gpt import GPT, lm_loss
    from plait.plans import gpt_plan
    from plait.testing import cached_mesh
    from plait.tp.apply import loss_fn_for

    cfg, world = _cfg(a), dist.get_world_size()
    with torch.device("meta"):
        model = GPT(cfg)
    common: dict[str, Any] = dict(ac=ac, mixed_precision="bf16" if bf16 else None)
    if layout == "ddp":
        mesh, plan = cached_mesh(dp=world), ParallelPlan(**common)
    elif layout.startswith("zero"):
        mesh, plan = cached_mesh(fsdp=world), ParallelPlan(data="fsdp", zero_stage=int(layout[-1]), **common)
    elif layout in ("tp", "tp_sp"):
        mesh = cached_mesh(tp=world)
        plan = ParallelPlan(tp=gpt_plan(cfg), sequence_parallel=layout == "tp_sp", **common)
    else:
        mesh = cached_mesh(pp=world)
        plan = ParallelPlan(pp_microbatches=a["microbatches"], loss_fn=lm_loss, **common)
    out = parallelize(model, mesh, plan)
    return out, loss_fn_for(out) if layout.startswith("tp") else lm_loss


def _torch_model(layout: str, ac: str | None, bf16: bool, a: dict) -> tuple[torch.nn.Module, bool]:
    """torch DDP (bf16: autocast) or FSDP2 (bf16: MixedPrecisionPolicy), blocks checkpointed
    with torch.utils.checkpoint; the same initial values as plait's meta-device init."""
    import plait
    from plait.models.gpt import GPT

    model = plait.init_weights(GPT(_cfg(a)), 0)
    if ac is not None:
        for block in model.layers:
            _torch_checkpoint(block, ac)
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model), bf16
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda" if torch.cuda.is_available() else "cpu")
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, False


def _torch_checkpoint(block: torch.nn.Module, policy: str) -> None:
    """torch's activation checkpointing of one block, replacing its forward on the instance (as
    plait does, so parameter names and FSDP2's units stay the same)."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from plait.compose.activation_checkpointing import KEPT_OPS

    kw: dict[str, Any] = dict(use_reentrant=False)
    if policy == "selective":  # save the outputs of the ops plait keeps, recompute the rest
        kw["context_fn"] = partial(create_selective_checkpoint_contexts, sorted(KEPT_OPS, key=str))
    block.forward = partial(checkpoint, block.forward, **kw)  # type: ignore[method-assign]


# ---------------------------------------------------------------- per-rank jobs
def _gpt_of(model: Any):
    from plait.models.gpt import GPT

    mods = model.modules() if isinstance(model, torch.nn.Module) else []
    return next((m for m in mods if isinstance(m, GPT)), None)


def _block_marks(model: Any, meter: PeakMeter) -> list[Any]:
    """Mark live bytes at each block's entry during the step's forward (the blocks' own hooks, e.g.
    FSDP's gathers, run first)."""
    gpt = _gpt_of(model)
    if gpt is None:  # a pipeline: its stages are cut from the model
        return []

    def hook(label: str, _mod: Any, _args: Any) -> None:
        if meter.tracker is None or meter.tracker.phase == "forward":
            meter.mark(label)

    return [b.register_forward_pre_hook(partial(hook, f"block {i}")) for i, b in enumerate(gpt.layers)]


def _live_now() -> int:
    """Live bytes on this rank now (the allocator's count on CUDA)."""
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated()
    return LiveStorageBytes().start


def memory_job(a: dict, configs: list[tuple[str, str, str | None, bool]]) -> list[dict]:
    """Each config built, warmed up one step, then measured for one step, in turn. What earlier
    configs left alive (an uncollectable cycle keeps a deleted plait DDP model; see the report) is
    measured before the build and subtracted: nothing of it is touched by the step measured."""
    out = []
    for impl, layout, ac, bf16 in configs:
        t0 = time.perf_counter()
        gc.collect()
        left = _live_now()
        runner = build(impl, layout, ac, bf16, a)
        runner.step()  # optimizer state exists from here on, as in steady-state training
        gc.collect()
        meter = PeakMeter()
        handles = _block_marks(runner.model, meter)
        with meter:
            runner.step(meter, count_states=impl == "plait" and layout in ("ddp", "zero1", "zero2", "zero3"))
        for h in handles:
            h.remove()
        gc.collect()
        kept = _live_now() - meter.start  # what the step left alive beyond what it started with
        out.append(dict(impl=impl, layout=layout, ac=ac, bf16=bf16, start=meter.start - left,
                        peak=meter.peak - left, left=left, kept=kept,
                        phase=meter.peak_phase, marks=meter.marks, states=runner.states,
                        losses=runner.losses, wall=time.perf_counter() - t0))
        del runner, meter, handles
    return out


def timing_job(a: dict) -> dict[str, dict[str, list[float]]]:
    """DDP steps (forward+backward+AdamW) of every policy on both sides, and forward-only passes,
    strictly alternating after warm-up: wall time (slowest rank) and this process's CPU time (what
    recomputation costs, less disturbed by other jobs on shared cores)."""
    bf16 = a["timing_bf16"]
    runners = {(impl, ac): build(impl, "ddp", ac, bf16, a) for impl in ("plait", "torch") for ac in POLICIES}
    cpu: dict[str, list[float]] = {}

    def cpu_timed(name: str, fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            t0 = time.process_time()
            fn()
            cpu.setdefault(name, []).append(time.process_time() - t0)
        return run

    steps: dict[str, Callable[[], object]] = {}
    for (impl, ac), r in runners.items():
        steps[f"{impl} step {ac}"] = cpu_timed(f"{impl} step {ac}", r.step)
        if ac is None:
            steps[f"{impl} forward"] = cpu_timed(f"{impl} forward", r.forward)
    wall = alternate(steps, warmup=a["warmup"], iters=a["iters"])
    return {"wall": wall, "cpu": {k: v[a["warmup"]:] for k, v in cpu.items()}}


# ---------------------------------------------------------------- driver
def configs(layouts: list[str], precisions: list[bool]) -> list[tuple[str, str, str | None, bool]]:
    out: list[tuple[str, str, str | None, bool]] = []
    for bf16 in precisions:
        for layout in layouts:
            for ac in POLICIES:
                out.append(("plait", layout, ac, bf16))
                if layout in TORCH_LAYOUTS:
                    out.append(("torch", layout, ac, bf16))
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="plait bench memory", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="GPT preset (default small)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch (data-parallel layouts split it)")
    p.add_argument("--dropout", type=float, default=0.1,
                   help="dropout (default 0.1: the masks and the unfused attention the formula counts)")
    p.add_argument("--microbatches", type=int, default=4, help="pipeline microbatches (default 4)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {LAYOUTS}")
    p.add_argument("--precisions", default="fp32,bf16", help="fp32, bf16 or both (default)")
    p.add_argument("--iters", type=int, default=12, help="timed steps per variant (default 12)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timing-bf16", action="store_true", help="time in bf16 (default fp32)")
    p.add_argument("--no-write", action="store_true", help="print only; do not update bench/results")
    ns = p.parse_args(argv)
    layouts = [s for s in ns.layouts.split(",") if s]
    bad = [s for s in layouts if s not in LAYOUTS]
    precisions = [{"fp32": False, "bf16": True}[s] for s in ns.precisions.split(",") if s]
    if bad:
        p.error(f"unknown layouts {bad}; choose from {LAYOUTS}")
    a = {k: getattr(ns, k) for k in ("model", "seq_len", "batch", "dropout", "microbatches", "iters",
                                     "warmup", "timing_bf16", "world")}
    from bench.common import rank_pool
    from bench.memory_report import report

    t0, load0 = time.time(), os.getloadavg()[0]
    pool = rank_pool(ns.world, timeout_s=1200)
    try:
        mem = pool.run(memory_job, a, configs(layouts, precisions))
        t1 = time.time()
        times = pool.run(timing_job, a)[0] if ns.iters > 0 else {}
    finally:
        pool.close()
    a.update(load=(load0, os.getloadavg()[0]), wall=time.time() - t0, mem_wall=t1 - t0)
    body = report(a, mem, times)
    print(body)
    if not ns.no_write:
        write_section("memory", "Memory: peak live memory per rank, activation checkpointing and bf16", body,
                      command=" ".join(["plait bench memory", *argv]))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
