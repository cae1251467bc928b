"""Cutting a model into pipeline stages by module names, and materializing one rank's stages.

A model is pipelined as a chain of *segments*: its top-level children in registration
order, with `nn.ModuleList` / `nn.Sequential` children flattened into their elements. For the
GPT that is ``tok_emb, drop, layers.0, ..., layers.N-1, norm, lm_head``. A stage is a run of
consecutive segments; each segment receives the previous one's output (``seg(x)`` for a tensor,
``seg(*x)`` for a tuple).

Requirement: the model's ``forward`` must be exactly that chain (children called once each, in
order, each fed the previous child's output, the last child's output returned). `check_chain`
verifies this on a meta-device copy before the first step, and raises a clear error otherwise;
the model's code is never edited.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from plait.env import get_logger
from plait.materialize import materialize

__all__ = ["segments", "plan_stages", "check_chain", "materialize_segments", "named_view", "meta_copy",
           "Stage"]

Segment = tuple[str, nn.Module]


def segments(module: nn.Module) -> list[Segment]:
    """The model's ordered segments (top-level children, containers flattened)."""
    own = [n for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None]
    if own:
        raise ValueError(
            f"pipeline: the root module {type(module).__name__} owns tensors directly ({', '.join(own)}); "
            "a pipeline runs the model's children as a chain, so every parameter and buffer must live "
            "in a child module")
    out: list[Segment] = []

    def visit(prefix: str, mod: nn.Module) -> None:
        for name, child in mod.named_children():
            full = f"{prefix}{name}"
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                visit(full + ".", child)
            else:
                out.append((full, child))

    visit("", module)
    if not out:
        raise ValueError(f"pipeline: {type(module).__name__} has no child modules to split into stages")
    return out


def _param_counts(segs: Sequence[Segment]) -> list[int]:
    seen: set[int] = set()
    counts = []
    for _, mod in segs:
        n = 0
        for p in mod.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        counts.append(n)
    return counts


def plan_stages(segs: Sequence[Segment], n_stages: int, split: str | Sequence[str]) -> list[list[int]]:
    """Segment indices of each stage.

    ``split="auto"`` balances parameter counts (minimises the largest stage, exactly, by dynamic
    programming); a list of segment names gives the first segment of stages 1..n_stages-1.
    """
    names = [n for n, _ in segs]
    if n_stages > len(segs):
        raise ValueError(f"pipeline: {n_stages} stages requested but the model has only {len(segs)} "
                         f"segments ({', '.join(names)})")
    if isinstance(split, str):
        if split != "auto":
            raise ValueError(f"split must be 'auto' or a list of segment names starting stages 1.."
                             f"{n_stages - 1}, got {split!r}")
        starts = _balanced_starts(_param_counts(segs), n_stages)
    else:
        split = list(split)
        if len(split) != n_stages - 1:
            raise ValueError(f"split: {n_stages} stages need {n_stages - 1} segment names (the first "
                             f"segment of each stage after the first), got {len(split)}: {split}")
        starts = [0]
        for name in split:
            if name not in names:
                raise ValueError(f"split: {name!r} is not a segment of the model; segments are: "
                                 f"{', '.join(names)}")
            i = names.index(name)
            if i <= starts[-1]:
                raise ValueError(f"split: {name!r} (segment #{i}) must come after the start of the "
                                 f"previous stage ({names[starts[-1]]!r}, segment #{starts[-1]}); "
                                 "stages must be non-empty and in model order")
            starts.append(i)
    bounds = [*starts, len(segs)]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(n_stages)]


def _balanced_starts(w: Sequence[int], k: int) -> list[int]:
    n = len(w)
    pre = [0]
    for x in w:
        pre.append(pre[-1] + x)
    inf = float("inf")
    # best[j][i]: smallest possible largest stage when the first i segments form j stages.
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for c in range(j - 1, i):
                cost = max(best[j - 1][c], pre[i] - pre[c])
                if cost < best[j][i]:
                    best[j][i], cut[j][i] = cost, c
    starts, i = [], n
    for j in range(k, 0, -1):
        i = cut[j][i]
        starts.append(i)
    return starts[::-1]


