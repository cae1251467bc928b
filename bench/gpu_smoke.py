"""GPU smoke test: every strategy on one CUDA device (NCCL), each against a single-device run.

Run by hand on a machine with a GPU::

    python bench/gpu_smoke.py            # CUDA + NCCL; exits 1 if any check fails
    python bench/gpu_smoke.py --cpu      # the same checks on CPU + Gloo (what CI can run)
    python bench/gpu_smoke.py --only ddp,fsdp-zero3

Each check trains the tiny GPT for a few AdamW steps under one strategy at world size 1 and
compares the per-step losses with the same model trained plainly on one device, at an explicit
tolerance (looser for bf16 compute). The last check runs 2 ranks on one device. One line per
check (PASS / FAIL / SKIP, seconds, detail), then a markdown summary. Without CUDA and without
``--cpu`` nothing can be checked: every line is SKIP and the exit code is 2.

On CUDA only, ``cp-vs-torch`` then runs ``bench/cp.py``'s variants on 2 GPUs: plait's ring attention
at cp=2 against torch's own ``context_parallel``, which replaces only the CUDA attention kernels
(on CPU it cannot run, so ``--cpu`` leaves it out): the step-time ratio (target <= 0.95) and the
first steps' losses, which must agree.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # a source checkout

import plait  # noqa: E402
from plait.models.gpt import GPT, GPTConfig, lm_loss  # noqa: E402

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)
STEPS, BATCH, SEED, LR = 4, 8, 0, 1e-2
RTOL_FP32 = 2e-4  # reductions in another order (and GPU atomics): fp32 rounding only
RTOL_BF16 = 3e-2  # bf16 compute against an fp32 reference


@dataclass
class Result:
    name: str
    status: str  # PASS | FAIL | SKIP
    seconds: float
    detail: str


class Skip(Exception):
    """A check that cannot run here; the message says why."""


def batches(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    data = [torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len + 1), generator=g) for _ in range(STEPS)]
    return [(b[:, :-1].to(device), b[:, 1:].to(device)) for b in data]


def fresh_model(device: torch.device) -> nn.Module:
    return plait.init_weights(GPT(CFG), SEED).to(device)


def meta_model() -> nn.Module:
    with torch.device("meta"):
        return GPT(CFG)


def train(model: nn.Module, device: torch.device, loss_fn: Callable = lm_loss) -> list[float]:
    """Plain training steps on ``model`` (any wrapper that behaves like a module)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in batches(device):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def compare(got: list[float], want: list[float], rtol: float) -> str:
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    if not worst <= rtol:
        raise AssertionError(f"losses {got} differ from the single-device {want}: relative {worst:.2e} > "
                             f"{rtol:.0e}")
    return f"{len(got)} steps, max relative difference {worst:.1e} (tolerance {rtol:.0e})"


# ------------------------------------------------------------------ the checks
def check_ddp(dev: torch.device, ref: list[float]) -> str:
    return compare(train(plait.DDP(fresh_model(dev), plait.Mesh(dp=1)), dev), ref, RTOL_FP32)


def _fsdp(dev: torch.device, ref: list[float], stage: int, **options: object) -> str:
    model = plait.FSDP(meta_model(), plait.Mesh(fsdp=1), zero_stage=stage, seed=SEED, **options)
    return compare(train(model, dev), ref, RTOL_BF16 if options.get("mixed_precision") else RTOL_FP32)


def check_fsdp_offload(dev: torch.device, ref: list[float]) -> str:
    model = plait.FSDP(meta_model(), plait.Mesh(fsdp=1), zero_stage=3, seed=SEED, offload=True)
    shards = list(model.parameters())
    if any(p.device.type != "cpu" for p in shards):
        raise AssertionError(f"offloaded shards should live on the CPU, found {[p.device for p in shards]}")
    if dev.type == "cuda" and not all(p.is_pinned() for p in shards):
        raise AssertionError("offloaded shards are not in pinned memory (host-to-device copies would block)")
    result = compare(train(model, dev), ref, RTOL_FP32)
    if dev.type != "cuda":
        return f"{result}; shards on the CPU (pinning applies on CUDA only)"
    grads = [p.grad for p in shards if p.grad is not None]
    pinned = sum(g.is_pinned() for g in grads)
    return f"{result}; shards pinned on the CPU; gradients pinned: {pinned}/{len(grads)}"


def check_tensor_parallel(dev: torch.device, ref: list[float]) -> str:
    model = plait.tensor_parallel(meta_model(), plait.Mesh(tp=1), plait.gpt_plan(CFG), seed=SEED)
    return compare(train(model, dev, plait.loss_fn_for(model)), ref, RTOL_FP32)


