"""The layout fuzzer: every layout up to N ranks, each checked against one process.

    plait check mymodels:build --all-layouts --nproc 4
    plait check mymodels:build --sample 5 --seed 3 --nproc 2

A layout is a set of `plait check` flags (`layouts` enumerates them: the data-parallel strategies
with ZeRO-1/2/3 and hybrid sharding, tensor parallelism with and without sequence parallelism,
every pipeline schedule, and their products on every factorisation of the ranks; context
parallelism with each algorithm, expert parallelism, activation checkpointing and mixed precision
on top, alone and, on 4 ranks, with tensor parallelism, a pipeline and FSDP). Which of them can
run is not decided here: each goes through the checks `plait check` itself makes
(`plait.app.check.layout_of`, then `plait.check`'s own before any process starts, and the
refusals of `plait.parallelize` on the ranks), and a refusal is listed as skipped with its reason.
The rest run through `plait.check` (`run_layouts`); the table (`format_table`) has one row per
layout with its worst tensor, and each failure its first divergence.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from plait.check.common import CheckInputError
from plait.check.report import CheckReport
from plait.pipeline.generators import SCHEDULES

Flags = tuple[tuple[str, Any], ...]  # (ParallelSection field, value), in flag order


@dataclass(frozen=True)
class Layout:
    """One layout: `plait train`'s parallel flags (as `ParallelSection` fields) on ``nproc`` ranks."""

    fields: Flags

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.fields)

    @property
    def nproc(self) -> int:
        return int(self.kwargs["nproc"])

    @property
    def label(self) -> str:
        parts = []
        for k, v in self.fields:
            flag = "--" + k.replace("_", "-")
            parts.append(flag if v is True else f"{flag} {v}")
        return " ".join(parts)


@dataclass
class Outcome:
    layout: Layout
    verdict: str  # "OK", "FAIL" (past the tolerance), "ERROR" (a rank failed) or "skipped"
    worst: str = "-"  # the tensor furthest from one process
    rel: float = math.nan  # its relative difference
    detail: str = ""  # why skipped, or where it first diverged
    seconds: float = 0.0
    report: CheckReport | None = field(default=None, repr=False)

    @property
    def failed(self) -> bool:
        return self.verdict in ("FAIL", "ERROR")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _data(rest: int, pp: int, tp: int) -> Iterator[Flags]:
    """The data-parallel strategies over ``rest`` ranks (none only where there are no data ranks)."""
    if rest == 1 and pp * tp > 1:
        yield (("strategy", "none"),)
    yield (("strategy", "ddp"),)
    for zero in (1, 2, 3):
        yield (("strategy", "fsdp"), ("zero_stage", zero))
        for dp in _divisors(rest)[1:-1]:  # hybrid: dp replicas of rest/dp shards
            yield (("strategy", "fsdp"), ("zero_stage", zero), ("dp", dp))


def _pipeline(pp: int) -> Iterator[Flags]:
    if pp == 1:
        yield ()
        return
    for name in SCHEDULES:
        yield (("pp", pp), ("schedule", name), *((("chunks", 2),) if name == "interleaved" else ()))


def _extras(tp: int) -> Iterator[Flags]:
    """What goes on top of a layout: sequence parallelism, then the features `plait check` may refuse."""
    yield ()
    if tp > 1:
        yield (("sequence_parallel", True),)


def _features(n: int) -> Iterator[Flags]:
    yield from ((("cp", n), ("cp_algorithm", a)) for a in ("ring", "allgather", "ulysses"))
    yield (("ep", n),)
    yield from ((("ac", a),) for a in ("full", "selective"))
    yield from ((("mixed_precision", p),) for p in ("bf16", "fp16"))


def _combined(n: int) -> Iterator[Flags]:
    """The features with the other axes, on 4 ranks: cp and ep on 2 of them beside tp, a pipeline or
    FSDP on the other 2, and checkpointing and mixed precision over 4-rank products."""
    if n != 4:
        return
    # (DDP averages the cp ranks' gradients, as it does the data ranks'.)
    halves = ((("strategy", "ddp"), ("nproc", 4), ("tp", 2)),
              (("strategy", "ddp"), ("nproc", 4), ("pp", 2), ("schedule", "1f1b")),
              (("strategy", "fsdp"), ("nproc", 4)))
    yield from ((*h, ("cp", 2)) for h in halves)
    data = ((("strategy", "ddp"), ("nproc", 4), ("tp", 2)), (("strategy", "fsdp"), ("nproc", 4), ("tp", 2)),
            (("strategy", "ddp"), ("nproc", 4), ("pp", 2), ("schedule", "1f1b")))
    yield from ((*d, ("ep", 2)) for d in data)
    whole = ((("strategy", "fsdp"), ("nproc", 4), ("tp", 2)),
             (("strategy", "ddp"), ("nproc", 4), ("pp", 2), ("schedule", "1f1b")),
             (("strategy", "none"), ("nproc", 4), ("tp", 2), ("sequence_parallel", True), ("pp", 2),
              ("schedule", "1f1b")))
    for w in whole:
        yield (*w, ("ac", "full"))
        yield (*w, ("mixed_precision", "bf16"))


