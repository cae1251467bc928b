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


def default_store() -> torch.distributed.Store:
    """The key-value store behind the default process group.

    When a collective fails, each rank posts where it stopped and reads where the others did,
    to name the ranks that never arrived. The group itself is broken by then; the store (a
    separate TCP connection to rank 0's server) still answers, and torch exposes it only here.
    """
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()
