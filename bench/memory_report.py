"""The markdown of `plait bench memory` (bench/memory.py measures; this file only formats)."""

from __future__ import annotations

import os
import statistics
from typing import Any

import torch

from bench.common import gpt_config, markdown_table, spread
from bench.memory_theory import Shape, korthikanti, plait_block, zero_states

MIB, KIB = 2**20, 2**10
ACS = (None, "full", "selective")
ZERO = ("ddp", "zero1", "zero2", "zero3")
FORMULA_LAYOUTS = {"ddp": (1, False), "tp": (2, False), "tp_sp": (2, True)}  # layout -> (t, sp)


def _name(ac: str | None) -> str:
    return ac or "none"


def _index(mem: list[list[dict]]) -> dict[tuple[str, str, str | None, bool], list[dict]]:
    """(impl, layout, ac, bf16) -> one record per rank."""
    out: dict[tuple[str, str, str | None, bool], list[dict]] = {}
    for rank_records in mem:
        for r in rank_records:
            out.setdefault((r["impl"], r["layout"], r["ac"], r["bf16"]), []).append(r)
    return out


def per_block(records: list[dict]) -> tuple[float, float, float] | None:
    """Mean, min and max over blocks (and ranks) of the live bytes one block's forward added: the
    difference between consecutive block entries (every block but the last)."""
    deltas = []
    for r in records:
        vals = [v for _, v in r["marks"]]
        deltas += [b - a for a, b in zip(vals, vals[1:])]
    if not deltas:
        return None
    return statistics.fmean(deltas), min(deltas), max(deltas)


def shape(a: dict, cfg: Any, layout: str, bf16: bool) -> Shape:
    t, sp = FORMULA_LAYOUTS.get(layout, (1, False))
    b = a["batch"] // (a["world"] if layout in ZERO else 1)
    rng = 0 if torch.cuda.is_available() else torch.get_rng_state().numel()
    return Shape(s=a["seq_len"], b=b, h=cfg.d_model, a=cfg.n_heads, kv=cfg.n_kv_heads, f=cfg.d_ff, t=t, sp=sp,
                 e=2 if bf16 else 4, rng=rng)


def _peak_table(idx: dict, layouts: list[str], precisions: list[bool]) -> str:
    rows = []
    for bf16 in precisions:
        for layout in layouts:
            for impl in ("plait", "torch"):
                recs = [idx.get((impl, layout, ac, bf16)) for ac in ACS]
                if recs[0] is None:
                    continue
                peaks = [max(x["peak"] for x in r) / MIB if r else float("nan") for r in recs]
                kept = [max(x["kept"] for x in r) / MIB if r else float("nan") for r in recs]
                rows.append([layout, "bf16" if bf16 else "fp32", impl, *peaks, peaks[1] / peaks[0],
                             peaks[2] / peaks[0], " / ".join(f"{k:.2f}" for k in kept)])
    return markdown_table(["layout", "precision", "impl", "no AC (MiB)", "full (MiB)", "selective (MiB)",
                           "full / none", "selective / none", "left alive by the step (MiB): none / full / "
                           "selective"], rows)


def _ratio_table(idx: dict, precisions: list[bool]) -> tuple[str, dict]:
    rows, ratios = [], {}
    for layout, theirs_name in (("zero3", "FSDP2"), ("ddp", "torch DDP")):
        for bf16 in precisions:
            for ac in ACS:
                ours, theirs = idx.get(("plait", layout, ac, bf16)), idx.get(("torch", layout, ac, bf16))
                if not ours or not theirs:
                    continue
                p, q = max(x["peak"] for x in ours), max(x["peak"] for x in theirs)
                ratios[(layout, ac, bf16)] = p / q
                target = "<= 0.9" if layout == "zero3" and ac == "full" else ""
                rows.append([f"{'ZeRO-3' if layout == 'zero3' else 'DDP'} + {_name(ac)} AC",
                             f"{theirs_name} + {_name(ac)} AC", _prec(bf16), p / MIB, q / MIB, p / q, target])
    return markdown_table(["plait", "torch", "precision", "plait peak (MiB)", "torch peak (MiB)",
                           "plait / torch", "target"], rows), ratios


def _prec(bf16: bool) -> str:
    return "bf16" if bf16 else "fp32"


