"""Dynamic loss scaling for fp16 training in any layout (Micikevicius et al. 2018, "Mixed Precision
Training", sec. 3.2), with the overflow check agreed by every rank.

    scaler = plait.GradScaler(mesh)
    scaler.scale(loss).backward()           # a pipeline: pipe.step(x, y, loss_scale=scaler.get_scale())
    scaler.unscale_(opt)                     # optional: before plait.clip_grad_norm_
    plait.clip_grad_norm_(model, 1.0)
    scaler.step(opt)                         # skipped when any gradient on any rank is inf or NaN
    scaler.update()

fp16 keeps 5 exponent bits: gradients below about 6e-8 flush to zero. Multiplying the loss by a
large scale ``S`` lifts the whole backward into range; the gradients are divided by ``S`` again
before the optimizer sees them. When a step overflows (some gradient is inf or NaN) it is skipped
and ``S`` backs off; after ``growth_interval`` clean steps it grows again (torch's
``torch.amp.GradScaler`` semantics and state-dict keys).

In a parallel layout each rank holds different gradients (tensor-parallel shards, pipeline stages,
FSDP shards), so one rank may overflow alone. `unscale_` therefore all-reduces its local verdict
(one float, MAX) over the whole job, every rank of every mesh axis, through `plait.comm`: every
rank skips the same steps and keeps the same scale, and the replicas never drift apart. bf16 has
fp32's exponent range and needs no scaler (``enabled=False`` makes it a pass-through).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from plait._torch_compat import map_tensors
from plait.runtime import comm
from plait.runtime.mesh import Mesh

_STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


class GradScaler:
    """``torch.amp.GradScaler`` for plait's layouts: the inf/NaN check is agreed over every rank.

    Args:
        mesh: the job's `plait.Mesh` (the check spans all of its ranks, the whole world); None: the
            default process group, or this process alone when none is initialised.
        init_scale: the first scale.
        growth_factor: multiplies the scale after ``growth_interval`` steps without overflow.
        backoff_factor: multiplies the scale after a step that overflowed (which is skipped).
        growth_interval: clean steps between growths.
        enabled: False: every method is a pass-through (``step`` just steps), as for bf16 or fp32.
    """

    def __init__(self, mesh: Mesh | None = None, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True) -> None:
        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(f"GradScaler(mesh=...) expects a plait.Mesh or None, got {type(mesh).__name__}")
        if not init_scale > 0:
            raise ValueError(f"GradScaler(init_scale=...) must be > 0, got {init_scale}")
        if not growth_factor > 1:
            raise ValueError(f"GradScaler(growth_factor=...) must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"GradScaler(backoff_factor=...) must be in (0, 1), got {backoff_factor}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"GradScaler(growth_interval=...) must be an integer >= 1, "
                             f"got {growth_interval!r}")
        self.enabled = enabled
        self._scale, self._growth_tracker = float(init_scale), 0
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self._found: dict[int, torch.Tensor] = {}  # id(optimizer) -> agreed inf flag, since update()
        self._stepped: set[int] = set()
        self.skipped = False  # whether the last update() backed off (its step was skipped)
        self.skipped_steps = 0  # steps skipped since construction (or the loaded state)

    # ------------------------------------------------------------------ the loop
    def scale(self, outputs: Any) -> Any:
        """``outputs`` (a loss, or a structure of tensors) times the current scale."""
        if not self.enabled:
            return outputs
        return map_tensors(lambda t: t * self._scale, outputs)

    def get_scale(self) -> float:
        """The current scale (1.0 when disabled): what a pipeline's ``step(..., loss_scale=)`` takes."""
        return self._scale if self.enabled else 1.0

    @torch.no_grad()
    def unscale_(self, optimizer: Any) -> None:
        """Divide the gradients of ``optimizer``'s parameters by the scale, in place, and agree with
        every rank whether any of them is inf or NaN (one all-reduce over the world)."""
        if not self.enabled:
            return
        if id(optimizer) in self._found:
            raise RuntimeError("GradScaler.unscale_: already called for this optimizer since the last "
                               "update()")
        if id(optimizer) in self._stepped:
            raise RuntimeError("GradScaler.unscale_: called after step() for this optimizer; call update() "
                               "first")
        agree = dist.is_initialized()  # one process alone has nothing to agree with
        flag = torch.zeros(1, dtype=torch.float32, device=comm.device_of(None) if agree else "cpu")
        inv = 1.0 / self._scale
        for g in _grads(optimizer):
            if g.dtype == torch.float16:
                raise ValueError("GradScaler.unscale_: the optimizer holds fp16 gradients; keep fp32 master "
                                 "weights (plait.mixed_precision, or FSDP's mixed_precision) and step those")
            g.mul_(inv)
            flag += (~torch.isfinite(g)).any().to(flag.device, flag.dtype)
        if agree:  # the default group: every rank of every mesh axis
            with comm.operation("GradScaler inf/NaN check"):
                comm.all_reduce(flag, None, op=dist.ReduceOp.MAX)
        self._found[id(optimizer)] = flag

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step(*args, **kwargs)`` unless some rank found an inf or NaN gradient (then
        nothing changes, on every rank); unscales first if `unscale_` was not called."""
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        if id(optimizer) in self._stepped:
            raise RuntimeError("GradScaler.step: already called for this optimizer since the last update()")
        if id(optimizer) not in self._found:
            self.unscale_(optimizer)
        self._stepped.add(id(optimizer))
        if self._found[id(optimizer)].item() > 0:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | None = None) -> None:
        """Back off after an overflow, grow after ``growth_interval`` clean steps (or set ``new_scale``)."""
        if not self.enabled:
            return
        if not self._found:
            raise RuntimeError("GradScaler.update: no inf check since the last update(); call step() (or "
                               "unscale_()) for the optimizer first")
        self.skipped = any(f.item() > 0 for f in self._found.values())
        self._found.clear()
        self._stepped.clear()
        if self.skipped:
            self.skipped_steps += 1
        if new_scale is not None:
            if not new_scale > 0:
                raise ValueError(f"GradScaler.update(new_scale=...) must be > 0, got {new_scale}")
            self._scale = float(new_scale)
        elif self.skipped:
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._scale *= self.growth_factor
                self._growth_tracker = 0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """torch's keys (``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker``) plus ``skipped_steps``; plain numbers (JSON-ready). Empty when disabled,
        as torch's."""
        if not self.enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": self._growth_tracker, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.enabled:
            return
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"GradScaler.load_state_dict: the state lacks {missing} (an empty state is "
                             "what a disabled scaler saves)")
        self._scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self._growth_tracker = int(state["_growth_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def _grads(optimizer: Any) -> list[torch.Tensor]:
    """The gradients of the optimizer's parameters, each once."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                # A DTensor's local tensor: the inf/NaN flag is agreed over every rank anyway.
                out.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
    return out
