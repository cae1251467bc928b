"""DataParallel: one process, one thread per device, torch's semantics.

Each forward, as torch's ``nn.DataParallel``: (1) scatters the inputs along ``dim`` in at most
``len(devices)`` chunks (``Tensor.chunk``: a batch of 3 rows over 4 devices runs on 3), (2)
replicates the module on the devices it needs (`replicate`: every module shallow-copied,
parameters and buffers that require grad broadcast as differentiable copies, other buffers
copied), (3) runs each replica in its own thread (`parallel_apply`), and (4) gathers the outputs
on the output device. Backward sums every replica's gradient into the original parameters (and
into buffers that require grad).

Each replica owns its modules and buffers, so no two threads share a module's state. Replica 0's
parameters and buffers share storage with the wrapped module, as in torch: in-place updates made
there persist, the others' are dropped. A BatchNorm's running statistics thus end as updated by
the first chunk alone, once per forward (use `plait.SyncBatchNorm` with
`DistributedDataParallel` for statistics over the whole batch: docs/batchnorm.md).

Prefer `DistributedDataParallel` whenever you can launch one process per device: DataParallel
is limited by Python's GIL (threads contend while launching kernels), re-copies the weights
to every device on *every* forward, funnels all outputs and gradients through one device, and
cannot span machines. It is handy for a quick multi-device run inside a notebook or a single
script without a launcher. On CPU it runs with N "cpu" devices (threads), which is how it is
tested.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from plait._torch_compat import replica_of
from plait.state.precision import precision_of
from plait.state.wrapped_state import WrappedModuleState

__all__ = ["DataParallel", "data_parallel", "scatter", "gather", "replicate", "parallel_apply"]

DeviceLike = torch.device | str | int


def _as_device(d: DeviceLike) -> torch.device:
    if isinstance(d, int):  # a CUDA index; -1 is the CPU (torch's convention for output_device)
        return torch.device("cpu") if d == -1 else torch.device("cuda", d)
    return torch.device(d)


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def scatter(inputs: Any, devices: Sequence[DeviceLike], dim: int = 0) -> list[Any]:
    """Split every tensor in ``inputs`` along ``dim`` into at most ``len(devices)`` chunks.

    As torch's ``nn.parallel.scatter``: chunks follow ``Tensor.chunk`` (so there may be fewer
    chunks than devices), containers are zipped, which truncates to the fewest chunks, and other
    objects (empty containers included) are passed to every device unchanged.
    """
    targets = [_as_device(d) for d in devices]

    def split(obj: Any) -> list[Any]:
        if isinstance(obj, torch.Tensor):
            return [c.to(d) for c, d in zip(obj.chunk(len(targets), dim), targets)]
        if _is_namedtuple(obj):
            return [type(obj)(*args) for args in zip(*map(split, obj))]
        if isinstance(obj, tuple) and obj:
            return list(zip(*map(split, obj)))
        if isinstance(obj, list) and obj:
            return [list(i) for i in zip(*map(split, obj))]
        if isinstance(obj, dict) and obj:
            return [type(obj)(i) for i in zip(*map(split, obj.items()))]
        return [obj for _ in targets]

    try:
        return split(inputs)
    finally:
        split = None  # type: ignore[assignment]  # the closure refers to itself: break the cycle


def scatter_kwargs(inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, devices: Sequence[DeviceLike],
                   dim: int = 0) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
    """`scatter` of the positional and keyword arguments, the shorter list padded with empties."""
    args: list[Any] = scatter(inputs, devices, dim) if inputs else []
    kws: list[Any] = scatter(kwargs, devices, dim) if kwargs else []
    args.extend(() for _ in range(len(kws) - len(args)))
    kws.extend({} for _ in range(len(args) - len(kws)))
    return tuple(args), tuple(kws)


def gather(outputs: Sequence[Any], target_device: DeviceLike, dim: int = 0) -> Any:
    """Concatenate the replicas' outputs along ``dim`` on ``target_device`` (differentiably).

    As torch's ``nn.parallel.gather``: dicts must have the same number of keys (ValueError) and
    the same keys (KeyError), scalars gathered along dim 0 become a vector (with torch's
    warning), None stays None. Leaves that are neither tensors nor containers are refused by type.
    """
    device = _as_device(target_device)

    def join(parts: Sequence[Any]) -> Any:
        out = parts[0]
        if isinstance(out, torch.Tensor):
            if dim == 0 and all(t.dim() == 0 for t in parts):
                warnings.warn("Was asked to gather along dimension 0, but all input tensors were scalars; "
                              "will instead unsqueeze and return a vector.", stacklevel=3)
                parts = [t.view(1) for t in parts]
            return torch.cat([t.to(device) for t in parts], dim)
        if out is None:
            return None
        if isinstance(out, dict):
            if not all(len(out) == len(d) for d in parts):
                raise ValueError("All dicts must have the same number of keys")
            return type(out)((k, join([d[k] for d in parts])) for k in out)
        if _is_namedtuple(out):
            return type(out)._make(map(join, zip(*parts, strict=True)))
        if isinstance(out, (list, tuple)):
            return type(out)(map(join, zip(*parts, strict=True)))
        raise TypeError(f"DataParallel cannot gather replica outputs of type {type(out).__name__}; return "
                        "tensors, None, or lists, tuples and dicts of them")

    try:
        return join(outputs)
    finally:
        join = None  # type: ignore[assignment]  # the closure refers to itself: break the cycle


class _Broadcast(torch.autograd.Function):
    """Copies of tensors on each device; backward sums the copies' gradients into the source.

    The first device's copies alias the sources (as torch's broadcast, which hands the source
    itself to the first device), so in-place updates there persist."""

    @staticmethod
    def forward(ctx: Any, devices: list[torch.device], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Gradients are materialized (torch's default, and its DataParallel's): a parameter no
        # replica used gets a zero gradient, not None.
        ctx.count, ctx.sources = len(tensors), [t.device for t in tensors]
        out = [t if j == 0 and d == t.device else t.to(d, copy=True)
               for j, d in enumerate(devices) for t in tensors]
        needs = ctx.needs_input_grad[1:]
        ctx.mark_non_differentiable(*[o for i, o in enumerate(out) if not needs[i % len(tensors)]])
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        sums: list[torch.Tensor | None] = []
        for k in range(ctx.count):
            if not ctx.needs_input_grad[1 + k]:
                sums.append(None)
                continue
            parts = [g.to(ctx.sources[k]) for g in grads[k::ctx.count] if g is not None]
            total = parts[0]
            for g in parts[1:]:  # in device order, as torch's reduce-add
                total = total + g
            sums.append(total)
        return (None, *sums)


def _copies(tensors: list[torch.Tensor], devices: list[torch.device], differentiable: bool
            ) -> list[list[torch.Tensor]]:
    """Per device, the copies of ``tensors`` (the first device's alias the originals)."""
    if not tensors:
        return [[] for _ in devices]
    if differentiable:
        flat = _Broadcast.apply(devices, *tensors)
    else:
        flat = [t if j == 0 and d == t.device else t.detach().to(d, copy=True)
                for j, d in enumerate(devices) for t in tensors]
    return [list(flat[j * len(tensors):(j + 1) * len(tensors)]) for j in range(len(devices))]


def replicate(network: nn.Module, devices: Sequence[DeviceLike], detach: bool = False) -> list[nn.Module]:
    """One replica of ``network`` per device, as torch's ``nn.parallel.replicate``.

    Every module is shallow-copied per device; parameters (and buffers that require grad) become
    differentiable copies, whose gradients sum into the originals in backward (``detach=True``:
    plain copies); other buffers are copied. The first device's copies share storage with the
    originals.
    """
    targets = [_as_device(d) for d in devices]
    if not targets:
        return []
    modules = list(network.modules())
    # Copy the modules first: a module that cannot be replicated (a lazy one) refuses by name
    # before any tensor is copied.
    replicas = [[replica_of(m) for m in modules] for _ in targets]
    params: list[torch.Tensor] = list(network.parameters())
    buffers = list(network.buffers())
    with_grad = [b for b in buffers if b.requires_grad and not detach]
    plain = [b for b in buffers if not (b.requires_grad and not detach)]
    copies: dict[int, list[torch.Tensor]] = {}
    for group, differentiable in ((params, not detach), (with_grad, True), (plain, False)):
        for t, per_device in zip(group, zip(*_copies(group, targets, differentiable))):
            copies[id(t)] = list(per_device)
    index = {id(m): i for i, m in enumerate(modules)}
    for i, m in enumerate(modules):
        for j, mine in enumerate(r[i] for r in replicas):
            for key, child in m._modules.items():
                if child is not None:
                    setattr(mine, key, replicas[j][index[id(child)]])
            for key, p in m._parameters.items():
                if p is None:
                    mine._parameters[key] = None
                else:  # a plain tensor: an attribute of the replica, not a parameter of it
                    setattr(mine, key, copies[id(p)][j])
            for key, b in m._buffers.items():
                if b is not None:
                    setattr(mine, key, copies[id(b)][j])
    return [r[0] for r in replicas]


class _Verbatim(str):
    """KeyError prints the repr of its argument; this one's repr is the text itself."""

    def __repr__(self) -> str:
        return str(self)


class _Failure:
    """An exception raised in a replica's thread, re-raised in the caller with the thread's trace."""

    def __init__(self, where: str) -> None:
        kind, err, _ = sys.exc_info()
        assert kind is not None and err is not None
        self.kind, self.err = kind, err
        self.message = f"Caught {kind.__name__} {where}.\nOriginal {''.join(traceback.format_exc())}"

    def reraise(self) -> None:
        message = _Verbatim(self.message) if self.kind is KeyError else self.message
        try:
            new = self.kind(message)
        except Exception:  # an exception type whose constructor takes other arguments
            raise RuntimeError(message) from self.err
        raise new from self.err


def _home(module: nn.Module) -> torch.device:
    """Where a module without a named device runs: where its first tensor lives (else the CPU)."""
    first = next(iter([*module.parameters(), *module.buffers()]), None)
    return first.device if first is not None else torch.device("cpu")


def parallel_apply(modules: Sequence[nn.Module], inputs: Sequence[Any],
                   kwargs_tup: Sequence[dict[str, Any]] | None = None,
                   devices: Sequence[DeviceLike] | None = None) -> list[Any]:
    """Run ``modules[i](*inputs[i], **kwargs_tup[i])`` in a thread each, as torch's ``parallel_apply``.

    An input that is not a list or tuple is the only argument. Grad mode and the autocast state of
    the devices' type are carried into the threads (both are thread-local); an exception in a
    replica is raised again here, naming the replica and its device.
    """
    if len(modules) != len(inputs):
        raise ValueError(f"parallel_apply: {len(modules)} modules but {len(inputs)} inputs")
    kws = list(kwargs_tup) if kwargs_tup is not None else [{} for _ in modules]
    targets = [_as_device(d) for d in devices] if devices is not None else [_home(m) for m in modules]
    if not len(kws) == len(targets) == len(modules):
        raise ValueError(f"parallel_apply: {len(modules)} modules, {len(kws)} kwargs, {len(targets)} devices")
    grad_enabled = torch.is_grad_enabled()
    kind = targets[0].type if targets else "cpu"
    autocast = torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)
    results: list[Any] = [None] * len(modules)

    def work(i: int) -> None:
        # The replica's GPU is the thread's current device, so tensors its forward makes land there.
        on_device = torch.cuda.device(targets[i]) if targets[i].type == "cuda" else contextlib.nullcontext()
        try:
            with torch.set_grad_enabled(grad_enabled), on_device, \
                    torch.autocast(kind, dtype=autocast[1], enabled=autocast[0]):
                args = inputs[i] if isinstance(inputs[i], (list, tuple)) else (inputs[i],)
                results[i] = modules[i](*args, **kws[i])
        except Exception:
            results[i] = _Failure(f"in replica {i} on device {targets[i]}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(1, len(modules))]
    for t in threads:
        t.start()
    if modules:
        work(0)  # the calling thread runs the first replica instead of waiting idle
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, _Failure):
            r.reraise()
    return results