def _activation_table(idx: dict, a: dict, cfg: Any, precisions: list[bool]) -> tuple[str, dict]:
    rows, dev = [], {}
    for bf16 in precisions:
        for layout, (t, _) in FORMULA_LAYOUTS.items():
            for ac in ACS:
                recs = idx.get(("plait", layout, ac, bf16))
                got = per_block(recs) if recs else None
                if got is None:
                    continue
                x = shape(a, cfg, layout, bf16)
                ours = sum(v for _, v in plait_block(x, ac))
                kor = korthikanti(x, ac)
                dev[(layout, ac, bf16)] = (got[0] / ours, got[0] / kor if bf16 else None)
                rows.append([layout.replace("_", "+").upper(), t, _prec(bf16), _name(ac), got[0] / KIB,
                             f"{got[1] / KIB:.1f}-{got[2] / KIB:.1f}", ours / KIB, got[0] / ours,
                             kor / KIB if bf16 else "- (16-bit formula)", got[0] / kor if bf16 else "-"])
    return markdown_table(["layout", "t", "precision", "AC", "measured KiB / block (mean)", "min-max",
                           "plait's block formula (KiB)", "measured / plait formula",
                           "Korthikanti (KiB)", "measured / Korthikanti"], rows), dev


def _torch_blocks(idx: dict, precisions: list[bool]) -> str:
    rows = []
    for bf16 in precisions:
        for ac in ACS:
            ours, theirs = idx.get(("plait", "ddp", ac, bf16)), idx.get(("torch", "ddp", ac, bf16))
            p, q = (per_block(ours) if ours else None), (per_block(theirs) if theirs else None)
            if p is not None and q is not None:
                rows.append(["DDP", _prec(bf16), _name(ac), p[0] / KIB, q[0] / KIB, p[0] / q[0]])
    return markdown_table(["layout", "precision", "AC", "plait KiB / block", "torch KiB / block",
                           "plait / torch"], rows)


# Korthikanti et al.'s terms (bytes / sbh; the score terms in units of as/h) beside the plait terms
# (`plait_block` names) that play the same part.
_SIDE_BY_SIDE = [
    ("two norms: what they save", 4.0, 0.0, ("RMSNorm inputs in fp32 (2)", "RMSNorm normalised values (2)",
                                           "RMSNorm reciprocal RMS (2)")),
    ("inputs of the QKV and first MLP matmuls", 4.0, 0.0, ("RMSNorm outputs = region inputs (2)",)),
    ("Q, K (for QK^T) and V", 6.0, 0.0, ("attention q, k, v in fp32", "rotary tables")),
    ("attention scores: softmax, dropout mask, dropout output", 0.0, 5.0,
     ("attention softmax and dropout outputs (fp32)", "attention dropout mask")),
    ("output projection input", 2.0, 0.0, ("o_proj input",)),
    ("MLP hidden activations (GELU 4h / SwiGLU d_ff)", 16.0, 0.0, ("MLP: gate, silu, up, product",)),
    ("dropout masks after attention and MLP", 2.0, 0.0, ("dropout masks after o_proj, down_proj",)),
]


def _side_by_side(a: dict, cfg: Any) -> str:
    x = shape(a, cfg, "ddp", True)
    sbh, ash = x.s * x.b * x.h, x.a * x.s / x.h
    terms = dict(plait_block(x, None))
    rows, tk, tp = [], 0.0, 0.0
    for what, k_sbh, k_score, names in _SIDE_BY_SIDE:
        k = k_sbh + k_score * ash
        ours = sum(terms[n] for n in names) / sbh
        tk, tp = tk + k, tp + ours
        rows.append([what, k, ours, ours - k, "; ".join(names)])
    rows.append(["**total per block**", tk, tp, tp - tk, ""])
    return markdown_table(["part", "Korthikanti (bytes / sbh)", "plait block, bf16 on CPU (bytes / sbh)",
                           "difference", "plait terms"], rows)


def _states_table(idx: dict, a: dict, psi: int, precisions: list[bool]) -> str:
    rows = []
    n = a["world"]
    for bf16 in precisions:
        for layout in ZERO:
            recs = idx.get(("plait", layout, None, bf16))
            if not recs or recs[0]["states"] is None:
                continue
            got = max(r["states"]["total"] for r in recs)
            f32, mp = zero_states(psi, n, False)[layout], zero_states(psi, n, True)[layout]
            rows.append([layout, _prec(bf16), got / MIB, f32 / MIB, got / f32, mp / MIB, got / mp])
    return markdown_table(["layout", "precision", "measured MiB / rank", "fp32-Adam formula", "ratio",
                           "mixed-precision-Adam formula", "ratio"], rows)


