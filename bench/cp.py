"""plait context parallelism (ring attention) at cp=2: against torch's own `context_parallel` where
it runs, and against cp=1 with the same attention kernel (scaling efficiency); one run.

Variants, all on 2 ranks, with the same GPT, initial values and global batch (B sequences of S
tokens), each trained by forward, loss, backward and AdamW:

* ``cp2``: `plait.parallelize` with ``ParallelPlan(cp="ring")`` on ``Mesh(cp=2)``: each rank holds
  the zigzag halves of all B sequences (`plait.cp.shard`), ring attention, DDP over cp;
* ``cp1``: the same plan on ``Mesh(dp=2)``, where cp=1: each rank runs the same ring kernel on the
  whole sequence of its B/2 sequences (plain data parallelism);
* ``sdpa`` (reference): dp=2 without context parallelism, torch's own fused attention kernel;
* ``torch``: `torch.distributed.tensor.experimental.context_parallel` at cp=2 on the same model
  (the batch and rotary tables sharded by it, the same zigzag split as plait's), torch DDP over the
  two ranks. It replaces only the CUDA flash / memory-efficient / cuDNN attention ops, so on CPU it
  fails at the first attention: the error is recorded, and the comparison runs in
  ``bench/gpu_smoke.py`` on machines with 2 GPUs.

Scaling efficiency is T(cp1) / T(cp2), step i against step i: the same global work on the same
two ranks, cp=2 paying ring communication where cp=1 pays nothing for attention. Then, untimed:
one step of ring at cp=1 and 2 and of allgather and ulysses at cp=2 with their collectives counted
(`plait.comm`) against theory, and the peak memory of one forward + backward per rank
(`bench.live_memory.PeakMeter`) at cp=1 and cp=2.

Run: ``plait bench cp`` (``--help`` for sizes; the defaults take a few minutes on 2 CPUs).
"""

from __future__ import annotations

import argparse
import gc
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from bench.common import (
    alternate,
    gpt_config,
    markdown_table,
    median,
    paired_ratios,
    run_on_ranks,
    spread,
    write_section,
)
from bench.live_memory import PeakMeter

WORLD = 2
MIB = 2**20
DEFAULTS: dict[str, Any] = {"model": "small", "seq_len": 1024, "batch": 2, "iters": 20, "warmup": 2}
ALGORITHMS = ("ring", "allgather", "ulysses")


def global_batch(a: dict) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    b = torch.randint(0, 256, (a["batch"], a["seq_len"] + 1), generator=g)
    return b[:, :-1].contiguous(), b[:, 1:].contiguous()


def _local(t: torch.Tensor, mesh: Any) -> torch.Tensor:
    """This rank's share: its dp slice of the sequences, then its cp shard of their tokens."""
    import plait
    from plait.runtime.env import device

    dp, i = mesh.size("dp"), mesh.rank("dp")
    n = len(t) // dp
    return plait.cp.shard(t[i * n:(i + 1) * n], mesh).to(device())


class Runner:
    """One variant: ``step()`` trains one step on this rank's batch; ``loss_and_backward()`` is
    the step without the optimizer (for the counted and the measured steps)."""

    def __init__(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                 context: Callable[[], Any] | None = None) -> None:
        self.model, self.x, self.y, self.context = model, x, y, context
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        self.losses: list[float] = []

    def loss_and_backward(self, meter: PeakMeter | None = None) -> torch.Tensor:
        from contextlib import nullcontext

        from plait.models.gpt import lm_loss

        x, y = self.x, self.y
        with (nullcontext() if self.context is None else self.context()) as xy:
            if xy is not None:  # torch's context parallel shards a fresh copy of the batch per step
                x, y = xy
            loss = lm_loss(self.model(x), y)
            if meter is not None:
                meter.mark("after forward")
                meter.phase("backward")
            loss.backward()
        return loss

    def step(self) -> None:
        loss = self.loss_and_backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(float(loss.item()))