def _check_source(module: nn.Module, source: torch.device) -> None:
    """torch checks this at every forward: the module may have moved since it was wrapped."""
    for t in [*module.parameters(), *module.buffers()]:
        if t.device != source:
            raise RuntimeError(f"module must have its parameters and buffers on device {source} "
                               f"(device_ids[0]) but found one of them on device: {t.device}")


def _refuse_collective_layers(module: nn.Module) -> None:
    """Layers that communicate across ranks (`plait.SyncBatchNorm` inside a job) would issue the
    same collectives from every replica's thread at once, on one group: refused, before any."""
    names = [n for n, m in module.named_modules() if getattr(m, "join_mirror", None) is not None]
    if names:
        raise ValueError(f"DataParallel: {', '.join(names[:4])} synchronize batch statistics across ranks "
                         "(SyncBatchNorm), which its replicas' threads cannot do together; use "
                         "DistributedDataParallel, one process per device")


def _run(module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None,
         devices: list[torch.device], output_device: torch.device, dim: int) -> Any:
    """Scatter, replicate on the devices the chunks need, apply, gather: one forward."""
    _check_source(module, devices[0])
    args, kws = scatter_kwargs(inputs, kwargs, devices, dim)
    if not args and not kws:  # a forward without inputs runs once, on the first device
        args, kws = ((),), ({},)
    if len(devices) == 1:
        return module(*args[0], **kws[0])
    used = devices[:len(args)]
    if len(used) > 1:
        _refuse_collective_layers(module)
    replicas = replicate(module, used, detach=not torch.is_grad_enabled())
    return gather(parallel_apply(replicas, args, kws, used), output_device, dim)


