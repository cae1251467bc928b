"""What both sides of a check share: the arguments, the model and its loss, and the folder through
which the one-process run hands each step's results to the layout's ranks."""

from __future__ import annotations

import dataclasses
import importlib
import os
import pickle
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.compose.parallel_plan import ParallelPlan
from plait.runtime.env import seed_everything

LossFn = Callable[[Any, Any], torch.Tensor]
BatchFn = Callable[[int], Any]


class CheckInputError(ValueError):
    """The check cannot run what it was given: the factory, its model or batches, or the layout."""


@dataclasses.dataclass(frozen=True)
class Spec:
    """Everything either side needs, picklable (the factory travels by name when it is a string)."""

    factory: Callable[[], Any] | str
    label: str
    plan: ParallelPlan
    degrees: dict[str, int]  # every axis, resolved for the world size, and ep
    steps: int
    dtype: torch.dtype
    tolerance: float | None  # None: the error budget (`plait.check.budget`)
    batch_size: int
    seq: int
    vocab: int | None
    lr: float
    seed: int
    activations: bool
    backend: str | None = None  # for `plait.init`: None picks NCCL on GPUs, "gloo" keeps to the CPU

    @property
    def data_size(self) -> int:
        """Ranks that see different slices of the batch."""
        return self.degrees["dp"] * self.degrees["fsdp"]

    @property
    def microbatches(self) -> int:
        return self.plan.pp_microbatches if self.degrees["pp"] > 1 else 1