def _as_args(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are on the meta device (no data copied)."""
    memo: dict[int, Any] = {}
    for t in [*module.parameters(), *module.buffers()]:
        meta = t.detach().to("meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def named_view(segs: Sequence[Segment]) -> nn.Module:
    """A module tree holding ``segs`` (shared, not copied) under their names in the original model.

    ``named_view([("layers.3", blk)])`` has ``blk`` at ``layers.3``, so module-name patterns written
    for the whole model (a tensor-parallel plan's ``layers.*.attn.q_proj``) and per-module init
    names match a pipeline stage's modules. The view is never called.
    """
    root = nn.Module()
    _place(root, segs)
    return root


def _place(root: nn.Module, segs: Sequence[Segment]) -> None:
    for name, mod in segs:
        parent = root
        *path, last = name.split(".")
        for part in path:
            if part not in parent._modules:
                parent.add_module(part, nn.Module())
            parent = parent.get_submodule(part)
        parent.add_module(last, mod)


def check_chain(module: nn.Module, segs: Sequence[Segment], example: Any) -> None:
    """Check on a meta-device copy that ``module(example)`` is exactly the segment chain.

    Hooks record each segment's call; the model is rejected if a segment is skipped, called twice
    or out of order, receives anything but the previous segment's output (a residual or a
    side input across segments), or if the model changes the last segment's output.
    """
    skeleton = meta_copy(module)
    calls: list[tuple[str, tuple, dict, Any]] = []
    hooks = []
    for name, _ in segs:
        sub = skeleton.get_submodule(name)
        pending: dict[str, Any] = {}

        def pre(mod: nn.Module, args: tuple, kwargs: dict, _p: dict = pending) -> None:
            _p["in"] = (args, kwargs)

        def post(mod: nn.Module, args: tuple, out: Any, _n: str = name, _p: dict = pending) -> None:
            calls.append((_n, *_p["in"], out))

        hooks += [sub.register_forward_pre_hook(pre, with_kwargs=True), sub.register_forward_hook(post)]
    args = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in _as_args(example))
    try:
        with torch.no_grad():
            result = skeleton(*args)
    except Exception as e:  # noqa: BLE001 - a model that cannot run on meta is still usable
        get_logger().warning("pipeline: could not trace %s on the meta device to check that its forward is "
                             "a chain of its children (%s); trusting that it is", type(module).__name__, e)
        return
    finally:
        for h in hooks:
            h.remove()
    names = [n for n, _ in segs]
    seen = [c[0] for c in calls]
    req = ("pipeline needs the model's forward to call its children once each, in registration order, "
           "each on the previous child's output, and to return the last child's output")
    if seen != names:
        raise ValueError(f"{req}; {type(module).__name__}.forward calls {seen}, expected {names}")
    prev: tuple = args
    for name, cargs, ckw, out in calls:
        if ckw or len(cargs) != len(prev) or any(a is not b for a, b in zip(cargs, prev)):
            raise ValueError(f"{req}; segment {name!r} is called with something other than the previous "
                             f"segment's output (keyword arguments, extra inputs or a modified tensor)")
        prev = _as_args(out)
    if _as_args(result) != prev or any(a is not b for a, b in zip(_as_args(result), prev)):
        raise ValueError(f"{req}; the model changes the output of its last segment {names[-1]!r}")


def materialize_segments(segs: Sequence[Segment], seed: int, device: torch.device,
                         first_owner: dict[int, tuple[str, nn.Module, str]]) -> None:
    """Give meta-device tensors of ``segs`` their oracle initial values on ``device``.

    Values are those of each tensor's first owner in the original model (``first_owner``, by
    id), so they equal `init_weights(model, seed)` of a single process even for a tensor tied
    to a module on another rank. Tied tensors inside ``segs`` stay tied.
    """

    def keep(name: str, attr: str, full: torch.Tensor, t: torch.Tensor) -> torch.Tensor | None:
        return full.to(device) if t.is_meta else None

    materialize(segs, seed, keep, first_owner)


class Stage(nn.Module):
    """Consecutive segments run as a chain (segment modules are shared with the user's model).

    The segments are registered under their names in the original model (``layers.3``), so the
    stage's parameter names are the model's: whatever wraps a stage (tensor parallelism's plan
    patterns, FSDP's units and state dicts, per-module initialisation) sees the original names.
    """

    def __init__(self, index: int, segs: Sequence[Segment]) -> None:
        super().__init__()
        # Attribute names a model's children are unlikely to have: the children live beside them.
        self.stage_index = index
        self.segment_names = [n for n, _ in segs]
        self._chain = tuple(m for _, m in segs)  # a tuple: not registered a second time
        _place(self, segs)

    def forward(self, *x: Any) -> Any:
        out: Any = x if len(x) > 1 else x[0]
        for seg in self._chain:
            out = seg(*out) if isinstance(out, tuple) else seg(out)
        return out

    @property
    def segments(self) -> list[Segment]:
        """(name in the original model, module) of each segment, in chain order."""
        return list(zip(self.segment_names, self._chain))

    def qualified_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name in the original model, parameter) for this stage, tied ones once."""
        return list(self.named_parameters())
