"""plait tensor parallelism against PyTorch's DTensor tensor parallel, tp=2, one run.

Both sides shard the same GPT in the Megatron pattern: q/k/v and gate/up column-parallel,
o/down row-parallel, the embedding and the lm_head split by vocabulary, and the loss computed
on vocabulary-sharded logits (plait's `vocab_parallel_cross_entropy`; torch's `loss_parallel`).
Torch's side is `parallelize_module` with `ColwiseParallel` / `RowwiseParallel`, as in
torchtitan. Both are built in the same processes from the same initial values, and their
training steps (forward, loss, backward, AdamW) strictly alternate.

Two patterns, each compared like for like and reported side by side:

* without sequence parallelism: activations replicated between regions. Megatron: 2 all-reduces
  forward + 2 backward per block. plait's `ParallelRegion` applies Megatron's f once per
  attention and once per MLP; torch gets the same with `PrepareModuleInput` on `attn` and `mlp`
  (q/k/v, and gate/up, then share one replicated input, whose gradient is all-reduced once);
* with sequence parallelism: activations split by sequence between regions, each all-reduce
  becomes an all-gather + a reduce-scatter (torch: `SequenceParallel` norms and
  `PrepareModuleInput` regions, as torchtitan).

A third torch variant, projections parallelized one by one with no region input (torch's
plan when only the linears are named), all-reduces the input gradient of q, k, v, gate and up
separately: 5 backward all-reduces per block instead of 2. It is timed as a reference, not as
the headline. Reports the median of the per-step ratios plait / torch with p10-p90, the
collectives per step of every variant (plait's counted by `plait.comm`, torch's by wrapping its
functional collectives) against Megatron's counts, and plait's bytes against the formula.

Run: ``plait bench tp`` (``--help`` for sizes; the defaults take a few minutes on 2 CPUs).
"""

from __future__ import annotations

import argparse
import os

import torch

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

WORLD = 2
MIB = 2**20


def _batch(args: dict) -> tuple[torch.Tensor, torch.Tensor]:
    # Tensor parallelism: every rank of the tp group sees the whole batch.
    g = torch.Generator().manual_seed(1234)
    b = torch.randint(0, 256, (args["batch"], args["seq_len"] + 1), generator=g)
    return b[:, :-1], b[:, 1:]


def _build_plait(args: dict, sequence_parallel: bool):
    from plait.models.gpt import GPT
    from plait.plans import gpt_plan
    from plait.testing import cached_mesh
    from plait.tp.apply import loss_fn_for, tensor_parallel

    cfg = gpt_config(args)
    with torch.device("meta"):
        model = GPT(cfg)
    model = tensor_parallel(model, cached_mesh(tp=WORLD), gpt_plan(cfg),
                            sequence_parallel=sequence_parallel, seed=0)
    return model, loss_fn_for(model)


def _build_torch(args: dict, sequence_parallel: bool = False, region_input: bool = True):
    """torch's side. ``region_input``: one `PrepareModuleInput` per attention and MLP, so the
    column-parallel projections share their input and its gradient is reduced once (Megatron's
    f); without it each projection reduces its own input gradient (only without SP)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )

    import plait
    from plait.models.gpt import GPT

    cfg = gpt_config(args)
    model = plait.init_weights(GPT(cfg), 0)  # full model on every rank; torch then shards it
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda" if torch.cuda.is_available() else "cpu")
    # Megatron pattern as torchtitan writes it; with SP the activations between the regions
    # are Shard(1) (sequence) and norms run on sequence shards.
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    for i in range(cfg.n_layers):
        pre = f"layers.{i}."
        plan.update({f"{pre}attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")})
        plan[f"{pre}attn.o_proj"] = RowwiseParallel(output_layouts=seq)
        plan.update({f"{pre}mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")})
        plan[f"{pre}mlp.down_proj"] = RowwiseParallel(output_layouts=seq)
        for region in ("attn", "mlp"):
            if sequence_parallel:
                plan[f"{pre}{region}_norm"] = SequenceParallel()
            if sequence_parallel or region_input:
                # The region's input as one replicated DTensor: forward all-gathers it (SP) or
                # passes it through; backward sums the projections' partial input gradients as
                # DTensors, then reduce-scatters (SP) or all-reduces them once.
                plan[f"{pre}{region}"] = PrepareModuleInput(input_layouts=(seq,),
                                                            desired_input_layouts=(Replicate(),))
    model = parallelize_module(model, mesh, plan)

    def loss_fn(logits, targets):
        with loss_parallel():
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return model, loss_fn


def _step_fn(model, loss_fn, opt, x, y, losses: list[float]):
    def step() -> None:
        loss = loss_fn(model(x), y)
        if hasattr(loss, "full_tensor"):  # torch's loss_parallel returns a replicated DTensor
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():
                loss.backward()
            loss = loss.full_tensor()
        else:
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return step


# name -> (side, sequence parallel, torch region input); the pairs below compare equal patterns.
VARIANTS = {
    "plait": ("plait", False, True),
    "torch": ("torch", False, True),
    "plait-sp": ("plait", True, True),
    "torch-sp": ("torch", True, True),
    "torch-per-proj": ("torch", False, False),
}
PAIRS = (("plait", "torch", "without sequence parallelism"),
         ("plait-sp", "torch-sp", "both with sequence parallelism"),
         ("plait", "torch-per-proj", "reference: torch's projections parallelized one by one"))


def _act_bytes(args: dict) -> int:
    """One activation, b·s·h fp32: what each of Megatron's block collectives moves."""
    return args["batch"] * args["seq_len"] * gpt_config(args).d_model * 4


