"""Verify a tensor-parallel plan by its numbers, before training: the check that shapes cannot do.

The layout trace (`plait.tp.layout_trace`) proves that every operation on a split tensor is one its rules
know to be exact; it cannot see values. A fused projection read in the wrong order (CodeGen's
``qkv_proj`` holds groups of [q v k], not [q|k|v]) or a style that drops what a module does
around its lookup (Gemma's embedding scales it by sqrt(hidden)) has the right shapes and trains
wrong. So each *distinct* unit of the plan (a module with a style whose ancestors have none: an
embedding, an attention, an MLP, a norm, the LM head; units of the same class, parameter shapes,
scalar attributes and styles are checked once) is built whole on the CPU in float64 with random
values, run once as one process would run it and once split over ``tp`` ranks (threads in this
process, collectives done in memory), on the same random inputs shaped as in the layout trace. The
outputs, the gradient of the input activation and the gradients of every parameter (each
rank's slice of a split one) must agree; a difference refuses the plan, naming the module and
the tensor.

Bound: float64 and the same values on both sides, so sharding changes only the order of sums
(a few ulps, ~1e-16 relative, per operation; ~1e-13 after a block's reductions); a tensor
passes when its largest difference is at most ``RTOL`` = 1e-8 of the reference's largest
entry. A unit that computes in a lower precision inside (Gemma's RMSNorm casts to float32) is
held to ``256 * eps`` of the lowest floating dtype its forward produced (float32: 3e-5; capped
at 5%), measured by watching the whole run's outputs. The layout does not depend on the dtype,
so the check always runs in float64 whatever the model's dtype and device. A wrong layout moves
results by O(1) of their size (measured: CodeGen misread 30-100%, Gemma's dropped scaling 80%).

The units run in ``eval()`` mode (dropout off: its per-rank streams are the layout trace's
concern). Inputs: floating tensors are random normal, token ids random below the embedding's
size, other integer tensors zeros and boolean ones true; other objects the forward received
(a KV cache) are passed as None. Cost: one forward and backward of each distinct unit, once
per replicated and split run (logged, and measured in `tests/test_tp_numeric.py`); a unit that
passed is not run again in the same process (same classes, shapes, styles, inputs, tp and sp).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from plait.runtime import faults
from plait.runtime.rng import RNGFork
from plait.runtime.tolerance import RTOL, LowestPrecision
from plait.state.placement.shards import ShardSpec
from plait.tp.collectives import emulated, fresh
from plait.tp.context import SequenceShardGrads, Style, TPContext
from plait.tp.layers import find_activation

# Replaces the parameters of a module by this rank's shards under ``ctx``'s styles; returns the
# shards by parameter name (`plait.tp.apply` passes its own: this module imports neither it nor
# the layout trace, which imports this module).
Split = Callable[[nn.Module, TPContext], dict[str, ShardSpec]]
# A unit whose float64 parameters exceed this is not checked (a warning names it): the check
# holds it whole, its gradient, and every rank's shards with theirs (~4x this), on the CPU.
MAX_UNIT_BYTES = 1 << 30
_TIMEOUT_S = 120.0  # one rank waiting this long at an exchange means another failed
_log = logging.getLogger("plait.tp.numeric")
# Units that passed in this process, by what they compute (`_signature` with the classes' modules,
# the layout trace's inputs, tp and sp): a process that parallelizes several models of one family
# (a pipeline's stages, a test's layouts) checks each kind of unit once. Refusals are not kept.
_passed: set[tuple] = set()


@dataclass(frozen=True)
class Blank:
    """A tensor the layout trace saw, by shape, dtype and layout (`plait.tp.layout_trace` tags)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    tag: str


def units(assigned: dict[str, Style]) -> list[str]:
    """The modules with a style none of whose ancestors has one, where spans of modules
    (`Style.is_unit` false) count as having none."""
    whole = {n: s for n, s in assigned.items() if s.is_unit()}
    return [n for n in whole if not any(o and n.startswith(o + ".") for o in whole if o != n)]


