"""What `plait.check` measures and prints: per-tensor differences, steps, the first divergence.

Every difference is a pair: ``abs``, the largest absolute difference over the tensor's entries,
and ``rel``, the part of it beyond known rounding divided by the tensor's scale (its largest
magnitude in the one-process run, at least the dtype's epsilon). The known rounding is zero but
for gradients, which are read back from parameter updates and carry the update's rounding (see
`update_rounding`). A tensor diverges when ``rel`` is above the tolerance, or is NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

Tolerance = Callable[[int], float]  # the step (0: the initial values) -> the largest relative difference


@dataclass(frozen=True)
class TensorDiff:
    """How far one tensor of the layout is from the one-process run."""

    abs: float  # max |layout - one process| over the entries
    rel: float  # (abs - known rounding) / max |one process|; inf when the shapes differ

    def over(self, tolerance: float) -> bool:
        return not self.rel <= tolerance  # NaN diverges too


@dataclass(frozen=True)
class ActivationDiff:
    """One module output of the layout against the one-process output on the same inputs."""

    module: str  # name in the original model ("" is the model itself)
    call: int  # which call of the module in the step, from 0 (microbatches, modules called twice)
    rank: int
    abs: float
    rel: float
    order: int  # the call's position in the one-process forward: earlier ran first


@dataclass
class StepDiff:
    """One training step of both runs."""

    step: int  # from 1
    loss: float  # the layout's (mean over the data-parallel ranks)
    oracle_loss: float  # the one-process run's, on the same global batch
    loss_rel: float  # |loss - oracle_loss| / |oracle_loss|, beyond the layout loss dtype's rounding
    grads: dict[str, TensorDiff]  # per parameter
    params: dict[str, TensorDiff]  # per state entry, after the step
    compared: int = 0  # module outputs compared, over all ranks
    worst: ActivationDiff | None = None  # the largest relative difference among them
    first: ActivationDiff | None = None  # the earliest output past the tolerance, over all ranks

    @property
    def loss_diff(self) -> float:
        return abs(self.loss - self.oracle_loss)


@dataclass(frozen=True)
class Divergence:
    """Where the layout first left the one-process run."""

    step: int  # 0: the initial values
    kind: str  # "activation", "loss", "gradient", "parameter" or "names"
    module: str  # the module to look at
    parameter: str | None  # the diverging parameter inside it (or the earliest in backward order)
    rank: int | None  # for an activation: the rank whose output diverged
    rel: float
    detail: str

    def describe(self) -> str:
        where = "initial values" if self.step == 0 else f"step {self.step}"
        module = self.module or "(the model's output)"
        param = f", parameter {self.parameter}" if self.parameter else ""
        return f"{where}, module {module}{param}: {self.detail}"


@dataclass
class CheckReport:
    """The comparison of a layout with one process, step by step; ``format()`` prints it."""

    factory: str
    layout: str
    dtype: str
    tolerance: float  # after the last step (the loosest, when an error budget grows with the steps)
    lr: float
    initial: dict[str, TensorDiff]  # state entries before the first step
    steps: list[StepDiff] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # names only one run has
    first: Divergence | None = None
    tolerances: list[float] = field(default_factory=list)  # per step, from 0 (the initial values)
    budget: str = ""  # how the error budget was derived; empty for a tolerance given or float64's
    notes: list[str] = field(default_factory=list)  # why the layout may differ by design (BatchNorm)

    @property
    def ok(self) -> bool:
        return self.first is None

    def tolerance_at(self, step: int) -> float:
        return self.tolerances[step] if step < len(self.tolerances) else self.tolerance

    def _tol(self, value: float) -> str:
        return f"{value:.1e}" if self.budget else f"{value:.0e}"  # a budget's digits are its own

    def format(self) -> str:
        """The report as text: a header, one line per step, a table per parameter and the verdict."""
        lines = [f"plait check {self.factory}: {self.layout} against one process"]
        if self.budget:
            lines += [f"  {self.dtype}, SGD lr {self.lr:g}, {len(self.steps)} steps, tolerance "
                      f"{self.tolerance_at(0):.1e} to {self.tolerance:.1e} (relative to each tensor's "
                      f"largest value, growing with the steps)",
                      f"  {self.budget}"]
        else:
            lines.append(f"  {self.dtype}, SGD lr {self.lr:g}, {len(self.steps)} steps, tolerance "
                         f"{self.tolerance:.0e} (relative to each tensor's largest value)")
        if self.missing:
            lines.append(f"  names in only one of the two state dicts: {', '.join(self.missing)}")
        lines.append(f"  initial values: {len(self.initial)} tensors, largest rel diff "
                     f"{_worst(self.initial)}")
        lines += _step_table(self.steps)
        lines += self._param_table()
        if self.first is None:
            lines.append(f"OK: every loss, gradient, parameter and module output within "
                         f"{self._tol(self.tolerance)}")
        else:
            lines.append(f"first divergence: {self.first.describe()}")
            lines += [f"note: {n}" for n in self.notes]
            lines.append(f"FAILED: differences above the tolerance "
                         f"{self._tol(self.tolerance_at(self.first.step))}")
        return "\n".join(lines)

    def _param_table(self) -> list[str]:
        if not self.steps:
            return []
        at = self.first.step if self.first is not None and self.first.step > 0 else None
        tol = self.tolerance_at(at) if at is not None else self.tolerance
        if at is not None:
            title, grads, params = f"at step {at}, the first divergence", self.steps[at - 1].grads, \
                self.steps[at - 1].params
        else:
            title, grads, params = "the largest over all steps", _max_over(s.grads for s in self.steps), \
                _max_over(s.params for s in self.steps)
        width = max([9, *(len(n) for n in params)])
        out = [f"per parameter, {title} (! = past the tolerance):",
               f"  {'parameter':<{width}}  {'grad abs':>9} {'grad rel':>9}  {'param abs':>9} "
               f"{'param rel':>9}"]
        for name, p in params.items():
            g = grads.get(name)
            mark = "!" if p.over(tol) or (g is not None and g.over(tol)) else " "
            gtxt = f"{g.abs:9.2e} {g.rel:9.2e}" if g is not None else f"{'-':>9} {'-':>9}"
            out.append(f"{mark} {name:<{width}}  {gtxt}  {p.abs:9.2e} {p.rel:9.2e}")
        return out


def _worst(diffs: Mapping[str, TensorDiff]) -> str:
    name = max(diffs, key=lambda n: _key(diffs[n].rel), default=None)
    if name is None or diffs[name].rel == 0:
        return "0"
    return f"{diffs[name].rel:.1e} ({name})"


def _key(x: float) -> float:
    return math.inf if math.isnan(x) else x


def _max_over(rows: Iterable[Mapping[str, TensorDiff]]) -> dict[str, TensorDiff]:
    out: dict[str, TensorDiff] = {}
    for row in rows:
        for name, d in row.items():
            old = out.get(name)
            out[name] = d if old is None or _key(d.rel) > _key(old.rel) else old
    return out


def _step_table(steps: Sequence[StepDiff]) -> list[str]:
    out = [f"  {'step':>4}  {'loss':>14} {'one process':>14} {'|diff|':>8}  {'grad rel':>8}  "
           f"{'param rel':>9}  {'output rel':>10} {'outputs':>7}"]
    for s in steps:
        act = "-" if s.worst is None else f"{s.worst.rel:.1e}"
        out.append(f"  {s.step:>4}  {s.loss:>14.10f} {s.oracle_loss:>14.10f} {s.loss_diff:>8.1e}  "
                   f"{_top(s.grads):>8}  {_top(s.params):>9}  {act:>10} {s.compared:>7}")
    return out


def _top(diffs: Mapping[str, TensorDiff]) -> str:
    return f"{max((_key(d.rel) for d in diffs.values()), default=0.0):.1e}"


# ---------------------------------------------------------------------------- measuring


@torch.no_grad()
def tensor_diff(got: torch.Tensor, want: torch.Tensor, rounding: float = 0.0) -> TensorDiff:
    """``got`` (the layout) against ``want`` (one process); differences up to ``rounding`` (absolute)
    do not count in ``rel``."""
    if got.shape != want.shape:
        return TensorDiff(math.inf, math.inf)
    if want.numel() == 0:
        return TensorDiff(0.0, 0.0)
    g, w = got.detach().to(torch.float64), want.detach().to(device=got.device, dtype=torch.float64)
    same = (g == w) | (g.isnan() & w.isnan())  # equal infinities and NaNs in the same places agree
    d = torch.where(same, torch.zeros_like(g), (g - w).abs())
    a = float(d.max())
    if a == 0:
        return TensorDiff(0.0, 0.0)
    eps = torch.finfo(want.dtype).eps if want.is_floating_point() else 0.0
    scale = max(float(w.nan_to_num(0.0, 0.0, 0.0).abs().max()), eps)
    if math.isnan(a) or scale == 0:
        return TensorDiff(a, math.nan if math.isnan(a) else math.inf)
    return TensorDiff(a, max(0.0, a - rounding) / scale)


def update_rounding(before: torch.Tensor, lr: float) -> float:
    """How far two gradients read back from SGD updates, ``(p - fl(p - lr * g)) / lr``, can differ
    by the updates' rounding alone: an ulp of the largest parameter each, over ``lr``."""
    if not before.is_floating_point() or before.numel() == 0:
        return 0.0
    return 2 * torch.finfo(before.dtype).eps * float(before.abs().max()) / lr


