"""plait expert parallelism at ep=2 against the same MoE model with replicated experts (ep=1, DDP);
one run.

Variants, all on 2 ranks, with the same GPT MoE config, initial values and global batch (each rank
half the sequences), each trained by forward, loss, backward and AdamW:

* ``ep2``: `plait.parallelize` on ``Mesh(dp=2, ep=2)``: each rank holds half of every layer's
  experts, routed tokens go to their expert's rank and back by all-to-all; DDP averages the dense
  gradients over dp, expert gradients are summed over edp (size 1 here: nothing to reduce);
* ``ep1``: the same on ``Mesh(dp=2)``: every rank holds every expert and DDP all-reduces every
  expert gradient;
* ``torch``: `torch.nn.parallel.DistributedDataParallel` (``find_unused_parameters=True``: an
  expert no local token chose has no gradient) over the plain model, experts replicated.

Dropless routing, so ep=2 computes what ep=1 does: their losses must agree. After the timed
steps, one counted forward + backward per plait variant: bytes by collective and axis
(`plait.comm`) against theory, the token all-to-all's from the routing measured in that step.

Run: ``plait bench moe`` (sizes: ``python -m bench.moe --help``, as ``plait bench`` keeps ``--help`` for
itself; the defaults take about a minute on 2 CPUs).
"""

from __future__ import annotations

import argparse
import os
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

WORLD = 2
MIB = 2**20
DEFAULTS: dict[str, Any] = {"model": "small", "experts": 8, "top_k": 2, "d_expert": 512,
                            "aux_loss_coef": 0.01, "seq_len": 128, "batch": 8, "iters": 20, "warmup": 2}


def _cfg(a: dict):
    return gpt_config(a, n_experts=a["experts"], top_k=a["top_k"], d_expert=a["d_expert"],
                      aux_loss_coef=a["aux_loss_coef"])


def _local_batch(a: dict) -> tuple[torch.Tensor, torch.Tensor]:
    from plait.runtime.env import device

    g = torch.Generator().manual_seed(1234)
    b = torch.randint(0, 256, (a["batch"], a["seq_len"] + 1), generator=g).chunk(WORLD)[dist.get_rank()]
    return b[:, :-1].contiguous().to(device()), b[:, 1:].contiguous().to(device())


class Runner:
    def __init__(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        self.model, self.x, self.y = model, x, y
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        self.losses: list[float] = []

    def loss_and_backward(self) -> torch.Tensor:
        from plait.models.gpt import lm_loss

        loss = lm_loss(self.model(self.x), self.y)
        loss.backward()
        return loss

    def step(self) -> None:
        loss = self.loss_and_backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(float(loss.item()))


def _plait(a: dict, ep: int, x: torch.Tensor, y: torch.Tensor) -> Runner:
    import plait
    from plait.models.gpt import GPT
    from plait.testing import cached_mesh

    with torch.device("meta"):
        model = GPT(_cfg(a))
    net = plait.parallelize(model, cached_mesh(dp=WORLD, ep=ep), plait.ParallelPlan(seed=0))
    assert isinstance(net, torch.nn.Module)
    return Runner(net, x, y)


def _torch(a: dict, x: torch.Tensor, y: torch.Tensor) -> Runner:
    from torch.nn.parallel import DistributedDataParallel

    import plait
    from plait.models.gpt import GPT
    from plait.runtime.env import device

    dev = device()
    model = plait.init_weights(GPT(_cfg(a)), 0).to(dev)  # the values plait's meta-device init gives
    return Runner(DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                          find_unused_parameters=True), x, y)


def _param_bytes(model: torch.nn.Module) -> dict[str, int]:
    from plait.state.placement.records import expert_of

    out = {"dense": 0, "expert": 0, "expert tensors": 0, "buffers": 0}
    for name, p in model.named_parameters():
        expert = expert_of(p) is not None or ".experts." in name  # torch's side has no placements
        out["expert" if expert else "dense"] += p.numel() * p.element_size()
        out["expert tensors"] += expert
    out["buffers"] = sum(b.numel() * b.element_size() for b in model.buffers())
    return out


