"""Which segment outputs each part of a model's forward reads: a dataflow trace of the unchanged forward.

A pipeline stage runs the model's own ``forward`` with the segments of other stages replaced (see
`plait.pipeline.replay`), so it must know which values computed on earlier stages it needs. Those
values can be read anywhere: as a segment's argument, through the model's glue code between
segments (a residual ``h + x``, a ``ModelOutput``, keyword arguments), or in what the forward
returns. `Tracer` finds them with one dataflow trace per input signature, on this rank, without any
collective:

* every segment that owns parameters (a *producer*) is replaced by a probe that runs the real
  module on the meta device (no weights are needed, so every rank can do it for every stage),
  records the output's structure, shapes and dtypes, and returns zeros of those shapes on the
  device, each tensor marked with its *key* ``(segment, call, leaf)``;
* the glue between segments (the parent modules' forwards, parameter-free modules such as rotary
  tables, dropout and masks) runs for real on the microbatch's inputs, under a torch function mode
  that gives every computed tensor the union of the keys of the tensors it was computed from;
* what a probe receives (``needs``) and what the forward returns (``end``) are thus the exact sets
  of producer outputs they depend on.

Glue runs for real rather than on the meta device because it may branch on its inputs' values
(Hugging Face checks position ids for packed sequences with ``.all()``, which a meta tensor cannot
answer). Glue that reads the *values* of a segment output in Python is reported: the stages that
do not own that segment see zeros there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from plait._torch_compat import map_tensors, tensors_in, tree_flatten, tree_unflatten
from plait.runtime.env import get_logger

Key = tuple[int, int, int]  # (segment index, call number, output leaf index)
_NONE: frozenset[Key] = frozenset()
# Tensor methods that hand a tensor's values to Python (glue that branches on them).
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__}
_CONSTANTS = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.Size)


@dataclass(frozen=True)
class TensorLeaf:
    """A tensor of a segment's output, as the dataflow trace saw it (stand-ins make zeros of it)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Call:
    """One call of a producer segment: the keys its arguments depend on and its output's form."""

    needs: frozenset[Key]
    spec: Any  # the output's pytree structure
    leaves: list[Any]  # per output leaf: a TensorLeaf, or the non-tensor value itself


@dataclass(frozen=True)
class StagePlan:
    """What one stage exchanges, in a fixed order both neighbours derive alike (sorted keys)."""

    recv: tuple[Key, ...]  # produced on earlier stages, needed here or later
    send: tuple[Key, ...]  # what the next stage receives (own outputs and relayed ones)
    calls: dict[int, int]  # own producer segment -> calls in one forward


@dataclass
class Flow:
    """The dataflow of one forward (one input signature) between the model's producer segments."""

    calls: dict[int, list[Call]]
    end: frozenset[Key]  # what the forward's return value depends on
    n_inputs: int
    reads: list[str] = field(default_factory=list)  # glue reading segment outputs' values
    # Output tensors as the real (sharded, wrapped, cast) layers make them, where different from the
    # dataflow trace's: filled by the stages' first forward and passed along the metadata pass.
    real: dict[Key, TensorLeaf] = field(default_factory=dict)

    def plans(self, owner: Sequence[int], names: Sequence[str]) -> list[StagePlan]:
        """Each stage's receives and sends, given the stage of every segment; a segment that reads
        an output of a later stage is an error naming both."""
        n = 1 + max(owner)
        needs: list[set[Key]] = [set() for _ in range(n)]
        for j, calls in self.calls.items():
            for c in calls:
                for k in c.needs:
                    if owner[k[0]] > owner[j]:
                        fix = ("a stage can only use what earlier stages computed: move the split points"
                               if j > k[0] else
                               f"{names[j]!r} is registered before {names[k[0]]!r} but runs after it "
                               "(OPT's final_layer_norm), and stages follow the registration order, so no "
                               "split places it: train this model without pipeline parallelism (tp, fsdp, "
                               "ddp)")
                        raise ValueError(
                            f"pipeline: segment {names[j]!r} (stage {owner[j]}) reads the output of "
                            f"{names[k[0]]!r}, which the split puts on a later stage ({owner[k[0]]}); {fix}")
                needs[owner[j]].update(c.needs)
        needs[-1].update(self.end)
        later: set[Key] = set()
        recv: list[tuple[Key, ...]] = [()] * n
        for s in range(n - 1, -1, -1):  # recv[s]: produced before s and needed at s or later
            later |= needs[s]
            recv[s] = tuple(sorted(k for k in later if owner[k[0]] < s))
        return [StagePlan(recv[s], recv[s + 1] if s + 1 < n else (),
                          {j: len(c) for j, c in self.calls.items() if owner[j] == s}) for s in range(n)]


class _Taint(TorchFunctionMode):
    """Gives every tensor an op computes the union of the keys of the tensors it read."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.paused = False
        self.reads: list[str] = []

    def of(self, obj: Any) -> frozenset[Key]:
        out: frozenset[Key] = _NONE
        for t in tensors_in(obj):
            out = out | self.keys.get(t, _NONE)
        return out

    def mark(self, t: torch.Tensor, keys: frozenset[Key]) -> None:
        self.keys[t] = self.keys.get(t, _NONE) | keys

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        old, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = old

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        src = self.of((args, kwargs))
        if src:
            if func in _READS:
                self.reads.append(f"{getattr(func, '__name__', func)} of a value computed from {sorted(src)}")
            # An op that returns nothing mutated its first argument (``x[i] = y``).
            for t in tensors_in(out if out is not None else args[:1]):
                self.mark(t, src)
        return out


class Tracer:
    """The state of one dataflow trace: the taint mode and the calls each probe saw."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.mode = _Taint()
        self.calls: dict[int, list[Call]] = {}

    def probe(self, segment: int, meta_module: nn.Module) -> Any:
        """A forward for a producer's slot: runs ``meta_module`` on the meta device and returns zeros
        of its output's shapes on the device, marked with their keys."""

        def forward(*args: Any, **kwargs: Any) -> Any:
            calls = self.calls.setdefault(segment, [])
            needs = self.mode.of((args, kwargs))
            with self.mode.pause():
                meta_args, meta_kwargs = map_tensors(lambda t: t.to("meta"), (args, kwargs))
                out = meta_module(*meta_args, **meta_kwargs)
                leaves, spec = tree_flatten(out)
                seen = [TensorLeaf(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t
                        for t in leaves]
                values = [torch.zeros(x.shape, dtype=x.dtype, device=self.device)
                          if isinstance(x, TensorLeaf) else x for x in seen]
            for i, v in enumerate(values):
                if isinstance(v, torch.Tensor):
                    self.mode.keys[v] = frozenset({(segment, len(calls), i)})
            calls.append(Call(needs, spec, seen))
            return tree_unflatten(values, spec)

        return forward

    def run(self, shell: nn.Module, inputs: tuple[torch.Tensor, ...]) -> Flow:
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad(), self.mode:
            out = shell(*inputs)
            end = self.mode.of(out)
        odd = sorted({type(x).__name__ for cs in self.calls.values() for c in cs for x in c.leaves
                      if not isinstance(x, (TensorLeaf, *_CONSTANTS))})
        if odd:
            get_logger().warning("pipeline: segments return %s objects; a stage that does not own such a "
                                 "segment gets the dataflow trace's object, not the real one", ", ".join(odd))
        return Flow(self.calls, end, len(inputs), self.mode.reads)