def first_divergence(steps: Sequence[StepDiff], initial: Mapping[str, TensorDiff], missing: Sequence[str],
                     tolerance: float | Tolerance, forward_rank: Mapping[str, int]) -> Divergence | None:
    """The earliest step with anything past ``tolerance`` (one number, or one per step), and the
    culprit in it.

    Within a step: the earliest module output in execution order (forward runs first, and every
    later output inherits its difference), then the loss, then gradients (the earliest in
    backward order: differences flow backward into every earlier layer), then parameters.
    ``forward_rank`` gives each module its position in the one-process forward.
    """
    if missing:
        return Divergence(0, "names", "", None, None, math.inf,
                          f"the layout's full state dict and the one-process state dict differ in "
                          f"{', '.join(missing)}")
    def tol(step: int) -> float:
        return tolerance(step) if callable(tolerance) else tolerance

    bad = _first_over(initial, tol(0))
    if bad is not None:
        return Divergence(0, "parameter", _owner(bad), bad, None, initial[bad].rel,
                          f"the layout starts from other values (rel {initial[bad].rel:.1e})")
    for s in steps:
        found = _in_step(s, tol(s.step), forward_rank)
        if found is not None:
            return found
    return None


def _in_step(s: StepDiff, tol: float, forward_rank: Mapping[str, int]) -> Divergence | None:
    grads = [n for n, d in s.grads.items() if d.over(tol)]
    # Backward order: the parameter whose module ran last in forward first.
    grads.sort(key=lambda n: -forward_rank.get(_owner(n), -1))
    if s.first is not None:
        a = s.first
        inside = [n for n in grads if not a.module or n.startswith(a.module + ".")]
        param = next(iter(inside or grads), None)
        return Divergence(s.step, "activation", a.module, param, a.rank, a.rel,
                          f"its output (call {a.call}) on rank {a.rank} is off by {a.abs:.2e} "
                          f"(rel {a.rel:.1e}){_grad_note(s, param)}")
    if not s.loss_rel <= tol:
        top = next(iter(grads), None)
        where = ("every compared module output agrees: look at the loss function" if s.compared
                 else "module outputs were not compared")
        return Divergence(s.step, "loss", "", top, None, s.loss_rel,
                          f"the loss is off by {s.loss_diff:.2e} (rel {s.loss_rel:.1e}); {where}"
                          f"{_grad_note(s, top)}")
    if grads:
        d = s.grads[grads[0]]
        forward = "every compared module output agrees" if s.compared else "module outputs were not compared"
        return Divergence(s.step, "gradient", _owner(grads[0]), grads[0], None, d.rel,
                          f"{forward}, its gradient is off by {d.abs:.2e} (rel {d.rel:.1e}): the gradient "
                          "reduction or the backward of the layout")
    bad = _first_over(s.params, tol)
    if bad is not None:
        d = s.params[bad]
        return Divergence(s.step, "parameter", _owner(bad), bad, None, d.rel,
                          f"gradients agree, the value after the update is off by {d.abs:.2e} "
                          f"(rel {d.rel:.1e}): the optimizer step on the layout's parameters")
    return None