def plait_runner(a: dict, mesh: Any, cp: str | None, x: torch.Tensor, y: torch.Tensor) -> Runner:
    import plait
    from plait.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(gpt_config(a))
    net = plait.parallelize(model, mesh, plait.ParallelPlan(cp=cp, seed=0))
    assert isinstance(net, torch.nn.Module)
    return Runner(net, _local(x, mesh), _local(y, mesh))


def _torch(a: dict, x: torch.Tensor, y: torch.Tensor) -> Runner:
    """torch's context parallel at cp=2 over the world: torch DDP averages the two ranks' gradients;
    each step shards a copy of the full batch and the rotary tables (restored after the step)."""
    from contextlib import contextmanager

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.parallel import DistributedDataParallel

    import plait
    from plait.models.gpt import GPT, Rotary
    from plait.runtime.env import device

    dev = device()
    model = plait.init_weights(GPT(gpt_config(a)), 0).to(dev)  # the values plait's meta-device init gives
    world = dist.group.WORLD
    assert world is not None  # after plait.init
    mesh = DeviceMesh.from_group(world, dev.type)
    tables = [t for m in model.modules() if isinstance(m, Rotary) for t in (m.cos, m.sin)]
    x, y = x.to(dev), y.to(dev)

    @contextmanager
    def sharded():
        xs, ys = x.clone(), y.clone()
        with context_parallel(mesh, buffers=[xs, ys, *tables], buffer_seq_dims=[1, 1] + [0] * len(tables),
                              no_restore_buffers={xs, ys}):
            yield xs, ys

    ddp = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    return Runner(ddp, x, y, context=sharded)


def _torch_or_error(a: dict, x: torch.Tensor, y: torch.Tensor) -> tuple[Runner | None, str | None]:
    """torch's side, tried once on the real batch (forward and backward, no update)."""
    runner = _torch(a, x, y)
    try:
        runner.loss_and_backward()
    except (NotImplementedError, RuntimeError) as e:  # raised on every rank alike, before any collective
        return None, f"{type(e).__name__}: {e}".splitlines()[0]
    runner.opt.zero_grad(set_to_none=True)
    return runner, None


def _counted(runner: Runner) -> dict[str, dict[str, float]]:
    """One counted forward + backward: {op@axis: {calls, bytes, wire_bytes}} of what moved."""
    from plait import comm

    with comm.counting() as counts:
        runner.loss_and_backward()
        runner.opt.zero_grad(set_to_none=True)
    return {k: v for k, v in counts.as_dict().items() if v["bytes"]}


def _memory(runner: Runner, whole_batch: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, Any]:
    """Live bytes of one forward + backward over what was live before it: after forward (what is
    saved for backward, and the logits) and at the peak; optionally on another batch."""
    saved = runner.x, runner.y
    if whole_batch is not None:
        runner.x, runner.y = whole_batch
    gc.collect()
    with PeakMeter() as meter:
        runner.loss_and_backward(meter)
    runner.opt.zero_grad(set_to_none=True)
    runner.x, runner.y = saved
    forward = dict(meter.marks)["after forward"]
    return {"tokens": runner.x.numel() if whole_batch is None else whole_batch[0].numel(),
            "forward": forward - meter.start, "peak": meter.peak - meter.start, "phase": meter.peak_phase}


