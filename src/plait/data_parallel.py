"""DataParallel: one process, one thread per device.

Each forward (1) copies the parameters to every device with autograd-tracked copies, (2)
scatters the batch along dim 0, (3) runs the module on each chunk in its own thread with
``torch.func.functional_call`` (so the user's module object is shared, not cloned), and (4)
gathers the outputs on the output device. Backward flows through the copies, so the
gradients of all replicas are summed into the original parameters' ``.grad``.

Prefer `DistributedDataParallel` whenever you can launch one process per device: DataParallel
is limited by Python's GIL (threads contend while launching kernels), re-copies the weights
to every device on *every* forward, funnels all outputs and gradients through one device, and
cannot span machines. It is handy for a quick multi-device run inside a notebook or a single
script without a launcher. On CPU it runs with N "cpu" devices (threads), which is how it is
tested.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from plait._torch_compat import tree_flatten, tree_unflatten
from plait.precision import precision_of
from plait.wrapped_state import WrappedModuleState

__all__ = ["DataParallel", "scatter", "gather", "replicate_state", "parallel_apply"]

DeviceLike = torch.device | str | int


def _as_device(d: DeviceLike) -> torch.device:
    return torch.device("cuda", d) if isinstance(d, int) else torch.device(d)


def scatter(obj: Any, devices: Sequence[torch.device]) -> list[Any]:
    """Split every tensor in ``obj`` along dim 0 into ``len(devices)`` chunks, one per device.

    Non-tensor leaves are passed to every replica unchanged.
    """
    n = len(devices)
    leaves, spec = tree_flatten(obj)
    columns = []
    for x in leaves:
        if not isinstance(x, torch.Tensor):
            columns.append([x] * n)
            continue
        if x.dim() == 0 or x.shape[0] < n:
            raise ValueError(f"DataParallel: cannot scatter a tensor of shape {tuple(x.shape)} over "
                             f"{n} devices; dim 0 must have at least {n} entries")
        columns.append([c.to(d) for c, d in zip(x.tensor_split(n, dim=0), devices)])
    return [tree_unflatten([col[i] for col in columns], spec) for i in range(n)]


def gather(outputs: list[Any], device: torch.device) -> Any:
    """Concatenate replica outputs along dim 0 on ``device`` (autograd-aware)."""
    flat = [tree_flatten(o)[0] for o in outputs]
    spec = tree_flatten(outputs[0])[1]
    out = []
    for leaves in zip(*flat):
        first = leaves[0]
        if isinstance(first, torch.Tensor):
            moved = [t.to(device) for t in leaves]
            # Scalars (e.g. a loss computed inside the model) come back as one entry per replica.
            out.append(torch.cat(moved, dim=0) if first.dim() else torch.stack(moved))
        else:
            out.append(first)
    return tree_unflatten(out, spec)


def replicate_state(module: nn.Module, devices: Sequence[torch.device]) -> list[dict[str, torch.Tensor]]:
    """Parameters and buffers for each device.

    Parameters are copied with ``.to`` (a differentiable op, so gradients flow back to the
    originals; on the source device it is the parameter itself). Buffers are detached copies
    except on the first device, which owns the module's real buffers (running statistics
    updated there persist, as in torch's DataParallel).
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    states = []
    for i, d in enumerate(devices):
        state = {k: p.to(d) for k, p in params.items()}
        state.update({k: b if i == 0 else b.detach().to(d, copy=True) for k, b in buffers.items()})
        states.append(state)
    return states


def parallel_apply(module: nn.Module, states: list[dict[str, torch.Tensor]], inputs: list[Any],
                   kwargs: list[dict[str, Any]], pool: ThreadPoolExecutor) -> list[Any]:
    """Run the module once per replica state, each in its own thread."""
    grad_enabled = torch.is_grad_enabled()

    def run(i: int) -> Any:
        with torch.set_grad_enabled(grad_enabled):  # grad mode is thread-local
            args = inputs[i] if isinstance(inputs[i], tuple) else (inputs[i],)
            return functional_call(module, states[i], args, kwargs[i], tie_weights=True)

    return list(pool.map(run, range(len(states))))


class DataParallel(WrappedModuleState, nn.Module):
    """Replicate ``module`` on ``devices`` and split each batch along dim 0 across them.

    Args:
        module: the model; it must live on ``devices[0]``.
        devices: e.g. ``[0, 1]`` or ``["cuda:0", "cuda:1"]``; on CPU ``["cpu"] * 4`` runs four
            threads. Defaults to every visible CUDA device.
        output_device: where outputs are gathered (default ``devices[0]``).
    """

    def __init__(self, module: nn.Module, devices: Sequence[DeviceLike] | None = None,
                 output_device: DeviceLike | None = None) -> None:
        super().__init__()
        if devices is None:
            if not torch.cuda.is_available():
                raise ValueError("DataParallel(devices=None) uses every CUDA device, but CUDA is not "
                                 "available; pass devices=['cpu'] * N to run N CPU threads")
            devices = list(range(torch.cuda.device_count()))
        if len(devices) == 0:
            raise ValueError("DataParallel(devices=...) must name at least one device, got []")
        if precision_of(module) is not None:
            raise ValueError("DataParallel: the module was given plait.mixed_precision, whose casts live in "
                             "the modules' attributes, which the replicas' threads would share; use "
                             "DistributedDataParallel (one process per device) for mixed precision")
        self.module = module
        self.devices = [_as_device(d) for d in devices]
        self.output_device = _as_device(output_device) if output_device is not None else self.devices[0]
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if t.device != self.devices[0]:
                raise ValueError(f"DataParallel: {name} is on {t.device} but the module must live on "
                                 f"devices[0] = {self.devices[0]}")
        self._pool = ThreadPoolExecutor(max_workers=len(self.devices), thread_name_prefix="plait-dp")

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if len(self.devices) == 1:
            return self.module(*inputs, **kwargs)
        scattered = scatter(inputs, self.devices)
        scattered_kw = scatter(kwargs, self.devices) if kwargs else [{} for _ in self.devices]
        states = replicate_state(self.module, self.devices)
        outputs = parallel_apply(self.module, states, scattered, scattered_kw, self._pool)
        return gather(outputs, self.output_device)