def _grad_note(s: StepDiff, param: str | None) -> str:
    if param is None:
        return ""
    return f"; gradient of {param} rel {s.grads[param].rel:.1e}"


def _first_over(diffs: Mapping[str, TensorDiff], tol: float) -> str | None:
    return next((n for n, d in diffs.items() if d.over(tol)), None)


def _owner(name: str) -> str:
    return name.rpartition(".")[0]


# ---------------------------------------------------------------------------- BatchNorm


def per_rank_batchnorms(model: torch.nn.Module) -> list[str]:
    """The BatchNorm layers of ``model`` that normalize with the statistics of the rows they see
    (every BatchNorm but `plait.SyncBatchNorm`): per rank in a layout that splits the batch."""
    from plait._torch_compat import BatchNormBase
    from plait.compose.sync_batchnorm import SyncBatchNorm

    return [name for name, m in model.named_modules()
            if isinstance(m, BatchNormBase) and not isinstance(m, SyncBatchNorm)]


def batchnorm_note(names: Sequence[str]) -> str:
    """Why a layout with BatchNorm parts from one process, and the two ways to compare alike."""
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return (f"the model has BatchNorm layers ({shown}): in this layout each rank (or microbatch) normalizes "
            "its own rows with their own statistics, BatchNorm's semantics under data parallelism, while "
            "one process normalizes the whole batch (docs/batchnorm.md). To compare like with like, either "
            "convert them in the factory with plait.SyncBatchNorm.convert_sync_batchnorm(model) (statistics "
            "over every data rank, as one process), or compare against per-rank statistics: a reference "
            "that runs each rank's rows through the BatchNorm layers separately")
