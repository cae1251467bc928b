"""plait tensor parallelism against PyTorch's DTensor tensor parallel, tp=2, one run.

Both sides shard the same GPT in the Megatron pattern: q/k/v and gate/up column-parallel,
o/down row-parallel, the embedding and the lm_head split by vocabulary, and the loss computed
on vocabulary-sharded logits (plait's `vocab_parallel_cross_entropy`; torch's `loss_parallel`).
Torch's side is `parallelize_module` with `ColwiseParallel` / `RowwiseParallel`, as in
torchtitan. Both are built in the same processes from the same initial values, and their
training steps (forward, loss, backward, AdamW) strictly alternate.

Reports the median step-time ratio plait / torch, plait's bytes per step (counted by
`plait.comm`) against the Megatron formula, and torch's collective counts for one step
(`CommDebugMode`). With ``--sequence-parallel`` both sides are also timed with sequence
parallelism (torch: `SequenceParallel` norms and `PrepareModuleInput` regions, as torchtitan).

Run: ``plait bench tp`` (``--help`` for sizes; the defaults take a few minutes on 2 CPUs).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import alternate, markdown_table, median, write_section

WORLD = 2
MIB = 2**20


def _cfg(args: dict):
    from plait.models.gpt import PRESETS, GPTConfig

    base = vars(PRESETS[args["model"]]).copy()
    base.update(seq_len=args["seq_len"])
    return GPTConfig(**base)


def _batch(args: dict) -> tuple[torch.Tensor, torch.Tensor]:
    # Tensor parallelism: every rank of the tp group sees the whole batch.
    g = torch.Generator().manual_seed(1234)
    b = torch.randint(0, 256, (args["batch"], args["seq_len"] + 1), generator=g)
    return b[:, :-1], b[:, 1:]


def _build_plait(args: dict, sequence_parallel: bool):
    from plait.models.gpt import GPT
    from plait.models.plans import gpt_plan
    from plait.testing import cached_mesh
    from plait.tp.apply import loss_fn_for, tensor_parallel

    cfg = _cfg(args)
    with torch.device("meta"):
        model = GPT(cfg)
    model = tensor_parallel(model, cached_mesh(tp=WORLD), gpt_plan(cfg),
                            sequence_parallel=sequence_parallel, seed=0)
    return model, loss_fn_for(model)


def _build_torch(args: dict, sequence_parallel: bool = False):
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

    cfg = _cfg(args)
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
        if sequence_parallel:
            for region in ("attn", "mlp"):
                plan[f"{pre}{region}_norm"] = SequenceParallel()
                plan[f"{pre}{region}"] = PrepareModuleInput(input_layouts=(Shard(1),),
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


def timing_job(args: dict) -> dict:
    from plait import comm

    x, y = _batch(args)
    built = {"plait": _build_plait(args, False), "torch": _build_torch(args)}
    if args["sequence_parallel"]:
        built["plait-sp"] = _build_plait(args, True)
        built["torch-sp"] = _build_torch(args, True)
    losses: dict[str, list[float]] = {k: [] for k in built}
    steps = {}
    for k, (model, loss_fn) in built.items():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        steps[k] = _step_fn(model, loss_fn, opt, x, y, losses[k])
    times = alternate(steps, warmup=args["warmup"], iters=args["iters"])
    out: dict = {"times": times, "losses": losses, "comm": {}}
    for k in steps:
        if k.startswith("plait"):
            comm.reset_stats()
            steps[k]()
            out["comm"][k] = comm.reset_stats().as_dict()
    with _CountFuncol() as counter:
        steps["torch"]()
    out["torch_counts"] = counter.counts
    return out


class _CountFuncol:
    """Counts torch's functional collectives (what DTensor redistributions call) during one step.

    `CommDebugMode` would be the tool, but its module tracker fails on this model in this torch
    version, so the functional-collective entry points are wrapped for the duration instead.
    """

    NAMES = ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single")

    def __enter__(self) -> _CountFuncol:
        import torch.distributed._functional_collectives as funcol

        self.counts: dict[str, list[int]] = {}
        self._saved = {n: getattr(funcol, n) for n in self.NAMES}
        for n, fn in self._saved.items():
            setattr(funcol, n, self._wrap(n, fn))
        return self

    def _wrap(self, name: str, fn):
        def counted(t, *a, **kw):
            calls_bytes = self.counts.setdefault(name, [0, 0])
            calls_bytes[0] += 1
            calls_bytes[1] += t.numel() * t.element_size()
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
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sequence-parallel", action="store_true", help="also time both sides with SP")
    p.add_argument("--no-write", action="store_true", help="print only; do not update bench/results")
    a = p.parse_args(argv)
    args = {k: getattr(a, k) for k in ("model", "seq_len", "batch", "iters", "warmup", "sequence_parallel")}
    from plait.testing import RankPool

    t0 = time.time()
    pool = RankPool(WORLD, timeout_s=900)
    try:
        res = pool.run(timing_job, args)[0]
    finally:
        pool.close()
    body = _report(args, res, time.time() - t0)
    print(body)
    if not a.no_write:
        write_section("tp", "Tensor parallel: plait vs PyTorch DTensor (parallelize_module), tp=2", body,
                      command="plait bench tp " + " ".join(argv))
    return 0


def _theory(args: dict) -> dict[str, float]:
    """Megatron's logical bytes per training step at tp=2 (fp32), without sequence parallelism."""
    cfg = _cfg(args)
    act = args["batch"] * args["seq_len"] * cfg.d_model * 4
    tokens = args["batch"] * args["seq_len"] * 4
    blocks = 4 * cfg.n_layers * act  # 2 all-reduces forward + 2 backward per block
    # Embedding all-reduce (forward), lm_head input all-reduce (backward), and the loss's per-token
    # max and (sum-exp, target logit) all-reduces.
    return {"blocks": blocks, "total": blocks + 2 * act + 3 * tokens}


