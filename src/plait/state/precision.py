"""Mixed precision outside FSDP: fp32 master weights, computation in a low dtype.

    model = plait.mixed_precision(model, "bf16")      # or MixedPrecision(torch.bfloat16, torch.float32)
    opt = torch.optim.AdamW(model.parameters())       # fp32 parameters, fp32 gradients, fp32 state

The parameters stay what they were (fp32): they are the *master weights* the optimizer steps
and checkpoints save. Each forward of the root module first casts every floating parameter to
``param_dtype`` (once per parameter, so tied weights share one copy) and points the owning
modules' attributes at the copies for the length of that forward; floating inputs are cast too.
The layers then compute in the low dtype, and so do the collectives they call (tensor
parallelism's all-reduces and all-gathers carry the activations' dtype, and a pipeline's
point-to-point buffers take the dtypes its metadata pass reports). Backward runs through the
casts: each use's low-precision weight gradient is summed in the low dtype (tied uses included)
and then cast back, so ``.grad`` of every master weight is fp32 and accumulation over
microbatches or ``no_sync`` steps happens in fp32. Losses are computed in fp32
(`plait.losses.lm_loss` and the vocab-parallel cross-entropy raise the logits to it).

A module called *outside* the root's forward (a recomputation by activation checkpointing, during
backward) casts its own parameters in its own pre-hook, so it sees the same values.

The data-parallel reduction is DDP's: it reads ``reduce_dtype`` from the policy when it wraps the
module (fp32: the master gradients as they are; bf16/fp16: DDP's ``gradient_compression``, a
pre-divided half-precision copy; None: ``param_dtype``, as FSDP reduces the compute-dtype gradient).

FSDP keeps its own implementation (`plait.fsdp`, same `MixedPrecision`): the same forward, bitwise
(the shard is cast before the all-gather, so each parameter is cast once per forward), the same
backward within one forward. Two differences: FSDP sums gradients over ``no_sync`` steps and pipeline
microbatches in the compute dtype on its low-precision leaves (here in fp32 on the masters), and its
division by the world size follows the reduction (DDP's precedes it). fp16 needs loss scaling:
`plait.GradScaler`.

Not supported: `plait.DataParallel` (its threads would share the modules' attributes), and layers
that keep their own references to their parameters instead of reading the attribute (``nn.RNN``
and its kin keep ``_flat_weights``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from plait._torch_compat import map_tensors
from plait.state.materialize import is_meta
from plait.state.placement.records import plain_leaf

# The names a mixed-precision option accepts, and what they mean.
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
_ATTR = "_plait_mixed_precision"  # the policy a module was given (see precision_of)
CASTS_ITSELF = "casts_parameters"  # a wrapper's class attribute: True when it casts on its own (FSDP)


@dataclass(frozen=True)
class MixedPrecision:
    """Compute in ``param_dtype``; reduce gradients over the data axes in ``reduce_dtype`` (None: in
    ``param_dtype``); master weights, their gradients and the optimizer state stay fp32.

    ``output_dtype`` (None: leave them) casts the floating-point outputs of the module's forward, as
    torch's ``MixedPrecisionPolicy.output_dtype`` does (under FSDP: each unit's outputs);
    ``cast_forward_inputs=False`` leaves the floating-point inputs as they come (the module casts
    them itself)."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = torch.float32
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            dt = getattr(self, name)
            if (dt is not None or name == "param_dtype") and not (isinstance(dt, torch.dtype)
                                                                   and dt.is_floating_point):
                raise ValueError(f"MixedPrecision.{name} must be a floating dtype, got {dt!r}")
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(f"MixedPrecision.cast_forward_inputs must be True or False, "
                            f"got {self.cast_forward_inputs!r}")

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced in."""
        return self.reduce_dtype or self.param_dtype


def parse_mixed_precision(mp: MixedPrecision | str | None, where: str) -> MixedPrecision | None:
    """``MixedPrecision``, ``"bf16"``/``"fp16"`` (fp32 reduction), or None / ``"fp32"`` (no mixed
    precision); ``where`` names the option in the error."""
    if mp is None or isinstance(mp, MixedPrecision):
        return mp
    if isinstance(mp, str) and mp.lower() in DTYPES:
        return MixedPrecision(param_dtype=DTYPES[mp.lower()])
    if isinstance(mp, str) and mp.lower() in ("fp32", "no", "none"):
        return None
    raise ValueError(f"{where} expects a MixedPrecision, 'bf16', 'fp16' or None; got {mp!r}")


def precision_of(module: Any) -> MixedPrecision | None:
    """The policy `mixed_precision` gave ``module`` (or any of a pipeline's stages); None if none."""
    for m in _modules_of(module):
        found = getattr(m, _ATTR, None)
        if found is not None:
            return found.policy
    return None


def mixed_precision(module: Any, policy: MixedPrecision | str = "bf16", *, cast_inputs: bool = True) -> Any:
    """Train ``module`` (an ``nn.Module``, or each stage of a `plait.Pipeline`) in mixed precision,
    in place; returns it. See the module docstring for what is cast and when.

    Args:
        module: a materialized model, plain, tensor-parallel or in DDP (whose reduce dtype must then
            match the policy's: wrap after this call and DDP takes it from the policy), or a pipeline
            whose stages are not FSDP.
        policy: `MixedPrecision`, ``"bf16"`` or ``"fp16"`` (with fp32 gradient reduction).
        cast_inputs: cast floating-point inputs of the root's forward to ``param_dtype`` (and the
            policy's ``cast_forward_inputs``: both must be True for the inputs to be cast).
    """
    mp = parse_mixed_precision(policy, "mixed_precision(policy=...)")
    if mp is None:
        raise ValueError(f"mixed_precision(policy=...): {policy!r} means no mixed precision; leave the model "
                         "as it is instead")
    targets = list(_modules_of(module))
    if not targets:
        raise TypeError(f"mixed_precision(module=...) expects an nn.Module or a plait.Pipeline, got "
                        f"{type(module).__name__}")
    for m in targets:  # every check first: nothing is installed on a model that is then refused
        _check_target(m, mp)
    for m in targets:
        setattr(m, _ATTR, _Caster(m, mp, cast_inputs and mp.cast_forward_inputs))
    return module


def _modules_of(obj: Any) -> Iterator[nn.Module]:
    """The module itself, or a pipeline's stage modules (duck-typed: the pipeline is no module)."""
    if isinstance(obj, nn.Module):
        yield obj
        return
    stages = getattr(obj, "stages", None)
    if isinstance(stages, dict):
        yield from (stages[s] for s in sorted(stages))


def _check_target(m: nn.Module, mp: MixedPrecision) -> None:
    # FSDP and DDP are recognised by attributes, not imported: they import this module.
    if any(getattr(sub, _ATTR, None) is not None for sub in m.modules()):
        raise ValueError("mixed_precision: this module already computes in mixed precision")
    if any(getattr(sub, CASTS_ITSELF, False) for sub in m.modules()):
        raise ValueError("mixed_precision: FSDP casts its own gathered parameters; pass "
                         "FullyShardedDataParallel(..., mixed_precision=...) (or ParallelPlan(data='fsdp', "
                         "mixed_precision=...)) instead")
    if is_meta(m):
        raise ValueError("mixed_precision: the module has meta-device parameters; materialize it first "
                         "(plait.parallelize does, in its data-parallel step)")
    for sub in m.modules():  # DDP: the dtype its buckets are all-reduced in (None: the gradients')
        if not hasattr(sub, "wire_dtype"):
            continue
        have = sub.wire_dtype or torch.float32
        if have != mp.wire_dtype:
            raise ValueError(f"mixed_precision: this DDP module reduces gradients in {have}, but the policy "
                             f"reduces in {mp.wire_dtype}; call mixed_precision on the module before "
                             "wrapping it in DDP (which then takes the reduce dtype from the policy)")
    check_castable(m)


def check_castable(module: nn.Module) -> None:
    """Refuse a model whose layers would not see the casts (no communication: callers run it before
    any collective)."""
    rnns = [n for n, sub in module.named_modules() if isinstance(sub, nn.RNNBase)]
    if rnns:
        raise ValueError(f"mixed_precision: recurrent layers ({', '.join(rnns[:4])}) read their own list of "
                         "weights, not the attributes that mixed precision casts; cast such a model with "
                         ".to(dtype) instead")


class _Caster:
    """The hooks of one root module: cast every parameter at the root's pre-forward, restore the
    master weights at its post-forward; each owning module casts its own parameters when called
    outside the root's forward."""

    def __init__(self, root: nn.Module, policy: MixedPrecision, cast_inputs: bool) -> None:
        self.policy, self.dtype, self.cast_inputs = policy, policy.param_dtype, cast_inputs
        # (owner module, attribute) of every parameter, each pair once (a shared module lists its
        # parameters once; a tied parameter has one pair per owner).
        self.slots: list[tuple[nn.Module, str]] = []
        seen: set[tuple[int, str]] = set()
        for mod in root.modules():
            for attr in mod._parameters:
                if (id(mod), attr) not in seen:
                    seen.add((id(mod), attr))
                    self.slots.append((mod, attr))
        self.active = 0  # depth of root forwards running (their casts are in place)
        self._own: dict[int, list[str]] = {}  # module id -> attributes its own pre-hook cast
        self.handles: list[RemovableHandle] = [
            root.register_forward_pre_hook(self._enter, with_kwargs=True),
            root.register_forward_hook(self._leave, always_call=True)]
        owners = {id(m): m for m, _ in self.slots if m is not root}
        for mod in owners.values():
            self.handles.append(mod.register_forward_pre_hook(self._own_enter))
            self.handles.append(mod.register_forward_hook(self._own_leave, always_call=True))

    def _cast(self, slots: list[tuple[nn.Module, str]]) -> list[tuple[nn.Module, str]]:
        """Point each slot's attribute at the low-precision copy of its parameter (one copy per
        parameter); return the slots changed."""
        copies: dict[int, torch.Tensor] = {}
        done = []
        for mod, attr in slots:
            p = mod._parameters.get(attr)
            p = plain_leaf(p) if p is not None else None  # a tp DTensor's plain leaf (what forward reads)
            if p is None or not p.is_floating_point() or p.dtype == self.dtype:
                continue
            low = copies.get(id(p))
            if low is None:
                low = copies[id(p)] = p.to(self.dtype)
            mod.__dict__[attr] = low  # found before nn.Module.__getattr__ looks in _parameters
            done.append((mod, attr))
        return done

    def _enter(self, _mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.active == 0:
            self._cast(self.slots)
        self.active += 1
        if not self.cast_inputs:
            return None
        return map_tensors(self._cast_input, (args, kwargs))

    def _cast_input(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype) if t.is_floating_point() else t

    def _leave(self, _mod: nn.Module, _args: Any, out: Any) -> Any:
        if self.active == 0:  # an earlier pre-hook raised before ours ran
            return None
        self.active -= 1
        if self.active == 0:
            for mod, attr in self.slots:
                _restore(mod, attr)  # the master weight is the attribute again
        out_dtype = self.policy.output_dtype
        if out_dtype is None:
            return None
        return map_tensors(lambda t: t.to(out_dtype) if t.is_floating_point() else t, out)

    def _own_enter(self, mod: nn.Module, _args: Any) -> None:
        if self.active == 0:  # e.g. recomputed by activation checkpointing during backward
            mine = [(m, a) for m, a in self.slots if m is mod]
            self._own[id(mod)] = [a for _, a in self._cast(mine)]

    def _own_leave(self, mod: nn.Module, _args: Any, _out: Any) -> None:
        for attr in self._own.pop(id(mod), ()):
            _restore(mod, attr)


def _restore(mod: nn.Module, attr: str) -> None:
    """Make ``mod.attr`` the master weight again: the parameter, or a tp DTensor's plain leaf."""
    p = mod._parameters.get(attr)
    if p is not None and plain_leaf(p) is not p:
        mod.__dict__[attr] = plain_leaf(p)
    else:
        mod.__dict__.pop(attr, None)