def _tree(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    if isinstance(obj, (torch.Tensor, Blank)):
        return leaf(obj)
    if isinstance(obj, dict):
        return {k: _tree(v, leaf) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tree(v, leaf) for v in obj) if not hasattr(obj, "_fields") else \
            type(obj)(*(_tree(v, leaf) for v in obj))
    if obj is None or isinstance(obj, (bool, int, float, str, torch.dtype, torch.device)):
        return obj
    return None  # a cache or other object holding state: not part of what the unit computes


def _leaves(obj: Any) -> list[Any]:
    out: list[Any] = []
    _tree(obj, lambda t: out.append(t))
    return out


def describe(obj: Any, layout_of: Callable[[torch.Tensor], str]) -> Any:
    """``obj`` (the layout trace's fake tensors) with every tensor replaced by its `Blank`."""
    return _tree(obj, lambda t: Blank(tuple(t.shape), t.dtype, layout_of(t)))


# ------------------------------------------------------------------ the group, in threads
class _Group:
    """``n`` threads exchanging tensors: each contributes one, each receives all, in rank order."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=_TIMEOUT_S)
        self.slots: list[torch.Tensor | None] = [None] * n

    def exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x.detach().clone()
        self.barrier.wait()
        out = [t for t in self.slots if t is not None]
        self.barrier.wait()
        return out

    def reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        parts = self.exchange(rank, x)
        total = parts[0]
        for p in parts[1:]:  # the same order on every rank: the same bits
            total = total + p
        return total

    def gather(self, rank: int, x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat(self.exchange(rank, x), dim=dim).contiguous()

    def split(self, rank: int, x: torch.Tensor, dim: int) -> torch.Tensor:
        return fresh(x.chunk(self.n, dim=dim)[rank])  # as the real operators: never a view


class _Op(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fwd: Callable, bwd: Callable) -> torch.Tensor:
        ctx.bwd = bwd
        return fwd(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return ctx.bwd(g.contiguous()), None, None


class _Exchange:
    """One rank's `plait.tp.collectives.Emulator`: every operator really computed, in memory,
    with its backward (see each operator's docstring in `plait.tp.collectives`)."""

    def __init__(self, group: _Group, rank: int) -> None:
        self.g, self.r = group, rank

    def collective(self, op: str, x: torch.Tensor, dim: int) -> torch.Tensor:
        g, r = self.g, self.r
        same = (lambda t: t)
        reduce = (lambda t: g.reduce(r, t))
        gather = (lambda t: g.gather(r, t, dim))
        split = (lambda t: g.split(r, t, dim))
        reduce_scatter = (lambda t: g.split(r, g.reduce(r, t), dim))
        on_first = (lambda t: g.reduce(r, t) if r == 0 else torch.zeros_like(g.reduce(r, t)))
        fwd, bwd = {
            "copy_to_tp": (same, reduce), "reduce_from_tp": (reduce, same), "sum_over_tp": (reduce, reduce),
            "sum_grad_on_first": (same, on_first),
            "gather_from_tp": (gather, split), "scatter_to_tp": (split, gather),
            "gather_from_sp": (gather, reduce_scatter), "reduce_scatter_to_sp": (reduce_scatter, gather),
            "scatter_to_sp": (split, gather), "replicate_from_sp": (gather, split),
        }[op]
        return _Op.apply(x, fwd, bwd)


class _NoStream(RNGFork):
    """The per-rank random stream of a unit run in ``eval()`` mode, which draws nothing: swapping
    the process's generator state from several threads at once deadlocks in torch."""

    def __init__(self) -> None:
        self._depth, self._paused, self._saved, self._cuda = 0, False, None, False

    def enter(self, *_: Any) -> None:
        self._depth += 1

    def exit(self, *_: Any) -> None:
        self._depth -= 1

    def pause(self) -> None:
        pass


class _Sums(SequenceShardGrads):
    """`SequenceShardGrads` whose sum is the threads' exchange."""

    def __init__(self, group: _Group, rank: int) -> None:
        super().__init__(None)
        self.g, self.r = group, rank

    def _sum(self, grad: torch.Tensor) -> torch.Tensor:
        return self.g.reduce(self.r, grad)


# ------------------------------------------------------------------ one unit
def _signature(mod: nn.Module, styles: dict[str, Style]) -> tuple:
    """What makes two units compute alike: classes, parameter shapes, scalar attributes, styles
    (layer indices excluded: they only address a cache)."""
    sig = []
    for name, sub in mod.named_modules():
        attrs = tuple(sorted((k, v) for k, v in vars(sub).items()
                             if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None)))
                             and not k.endswith(("idx", "index", "layer_id"))))
        params = tuple((k, tuple(p.shape)) for k, p in sub._parameters.items() if p is not None)
        sig.append((name, type(sub).__qualname__, attrs, params, repr(styles.get(name))))
    return tuple(sig)


