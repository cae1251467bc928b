"""Pictures of schedules: a text grid for the terminal and Gantt charts (planned and measured).

`Schedule.text` and `Schedule.draw` call these with the schedule itself; they read it through
`Drawable` (and the actions module), not the schedules module that imports them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from plait.pipeline.actions import Action, Costs, Kind, Slot


class Drawable(Protocol):
    """What the pictures read of a `plait.pipeline.Schedule`."""

    @property
    def name(self) -> str: ...
    @property
    def ranks(self) -> int: ...
    @property
    def stages(self) -> int: ...
    @property
    def microbatches(self) -> int: ...
    @property
    def chunks(self) -> int: ...
    @property
    def actions(self) -> tuple[tuple[Action, ...], ...]: ...
    def chunk(self, stage: int) -> int: ...
    def simulate(self, costs: Costs | None = None) -> list[list[Slot]]: ...
    def bubble(self, costs: Costs | None = None) -> float: ...

_COLORS = {Kind.F: "#4c72b0", Kind.B: "#55a868", Kind.BW: "#55a868", Kind.W: "#c44e52"}


def _label(slot: Slot, sched: Drawable) -> str:
    a = slot.action
    kind = "B" if a.kind is Kind.BW else a.kind.value
    chunk = "" if sched.chunks == 1 else "abcdefghij"[sched.chunk(a.stage) % 10]
    return f"{kind}{a.mb}{chunk}" + ("+" if a.overlap else "")


def _pairs(row: Sequence[Slot]) -> list[tuple[Slot, Slot]]:
    """Overlapped (forward, backward) pairs of a rank's placed actions."""
    compute = [s for s in row if s.action.kind.is_compute]
    return [(f, b) for f, b in zip(compute, compute[1:]) if f.action.overlap]


def render_text(sched: Drawable, costs: Costs | None = None) -> str:
    """One line per rank, one cell per time unit of the unit-cost plan (BW spans two cells).

    Cells read ``F3`` (forward of microbatch 3), ``B3``, ``W3``; with several chunks per rank a
    letter names the rank's chunk (``F3a``, ``F3b``: its first and second stage); ``+`` marks a
    forward overlapped with the backward after it (DualPipe's pairs); ``.`` is idle time.
    """
    slots = sched.simulate(costs)
    span = max((s.end for row in slots for s in row), default=0.0)
    width = max([len(_label(s, sched)) for row in slots for s in row
                 if s.action.kind.is_compute] + [1]) + 1
    n = int(round(span))
    lines = [f"{sched.name}: {sched.ranks} ranks, {sched.stages} stages, {sched.microbatches} microbatches, "
             f"planned bubble {sched.bubble(costs):.1%}"]
    for r, row in enumerate(slots):
        cells = ["." * (width - 1)] * n
        for s in row:
            if not s.action.kind.is_compute:
                continue
            for t in range(int(round(s.start)), int(round(s.end))):
                cells[t] = _label(s, sched).ljust(width - 1)
        lines.append(f"rank {r}: " + " ".join(cells))
    return "\n".join(lines)


def draw_png(sched: Drawable, path: str, measured: Sequence[Sequence[Slot]] | None = None,
             costs: Mapping[Kind, float] | None = None) -> str:
    """Save a Gantt chart of ``sched`` (and of a measured step, if given) to ``path``."""
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("plait.pipeline.draw.draw_png needs matplotlib, the pictures' extra: "
                                  "pip install 'plait[viz]'", name=e.name) from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    panels: list[tuple[str, Sequence[Sequence[Slot]], str]] = [
        (f"planned (F = B = W = 1 unit), bubble {sched.bubble(costs):.1%}", sched.simulate(costs), "units")]
    if measured is not None:
        span = max((s.end for row in measured for s in row), default=0.0)
        busy = [sum(s.end - s.start for s in row if s.action.kind.is_compute) for row in measured]
        bub = sum(1 - b / span for b in busy) / len(measured) if span else 0.0
        panels.append((f"measured, bubble {bub:.1%}", measured, "ms"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 1.0 + 0.55 * sched.ranks * len(panels) + 0.6),
                             squeeze=False)
    for ax, (title, rows, unit) in zip(axes[:, 0], panels):
        scale = 1000.0 if unit == "ms" else 1.0
        for r, row in enumerate(rows):
            for s in row:
                a = s.action
                if not a.kind.is_compute:
                    continue
                x0, w = s.start * scale, (s.end - s.start) * scale
                shade = 1.0 - 0.35 * sched.chunk(a.stage) / max(1, sched.chunks - 1)
                ax.broken_barh([(x0, w)], (r - 0.4, 0.8), facecolors=_COLORS[a.kind], alpha=shade,
                               edgecolor="white", linewidth=0.5)
                ax.text(x0 + w / 2, r, _label(s, sched), ha="center", va="center",
                        fontsize=6, color="white")
            for f, b in _pairs(row):  # one frame around each overlapped pair
                ax.add_patch(Rectangle((f.start * scale, r - 0.46), (b.end - f.start) * scale, 0.92,
                                       fill=False, edgecolor="black", linewidth=1.0))
        ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
        ax.invert_yaxis()
        ax.set_xlabel(unit)
        ax.set_title(f"{sched.name}, {sched.microbatches} microbatches: {title}", fontsize=9)
    kinds = [(Kind.F, "forward"), (Kind.B, "backward (input grad, or full)"), (Kind.W, "weight grad")]
    handles = [Patch(color=_COLORS[k], label=lbl) for k, lbl in kinds]
    if any(a.overlap for row in sched.actions for a in row):
        handles.append(Patch(fill=False, edgecolor="black", label="overlapped F + B pair"))
    axes[0, 0].legend(handles=handles, fontsize=7,
                      loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