def data_parallel(module: nn.Module, inputs: Any, device_ids: Sequence[DeviceLike] | None = None,
                  output_device: DeviceLike | None = None, dim: int = 0,
                  module_kwargs: dict[str, Any] | None = None) -> Any:
    """``module(*inputs, **module_kwargs)`` over ``device_ids``: the functional `DataParallel`, as
    torch's ``nn.parallel.data_parallel`` (``inputs``: a tuple of arguments, or one argument)."""
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    devices = _devices(device_ids)
    target = _as_device(output_device) if output_device is not None else devices[0]
    return _run(module, inputs, module_kwargs, devices, target, dim)


def _devices(devices: Sequence[DeviceLike] | None) -> list[torch.device]:
    if devices is None:
        if not torch.cuda.is_available():
            raise ValueError("DataParallel(devices=None) uses every CUDA device, but CUDA is not "
                             "available; pass devices=['cpu'] * N to run N CPU threads")
        devices = list(range(torch.cuda.device_count()))
    if len(devices) == 0:
        raise ValueError("DataParallel(devices=...) must name at least one device, got []")
    return [_as_device(d) for d in devices]


class DataParallel(WrappedModuleState, nn.Module):
    """Replicate ``module`` on ``devices`` and split each batch along ``dim`` across them.

    Args:
        module: the model; its parameters and buffers must live on ``devices[0]`` at each forward.
        devices: e.g. ``[0, 1]`` or ``["cuda:0", "cuda:1"]``; on CPU ``["cpu"] * 4`` runs four
            threads. Defaults to every visible CUDA device. ``device_ids=`` (torch's name) is
            the same argument.
        output_device: where outputs are gathered (default ``devices[0]``).
        dim: the dimension inputs are scattered and outputs gathered along (default 0).
    """

    def __init__(self, module: nn.Module, devices: Sequence[DeviceLike] | None = None,
                 output_device: DeviceLike | None = None, dim: int = 0, *,
                 device_ids: Sequence[DeviceLike] | None = None) -> None:
        super().__init__()
        if device_ids is not None:
            if devices is not None:
                raise ValueError("DataParallel: pass devices or device_ids (the same argument), not both")
            devices = device_ids
        targets = _devices(devices)
        if precision_of(module) is not None:
            raise ValueError("DataParallel: the module was given plait.mixed_precision, whose casts live in "
                             "the modules' attributes, which the replicas would share; use "
                             "DistributedDataParallel (one process per device) for mixed precision")
        self.module = module
        self.devices = targets
        self.output_device = _as_device(output_device) if output_device is not None else targets[0]
        self.dim = dim

    @property
    def device_ids(self) -> list[torch.device]:
        """torch's name for `devices`."""
        return self.devices

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return _run(self.module, inputs, kwargs, self.devices, self.output_device, self.dim)