def timing_job(a: dict) -> dict[str, Any]:
    """Every rank: build the variants, time them alternately, then count and measure (untimed)."""
    from plait.runtime.env import device
    from plait.testing import cached_mesh

    x, y = global_batch(a)
    cp2, dp2 = cached_mesh(cp=WORLD), cached_mesh(dp=WORLD)
    torch_side, torch_error = _torch_or_error(a, x, y)
    runners = {"cp2": plait_runner(a, cp2, "ring", x, y), "cp1": plait_runner(a, dp2, "ring", x, y),
               "sdpa": plait_runner(a, dp2, None, x, y)}
    if torch_side is not None:
        runners["torch"] = torch_side
    times = alternate({k: r.step for k, r in runners.items()}, warmup=a["warmup"], iters=a["iters"])
    counts = {"ring cp=2": _counted(runners["cp2"]), "ring cp=1": _counted(runners["cp1"])}
    for algorithm in ALGORITHMS[1:]:
        counts[f"{algorithm} cp=2"] = _counted(plait_runner(a, cp2, algorithm, x, y))
    dev = device()
    memory = {"cp1": _memory(runners["cp1"]),
              "cp1, whole batch": _memory(runners["cp1"], (x.to(dev), y.to(dev))),
              "cp2": _memory(runners["cp2"])}
    return {"times": times, "losses": {k: r.losses for k, r in runners.items()}, "counts": counts,
            "memory": memory, "torch_error": torch_error}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="plait bench cp", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULTS["model"], help="GPT preset (default small)")
    p.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"], help="S, divisible by 4")
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="B, the global batch (even)")
    p.add_argument("--iters", type=int, default=DEFAULTS["iters"], help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=DEFAULTS["warmup"])
    p.add_argument("--no-write", action="store_true", help="print only; do not update bench/results")
    ns = p.parse_args(argv)
    a = {k: getattr(ns, k) for k in DEFAULTS}
    if a["seq_len"] % (2 * WORLD) or a["batch"] % WORLD:
        p.error(f"--seq-len must divide by {2 * WORLD} (zigzag chunks) and --batch by {WORLD} (dp=2)")
    res, wall = run_on_ranks(WORLD, timing_job, a)
    body = report(a, res, wall)
    print(body)
    if not ns.no_write:
        write_section("cp", "Context parallel: plait ring attention at cp=2 vs torch context_parallel and "
                      "cp=1", body, command=" ".join(["plait bench cp", *argv]))
    return 0