def layouts(max_ranks: int) -> list[Layout]:
    """Every layout on 2..``max_ranks`` ranks, valid or not (`run_layouts` sorts them out)."""
    out: list[Layout] = []
    for n in range(2, max_ranks + 1):
        for pp in _divisors(n):
            for tp in _divisors(n // pp):
                for data in _data(n // (pp * tp), pp, tp):
                    for pipe in _pipeline(pp):
                        for extra in _extras(tp):
                            tp_flags = (("tp", tp),) if tp > 1 else ()
                            out.append(Layout((*data, ("nproc", n), *tp_flags, *extra, *pipe)))
        # The features on the plainest layout of n ranks, then with the other axes.
        out += [Layout((("strategy", "ddp"), ("nproc", n), *f)) for f in _features(n)]
        out += [Layout(f) for f in _combined(n)]
    return out


def sample(candidates: Sequence[Layout], k: int, seed: int) -> list[Layout]:
    """``k`` of them, drawn by ``seed``, in their enumeration order."""
    picked = set(random.Random(seed).sample(range(len(candidates)), min(k, len(candidates))))
    return [c for i, c in enumerate(candidates) if i in picked]


Runner = Callable[..., CheckReport]
ToPlan = Callable[[dict[str, Any]], tuple[Any, dict[str, int]]]


def run_layouts(factory: str | Callable[[], Any], candidates: Sequence[Layout], to_plan: ToPlan,
                runner: Runner | None = None, progress: Callable[[Outcome], None] | None = None,
                **check_kwargs: Any) -> list[Outcome]:
    """Check each layout against one process; ``check_kwargs`` go to `plait.check` (steps, dtype, ...).
    ``to_plan`` turns a layout's flags into the plan and mesh degrees or refuses them with a
    ValueError (`plait.app.check.layout_from_flags`, plait check's own validation); ``runner``
    replaces `plait.check` (same signature)."""
    from plait.check.run import check, shared_reference

    run = runner or check
    out = []
    with shared_reference():  # one one-process interpreter for every layout
        for layout in candidates:
            start = time.perf_counter()
            try:
                plan, mesh = to_plan(layout.kwargs)
                report = run(factory, plan, nproc=layout.nproc, mesh=mesh, **check_kwargs)
            except (CheckInputError, ValueError, TypeError) as e:
                result = Outcome(layout, "skipped", detail=str(e).split("\n")[0])
            except RuntimeError as e:
                result = Outcome(layout, "ERROR", detail=str(e).split("\n")[0])
            else:
                result = _outcome(layout, report)
            result.seconds = time.perf_counter() - start
            out.append(result)
            if progress is not None:
                progress(result)
    return out


def _outcome(layout: Layout, report: CheckReport) -> Outcome:
    worst, rel = "-", 0.0
    for s in report.steps:
        rows = [(f"grad {k}", d.rel) for k, d in s.grads.items()] + [(k, d.rel) for k, d in s.params.items()]
        rows.append(("loss", s.loss_rel))
        if s.worst is not None:
            rows.append((f"output {s.worst.module or '(model)'}", s.worst.rel))
        for name, r in rows:
            if math.isnan(r) or r > rel:
                worst, rel = name, math.inf if math.isnan(r) else r
    if report.ok:
        return Outcome(layout, "OK", worst, rel, report=report)
    assert report.first is not None
    return Outcome(layout, "FAIL", worst, rel, report.first.describe(), report=report)


def format_table(outcomes: Sequence[Outcome]) -> str:
    width = max([6, *(len(o.layout.label) for o in outcomes)])
    lines = [f"{'layout':<{width}}  {'worst tensor':<34} {'rel diff':>9}  {'time':>6}  verdict"]
    for o in outcomes:
        rel = "-" if math.isnan(o.rel) else f"{o.rel:.1e}"
        verdict = o.verdict + (f": {o.detail}" if o.detail else "")
        lines.append(f"{o.layout.label:<{width}}  {o.worst[:34]:<34} {rel:>9}  {o.seconds:5.1f}s  {verdict}")
    ran = [o for o in outcomes if o.verdict != "skipped"]
    bad = [o for o in ran if o.failed]
    lines.append(f"{len(ran)} layouts run, {len(bad)} failed, {len(outcomes) - len(ran)} skipped "
                 f"(refused by plait check or plait.parallelize, with the reason)")
    return "\n".join(lines)