def _classes(mod: nn.Module) -> tuple[str, ...]:
    """The modules defining each submodule's class (two models may name their classes alike)."""
    return tuple(type(sub).__module__ for sub in mod.modules())


def _materialize(mod: nn.Module, gen: torch.Generator) -> nn.Module:
    """A float64 CPU copy of ``mod`` with random parameters (its real buffers kept)."""
    real = {n: b for n, b in mod.named_buffers() if not b.is_meta}
    full = copy.deepcopy(mod).to_empty(device="cpu")
    with torch.no_grad():
        for p in full.parameters():
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) / max(1, p.shape[-1]) ** 0.5)
        for n, b in full.named_buffers():
            if n in real:
                b.copy_(real[n])
            elif b.is_floating_point():
                b.copy_(0.5 + torch.rand(b.shape, generator=gen, dtype=torch.float64))
            else:
                b.fill_(1 if b.dtype == torch.bool else 0)
    full = full.to(torch.float64)
    return full.eval()


def _realize(mod: nn.Module, blank: Blank, n: int, gen: torch.Generator) -> torch.Tensor:
    shape = list(blank.shape)
    if blank.tag == "S":
        shape[1] *= n
    if blank.dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float64)
    if blank.dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool)
    bound = getattr(mod, "num_embeddings", None)  # token ids for an embedding
    if isinstance(bound, int):
        return torch.randint(0, bound, shape, generator=gen, dtype=blank.dtype)
    return torch.zeros(shape, dtype=blank.dtype)


class Mismatch(Exception):
    """What differs between a unit run whole and split."""


def _compare(what: str, got: torch.Tensor | None, want: torch.Tensor | None, rtol: float = RTOL,
             floor: float = 0.0) -> None:
    """``got`` equals ``want`` within ``rtol`` of the larger of ``want``'s largest entry and
    ``floor`` (the largest gradient of the unit's parameters: a gradient that is zero in exact
    arithmetic, such as that of a key bias with no rotary positions, is all rounding noise)."""
    if got is None or want is None:
        if (got is None) != (want is None):
            raise Mismatch(f"{what} is {'missing' if got is None else 'present where one process has none'}")
        return
    if got.shape != want.shape:
        raise Mismatch(f"{what} has shape {tuple(got.shape)} where one process has {tuple(want.shape)}")
    scale = max(float(want.abs().max()) if want.numel() else 0.0, floor)
    err = float((got - want).abs().max()) if want.numel() else 0.0
    if not err <= rtol * scale:
        raise Mismatch(f"{what} differs from one process's by {err:.3g} (its largest entry: {scale:.3g}; "
                       f"bound: {rtol:g} of it)")