def _report(args: dict, res: dict, wall: float) -> str:
    cfg = _cfg(args)
    med = {k: median(v) for k, v in res["times"].items()}
    rows = [["median step time (s)", med["plait"], med["torch"], med["plait"] / med["torch"], "<= 0.9"]]
    if "plait-sp" in med:
        rows.append(["median step time (s), both with sequence parallelism", med["plait-sp"],
                     med["torch-sp"], med["plait-sp"] / med["torch-sp"], ""])
    table = markdown_table(["metric", "plait", "torch", "ratio", "target"], rows)
    th = _theory(args)
    c = res["comm"]["plait"]
    ring = 2 * (WORLD - 1) / WORLD
    ar = c.get("all_reduce@tp", {"calls": 0, "bytes": 0, "wire_bytes": 0})
    brows = [["all-reduce calls / step", ar["calls"], 4 * cfg.n_layers + 4,
              "4 per block + embedding + lm_head + 2 in the loss"],
             ["all-reduce logical bytes / step (MiB)", ar["bytes"] / MIB, th["total"] / MIB,
              f"{ar['bytes'] / th['total']:.4f}"],
             ["  of which the blocks' (MiB), 4·L·b·s·h·4", th["blocks"] / MIB, th["blocks"] / MIB, ""],
             ["all-reduce wire bytes / rank / step (MiB), ring 2(n-1)/n", ar["wire_bytes"] / MIB,
              th["total"] * ring / MIB, ""]]
    if "plait-sp" in res["comm"]:
        s = res["comm"]["plait-sp"]
        ag, rs = s.get("all_gather@tp", {}), s.get("reduce_scatter@tp", {})
        ar2 = s.get("all_reduce@tp", {"calls": 0, "bytes": 0})
        # Each all-reduce of X bytes becomes an all-gather + a reduce-scatter of X: the same ring
        # wire bytes, 2(n-1)/n·X (the loss's per-token all-reduces are unchanged).
        sp_theory = (th["total"] - 3 * args["batch"] * args["seq_len"] * 4) * ring
        note = (f"{ag.get('calls', 0)} all-gathers + {rs.get('calls', 0)} reduce-scatters; plus "
                f"{ar2['calls']} small all-reduces (loss, norm-weight gradients)")
        brows.append(["SP: all-gather + reduce-scatter wire bytes / rank / step (MiB)",
                      (ag.get("wire_bytes", 0) + rs.get("wire_bytes", 0)) / MIB, sp_theory / MIB, note])
    btable = markdown_table(["plait communication", "measured", "theory", "note"], brows)
    torch_counts = ", ".join(f"{k}: {v[0]} calls, {v[1] / MIB:.2f} MiB"
                             for k, v in sorted(res["torch_counts"].items())) or "none seen"
    lp, lt = res["losses"]["plait"], res["losses"]["torch"]
    return f"""
GPT preset `{args['model']}` (d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads,
vocabulary {cfg.vocab_size}), seq {args['seq_len']}, batch {args['batch']} on both tp ranks, tp={WORLD}
(Gloo, one thread per rank), AdamW; {args['iters']} timed steps per side after {args['warmup']}
warm-up, strictly alternating; total wall {wall:.0f} s.

{table}

{btable}

Torch's functional collectives in one step (input bytes): {torch_counts}. Its per-layer
`ColwiseParallel` all-reduces the input gradient of q, k, v, gate and up separately (5 per block
in backward); plait's `ParallelRegion` applies Megatron's f once per attention and once per MLP.

Sanity: same initial values and batch on both sides; loss at step 1 plait {lp[0]:.6f}, torch
{lt[0]:.6f}; after step {len(lp)} plait {lp[-1]:.6f}, torch {lt[-1]:.6f}.
"""


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