# ---------------------------------------------------------------- theory and the report
def theory(a: dict, algorithm: str, cp: int) -> dict[str, float]:
    """Logical bytes per rank of one forward + backward, all attention layers (fp32). plait's GPT
    repeats KV heads to the query heads before attention, so |K, V| counts every query head."""
    if cp == 1:  # one rank holds the whole sequence: the ring has nowhere to send
        return {}
    cfg = gpt_config(a)
    q = a["batch"] * cfg.n_heads * (a["seq_len"] // cp) * cfg.head_dim * 4  # every sequence on every cp rank
    kv, n, layers = 2 * q, cp, cfg.n_layers
    return {"ring": {"send": layers * ((n - 1) * kv + (n - 1) * kv + n * kv)},
            "allgather": {"all_gather": layers * n * kv, "reduce_scatter": layers * n * kv},
            "ulysses": {"all_to_all": layers * 2 * (2 * q + kv)}}[algorithm]


def score_elements(seq: int, cp: int) -> tuple[int, int]:
    """Query-key scores in the blocks the ring kernel attends for one sequence on one rank, and how
    many of them lie in the causal diagonal's blocks: it attends every block a query chunk sees any
    key of and skips the blocks it sees none of."""
    from plait.cp.kernel import NONE, PARTIAL, visibility
    from plait.cp.layout import Layout

    lay = Layout(seq, cp, 0)  # the zigzag split gives every rank the same counts
    blocks = [(q.length * k.length, visibility(q, k, True)) for q in lay.spans() for r in range(cp)
              for k in lay.spans(r)]
    return sum(n for n, kind in blocks if kind != NONE), sum(n for n, kind in blocks if kind == PARTIAL)


def _timing_table(res: dict) -> str:
    t = res["times"]
    rows = []
    pairs = [("cp1", "cp2", "scaling efficiency T(cp=1, dp=2) / T(cp=2)", ">= 0.85"),
             ("sdpa", "cp2", "reference: T(dp=2, torch SDPA kernel) / T(plait cp=2)", ""),
             ("sdpa", "cp1", "reference: T(dp=2, torch SDPA kernel) / T(dp=2, plait ring kernel)", "")]
    for num, den, what, target in pairs:
        if num in t and den in t:
            r = spread(paired_ratios(t[num], t[den]))
            rows.append([what, median(t[num]), median(t[den]), r.median, f"{r.p25:.3f}-{r.p75:.3f}",
                         f"{r.p10:.3f}-{r.p90:.3f}", target])
    if "torch" in t:
        r = spread(paired_ratios(t["cp2"], t["torch"]))
        rows.insert(0, ["plait cp=2 / torch context_parallel cp=2", median(t["cp2"]), median(t["torch"]),
                        r.median, f"{r.p25:.3f}-{r.p75:.3f}", f"{r.p10:.3f}-{r.p90:.3f}", "<= 0.95"])
    return markdown_table(["comparison", "numerator median step (s)", "denominator median step (s)",
                           "median per-step ratio", "IQR", "p10-p90", "target"], rows)


def _bytes_table(a: dict, res: dict) -> str:
    rows = []
    for name, counted in res["counts"].items():
        algorithm, cp = name.split()[0], int(name[-1])
        want = theory(a, algorithm, cp)
        for key, v in counted.items():
            op, axis = key.split("@")
            expect = want.get(op) if axis == "cp" else None
            rows.append([name, f"{op} ({axis})", int(v["calls"]), v["bytes"] / MIB,
                         "" if expect is None else expect / MIB,
                         "" if expect is None else v["bytes"] / expect, v["wire_bytes"] / MIB])
        if not any(k.endswith("@cp") for k in counted) and not want:
            rows.append([name, "(attention)", 0, 0.0, 0.0, "", 0.0])
    return markdown_table(["step", "collective (axis)", "calls", "counted logical MiB", "theory MiB",
                           "counted / theory", "wire MiB sent by one rank"], rows)


def _memory_table(res: list[dict]) -> str:
    per_rank = [r["memory"] for r in res]
    cp2 = max(m["cp2"]["peak"] for m in per_rank)
    rows = []
    for name in per_rank[0]:
        fwd = max(m[name]["forward"] for m in per_rank)
        peak = max(m[name]["peak"] for m in per_rank)
        rows.append([name, per_rank[0][name]["tokens"], fwd / MIB, peak / MIB, per_rank[0][name]["phase"],
                     cp2 / peak])
    return markdown_table(["layout", "tokens per rank", "after forward (MiB)",
                           "peak forward + backward (MiB)", "phase of peak", "cp=2 peak / this peak"], rows)


def report(a: dict, res: list[dict], wall: float) -> str:
    cfg = gpt_config(a)
    r0 = res[0]
    s, b = a["seq_len"], a["batch"]
    (c1, m1), (c2, m2) = score_elements(s, 1), score_elements(s, 2)
    c1, m1, c2, m2 = b // 2 * c1, b // 2 * m1, b * c2, b * m2  # per rank: B/2 whole or B half sequences
    ran = r0["torch_error"] is None
    torch_line = ("ran here: its steps alternate with plait's, in the table below." if ran
                  else f"does not run here: on the first attention it raised `{r0['torch_error']}` (the "
                       "CPU SDPA kernel, `aten._scaled_dot_product_flash_attention_for_cpu`, has no "
                       "context-parallel handler; forcing the math kernel fails too, on the causal mask "
                       "built as a plain tensor beside DTensor inputs). The comparison is in "
                       "`bench/gpu_smoke.py` (`cp-vs-torch`, CUDA with 2 GPUs); here cp=2 is measured "
                       "against cp=1 with the same kernel.")
    losses = {k: [sum(r["losses"][k][i] for r in res) / len(res) for i in (0, -1)] for k in r0["losses"]}
    first = ", ".join(f"{k} {v[0]:.6f}" for k, v in losses.items())
    last = ", ".join(f"{k} {v[1]:.6f}" for k, v in losses.items())
    steps = len(r0["losses"]["cp2"])
    return f"""
GPT preset `{a['model']}` (d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads of
{cfg.head_dim}, vocabulary {cfg.vocab_size}), S = {s} tokens, global batch B = {b}, 2 ranks (Gloo, one
thread each), fp32, AdamW. Variants (same initial values and global batch): **cp2** plait ring
attention at cp=2 (each rank B sequences x S/2 tokens, DDP over cp); **cp1** the same plan on dp=2, so
cp=1: each rank B/2 whole sequences through the same ring kernel; **sdpa** dp=2 with torch's own fused
SDPA kernel (reference).
{a['iters']} timed steps each after {a['warmup']} warm-up, strictly alternating; ratios are per step (step
i over step i), median, interquartile range, 10th-90th percentiles. Total wall {wall:.0f} s; 1-minute load
{a['load'][0]:.1f} at the start, {a['load'][1]:.1f} at the end ({os.cpu_count()} cores, shared: compare
ratios, not absolute times).

torch's `context_parallel` (`torch.distributed.tensor.experimental`, torch {torch.__version__})
{torch_line}

Scaling efficiency = T(cp=1) / T(cp=2) with the same global batch on the same 2 ranks: the standard
T(1 rank) / (2 T(2 ranks)) for the same work, with cp=1 run as dp=2 (each rank half the sequences,
whole) so both use both cores and the same kernel. Per rank both hold B·S/2 tokens, so all but
attention is the same work, nearly: the ring kernel attends each query chunk to each key chunk it
sees any key of, skipping the others, and runs every such block through torch's fused CPU kernel
(all keys visible, or the chunk's own causal diagonal, where it stops at the diagonal). With 2
chunks per rank at cp=1 a rank's blocks hold {c1:,} scores per layer and head, {m1 / c1:.0%} of them
in diagonal blocks (about half of which the fused kernel skips); with 4 finer chunks at cp=2
{c2:,} ({c2 / c1:.3f}x), {m2 / c2:.0%} diagonal. What is left is the ring's cost: the transfers it
does not hide and the merging of blocks. The sdpa rows compare with torch's fused kernel called
once on each whole sequence (no blocks to merge).

{_timing_table(r0)}

Bytes per rank of one forward + backward, counted by `plait.comm` (logical: the tensor sent,
gathered, reduced; wire: what one rank sends) against theory per attention layer times
{cfg.n_layers} layers, with |K,V| = 2·b·heads·s_local·d·4 bytes (KV heads repeated to the query heads
before attention), n = cp: ring (n-1)|K,V| forward, (n-1)|K,V| + n|dK,dV| backward; allgather an
all-gather of n|K,V| and a reduce-scatter of n|dK,dV|; ulysses all-to-alls of Q, K, V and the output
forward and of their gradients backward, 2(2|Q| + |K,V|). The all_reduce and broadcast rows are DDP's,
on the group it averages over (cp at cp=2, dp at cp=1): the gradient average, and the buffers (the
rotary tables) broadcast before each forward; every layout pays them, and they are not attention, so
they have no theory. A recv is the other end of a send (no wire bytes of its own).

{_bytes_table(a, r0)}

Memory per rank of one forward + backward (after the timed steps, gradients freed first), over the
live bytes before it (parameters, AdamW state): after forward (what is saved for backward, and the
logits) and the peak (gradients included), the larger of the two ranks; CPU: live tensor storage
(`bench.live_memory`). **cp1** is the timing's per-rank share (B/2 whole sequences: the same tokens
per rank as cp2); **cp1, whole batch** puts all B whole sequences on one rank: what a rank holds for
the same sequences without context parallelism, against which cp=2 should halve.

{_memory_table(res)}

Sanity: same initial values and global batch; rank-mean loss at step 1: {first}. After step {steps}:
{last}.
"""


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