@dataclass
class _Inputs:
    """A unit's realized inputs: the call's structure, and its tensors with their layouts."""

    args: Any
    kwargs: Any
    tensors: list[torch.Tensor]
    tags: list[str]
    act: int | None  # index of the activation among ``tensors``

    def local(self, n: int, r: int) -> tuple[Any, Any, torch.Tensor | None]:
        """Rank ``r``'s copy: sequence-split tensors cut, the activation a leaf needing a gradient."""
        swap: dict[int, torch.Tensor] = {}
        act = None
        for i, (t, tag) in enumerate(zip(self.tensors, self.tags)):
            mine = (t.chunk(n, dim=1)[r] if tag == "S" else t).detach().clone()
            if i == self.act:
                act = mine.requires_grad_(True)
            swap[id(t)] = mine
        return _tree(self.args, lambda t: swap[id(t)]), _tree(self.kwargs, lambda t: swap[id(t)]), act


def _inputs(mod: nn.Module, blanks: tuple[Any, Any], n: int, gen: torch.Generator) -> _Inputs:
    tensors: list[torch.Tensor] = []
    tags: list[str] = []

    def realize(b: Blank) -> torch.Tensor:
        t = _realize(mod, b, n, gen)
        tensors.append(t)
        tags.append(b.tag)
        return t

    args, kwargs = _tree(blanks[0], realize), _tree(blanks[1], realize)
    act = find_activation(mod, args, kwargs)
    index = next((i for i, t in enumerate(tensors) if t is act), None)
    if act is None or not act.is_floating_point():
        index = None
    return _Inputs(args, kwargs, tensors, tags, index)