def _counted(runner: Runner) -> dict[str, Any]:
    """One counted forward + backward: what moved, and each MoE layer's rows received per source
    rank (the dispatch's counts; absent at ep=1, where nothing is dispatched)."""
    from plait import comm
    from plait.ep import ExpertDispatch
    from plait.models.moe import moe_layers

    with comm.counting() as counts:
        runner.loss_and_backward()
        runner.opt.zero_grad(set_to_none=True)
    moved = {k: v for k, v in counts.as_dict().items() if v["bytes"]}
    dispatches = [m.experts_forward for m in moe_layers(runner.model)]
    received = [d.last_counts.sum(1).tolist() for d in dispatches
                if isinstance(d, ExpertDispatch) and d.last_counts is not None]
    return {"moved": moved, "received": received, "params": _param_bytes(runner.model)}


def timing_job(a: dict) -> dict[str, Any]:
    """Every rank: build the variants, time them alternately, then count (untimed)."""
    x, y = _local_batch(a)
    runners = {"ep2": _plait(a, 2, x, y), "ep1": _plait(a, 1, x, y)}
    if not a["no_torch"]:
        runners["torch"] = _torch(a, x, y)
    times = alternate({k: r.step for k, r in runners.items()}, warmup=a["warmup"], iters=a["iters"])
    counts = {k: _counted(runners[k]) for k in ("ep2", "ep1")}
    counts["torch"] = {"params": _param_bytes(runners["torch"].model)} if "torch" in runners else {}
    return {"times": times, "losses": {k: r.losses for k, r in runners.items()}, "counts": counts}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="plait bench moe", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULTS["model"], help="GPT preset for the dense part (default small)")
    p.add_argument("--experts", type=int, default=DEFAULTS["experts"], help="E experts per layer (even)")
    p.add_argument("--top-k", type=int, default=DEFAULTS["top_k"])
    p.add_argument("--d-expert", type=int, default=DEFAULTS["d_expert"], help="each expert's hidden size")
    p.add_argument("--aux-loss-coef", type=float, default=DEFAULTS["aux_loss_coef"])
    p.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"])
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="global batch in sequences (even)")
    p.add_argument("--iters", type=int, default=DEFAULTS["iters"], help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=DEFAULTS["warmup"])
    p.add_argument("--no-torch", action="store_true", help="leave out the torch DDP variant")
    p.add_argument("--no-write", action="store_true", help="print only; do not update bench/results")
    ns = p.parse_args(argv)
    a = {k: getattr(ns, k) for k in DEFAULTS} | {"no_torch": ns.no_torch}
    if a["experts"] % WORLD or a["batch"] % WORLD:
        p.error(f"--experts and --batch must divide by {WORLD} (ep=2, dp=2)")
    res, wall = run_on_ranks(WORLD, timing_job, a)
    body = report(a, res, wall)
    print(body)
    if not ns.no_write:
        write_section("moe", "Expert parallel: plait ep=2 vs replicated experts (plait DDP, torch DDP)", body,
                      command=" ".join(["plait bench moe", *argv]))
    return 0


