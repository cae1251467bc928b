"""The one place plait touches private PyTorch APIs; each use says why no public one fits."""

from __future__ import annotations

from collections.abc import Callable

import torch


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current ``backward()`` has finished every node.

    DDP needs this to learn that backward is over (to wait for the last bucket and to name
    parameters that never received a gradient). Public hooks fire per tensor or per node;
    only the engine's callback queue fires after the whole graph. Must be called from inside
    a running backward (e.g. from a gradient hook).
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]