def check_pipeline(dev: torch.device, ref: list[float]) -> str:
    try:
        pipe = plait.pipeline(meta_model(), plait.Mesh(pp=1), microbatches=2, loss_fn=lm_loss, seed=SEED,
                              device=dev)
    except ValueError as e:
        raise Skip(f"pp=1 is refused: {e}") from None
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    losses = []
    for x, y in batches(dev):
        opt.zero_grad(set_to_none=True)
        losses.append(pipe.step(x, y).item())  # the whole batch as 2 microbatches
        opt.step()
    return compare(losses, ref, RTOL_FP32)


def check_context_parallel(dev: torch.device, ref: list[float]) -> str:
    """plait's ring attention at cp=1 under DDP: its kernel, on this device, on the whole sequence."""
    mesh = plait.Mesh(cp=1)
    model = plait.DDP(plait.context_parallel(fresh_model(dev), mesh, "ring"), mesh)
    return compare(train(model, dev, lambda out, y: lm_loss(out, plait.cp.shard(y, mesh))), ref, RTOL_FP32)


def check_experts(dev: torch.device, ref: list[float]) -> str:
    """An MoE GPT (top-2 of 4 experts) through parallelize's expert path and DDP, against the same
    model trained plainly on this device (its own reference: the dense one's losses differ)."""
    import dataclasses

    cfg = dataclasses.replace(CFG, n_experts=4, top_k=2, n_shared_experts=1, aux_loss_coef=0.01)
    want = train(plait.init_weights(GPT(cfg), SEED).to(dev), dev)
    model = plait.init_weights(GPT(cfg), SEED).to(dev)
    net = plait.parallelize(model, plait.Mesh(dp=1), plait.ParallelPlan())
    return "MoE, " + compare(train(net, dev), want, RTOL_FP32)


def check_data_parallel(dev: torch.device, ref: list[float]) -> str:
    devices: list = list(range(torch.cuda.device_count())) if dev.type == "cuda" else ["cpu", "cpu"]
    model = plait.DataParallel(fresh_model(dev), devices)
    return f"{len(devices)} device thread(s): " + compare(train(model, dev), ref, RTOL_FP32)


def _two_ranks(cpu: bool, cuda_index: int, out: str) -> None:
    """One rank of a 2-rank DDP run on one device; rank 0 writes the per-step mean losses."""
    import os

    if not cpu:  # both ranks on the parent's device, however many GPUs the machine has
        os.environ["CUDA_VISIBLE_DEVICES"] = str(cuda_index)
    dev = plait.init(backend="gloo" if cpu else None, timeout_s=120)
    rank = torch.distributed.get_rank()
    model = plait.DDP(fresh_model(dev), plait.Mesh(dp=2))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)  # each rank its half of the global batch
    losses = []
    for x, y in batches(dev):
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(x[half]), y[half])
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        plait.comm.all_reduce(mean)
        losses.append(mean.item() / 2)
    if rank == 0:
        Path(out).write_text(" ".join(map(str, losses)))


def check_two_ranks_one_device(dev: torch.device, ref: list[float]) -> str:
    import tempfile

    from plait.app.launch import spawn

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "losses")
        index = dev.index if dev.type == "cuda" else -1
        try:
            spawn(_two_ranks, 2, (dev.type != "cuda", index, out), threads=1)
        except Exception as e:
            # Recent NCCL refuses two communicator ranks on one GPU; plait pairs Gloo with CPU
            # tensors only, so there is no other backend to try for CUDA tensors.
            if dev.type == "cuda" and ("Duplicate GPU" in str(e) or "ncclInvalidUsage" in str(e)):
                raise Skip("NCCL refuses two ranks on one GPU (Duplicate GPU detected)") from None
            raise
        losses = [float(v) for v in Path(out).read_text().split()]
    return "2 ranks, DDP: " + compare(losses, ref, RTOL_FP32)


def _cp_ranks(out: str, sizes: dict) -> None:
    """One rank of bench/cp.py's variants, a GPU each (NCCL); rank 0 writes the results."""
    import json

    from bench.cp import timing_job

    plait.init(timeout_s=300)
    res = timing_job(sizes)
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(res))