# ---------------------------------------------------------------- theory and the report
def theory(a: dict, res: list[dict], rank: int, variant: str) -> dict[str, tuple[float, float]]:
    """{op@axis: (logical, wire)} bytes of one forward + backward on ``rank``, fp32.

    Token all-to-all, per MoE layer (ep=2): forward sends the A assignments this rank routed and
    returns the R rows it received, backward the same in reverse, 2(A + R) rows of d_model; on the
    wire the rows a rank keeps (S, sent to its own experts) do not count: 2(A + R - 2S). A is read
    from what the other ranks received from this one. Plus the counts, E int64, forward only (half
    of them to the other rank). All-reduce: DDP's dense buckets on dp; expert gradients in one
    coalesced all-reduce with a had-a-gradient flag per expert tensor (fp32), over edp (dp at ep=1,
    this rank alone at ep=2: nothing launched or counted). Broadcast: DDP's buffers before the forward
    (plait.comm books the whole tensor on every rank's wire).
    """
    c = res[rank]["counts"][variant]
    pb, d, e = c["params"], _cfg(a).d_model, a["experts"]
    experts = pb["expert"] + 4 * pb["expert tensors"]
    out = {"broadcast@dp": (pb["buffers"],) * 2}  # plait.comm books a broadcast's tensor on every rank's wire
    if variant == "ep1":
        out["all_reduce@dp"] = (pb["dense"] + experts,) * 2
        return out
    out["all_reduce@dp"] = (pb["dense"],) * 2  # edp is this rank alone: nothing launched or counted
    logical = wire = 0.0
    for layer, got in enumerate(c["received"]):
        sent = sum(r["counts"][variant]["received"][layer][rank] for r in res)  # A
        kept = got[rank]  # S: rows this rank sent to itself
        logical += 2 * (sent + sum(got)) * d * 4 + e * 8
        wire += 2 * (sent + sum(got) - 2 * kept) * d * 4 + e * 8 * (WORLD - 1) / WORLD
    out["all_to_all@ep"] = (logical, wire)
    return out


def _timing_table(a: dict, res: dict) -> str:
    t = res["times"]
    tokens = a["batch"] * a["seq_len"]
    names = {"ep2": "ep2: plait ep=2", "ep1": "ep1: plait ep=1, replicated experts",
             "torch": "torch: torch DDP, replicated experts"}
    rows: list[list[object]] = [[names[k], median(v), tokens / median(v), "", "", ""] for k, v in t.items()]
    for num, den in (("ep2", "ep1"), ("ep2", "torch"), ("ep1", "torch")):
        if num in t and den in t:
            r = spread(paired_ratios(t[num], t[den]))
            rows.append([f"T({num}) / T({den})", "", "", r.median, f"{r.p25:.3f}-{r.p75:.3f}",
                         f"{r.p10:.3f}-{r.p90:.3f}"])
    return markdown_table(["variant or ratio", "median step (s)", "tokens/s", "median per-step ratio", "IQR",
                           "p10-p90"], rows)


def _bytes_table(a: dict, res: list[dict]) -> str:
    rows: list[list[object]] = []
    for variant in ("ep2", "ep1"):
        for rank, r in enumerate(res):
            want = theory(a, res, rank, variant)
            moved = r["counts"][variant]["moved"]
            for key in sorted(set(moved) | set(want)):
                got = moved.get(key, {"calls": 0, "bytes": 0, "wire_bytes": 0.0})
                logical, wire = want.get(key, (None, None))
                op, axis = key.split("@")
                rows.append([f"{variant}, rank {rank}", f"{op} ({axis})", int(got["calls"]),
                             got["bytes"] / MIB, "" if logical is None else logical / MIB,
                             "" if not logical else got["bytes"] / logical, got["wire_bytes"] / MIB,
                             "" if wire is None else wire / MIB])
    return markdown_table(["variant, rank", "collective (axis)", "calls", "counted logical MiB", "theory MiB",
                           "counted / theory", "counted wire MiB", "theory wire MiB"], rows)


def _routing_table(a: dict, res: list[dict]) -> str:
    rows: list[list[object]] = []
    for layer in range(len(res[0]["counts"]["ep2"]["received"])):
        got = [r["counts"]["ep2"]["received"][layer] for r in res]  # got[j][i]: rows rank j got from rank i
        for i in range(WORLD):
            sent = [got[j][i] for j in range(WORLD)]
            rows.append([layer, i, sum(sent), " / ".join(map(str, sent)), sum(got[i])])
    return markdown_table(["MoE layer", "rank", "A: assignments routed", "sent to rank 0 / 1",
                           "R: rows received"], rows)


