"""Data parallelism over pipeline stages: what a pipeline needs to know of a stage's wrapper.

`plait.parallelize` wraps each of this rank's stages in DDP or FSDP (torchtitan's layout: every
stage is its own FSDP module over the data axes). The pipeline package never imports those
strategies; `plait.parallelize` hands the pipeline a `StageWrapper` instead, and the pipeline
drives it: it accumulates gradients locally over a step's microbatches and lets only each
stage's last accumulating backward reduce them (see `plait.pipeline.runtime`).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

from plait.pipeline.ties import Tie


class StageWrapper(Protocol):
    """How `plait.parallelize` applies data parallelism to one pipeline stage."""

    # wrap() gives meta-device tensors their values itself (FSDP materializes only its slice);
    # False: the pipeline materializes each stage first (tied tensors take their first owner's
    # values, as in one process).
    materializes: bool
    # The wrapped stage trains the stage's own parameter objects (DDP), so a weight tied across
    # pp ranks can stay one plain copy per rank; False (FSDP's flat shards): such ties are refused.
    keeps_parameters: bool
    # Why schedules that split backward into B and W cannot run with this wrapper; None: they can.
    split_backward_refusal: str | None

    def wrap(self, stage: nn.Module) -> nn.Module:
        """The stage (parameters under the original model's names), wrapped."""
        ...

    def leaves(self, wrapped: nn.Module) -> list[torch.Tensor]:
        """The autograd leaves the wrapped stage's forward uses, whose gradients it reduces."""
        ...

    def grad_sync(self, wrapped: nn.Module, reduce: bool) -> AbstractContextManager[None]:
        """The context of one action on the stage: ``reduce`` for its last accumulating backward
        of the step (gradients are reduced as its hooks fire), else local accumulation only."""
        ...


class StateHoldingStage(Protocol):
    """A wrapped stage that holds its state in a form of its own (FSDP's flat shards, under a
    wrapper whose ``keeps_parameters`` is False) and answers the state protocols itself
    (`plait.state.state_dict`, `plait.state.checkpoint.protocol`)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def checkpoint_state(self, optimizer: Any) -> dict[str, Any]: ...

    def load_checkpoint_state(self, state: dict[str, Any], optimizer: Any) -> None: ...


def check_wrappable(wrapper: StageWrapper | None, rank: int, stage_params: dict[int, Sequence[nn.Parameter]],
                    ties: Sequence[Tie]) -> None:
    """Refuse, before any collective, weights a per-stage wrapper cannot hold on pp rank ``rank``
    (every rank checks every rank's ``stage_params``, so all of them refuse alike).

    A parameter used by two stages of one rank would be wrapped twice (two DDP buckets or two
    FSDP flat shards reducing one tensor); a weight tied across pp ranks needs a plain copy per
    rank, which FSDP's flat shards are not.
    """
    if wrapper is None:
        return
    owner: dict[int, int] = {}
    for s, params in sorted(stage_params.items()):
        for p in params:
            if owner.setdefault(id(p), s) != s:
                raise ValueError(
                    f"pipeline: stages {owner[id(p)]} and {s} of pp rank {rank} share a parameter (e.g. a "
                    "tied embedding and LM head, which a V schedule puts on rank 0); data parallelism wraps "
                    "each stage on its own and would reduce it twice: untie it, split the model so that its "
                    "users share one stage, or use a schedule with one stage per rank")
    if ties and not wrapper.keeps_parameters:
        raise ValueError(f"pipeline: weights shared across pp ranks ({[t.names for t in ties]}) cannot be "
                         "FSDP-sharded per stage (each rank keeps a plain copy whose gradients are summed); "
                         "untie them (e.g. GPTConfig(tie_embeddings=False)) or use data='ddp'")