def timing_job(args: dict) -> dict:
    from plait import comm

    x, y = _batch(args)
    built = {}
    for name, (side, sp, region) in VARIANTS.items():
        built[name] = _build_plait(args, sp) if side == "plait" else _build_torch(args, sp, region)
    losses: dict[str, list[float]] = {k: [] for k in built}
    steps = {}
    for k, (model, loss_fn) in built.items():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        steps[k] = _step_fn(model, loss_fn, opt, x, y, losses[k])
    times = alternate(steps, warmup=args["warmup"], iters=args["iters"])
    # One more step of each, counting its collectives (after the timed ones: counting is not timed).
    counts: dict[str, dict[str, list[int]]] = {}
    act = _act_bytes(args)
    for k, step in steps.items():
        if VARIANTS[k][0] == "plait":
            with comm.counting() as counted:
                step()
            counts[k] = {op.split("@")[0]: [int(v["calls"]), round(v["bytes"] / act), int(v["bytes"])]
                         for op, v in counted.as_dict().items() if op.endswith("@tp")}
        else:
            with _CountFuncol(act) as counter:
                step()
            counts[k] = counter.counts
    return {"times": times, "losses": losses, "counts": counts}


class _CountFuncol:
    """Counts torch's functional collectives (what DTensor redistributions call) during one step.

    `CommDebugMode` would be the tool, but its module tracker fails on this model in this torch
    version, so the functional-collective entry points are wrapped for the duration instead.
    Each entry: [calls, activation-sized calls, logical bytes], where a collective is
    activation-sized if its full tensor (gathered or reduced) is one b·s·h activation or more,
    and logical bytes count the full tensor, as `plait.comm` does.
    """

    NAMES = {"all_reduce": "all_reduce", "all_gather_tensor": "all_gather", "all_gather_single": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
             "all_to_all_single": "all_to_all"}

    def __init__(self, act_bytes: int) -> None:
        self.act_bytes = act_bytes
        self.counts: dict[str, list[int]] = {}

    def __enter__(self) -> _CountFuncol:
        import torch.distributed._functional_collectives as funcol

        self._saved = {n: getattr(funcol, n) for n in self.NAMES}
        for n, fn in self._saved.items():
            setattr(funcol, n, self._wrap(self.NAMES[n], fn))
        return self

    def _wrap(self, name: str, fn):
        def counted(t, *a, **kw):
            full = t.numel() * t.element_size() * (WORLD if name == "all_gather" else 1)
            entry = self.counts.setdefault(name, [0, 0, 0])
            entry[0] += 1
            entry[1] += full >= self.act_bytes
            entry[2] += full
            return fn(t, *a, **kw)
        return counted

    def __exit__(self, *exc) -> None:
        import torch.distributed._functional_collectives as funcol

        for n, fn in self._saved.items():
            setattr(funcol, n, fn)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="plait bench tp", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="GPT preset (default small)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="batch (the same on both tp ranks)")
    p.add_argument("--iters", type=int, default=40, help="timed steps per variant (default 40)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-write", action="store_true", help="print only; do not update bench/results")
    a = p.parse_args(argv)
    args = {k: getattr(a, k) for k in ("model", "seq_len", "batch", "iters", "warmup")}
    res, wall = run_on_ranks(WORLD, timing_job, args)
    body = _report(args, res[0], wall)
    print(body)
    if not a.no_write:
        write_section("tp", "Tensor parallel: plait vs PyTorch DTensor (parallelize_module), tp=2", body,
                      command=" ".join(["plait bench tp", *argv]))
    return 0


def _theory(args: dict) -> dict[str, float]:
    """Megatron's logical bytes per training step at tp=2 (fp32), without sequence parallelism."""
    act, tokens = _act_bytes(args), args["batch"] * args["seq_len"] * 4
    blocks = 4 * gpt_config(args).n_layers * act  # 2 all-reduces forward + 2 backward per block
    # Embedding all-reduce (forward), lm_head input all-reduce (backward), and the loss's per-token
    # max and (sum-exp, target logit) all-reduces.
    return {"blocks": blocks, "total": blocks + 2 * act + 3 * tokens}


def _timing_table(res: dict) -> str:
    rows = []
    for mine, theirs, what in PAIRS:
        a, b = res["times"][mine], res["times"][theirs]
        r = spread(paired_ratios(a, b))
        rows.append([what, median(a), median(b), r.median, f"{r.p25:.3f}-{r.p75:.3f}",
                     f"{r.p10:.3f}-{r.p90:.3f}", "<= 0.9" if theirs == "torch" else ""])
    return markdown_table(["pattern", "plait median step (s)", "torch median step (s)",
                           "median per-step ratio plait / torch", "IQR", "p10-p90", "target"], rows)