def _costs(times: dict[str, list[float]], impl: str, ac: str | None) -> tuple[float, str, float]:
    """(median per-iteration cost / forward, its IQR, cost of the medians / median forward)."""
    fwd, base, st = times[f"{impl} forward"], times[f"{impl} step None"], times[f"{impl} step {ac}"]
    per = spread([(x - y) / f for x, y, f in zip(st, base, fwd)])  # iteration i's steps ran back to back
    of_medians = (statistics.median(st) - statistics.median(base)) / statistics.median(fwd)
    return per.median, f"{per.p25:.2f}-{per.p75:.2f}", of_medians


def _timing_table(times: dict[str, dict[str, list[float]]]) -> tuple[str, dict]:
    rows, cost = [], {}
    for impl in ("plait", "torch"):
        for ac in ACS:
            row: list[object] = [impl, _name(ac)]
            for kind in ("cpu", "wall"):
                t = times[kind]
                c, iqr, cm = _costs(t, impl, ac)
                cost[(impl, ac, kind)] = cm
                row += [statistics.median(t[f"{impl} step {ac}"]), statistics.median(t[f"{impl} forward"]),
                        cm if ac else "", c if ac else "", iqr if ac else ""]
            row.append({"full": "about 1", "selective": "< 1"}.get(ac or "", ""))
            rows.append(row)
    head = [f"{k} {w}" for k in ("CPU", "wall") for w in ("step (s)", "forward (s)", "cost / forward",
                                                          "per-iteration cost / forward", "IQR")]
    return markdown_table(["impl", "AC", *head, "expected"], rows), cost


def report(a: dict, mem: list[list[dict]], times: dict[str, dict[str, list[float]]]) -> str:
    from plait.models.gpt import GPT

    cfg = gpt_config(a, dropout=a["dropout"])  # the model bench/memory.py measured
    with torch.device("meta"):
        psi = GPT(cfg).num_parameters()
    idx = _index(mem)
    layouts = list(dict.fromkeys(k[1] for k in idx))
    precisions = list(dict.fromkeys(k[3] for k in idx))
    ratio_md, ratios = _ratio_table(idx, precisions)
    cpu = not torch.cuda.is_available()
    method = ("live tensor storage (`bench.live_memory.LiveStorageBytes`: every storage alive in the "
              "process, Python-held or saved by autograd, at its current size, exact at every op "
              "boundary)" if cpu else "the CUDA caching allocator (`torch.cuda.max_memory_allocated`)")
    parts = [f"""
GPT preset `{a['model']}` (Ψ = {psi / 1e6:.2f}M parameters; h {cfg.d_model}, {cfg.n_heads} heads, d_ff
{cfg.d_ff}, {cfg.n_layers} blocks), seq {a['seq_len']}, global batch {a['batch']} (DDP/ZeRO ranks get
{a['batch'] // a['world']} sequences, TP and PP ranks all {a['batch']}; PP in {a['microbatches']}
microbatches, 1F1B), dropout {a['dropout']}, world {a['world']}, AdamW. Peak live memory per rank is
measured by {method} over one step (forward, backward, AdamW) after a warm-up step, so optimizer
state exists; the figure is the larger of the ranks'. Each configuration is built, measured and
freed in turn in the same processes, plait's and torch's alike. Memory part {a['mem_wall']:.0f} s,
total wall {a['wall']:.0f} s; 1-minute load {a['load'][0]:.1f} at the start, {a['load'][1]:.1f} at
the end ({os.cpu_count()} cores, shared with other jobs).

### Peak live memory per rank

plait: `plait.parallelize` with `ParallelPlan(ac=..., mixed_precision=...)` (DDP; ZeRO-1/2/3 =
`data="fsdp", zero_stage=k`; TP = `gpt_plan`, tp=2; TP+SP; PP = pp=2, 1F1B). torch:
`torch.nn.parallel.DistributedDataParallel` (bf16: `torch.autocast`, which keeps the residual
stream and the norms in fp32) and FSDP2 (`fully_shard` per block and root; bf16:
`MixedPrecisionPolicy(bfloat16, float32)`), every block checkpointed by `torch.utils.checkpoint`
(non-reentrant; selective: `create_selective_checkpoint_contexts` with plait's op list). torch has
no ZeRO-1/2 of the same kind, and its TP and pipeline APIs are compared in `plait bench tp|pp`, so
those rows are plait only.

{_peak_table(idx, layouts, precisions)}

{_leak_text(idx)}

### plait against torch with the same checkpointing

{ratio_md}

{_fsdp_text(idx, ratios, precisions)}
"""]
    parts.append(_activation_section(idx, a, cfg, precisions))
    parts.append(f"### Model states per rank (after backward: parameters, gradients, AdamW state)\n\n"
                 f"{_states_table(idx, a, psi, precisions)}\n\nplait's mixed precision keeps the fp32 "
                 "master weights *as the parameters*, and fp32 gradients (`plait.state.precision`, and "
                 "FSDP's fp32 shards), so in bf16 its model states follow the fp32-Adam formula, not the "
                 "mixed-precision one (which assumes 16-bit parameters and gradients besides the fp32 "
                 "copies); the 16-bit copies of the parameters exist only while a forward and its "
                 "backward use them and count as activations. The two formulas coincide for DDP and "
                 "ZeRO-3.\n")
    if times:
        parts.append(_timing_section(a, times))
    return "\n".join(parts)


