"""Activation checkpointing: keep less of a block's forward for backward, and recompute the rest.

    model = plait.activation_checkpointing(model, "full")             # every block
    model = plait.activation_checkpointing(model, "full", every=2)    # every second block only
    model = plait.activation_checkpointing(model, "selective")        # keep matmul and attention outputs

A *block* is each child of the model's outermost block containers (`plait.state.blocks`: an
``nn.ModuleList``, or an ``nn.ModuleDict`` or ``nn.Sequential`` of blocks of one class; FSDP's
default units: the transformer layers), or each module ``blocks=`` names by class or module-name
pattern. What a
checkpointed block keeps from its forward until backward:

* ``"full"`` (Chen et al. 2016): its inputs only. Backward runs the block's forward again, the
  first time it needs one of the tensors autograd saved there, and takes them from that run.
* ``"selective"`` (torchtitan's op-level selective checkpointing; Korthikanti et al. 2022 keep the
  same expensive parts): its inputs and the outputs of its matmuls (``mm``, ``addmm``, ``_scaled_mm``)
  and fused attention kernels (``scaled_dot_product_attention``'s flash, efficient, cuDNN and CPU
  kernels). The recomputation is handed those outputs instead of running the ops, and recomputes
  only what is cheap: norms, activations, rotary embeddings, dropout, residual additions, and the
  batched matmuls and softmax of an unfused attention core (its sequence-squared scores).

Models are not edited: the block's ``forward`` is replaced on the instance (as tensor parallelism's
styles do), so parameter names and state dict keys stay the model's. Its forward runs under
`torch.autograd.graph.saved_tensors_hooks` that store a placeholder for every tensor autograd
saves. The recomputation:

* runs **once per forward**, however many backward passes read the block: the recomputed tensors
  live as long as the graph nodes that saved them, as saved tensors do without checkpointing
  (a zero-bubble pipeline's input-gradient pass B and its deferred weight-gradient pass W both
  read a block: W uses what B recomputed; only on the first stage, whose B computes nothing,
  does W recompute, and `plait.pipeline` then runs a tensor-parallel stage's W's where the
  schedule lists them);
* stops as soon as it has saved the last tensor backward reads (the ops after it, such as a
  row-parallel layer's all-reduce when no dropout follows, are not run again);
* draws the **same random numbers**: the default CPU and CUDA generators and tensor parallelism's
  per-rank stream (`plait.runtime.rng.RNGFork`, swapped in by the regions inside the block) are
  set to their states at the start of the block's forward, then put back, so later forwards'
  dropout masks are unchanged too; autocast is entered as it was;
* calls the block's **submodules** as the forward did, with their hooks (tensor parallelism's
  regions and collectives, mixed precision's casts), but not the block's own hooks: an FSDP
  unit's gather and reshard around the block, a pipeline stage's capture of its output, run once;
* repeats the block's other collectives (tensor and sequence parallelism's all-reduces and
  all-gathers) in their forward order. Every rank of a tp group recomputes the same blocks at
  the same point of its backward, so the recomputed collectives match (and `plait.comm`'s desync
  check sees the same calls everywhere).

Gradients equal those without checkpointing, bitwise when the kernels are deterministic
(`tests/test_activation_checkpointing.py`). A recomputation that saves other tensors than its
forward (a forward that depends on state changed since, or on values) is an error naming the block.
Not supported: `plait.DataParallel` (its threads run the shared modules under
``torch.func.functional_call``, which a recomputation would not see), and nested blocks.

The module is callable: ``plait.activation_checkpointing(...)`` is
`plait.activation_checkpointing.activation_checkpointing` (`plait.runtime.callable_module`).
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from plait._torch_compat import TorchDispatchMode, forward_pre_hooks, map_tensors, tensors_in, version_of
from plait.compose.layout_error import LayoutError, LayoutTypeError
from plait.runtime.callable_module import make_callable
from plait.runtime.rng import RNGFork, fork_of
from plait.state.blocks import DESCRIBED, Checkpointed, checkpoint_record, checkpointed, mark_checkpointed
from plait.state.blocks import blocks as repeated_blocks
from plait.state.names import matches

__all__ = ["activation_checkpointing", "POLICIES"]

POLICIES = ("full", "selective")


def _aten(*names: str) -> frozenset[Any]:
    """The aten overloads named ``op.overload`` that this torch has (newer kernels may be missing)."""
    found = set()
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(torch.ops.aten, packet, None)
        if op is not None and hasattr(op, overload):
            found.add(getattr(op, overload))
    return frozenset(found)


# What the selective policy keeps: the matmuls with weights, and fused attention.
KEPT_OPS = _aten("mm.default", "addmm.default", "_scaled_mm.default", "_grouped_mm.default",
                 "_scaled_dot_product_flash_attention.default",
                 "_scaled_dot_product_efficient_attention.default",
                 "_scaled_dot_product_cudnn_attention.default",
                 "_scaled_dot_product_flash_attention_for_cpu.default",
                 "_scaled_dot_product_fused_attention_overrideable.default")


def check_options(policy: str | None, every: int = 1, blocks: Sequence[type | str] | None = None,
                  where: str = "activation_checkpointing",
                  names: tuple[str, str, str] = ("policy", "every", "blocks")) -> None:
    """Raise `LayoutError` for an unknown policy, ``every`` < 1, or options given without a policy
    (`LayoutTypeError` for ``blocks`` that are not a list). ``where`` is the call and ``names`` its
    names for the three options (``ParallelPlan``'s ``ac``, ``ac_every``, ``ac_blocks``): the
    message and the error's ``fields`` use them."""
    pol, ev, bl = names
    if policy is not None and policy not in POLICIES:
        raise LayoutError(f"{where}({pol}=...): policy must be one of {POLICIES} or None (no checkpointing), "
                          f"got {policy!r}", (pol,))
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise LayoutError(f"{where}({ev}=...): every must be an integer >= 1 (checkpoint every k-th block), "
                          f"got {every!r}", (ev,))
    if blocks is not None and (isinstance(blocks, str) or not isinstance(blocks, Sequence)
                               or not all(isinstance(b, (str, type)) for b in blocks)):
        raise LayoutTypeError(f"{where}({bl}=...): blocks must be a list of module classes or module-name "
                              f"patterns, got {blocks!r}", (bl,))
    given = [(n, v) for n, v, on in ((ev, every, every != 1), (bl, blocks, blocks is not None)) if on]
    if policy is None and given:
        one = len(given) == 1
        raise LayoutError(f"{where}({', '.join(f'{n}={v!r}' for n, v in given)}) "
                          f"{'chooses' if one else 'choose'} the blocks to checkpoint; {pol}=None would "
                          f"ignore {'it' if one else 'them'}: give {pol}='full' or {pol}='selective'",
                          (*(n for n, _ in given), pol))


def activation_checkpointing(model: nn.Module, policy: str | None = "full", every: int = 1, *,
                             blocks: Sequence[type | str] | None = None) -> nn.Module:
    """Checkpoint ``model``'s blocks in place with ``policy`` (``"full"``, ``"selective"``; None does
    nothing); return ``model``. ``every=k`` checkpoints the k-th, 2k-th... block only (counted over
    the whole model). ``blocks``: module classes or qualified-name patterns (`plait.state.names.matches`)
    of the blocks; default: each child of the outermost block containers. Apply it after
    tensor parallelism and before DDP or FSDP (`plait.parallelize` does, with ``ParallelPlan(ac=...)``).
    """
    check_options(policy, every, blocks)
    if not isinstance(model, nn.Module):
        raise TypeError(f"activation_checkpointing: model must be an nn.Module, got {type(model).__name__}")
    if policy is None:
        return model
    checkpoint_blocks(model, select_blocks(model, blocks, every), policy)
    return model


def select_blocks(model: nn.Module, blocks: Sequence[type | str] | None = None, every: int = 1) -> list[str]:
    """Qualified names of the blocks to checkpoint, in model order (see `activation_checkpointing`).
    Raises ``ValueError`` when nothing matches, when an entry of ``blocks`` matches no module, when
    one chosen block lies inside another, or when ``every`` exceeds the number of blocks."""
    mods = [(n, m) for n, m in model.named_modules() if n]
    if blocks is None:
        names = repeated_blocks(model, outermost=True)
        if not names:
            raise ValueError(f"activation_checkpointing: {type(model).__name__} holds no {DESCRIBED}; name "
                             "the modules to checkpoint with blocks=[classes or name patterns]")
    else:
        def chosen(name: str, mod: nn.Module, b: type | str) -> bool:
            return isinstance(mod, b) if isinstance(b, type) else matches(b, name)

        names = [n for n, m in mods if any(chosen(n, m, b) for b in blocks)]
        unused = [b for b in blocks if not any(chosen(n, m, b) for n, m in mods)]
        if unused:
            raise ValueError(f"activation_checkpointing(blocks=...): {unused} matched no submodule of "
                             f"{type(model).__name__} (a '*' in a pattern stands for one name segment)")
        for outer in names:
            inner = next((n for n in names if n.startswith(outer + ".")), None)
            if inner is not None:
                raise ValueError(f"activation_checkpointing(blocks=...): {inner!r} lies inside {outer!r}; "
                                 "checkpointed blocks must not nest")
    if every > len(names):
        raise ValueError(f"activation_checkpointing: every={every} checkpoints no block: "
                         f"{type(model).__name__} has {len(names)} ({', '.join(names)})")
    return names[every - 1::every]


def checkpoint_blocks(model: nn.Module, names: Sequence[str], policy: str) -> None:
    """Checkpoint the submodules of ``model`` named ``names`` with ``policy`` (no selection rules:
    a pipeline stage gets the blocks `select_blocks` chose in the whole model that it holds)."""
    check_options(policy)
    for name in names:
        parts = name.split(".")
        for k in range(1, len(parts)):
            _forks(model.get_submodule(".".join(parts[:k])), name, inside=False)  # within a region?
        mod = model.get_submodule(name)
        if (already := checkpointed(mod)) is not None:
            raise ValueError(f"activation_checkpointing: {name!r} is checkpointed already ({already!r})")
        mark_checkpointed(mod, Checkpointed(name, policy, mod.forward))
        mod.forward = types.MethodType(_checkpointed_forward, mod)


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state = checkpoint_record(self)
    assert state is not None
    if not torch.is_grad_enabled():  # nothing is saved for backward: nothing to recompute
        return state.forward(*args, **kwargs)
    frame = _Frame(state, args, kwargs, _RandomState(_forks(self, state.name), args))
    with saved_tensors_hooks(frame.pack, frame.unpack), frame.keeping():
        out = state.forward(*args, **kwargs)
    frame.forward_done()
    return out


def _forks(module: nn.Module, name: str, inside: bool = True) -> list[RNGFork]:
    """Tensor parallelism's per-rank random streams that regions in ``module`` (and, with
    ``inside``, in its submodules) swap in. Refuses a block ``name`` that runs within a region:
    called on an enclosing module (``inside=False``), or while one of the streams is entered."""
    found: dict[int, RNGFork] = {}
    for m in module.modules() if inside else [module]:
        for hook in forward_pre_hooks(m):
            if (fork := fork_of(hook)) is not None:
                found[id(fork)] = fork
    for fork in found.values():
        if fork.entered or not inside:
            raise ValueError(f"activation_checkpointing: {name!r} runs inside a tensor-parallel region "
                             "(its per-rank random stream is swapped in), where a recomputation could not "
                             "draw the same dropout masks; checkpoint the block that holds the region")
    return list(found.values())


class _RandomState:
    """The random state a checkpointed forward started from; `replay` recomputes under it."""

    def __init__(self, forks: list[RNGFork], args: tuple[Any, ...]) -> None:
        self.cpu = torch.get_rng_state()
        devices = {a.device.index for a in args if isinstance(a, torch.Tensor) and a.is_cuda}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            devices.add(torch.cuda.current_device())
        self.cuda = [(d, torch.cuda.get_rng_state(d)) for d in sorted(d for d in devices if d is not None)]
        self.forks = [(f, f.snapshot()) for f in forks]
        types_ = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
        self.autocast = [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types_]
        self.autocast_cache = torch.is_autocast_cache_enabled()

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            # fork_rng puts the default generators back afterwards; the forks are put back below.
            stack.enter_context(torch.random.fork_rng(devices=[d for d, _ in self.cuda]))
            torch.set_rng_state(self.cpu)
            for d, s in self.cuda:
                torch.cuda.set_rng_state(s, d)
            for fork, start in self.forks:
                stack.callback(fork.restore, fork.snapshot())
                fork.restore(start)
            for t, on, dtype in self.autocast:
                stack.enter_context(torch.autocast(t, dtype, on, self.autocast_cache))
            yield


class _Holder:
    """What autograd keeps instead of a saved tensor: the tensor's place in the forward's order."""

    __slots__ = ("index", "__weakref__")

    def __init__(self, index: int) -> None:
        self.index = index


class _Recomputed(Exception):
    """Ends a recomputation once it has saved every tensor backward needs. An ``Exception`` (as
    torch's own early stop): modules run their ``always_call`` hooks on those only, and tensor
    parallelism's regions leave their random stream in one."""


class _Frame:
    """One checkpointed forward: its placeholders, how to run it again, and what that run saved."""

    def __init__(self, state: Checkpointed, args: tuple[Any, ...], kwargs: dict[str, Any],
                 rng: _RandomState) -> None:
        self.state, self.rng = state, rng
        self.inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = (args, kwargs)
        self.versions = [version_of(a) if isinstance(a, torch.Tensor) else None for a in args]
        self.holders: list[weakref.ref[_Holder]] = []
        self.shapes: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        # Recomputed tensors, dropped with their placeholders (when autograd frees the graph nodes).
        self.values: weakref.WeakKeyDictionary[_Holder, torch.Tensor] = weakref.WeakKeyDictionary()
        self.kept: dict[Any, list[Any]] | None = {} if state.policy == "selective" else None

    def pack(self, t: torch.Tensor) -> _Holder:
        holder = _Holder(len(self.holders))
        self.holders.append(weakref.ref(holder))
        self.shapes.append((t.shape, t.dtype, t.device))
        return holder

    def unpack(self, holder: _Holder) -> torch.Tensor:
        if self.inputs is not None:
            self.recompute()
        got = self.values.get(holder)
        if got is None:
            raise RuntimeError(f"activation checkpointing of {self.state.name!r}: saved tensor "
                               f"#{holder.index} was not recomputed")
        return got

    def keeping(self) -> contextlib.AbstractContextManager[Any]:
        """The forward's context: the selective policy keeps its matmul and attention outputs."""
        return contextlib.nullcontext() if self.kept is None else _Keep(self.kept)

    def forward_done(self) -> None:
        if not self.holders:  # nothing saved (frozen block, no grad needed): nothing to recompute
            self.inputs, self.kept = None, None

    def recompute(self) -> None:
        """Run the block's forward again (once), capturing what it saves in the forward's order."""
        assert self.inputs is not None
        args, kwargs = self.inputs
        for i, (a, v) in enumerate(zip(args, self.versions)):
            if isinstance(a, torch.Tensor) and version_of(a) != v:
                raise RuntimeError(f"activation checkpointing of {self.state.name!r}: its input #{i} was "
                                   "modified in place since its forward began (by the block or after it), so "
                                   "a recomputation would not start from the same values; keep the input "
                                   "unchanged, or do not checkpoint this block")
        # Detached like the tensors autograd saves: the recomputed graph is never backpropagated.
        again = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                      for a in args)
        count = [0]

        def capture(t: torch.Tensor) -> None:
            i = count[0]
            count[0] += 1
            if i >= len(self.shapes) or self.shapes[i] != (t.shape, t.dtype, t.device):
                self._mismatch(i, t)
            holder = self.holders[i]()
            if holder is not None:  # else autograd freed that node already
                self.values[holder] = t.detach()
            if count[0] == len(self.shapes):
                raise _Recomputed
            # Keep nothing in the recomputed graph (it is never run backward): a node holding its own
            # output would form a cycle through autograd's C++ graph that no collector breaks, and
            # every step would leak the block's activations.
            return None

        reuse = contextlib.nullcontext() if self.kept is None else _Reuse(self.kept)
        with (self.rng.replay(), torch.enable_grad(), saved_tensors_hooks(capture, _same), reuse,
              contextlib.suppress(_Recomputed)):  # innermost: the others exit normally
            self.state.forward(*again, **kwargs)
        if count[0] != len(self.shapes):
            self._mismatch(count[0], None)
        self.inputs, self.kept = None, None  # recomputed once: the inputs and kept outputs may go

    def _mismatch(self, i: int, t: torch.Tensor | None) -> None:
        want = (f"a {tuple(self.shapes[i][0])} {self.shapes[i][1]} tensor" if i < len(self.shapes)
                else "nothing more")
        got = "nothing more" if t is None else f"a {tuple(t.shape)} {t.dtype} tensor"
        raise RuntimeError(f"activation checkpointing of {self.state.name!r}: the recomputed forward saved "
                           f"{got} for backward where the forward saved {want} (#{i}); the block's forward "
                           "must do the same when called again (no state changed since, no branches on "
                           "values)")


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _kept(out: Any) -> tuple[Any, list[tuple[torch.Tensor, int]]]:
    """An op's output as kept (detached aliases) and each tensor's version counter at that moment."""
    out = map_tensors(torch.Tensor.detach, out)
    return out, [(t, version_of(t)) for t in tensors_in(out)]


class _Keep(TorchDispatchMode):
    """Selective forward: keeps the output of every `KEPT_OPS` op, per op in call order."""

    def __init__(self, kept: dict[Any, list[Any]]) -> None:
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in KEPT_OPS:
            self.kept.setdefault(func, []).append(_kept(out))
        return out


class _Reuse(TorchDispatchMode):
    """Selective recomputation: hands each `KEPT_OPS` op the output the forward kept. One modified
    in place since (a version moved) is computed again instead, from the recomputed inputs."""

    def __init__(self, kept: dict[Any, list[Any]]) -> None:
        super().__init__()
        self.kept = kept
        self.calls: dict[Any, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in KEPT_OPS:
            i = self.calls.get(func, 0)
            self.calls[func] = i + 1
            outs = self.kept.get(func, [])
            if i < len(outs) and all(version_of(t) == v for t, v in outs[i][1]):
                return map_tensors(torch.Tensor.detach, outs[i][0])
        return func(*args, **(kwargs or {}))


make_callable(__name__)