def _local_weight(w: torch.Tensor, tag: str, out: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Rank ``r``'s part of the loss weight ``w`` of an output laid out as ``tag``."""
    if tag == "S":
        return w.chunk(n, dim=1)[r]
    if tag == "V":  # this rank's vocabulary rows, the padding past the vocabulary weighted 0
        width = out.shape[-1]
        padded = torch.nn.functional.pad(w, (0, max(0, width * n - w.shape[-1])))
        return padded[..., r * width:(r + 1) * width]
    return w


def _loss(outs: list[torch.Tensor], weights: list[torch.Tensor | None], tags: list[str], n: int,
          r: int | None) -> None:
    """Backward of sum(out * weight) over the outputs laid out R, S or V (``r`` None: whole)."""
    terms = [(o * (w if r is None else _local_weight(w, tag, o, n, r))).sum()
             for o, w, tag in zip(outs, weights, tags)
             if w is not None and o.requires_grad and tag in ("R", "S", "V")]
    if terms:
        torch.stack(terms).sum().backward()


@dataclass
class _RankResult:
    outs: list[torch.Tensor]
    act_grad: torch.Tensor | None
    grads: dict[str, torch.Tensor | None]
    specs: dict[str, ShardSpec]


def check_unit(mod: nn.Module, styles: dict[str, Style], n: int, sp: bool, blanks: tuple[Any, Any],
               out_tags: list[str], split: Split, seed: int = 0) -> None:
    """Raise `Mismatch` when ``mod`` split by ``styles`` (names relative to ``mod``) over ``n``
    ranks does not compute what it computes whole, on inputs shaped as ``blanks`` (rank 0's, as
    the layout trace saw them) whose outputs the layout trace laid out as ``out_tags``."""
    gen = torch.Generator().manual_seed(seed)
    whole = _materialize(mod, gen)
    inputs = _inputs(whole, blanks, n, gen)
    args, kwargs, act = inputs.local(1, 0)
    precision = LowestPrecision()
    with torch.enable_grad():
        with precision:
            outs = [t for t in _leaves(whole(*args, **kwargs)) if isinstance(t, torch.Tensor)]
        tags = (out_tags + ["R"] * len(outs))[:len(outs)]
        weights = [torch.randn(t.shape, generator=gen, dtype=torch.float64) if t.is_floating_point() else None
                   for t in outs]
        _loss(outs, weights, tags, n, None)
    ranks = _run_split(whole, styles, n, sp, inputs, weights, tags, seed, split)
    compare = partial(_compare, rtol=precision.rtol())
    for i, (want, tag) in enumerate(zip(outs, tags)):
        if tag == "R":
            for r, res in enumerate(ranks):
                compare(f"output {i} on rank {r}", res.outs[i], want.detach())
        elif tag == "S":
            compare(f"output {i} (the ranks' sequence shards)", torch.cat([x.outs[i] for x in ranks], 1),
                     want.detach())
        elif tag == "V":
            for r, res in enumerate(ranks):
                local = res.outs[i].shape[-1]
                valid = max(0, min(local, want.shape[-1] - r * local))
                compare(f"output {i} (rank {r}'s vocabulary rows)", res.outs[i][..., :valid],
                         want.detach()[..., r * local:r * local + valid])
    if act is not None:
        if inputs.tags[inputs.act or 0] == "S":
            compare("the gradient of its input (the ranks' sequence shards)",
                     torch.cat([x.act_grad for x in ranks if x.act_grad is not None], 1), act.grad)
        else:
            for r, res in enumerate(ranks):
                compare(f"the gradient of its input on rank {r}", res.act_grad, act.grad)
    floor = RTOL * max((float(p.grad.abs().max()) for p in whole.parameters() if p.grad is not None and
                        p.grad.numel()), default=0.0)
    for k, p in whole.named_parameters():
        for r, res in enumerate(ranks):
            spec = res.specs.get(k)
            expected = p.grad if spec is None or p.grad is None else spec.take(p.grad)
            compare(f"the gradient of parameter {k!r} on rank {r}", res.grads.get(k), expected, floor=floor)


def _run_split(whole: nn.Module, styles: dict[str, Style], n: int, sp: bool, inputs: _Inputs,
               weights: list[torch.Tensor | None], tags: list[str], seed: int,
               split: Split) -> list[_RankResult]:
    """Each rank's results, the ranks run as threads of this process."""
    group = _Group(n)
    results: list[_RankResult | None] = [None] * n
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            mod, specs = _split_copy(whole, styles, n, r, sp, group, seed, split)
            args, kwargs, act = inputs.local(n, r)
            with torch.enable_grad(), emulated(_Exchange(group, r)):
                outs = [t for t in _leaves(mod(*args, **kwargs)) if isinstance(t, torch.Tensor)]
                _loss(outs, weights, tags, n, r)
            grads = {k: p.grad for k, p in mod.named_parameters()}
            act_grad = None if act is None else act.grad
            results[r] = _RankResult([o.detach() for o in outs], act_grad, grads, specs)
        except BaseException as e:  # noqa: BLE001 (re-raised below, in the caller's thread)
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return [r for r in results if r is not None]


def _split_copy(whole: nn.Module, styles: dict[str, Style], n: int, r: int, sp: bool, group: _Group,
                seed: int, split: Split) -> tuple[nn.Module, dict[str, ShardSpec]]:
    """A copy of ``whole`` holding rank ``r``'s shards, its styles installed."""
    mod = copy.deepcopy(whole)
    mod.zero_grad(set_to_none=True)
    ctx = TPContext(group=None, size=n, rank=r, sequence_parallel=sp,
                    rng=_NoStream(), seq_grads=_Sums(group, r))
    ctx.assigned = dict(styles)
    modules = dict(mod.named_modules())
    for k, style in styles.items():
        style.validate(modules[k], k, ctx)
    named = split(mod, ctx)
    for k, style in styles.items():
        style.install(modules[k], k, ctx)
    return mod, named


# ------------------------------------------------------------------ the plan
def _styles_under(assigned: dict[str, Style], name: str) -> dict[str, Style]:
    """The styles of ``name`` and of the modules inside it, by name relative to ``name``."""
    return {k[len(name) + 1:] if k != name else "": s for k, s in assigned.items()
            if k == name or k.startswith(name + ".")}


def _mismatch(modules: dict[str, nn.Module], assigned: dict[str, Style], name: str, n: int, sp: bool,
              seen: dict[str, tuple[Any, Any, list[str]]], split: Split) -> tuple[str, Mismatch] | None:
    """(module, what differs) for unit ``name``, or None. A unit holding styled modules of its own
    (a decoder layer that starts the sequence split) that differs is narrowed down to the first
    of those that differs too."""
    args, kwargs, out_tags = seen[name]
    with torch.random.fork_rng(devices=[]):
        try:
            check_unit(modules[name], _styles_under(assigned, name), n, sp, (args, kwargs), out_tags, split)
            return None
        except Mismatch as e:
            found: tuple[str, Mismatch] = (name, e)
    inner = {k: s for k, s in assigned.items() if k.startswith(name + ".")}
    for sub in units(inner):
        if sub not in seen or not _whole_inputs(seen[sub]):
            continue  # a layer inside a region gets feature-split inputs: not a unit of its own
        try:
            deeper = _mismatch(modules, assigned, sub, n, sp, seen, split)
        except Exception:  # noqa: BLE001 (only narrowing down: the unit itself is refused anyway)
            deeper = None
        if deeper is not None:
            return deeper
    return found


def _whole_inputs(call: tuple[Any, Any, list[str]]) -> bool:
    return all(b.tag in ("R", "S") for b in _leaves(call[:2]) if isinstance(b, Blank))


def verify(module: nn.Module, assigned: dict[str, Style], n: int, sp: bool,
           seen: dict[str, tuple[Any, Any, list[str]]], error: type[Exception], split: Split) -> None:
    """Check each distinct unit of ``assigned`` (module name -> style) in ``module`` whose inputs
    the layout trace saw (``seen``: name -> (args, kwargs) of `Blank`s, output tags); raise ``error``
    naming the module and the tensor that differ. Logs the count and the time taken."""
    start = time.perf_counter()
    modules = dict(module.named_modules())
    done: set[tuple] = set()
    todo = [name for name in units(assigned) if name in seen]  # others: never called
    for name in todo:
        sig = (_signature(modules[name], _styles_under(assigned, name)), repr(seen[name]))
        if sig in done:
            continue
        size = 8 * sum(p.numel() for p in modules[name].parameters())
        if size > MAX_UNIT_BYTES:
            _log.warning("numeric plan check: module %r (%s) not checked: %.1f GiB in float64, over "
                         "plait.tp.numeric.MAX_UNIT_BYTES (check it on a smaller config of the model)", name,
                         type(modules[name]).__name__, size / 2**30)
            continue
        done.add(sig)
        known = (sig, _classes(modules[name]), n, sp, faults.injected())
        if known in _passed:
            continue
        try:
            found = _mismatch(modules, assigned, name, n, sp, seen, split)
        except Exception as failed:
            raise error(f"plan check: module {name!r} ({type(modules[name]).__name__}) could not be run "
                        "whole and split on random inputs shaped as in the layout trace "
                        f"({type(failed).__name__}: {failed}); pass check='shapes' to check the plan on "
                        "shapes only (`plait.tp.numeric`)") from failed
        if found is None:
            _passed.add(known)
        else:
            where, e = found
            layout = f"tp={n}" + (" with sequence parallelism" if sp else "")
            raise error(
                f"plan refused: module {where!r} ({type(modules[where]).__name__}) split over {layout} does "
                f"not compute what it computes in one process: {e}. The plan misreads this module (a fused "
                "projection split in another order than its layout, or a style that replaces computation "
                "the module does, such as a scaling); fix the plan for it, or leave the module replicated "
                "(checked by running it whole and split on random inputs: `plait.tp.numeric`)") from e
    _log.info("numeric plan check: %d distinct of %d units at tp=%d%s in %.3f s", len(done), len(todo), n,
              " with sp" if sp else "", time.perf_counter() - start)