def compare_cp_with_torch(dev: torch.device, ref: list[float]) -> str:
    import json
    import tempfile

    sys.path.insert(0, str(ROOT))  # bench/ as a package, here and in the spawned ranks
    from bench.common import paired_ratios, spread
    from bench.cp import DEFAULTS
    from plait.app.launch import spawn

    if dev.type != "cuda":
        raise Skip("CUDA only: torch's context_parallel replaces CUDA attention kernels (plait bench cp "
                   "records what it raises on CPU)")
    if torch.cuda.device_count() < 2:  # cp=2 is 2 ranks, and NCCL refuses two ranks on one GPU
        raise Skip(f"needs 2 GPUs for cp=2, found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "cp.json")
        spawn(_cp_ranks, 2, (out, {**DEFAULTS, "iters": 10}))
        res = json.loads(Path(out).read_text())
    if res["torch_error"] is not None:
        raise AssertionError(f"torch's context_parallel failed: {res['torch_error']}")
    t, lo = res["times"], res["losses"]
    mine, theirs = lo["cp2"][:STEPS], lo["torch"][:STEPS]  # rank 0's: the same tokens on both sides
    worst = max(abs(m - w) / abs(w) for m, w in zip(mine, theirs, strict=True))
    if not worst <= RTOL_FP32:
        raise AssertionError(f"rank 0's losses, plait {mine} and torch {theirs}, differ: relative "
                             f"{worst:.2e} > {RTOL_FP32:.0e}")
    r, eff = spread(paired_ratios(t["cp2"], t["torch"])), spread(paired_ratios(t["cp1"], t["cp2"]))
    return (f"step time plait ring cp=2 / torch context_parallel cp=2: median {r.median:.3f} (p10-p90 "
            f"{r.p10:.3f}-{r.p90:.3f}, target <= 0.95); cp=2 efficiency T(cp=1, dp=2) / T(cp=2) "
            f"{eff.median:.3f} (target >= 0.85); {len(mine)} steps' losses agree to {worst:.1e}")


# Comparisons with torch that need CUDA: run after the checks, on CUDA only.
COMPARISONS: dict[str, Callable[[torch.device, list[float]], str]] = {"cp-vs-torch": compare_cp_with_torch}

CHECKS: dict[str, Callable[[torch.device, list[float]], str]] = {
    "ddp": check_ddp,
    "fsdp-zero1": lambda dev, ref: _fsdp(dev, ref, 1),
    "fsdp-zero2": lambda dev, ref: _fsdp(dev, ref, 2),
    "fsdp-zero3": lambda dev, ref: _fsdp(dev, ref, 3),
    "fsdp-bf16": lambda dev, ref: _fsdp(dev, ref, 3, mixed_precision="bf16"),
    "fsdp-offload": check_fsdp_offload,
    "tensor-parallel": check_tensor_parallel,
    "pipeline-pp1": check_pipeline,
    "context-parallel-cp1": check_context_parallel,
    "experts": check_experts,
    "data-parallel": check_data_parallel,
    "two-ranks-one-device": check_two_ranks_one_device,
}


def run_check(name: str, fn: Callable[[torch.device, list[float]], str], dev: torch.device,
              ref: list[float]) -> Result:
    t0 = time.perf_counter()
    try:
        status, detail = "PASS", fn(dev, ref)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    except Skip as e:
        status, detail = "SKIP", str(e)
    except Exception as e:  # a failing check is reported, and the others still run
        status, detail = "FAIL", f"{type(e).__name__}: {e}"
        traceback.print_exc(file=sys.stderr)
    result = Result(name, status, time.perf_counter() - t0, detail.replace("\n", " "))
    print(f"{result.status:4}  {result.name:22} {result.seconds:7.2f}s  {result.detail}", flush=True)
    return result


def summary(results: list[Result], where: str) -> str:
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    lines = [f"## GPU smoke test ({where})", "",
             ", ".join(f"{n} {s}" for s, n in counts.items()), "",
             "| check | result | seconds | detail |", "|---|---|---|---|"]
    lines += [f"| {r.name} | {r.status} | {r.seconds:.2f} | {r.detail} |" for r in results]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run the checks on CPU + Gloo")
    every = {**CHECKS, **COMPARISONS}
    parser.add_argument("--only", default=None, help=f"comma-separated subset of {', '.join(every)}")
    args = parser.parse_args(argv)
    names = list(every) if args.only is None else args.only.split(",")
    unknown = [n for n in names if n not in every]
    if unknown:
        parser.error(f"--only: unknown checks {unknown}; choose from {list(every)}")
    if not args.cpu and not torch.cuda.is_available():
        results = [Result(n, "SKIP", 0.0, "no CUDA device" if n in COMPARISONS else
                          "no CUDA device (pass --cpu to run on CPU + Gloo)") for n in names]
        for r in results:
            print(f"SKIP  {r.name:22} {r.seconds:7.2f}s  {r.detail}")
        print(summary(results, "no CUDA"))
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on both sides of each comparison
    torch.backends.cudnn.allow_tf32 = False
    dev = plait.init(backend="gloo" if args.cpu else None)  # one process: world size 1
    where = "CPU, Gloo" if dev.type == "cpu" else f"{torch.cuda.get_device_name(dev)}, NCCL"
    ref = train(fresh_model(dev), dev)
    results = [run_check(n, CHECKS[n], dev, ref) for n in names if n in CHECKS]
    # On CPU a comparison runs (to say why it skips) only when asked for by name.
    asked = [n for n in names if n in COMPARISONS and (dev.type == "cuda" or args.only is not None)]
    results += [run_check(n, COMPARISONS[n], dev, ref) for n in asked]
    print(summary(results, where))
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