def _leak_text(idx: dict) -> str:
    """What the measured step left alive (after a garbage collection) beyond what it started with."""
    def worst(impl: str, ac: bool) -> float:
        vals = [r["kept"] for k, recs in idx.items() if k[0] == impl and (k[2] is not None) == ac
                for r in recs]
        return max(vals, default=0) / MIB

    left = max((r["left"] for recs in idx.values() for r in recs), default=0) / MIB
    return (f"Left alive by one step, after a garbage collection: plait with checkpointing up to "
            f"{worst('plait', True):.2f} MiB per step, plait without {worst('plait', False):.2f} MiB, torch "
            f"with checkpointing {worst('torch', True):.2f} MiB (torch DDP allocates its rebuilt gradient "
            "buckets once, in its second step, the one measured). A step that leaves memory behind with "
            "checkpointing is a leak of recomputed activations (this column found one in plait: a "
            "recomputed node holding its own output through a pack hook, in a cycle through autograd's "
            "C++ graph; fixed, and guarded by tests/test_activation_checkpointing.py). Up to "
            f"{left:.1f} MiB of earlier configurations was still alive when one was built, and is "
            "subtracted from its figures (the step never touches it).")


def _fsdp_text(idx: dict, ratios: dict, precisions: list[bool]) -> str:
    lines = []
    for bf16 in precisions:
        ours, theirs = idx.get(("plait", "zero3", "full", bf16)), idx.get(("torch", "zero3", "full", bf16))
        if not ours or not theirs:
            continue
        po, pt = max(ours, key=lambda r: r["peak"]), max(theirs, key=lambda r: r["peak"])
        r = ratios[("zero3", "full", bf16)]
        lines.append(
            f"* {_prec(bf16)}: ZeRO-3 + full AC / FSDP2 + full AC = **{r:.3f}** (target <= 0.9: "
            f"{'met' if r <= 0.9 else 'not met'}). Live at the step's start: plait "
            f"{po['start'] / MIB:.1f} MiB, torch {pt['start'] / MIB:.1f} MiB (the same fp32 parameter and "
            f"AdamW shards); above that start plait peaks "
            f"{(po['peak'] - po['start']) / MIB:.2f} MiB higher (in {po['phase']}), torch "
            f"{(pt['peak'] - pt['start']) / MIB:.2f} MiB (in {pt['phase']}).")
    if not lines:
        return ""
    return ("\n".join(lines) + "\n\nBoth start from the same model states (fp32 parameter and AdamW "
            "shards), so the ratio is set by what each adds above them in backward: the checkpointed "
            "blocks' inputs, one block's recomputed activations and its gradients, and the gathered "
            "parameters of the unit in hand. plait adds less than torch, but not enough for the 0.9 "
            "target at this size, where the model states are about a third of the peak. Without "
            "checkpointing the two peaks are equal within 1%.")