def _counts_table(args: dict, res: dict) -> str:
    n_layers = gpt_config(args).n_layers
    megatron = 4 * n_layers + 2  # 4 per block (2 forward + 2 backward) + embedding + lm_head
    c = res["counts"]

    def cell(k: str, op: str) -> str:
        calls, act, _ = c[k].get(op, [0, 0, 0])
        return f"{calls} ({act})"

    rows = [["no SP", "all-reduce", megatron, cell("plait", "all_reduce"), cell("torch", "all_reduce")]]
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        rows.append(["SP", op.replace("_", "-"), megatron if op != "all_reduce" else 0,
                     cell("plait-sp", op), cell("torch-sp", op)])
    rows.append(["no SP, torch per projection", "all-reduce", megatron, cell("plait", "all_reduce"),
                 cell("torch-per-proj", "all_reduce")])
    return markdown_table(["pattern", "collective", "Megatron: activation-sized calls",
                           "plait: calls (activation-sized)", "torch: calls (activation-sized)"], rows)


def _bytes_table(args: dict, res: dict) -> str:
    th = _theory(args)
    ar = res["counts"]["plait"].get("all_reduce", [0, 0, 0])
    sp = res["counts"]["plait-sp"]
    sp_bytes = sp.get("all_gather", [0, 0, 0])[2] + sp.get("reduce_scatter", [0, 0, 0])[2]
    sp_theory = 2 * (th["total"] - 3 * args["batch"] * args["seq_len"] * 4)
    rows = [["no SP: all-reduce logical bytes / step (MiB)", ar[2] / MIB, th["total"] / MIB,
             ar[2] / th["total"]],
            ["  of which the blocks' (MiB), 4·L·b·s·h·4", th["blocks"] / MIB, th["blocks"] / MIB, ""],
            ["SP: all-gather + reduce-scatter logical bytes / step (MiB)", sp_bytes / MIB, sp_theory / MIB,
             sp_bytes / sp_theory]]
    return markdown_table(["plait communication", "measured", "Megatron", "ratio"], rows)


def _report(args: dict, res: dict, wall: float) -> str:
    cfg = gpt_config(args)
    lo = res["losses"]
    first = ", ".join(f"{k} {v[0]:.6f}" for k, v in lo.items())
    last = ", ".join(f"{k} {v[-1]:.6f}" for k, v in lo.items())
    return f"""
GPT preset `{args['model']}` (d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, vocabulary
{cfg.vocab_size}), seq {args['seq_len']}, batch {args['batch']} on both tp ranks, tp={WORLD} (Gloo, one
thread per rank), AdamW. {len(VARIANTS)} variants built in the same processes ({", ".join(VARIANTS)});
{args['iters']} timed steps each after {args['warmup']} warm-up, strictly alternating, so step i of every
variant ran back to back. Ratios are per step (step i of plait over step i of torch), reported
as their median, interquartile range and 10th-90th percentiles. Total wall {wall:.0f} s; 1-minute
load average {args['load'][0]:.1f} at the start, {args['load'][1]:.1f} at the end ({os.cpu_count()} cores,
shared with other jobs: compare ratios, not absolute times).

{_timing_table(res)}

Collectives in one training step (forward, loss, backward) on the tp group, Megatron's
count for L = {cfg.n_layers} blocks: without SP 4 all-reduces per block (2 forward, 2 backward)
+ the embedding's (forward) + the lm_head input's (backward) = 4L+2; with SP each of those
becomes an all-gather + a reduce-scatter, 4L+2 of each. Activation-sized: the full tensor is one
b·s·h activation ({_act_bytes(args) / MIB:.2f} MiB; plait's counted as logical bytes / that size).
The rest are small: the loss's per-token all-reduces (plait 2: max, then sum-exp and target
logit together; torch's `loss_parallel` its own), and with SP the norm weights' gradient sums
(2L+1 norms). plait's counts come from `plait.comm.counting()`, torch's from wrapping its
functional collectives.

{_counts_table(args, res)}

Torch's small all-reduces with SP: its `SequenceParallel` leaves each norm weight's gradient
`Partial(sum)` (not reduced in backward), and AdamW's operations on it then reduce it again each
time they read it (3 per norm per step in this torch version, 1 KiB each); plait sums each norm
weight's gradient once, in backward.

Torch's per-projection plan (no region input) all-reduces the input gradient of q, k, v, gate and
up separately, 5 per block in backward instead of Megatron's 2; the headline compares plait with
the torch plan that has Megatron's pattern.

{_bytes_table(args, res)}

Ring wire bytes per rank are the same for both patterns: an all-reduce of X sends 2(n-1)/n·X, an
all-gather and a reduce-scatter of X (n-1)/n·X each.

Sanity: same initial values and batch on all sides; loss at step 1: {first}.
After step {len(lo['plait'])}: {last}.
"""


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
