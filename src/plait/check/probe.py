"""Forward hooks that compare every module's output in the layout with the one-process model's.

The layout is built in place from the model the one-process run also builds, so their modules
carry the same names; a hook on each module, keyed by its name, pairs the outputs call by call
(a module called twice per forward, or once per microbatch, has several). Under context
parallelism a rank's outputs hold its tokens of each sequence (`plait.cp.Layout`'s two chunks),
along the sequence's dimension or one that flattens batch and sequence: they are compared with
the same tokens of the one-process output. Other outputs a rank holds only
in part (a column-parallel layer's shard, a sequence-parallel activation) have another shape and
are left out; modules a rank never runs record nothing there.

Copies of a module (a pipeline's meta-device skeletons, stand-ins and shells share or copy the
hooks) call the hook with themselves: only the module the hook was put on counts. A pipeline
also runs its stages once more on its first step, to learn the shapes it sends: when a module
has more calls than the reference, the calls are paired from the last one backward. Calls made
inside backward (activation checkpointing recomputing a block) are not counted: the forward's are.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from plait._torch_compat import in_backward, tensors_in
from plait.check.report import ActivationDiff, TensorDiff, tensor_diff
from plait.cp.layout import Layout

# What a Recorder hands over: (module name, call, position in the forward, output tensors).
Reference = Sequence[tuple[str, int, int, Sequence[torch.Tensor]]]


class _Hooks:
    """One forward hook per named module; ``_seen(name, call, tensors)`` runs while armed."""

    def __init__(self, modules: Iterable[tuple[str, nn.Module]]) -> None:
        self.armed = False
        self.calls: dict[str, int] = {}
        self._handles = [m.register_forward_hook(self._hook(name, m)) for name, m in modules]

    def _hook(self, name: str, target: nn.Module) -> Any:
        def hook(mod: nn.Module, _args: Any, out: Any) -> None:
            if not self.armed or mod is not target:  # a copy of the module, not the module
                return
            if in_backward():  # activation checkpointing recomputing it: the forward's call counted
                return
            ts = tensors_in(out)
            # A shape-only run; or a run on no rows (an MoE layout runs an expert on no tokens so
            # that its gradient is made on every rank that sums it: `MoE.experts_in_use`).
            if any(t.is_meta for t in ts) or (ts and all(t.numel() == 0 for t in ts)):
                return
            call = self.calls.get(name, 0)
            self.calls[name] = call + 1
            self._seen(name, call, ts)
        return hook

    def _seen(self, name: str, call: int, ts: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self.calls = {}
        self.armed = True

    def stop(self) -> None:
        self.armed = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class Recorder(_Hooks):
    """Records the one-process model's outputs, and the order in which the calls finished."""

    def start(self) -> None:
        super().start()
        self.outputs: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.order: dict[tuple[str, int], int] = {}

    def _seen(self, name: str, call: int, ts: list[torch.Tensor]) -> None:
        self.order[(name, call)] = len(self.order)
        self.outputs[(name, call)] = [t.detach().clone() for t in ts]


class Comparer(_Hooks):
    """Compares the layout's outputs with a `Reference` as they come; ``stop()`` pairs the calls and
    leaves the findings in ``diffs``."""

    def __init__(self, modules: Iterable[tuple[str, nn.Module]], rank: int,
                 cp: tuple[int, int] = (1, 0)) -> None:
        """``rank``: this rank's global rank, named in the findings; ``cp``: the cp degree and this
        rank's index along cp."""
        super().__init__(modules)
        self.rank, self.cp = rank, cp
        self.seq = 0  # tokens per sequence this step (under cp: what a rank's shares add up to)
        self.diffs: list[ActivationDiff] = []
        self._want: dict[str, list[tuple[int, Sequence[torch.Tensor]]]] = {}
        self._got: dict[str, list[dict[int, TensorDiff]]] = {}  # per layout call: reference call -> diff

    def compare_with(self, reference: Reference, seq: int = 0) -> None:
        """Arm the hooks for one step against ``reference``, on sequences of ``seq`` tokens."""
        self.seq = seq
        self._want = {}
        for name, _call, order, ts in sorted(reference, key=lambda r: r[1]):
            self._want.setdefault(name, []).append((order, ts))
        self._got, self.diffs = {}, []
        self.start()

    def _seen(self, name: str, call: int, ts: list[torch.Tensor]) -> None:
        want = self._want.get(name, [])
        # Against every reference call it could be paired with (from the first or from the last),
        # so that no output has to be kept until the step's calls are counted.
        pairs = ((r, _diff(ts, want[r][1], self.cp, self.seq)) for r in range(min(call + 1, len(want))))
        self._got.setdefault(name, []).append({r: d for r, d in pairs if d is not None})

    def stop(self) -> None:
        super().stop()
        for name, got in self._got.items():
            want = self._want.get(name, [])
            extra = max(0, len(got) - len(want))  # the first calls were extra: pair from the last
            for call, by_ref in enumerate(got[extra:]):
                d = by_ref.get(call)
                if d is not None:
                    self.diffs.append(ActivationDiff(name, call, self.rank, d.abs, d.rel, want[call][0]))


def _diff(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], cp: tuple[int, int],
          seq: int) -> TensorDiff | None:
    """The worst difference over the output's tensors; None when none can be compared (another
    structure, or held in part on this rank: tensor- or sequence-parallel shards)."""
    if len(got) != len(want):
        return None
    if cp[0] > 1 and seq:
        want = [w if g.shape == w.shape else _tokens(w, g.shape, *cp, seq) for g, w in zip(got, want)]
    diffs = [tensor_diff(g, w) for g, w in zip(got, want) if g.shape == w.shape and w.is_floating_point()]
    return max(diffs, key=lambda d: math.inf if math.isnan(d.rel) else d.rel, default=None)


def _tokens(want: torch.Tensor, shape: torch.Size, cp: int, rank: int, seq: int) -> torch.Tensor:
    """Cp rank ``rank``'s tokens of a one-process output, when ``shape`` is its shape with one
    dimension of ``k * seq`` entries (k sequences, one after the other: 1, or a batch flattened
    with them) cut to ``k`` times the rank's share; else ``want`` itself (not comparable)."""
    if len(shape) != want.dim():
        return want
    cut = [d for d, (n, m) in enumerate(zip(want.shape, shape)) if n != m]
    if len(cut) != 1 or want.shape[cut[0]] % seq:
        return want
    d, k = cut[0], want.shape[cut[0]] // seq
    layout = Layout(seq, cp, rank)
    if shape[d] != k * layout.local_len():
        return want
    return layout.shard(want.unflatten(d, (k, seq)), d + 1).flatten(d, d + 1)


def module_order(reference: Reference) -> dict[str, int]:
    """Each module's position in the forward (its first call)."""
    out: dict[str, int] = {}
    for name, _, order, _ in sorted(reference, key=lambda r: r[2]):
        out.setdefault(name, order)
    return out