def _activation_section(idx: dict, a: dict, cfg: Any, precisions: list[bool]) -> str:
    act_md, dev = _activation_table(idx, a, cfg, precisions)
    x = shape(a, cfg, "ddp", True)
    worst = max((abs(v[0] - 1) for v in dev.values()), default=0.0)

    def kor(ac: str | None) -> str:
        vals = [v[1] for (_, c, bf16), v in dev.items() if c == ac and v[1] is not None]
        return f"{min(vals):.3f}-{max(vals):.3f}" if vals else "-"

    return f"""### Activation bytes per block

Measured: the live bytes one block's forward adds, i.e. the difference between consecutive block
entries during the step's forward (over every block but the last, and both ranks): what the block
keeps for backward, its output replacing its input. Korthikanti et al. 2022 (16-bit): sbh(34 +
5as/h) without parallelism, sbh(10 + 24/t + 5as/(ht)) with TP, sbh(34 + 5as/h)/t with TP+SP; their
selective recomputation drops the 5as/h term; full recomputation keeps 2sbh (2sbh/t with SP).
plait's block formula: `bench.memory_theory.plait_block`, derived element by element from what
autograd saves in `plait.models.gpt.Block` (and checked byte-exact on a tiny block by
`tests/test_bench_memory.py`). Target: within 5%.

{act_md}

**Result.** plait's own block formula holds everywhere: the largest deviation is {100 * worst:.2f}%
(it is exact without checkpointing; with checkpointing the RNG states a block keeps are counted).
Korthikanti's formula holds for full recomputation only (measured / Korthikanti {kor('full')}: the
2sbh input plus the {x.rng}-byte CPU generator state, and under TP the per-rank stream's, that each
checkpointed block keeps to replay its dropout, which is 2-4% at this small size). Without
checkpointing plait's block keeps {kor(None)} times Korthikanti's count, and with `"selective"`
{kor('selective')} of *their* selective count, because the block and the policy are not theirs:

{_side_by_side(a, cfg)}

(s={x.s}, b={x.b}, h={x.h}, a={x.a}, d_ff={x.f}: 5as/h = {5 * x.a * x.s / x.h:.1f}.) The differences:
RMSNorm computes in fp32 and saves its fp32 input and its bf16 normalised value (a 16-bit LayerNorm
saves its 2-byte input); with dropout on, torch's CPU attention is the unfused math kernel, which
upcasts q, k and v to fp32 (12 sbh where Korthikanti counts 6) and keeps 12 bytes per score (fp32
softmax output, fp32 dropout noise, fp32 dropout output; Korthikanti 2 + 1 + 2); CPU dropout saves
its scaled noise in the input's dtype, 2 bytes per element where CUDA's `native_dropout` keeps a
1-byte mask; the MLP is SwiGLU with d_ff = {x.f / x.h:.2f}h, four d_ff-wide tensors (8·d_ff/h =
{8 * x.f / x.h:.1f} sbh) where GELU over 4h keeps 16; and the rotary tables cast to bf16 add a little. The
fused attention kernels keep no scores but need dropout off on CPU, which would also remove the
masks Korthikanti counts. plait's `"selective"` is torchtitan's op-level policy (keep every matmul
output, recompute norms, activations, dropout and the attention core), so it keeps less than their
selective recomputation (everything but the attention core): their column is a bound for theirs.

Per block, plait and torch with the same policy (DDP; torch's bf16 is autocast, whose cast-weight
cache holds each block's bf16 weights from its forward to its backward, and whose residual stream
stays fp32; FSDP layouts are left out: their gathers move between block entries):

{_torch_blocks(idx, precisions)}
"""


def _timing_section(a: dict, times: dict[str, dict[str, list[float]]]) -> str:
    t_md, cost = _timing_table(times)
    lines = [f"{impl} {_name(ac)}: {cost[(impl, ac, 'cpu')]:.2f} (wall {cost[(impl, ac, 'wall')]:.2f})"
             for impl in ("plait", "torch") for ac in ("full", "selective")]
    return f"""### Step-time cost of recomputation (DDP, {_prec(a['timing_bf16'])})

{a['iters']} timed iterations after {a['warmup']} warm-up; in each iteration every variant (plait and
torch, each with no AC, full and selective, and a forward-only pass of each side's no-AC model) ran
once, back to back. A policy's cost is (its step - the no-AC step) / the no-AC forward: from the
medians ("cost / forward"), and per iteration (median and IQR). CPU time is the rank's process time
(what recomputation adds in compute, little disturbed by other jobs on shared cores); wall time is
the slowest rank's.

{t_md}

Cost / forward from the CPU-time medians (wall in brackets): {'; '.join(lines)}. Full recomputation
runs each block's forward once more in backward, about one forward (less the embedding, head and
loss, which are not recomputed); selective recomputes only the cheap ops.
"""
