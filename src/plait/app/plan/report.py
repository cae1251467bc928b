"""`plait plan`'s output: tables for people, and a picture of the memory per rank."""

from __future__ import annotations

from typing import Any

from plait.app.config import TrainConfig
from plait.app.plan.cluster import Cluster
from plait.app.plan.predict import Prediction, breakdown_rows, size
from plait.app.plan.rehearse import CATEGORIES

GIB, MIB = 2**30, 2**20


_b = size


def _s(t: float) -> str:
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def layout_text(flags: dict[str, Any]) -> str:
    return " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in flags.items())


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def format_prediction(p: Prediction, cluster: Cluster, cfg: TrainConfig) -> str:
    stages = [f"stage {m['stage']} (rank {m['rank']})" for m in p.memory]
    rows = [[c, *(_b(v) for v in vals)] for c, vals in breakdown_rows(p)]
    rows.append(["peak", *(_b(m["peak"]) for m in p.memory)])
    blocks = [m["activations_per_block"] for m in p.memory]
    # Net of what the block's forward frees (FSDP's gathered unit), so it can be below zero.
    rows.append(["live bytes a block's forward adds", *(_b(b[0]) if b else "-" for b in blocks)])
    rows.append(["blocks on the rank", *(str(len(b)) for b in blocks)])
    if cfg.parallel.pp > 1:
        rows.append(["microbatches in flight (most)", *(str(m["microbatches_in_flight"]) for m in p.memory)])
    rows.append(["between steps: parameters", *(_b(m["parameters"]) for m in p.memory)])
    rows.append(["between steps: gradients", *(_b(m["gradients"]) for m in p.memory)])
    rows.append(["between steps: optimizer state", *(_b(m["optimizer"]) for m in p.memory)])
    total = sum(p.time.values()) or 1.0
    times = [[k, _s(v), f"{v / total:.0%}"] for k, v in p.time.items()]
    comm = [[axis, _b(b)] for axis, b in sorted(p.comm_bytes.items())]
    verdict = "fits" if p.fits else "does NOT fit: " + "; ".join(p.reasons)
    return "\n\n".join([
        f"plait plan: {cfg.model.hf_config or cfg.model.name}, global batch {cfg.data.batch_size} x "
        f"{cfg.seq_len} tokens, {layout_text(p.flags)}\n"
        f"cluster {cluster.name}: {cluster.nodes} x {cluster.devices_per_node} devices, "
        f"{cluster.memory_gib:g} GiB, {cluster.peak_tflops:g} TFLOP/s at {cluster.efficiency:.0%}",
        "memory per rank at the peak of a step\n" + _table(["", *stages], rows),
        f"step time {_s(p.step_s)} ({p.tokens_per_s:,.0f} tokens/s)\n"
        + _table(["where the time goes", "", ""], times),
        "bytes each rank sends per step, by axis\n" + (_table(["axis", "sent"], comm) if comm else "(none)"),
        f"peak {_b(p.peak_bytes)} per rank of {cluster.memory_gib:g} GiB: {verdict}"])


def format_search(result: Any, cluster: Cluster, top: int) -> str:
    rows = [[str(i + 1), layout_text(p.flags), _s(p.step_s), f"{p.tokens_per_s:,.0f}", _b(p.peak_bytes),
             max(p.time, key=lambda k: p.time[k])] for i, p in enumerate(result.ranked[:top])]
    out = [f"plait plan --search on {cluster.name}, {cluster.nodes} x {cluster.devices_per_node} devices of "
           f"{cluster.memory_gib:g} GiB: {len(result.ranked)} layouts fit, {len(result.rejected)} rejected"]
    if rows:
        out.append(_table(["#", "layout", "step", "tokens/s", "peak/rank", "most time in"], rows))
    rejected = [[layout_text(r["flags"]), r["reason"]] for r in result.rejected[: max(top, 10)]]
    if rejected:
        out.append("rejected (first ones)\n" + _table(["layout", "why"], rejected))
    return "\n\n".join(out)


def format_dry_run(report: dict[str, Any], cfg: TrainConfig) -> str:
    rows = [[str(s["stage"]), str(s["rank"]), f"{s['parameters']:,}", _b(s["parameter_bytes"]),
             _b(s["gradient_bytes"]), _b(s["optimizer_bytes"]), str(s["groups"]), f"{s['seconds']:.1f} s"]
            for s in report["stages"]]
    mesh = report["stages"][0]["mesh"]
    return (f"plait plan --dry-run: {cfg.model.hf_config or cfg.model.name} built on the meta device as one "
            f"rank per pipeline stage of a world of {report['world']} (mesh {mesh}); nothing allocated\n"
            + _table(["stage", "rank", "parameters", "parameter bytes", "gradient bytes", "optimizer bytes",
                      "groups", "built in"], rows))


def write_picture(preds: list[Prediction], path: str) -> str:
    """Stacked bars of each layout's memory per stage at the peak (one bar per stage)."""
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("plait plan's picture needs matplotlib, the pictures' extra: "
                                  "pip install 'plait[viz]'", name=e.name) from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, stacks = [], []
    for p in preds:
        for m in p.memory:
            labels.append(f"{layout_text(p.flags)}\nstage {m['stage']}")
            stacks.append([m["at_peak"][c] / GIB for c in CATEGORIES])
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels)), 5))
    bottom = [0.0] * len(labels)
    for i, c in enumerate(CATEGORIES):
        vals = [s[i] for s in stacks]
        ax.bar(range(len(labels)), vals, bottom=bottom, label=c)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("GiB per rank at the peak")
    ax.set_title("plait plan: memory per rank")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