def load_factory(factory: Callable[[], Any] | str) -> Callable[[], Any]:
    """The factory itself, or the function a ``"package.module:function"`` string names."""
    if callable(factory):
        return factory
    mod_name, colon, attr = factory.partition(":") if isinstance(factory, str) else ("", "", "")
    if not (mod_name and colon and attr) or ":" in attr:
        raise CheckInputError(f"FACTORY must name a function as 'package.module:function' (e.g. "
                              f"'mymodels:build'), got {factory!r}")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as e:
        raise CheckInputError(f"FACTORY {factory!r}: cannot import module {mod_name!r}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CheckInputError(f"FACTORY {factory!r}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CheckInputError(f"FACTORY {factory!r}: {attr} is a {type(obj).__name__}, not a function")
    return obj


def build(spec: Spec) -> tuple[nn.Module, BatchFn | None, LossFn | None]:
    """The factory's model in ``spec.dtype`` (train mode), its batch maker and its loss (None: the
    defaults), built under ``spec.seed`` so that every process starts from the same values."""
    seed_everything(spec.seed)
    try:
        made = load_factory(spec.factory)()
    except CheckInputError:
        raise
    except Exception as e:  # the user's code: bad input, with where it went wrong
        raise CheckInputError(f"the factory {spec.label} raised {type(e).__name__}: {e}\n"
                              f"{''.join(traceback.format_exception(e)[1:])}") from None
    parts = tuple(made) if isinstance(made, (tuple, list)) else (made,)
    if not 1 <= len(parts) <= 3 or not isinstance(parts[0], nn.Module):
        raise CheckInputError(f"the factory {spec.label} must return a torch.nn.Module or (model, "
                              f"make_batch, loss_fn); got {type(made).__name__}")
    model, make_batch, loss_fn = (*parts, None, None)[:3]
    for what, fn in (("make_batch", make_batch), ("loss_fn", loss_fn)):
        if fn is not None and not callable(fn):
            raise CheckInputError(f"the factory {spec.label} returned a {type(fn).__name__} as {what}, "
                                  "not a callable")
    return model.to(spec.dtype).train(), make_batch, loss_fn


def next_token_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the output's logits against the targets, in the logits' precision
    (float64 stays float64; lower precisions compute in float32)."""
    logits = logits_of(output)
    wide = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(wide), targets.reshape(-1))


def logits_of(output: Any) -> torch.Tensor:
    """A model output's logits: the output itself, its ``.logits`` / ``["logits"]``, or its first item."""
    if isinstance(output, torch.Tensor):
        return output
    found = getattr(output, "logits", None)
    if found is None and isinstance(output, Mapping):
        found = output.get("logits")
    if found is None and isinstance(output, (tuple, list)) and output:
        found = output[0]
    if not isinstance(found, torch.Tensor):
        raise CheckInputError(f"the model returned a {type(output).__name__}: the default loss needs logits "
                              "(a tensor, or an output with .logits); return (model, make_batch, loss_fn) "
                              "from the factory")
    return found


def as_args(x: Any) -> tuple:
    """Model inputs as positional arguments: a tuple or list is spread, anything else is one."""
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def chunk(t: torch.Tensor, m: int, i: int) -> torch.Tensor:
    """Part ``i`` of ``m`` equal parts along dim 0."""
    return t.chunk(m)[i]


class Exchange:
    """A folder the one-process run writes each step's results to, and the ranks read them from.

    Per step, one file with the batch, the loss and the state after the step (step 0: the initial
    state), and one per data-parallel slice with the module outputs on it. Files are written whole
    and renamed into place, so a reader never sees half of one; rank 0 deletes a step's files once
    every rank has read them, and the one-process run waits to be at most `AHEAD` steps ahead, so
    the folder holds a few full states, not one per step. A reader stops waiting when the
    one-process run has failed (``oracle.err``, written by the run itself, or by the caller when its
    process ends without finishing).
    """

    ERROR = "oracle.err"
    AHEAD = 2

    def __init__(self, folder: str, timeout_s: float) -> None:
        self.folder, self.timeout_s = Path(folder), timeout_s

    def put_step(self, step: int, payload: Any, slices: Sequence[Any] = ()) -> None:
        behind = self.folder / f"step{step - self.AHEAD}.pt"
        self._wait(lambda: not behind.exists(), f"the ranks to finish step {step - self.AHEAD}")
        for d, part in enumerate(slices):
            self._put(f"step{step}.slice{d}.pt", part)
        self._put(f"step{step}.pt", payload)  # last: its presence says the step is complete

    def get_step(self, step: int) -> Any:
        return self._get(f"step{step}.pt")

    def get_slice(self, step: int, d: int) -> Any:
        return self._get(f"step{step}.slice{d}.pt")

    def consumed(self, step: int) -> None:
        """Every rank has read ``step``: its files can go (the step file last)."""
        for path in sorted(self.folder.glob(f"step{step}.*"), key=lambda p: p.name == f"step{step}.pt"):
            path.unlink(missing_ok=True)

    def _put(self, name: str, obj: Any) -> None:
        tmp = self.folder / f".{name}.tmp"
        torch.save(obj, tmp)
        os.replace(tmp, self.folder / name)

    def _get(self, name: str) -> Any:
        path = self.folder / name
        self._wait(path.exists, f"the one-process run to write {name}", reader=True)
        return torch.load(path, weights_only=True)

    def _wait(self, done: Callable[[], bool], what: str, reader: bool = False) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not done():
            if reader and (self.folder / self.ERROR).exists():
                raise self.oracle_error()
            if time.monotonic() > deadline:
                raise RuntimeError(f"plait check: waited {self.timeout_s:.0f} s for {what}")
            time.sleep(0.01)

    def fail(self, e: BaseException, tb: str) -> None:
        """Record the one-process run's error for the ranks (and the caller) to raise."""
        kind = "input" if isinstance(e, (ValueError, TypeError)) else "crash"
        with open(self.folder / self.ERROR, "wb") as f:
            pickle.dump((kind, type(e).__name__, str(e), tb), f)

    def oracle_error(self) -> Exception:
        with open(self.folder / self.ERROR, "rb") as f:
            kind, name, msg, tb = pickle.load(f)
        if name == CheckInputError.__name__:
            return CheckInputError(msg)
        if kind == "input":
            return CheckInputError(f"{name} in the one-process run: {msg}\n{tb}")
        return RuntimeError(f"the one-process run failed: {name}: {msg}\n{tb}")


HALF = (torch.bfloat16, torch.float16)


def refuse_routing_in_half(model: nn.Module, spec: Spec) -> None:
    """Mixture-of-experts routing computed in bfloat16 or float16 (``--dtype`` or mixed precision)
    flips its top-k choice on near ties between the layout and one process: a difference no
    rounding budget bounds (measured 0.71 against 0.27 after 5 bfloat16 steps). Refused by name."""
    from plait.ep.apply import has_experts

    computes_in = spec.plan.precision.param_dtype if spec.plan.precision is not None else spec.dtype
    if computes_in in HALF and has_experts(model):
        raise CheckInputError(f"{type(model).__name__} routes tokens to experts, and its top-k choice in "
                              f"{str(computes_in).removeprefix('torch.')} flips on near ties between the "
                              "layout and one process, which no error budget bounds: check MoE layouts in "
                              "float32 or float64 (--dtype float32, without --mixed-precision)")