def _params_table(res: list[dict]) -> str:
    rows: list[list[object]] = []
    for variant in ("ep2", "ep1", "torch"):
        pb = res[0]["counts"][variant].get("params")
        if pb:
            rows.append([variant, pb["dense"] / MIB, pb["expert"] / MIB, (pb["dense"] + pb["expert"]) / MIB])
    return markdown_table(["variant", "dense MiB", "expert MiB", "total MiB per rank"], rows)


def report(a: dict, res: list[dict], wall: float) -> str:
    cfg = _cfg(a)
    r0 = res[0]
    losses = {k: [sum(r["losses"][k][i] for r in res) / len(res) for i in range(len(r0["losses"][k]))]
              for k in r0["losses"]}
    first = min(3, len(losses["ep2"]))
    shown = sorted({*range(first), len(losses["ep2"]) - 1})
    loss_rows = [[i + 1, *(f"{losses[k][i]:.6f}" for k in losses),
                  f"{losses['ep2'][i] - losses['ep1'][i]:.1e}"] for i in shown]
    worst = max(abs(losses["ep2"][i] - losses["ep1"][i]) for i in range(first))
    tokens = a["batch"] * a["seq_len"]
    return f"""
GPT preset `{a['model']}` for the dense part (d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads}
heads, vocabulary {cfg.vocab_size}), every MLP an MoE of E = {a['experts']} SwiGLU experts of hidden size
{a['d_expert']}, top-{a['top_k']} softmax routing, dropless, auxiliary loss {a['aux_loss_coef']}; global
batch {a['batch']} x {a['seq_len']} = {tokens} tokens (each rank half), 2 ranks (Gloo, one thread each), fp32,
AdamW.
Variants (same initial values and batch): **ep2** plait `Mesh(dp=2, ep=2)`; **ep1** plait
`Mesh(dp=2)`, every expert on both ranks; **torch** torch DDP (`find_unused_parameters=True`) over the
plain model, experts replicated. {a['iters']} timed steps each after {a['warmup']} warm-up, strictly
alternating; ratios are per step (step i over step i): median, interquartile range, 10th-90th
percentiles. Total wall {wall:.0f} s; 1-minute load {a['load'][0]:.1f} at the start, {a['load'][1]:.1f} at the
end ({os.cpu_count()} cores, shared: compare ratios, not absolute times).

{_timing_table(a, r0)}

Parameter bytes per rank (both ranks alike):

{_params_table(res)}

Rank-mean loss at the first steps and the last (dropless ep=2 computes what ep=1 does; the largest
difference between ep2 and ep1 over steps 1-{first}: {worst:.2e}):

{markdown_table(['step', *losses, 'ep2 - ep1'], loss_rows)}

Bytes of one forward + backward per rank (no collective in the optimizer step: this is the step),
counted by `plait.comm` after the timed steps (logical: the tensor reduced, broadcast, or given to
the all-to-all; wire: what the rank sends) against theory. Token all-to-all per MoE layer: 2(A + R)
rows of d_model x 4 bytes (forward the dispatch sends A, the combine returns R; backward the
reverse), plus E int64 counts forward; wire 2(A + R - 2S), S the rows a rank routes to its own
experts, and half of the counts. All-reduce on dp: DDP's dense gradient buckets (ep1: and every
expert gradient in one coalesced all-reduce with a flag per expert tensor); at ep2 that expert
all-reduce runs over edp, which at world 2 is the rank alone (counted logically, nothing sent).
Broadcast: DDP's buffers (rotary tables, expert biases) before each forward. torch DDP's own
collectives are not counted by plait; it all-reduces every gradient, as ep1 does.

{_bytes_table(a, res)}

Routing of the counted step at ep=2 (A from what each rank received from the other, R what it got):

{_routing_table(a, res)}
"""


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
