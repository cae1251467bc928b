"""A second random stream that can be swapped in around regions of a forward: tensor
parallelism's per-rank stream (`plait.tp`), which activation checkpointing replays when it
recomputes a block (`plait.activation_checkpointing`). It lives apart from both, since both use it."""

from __future__ import annotations

from typing import Any

import torch

from plait._torch_compat import eager

__all__ = ["RNGFork"]


class RNGFork:
    """A second random stream, seeded differently on every tp rank, swapped in around the
    regions whose activations are *sharded* (attention heads; the sequence under SP).

    Outside those regions the default generator runs, which `tensor_parallel` synchronizes
    across the tp group, so replicated activations get the same dropout mask on every rank
    while sharded ones get independent masks (Megatron's RNG tracker, section 3 of the paper).
    Nesting is allowed: only the outermost region swaps states. ``pause`` hands the rest of the
    outermost region back to the default stream: a row-parallel layer calls it after its
    all-reduce, when what follows inside the region (GPT-2's residual dropout) is replicated.
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._device = device
        with torch.random.fork_rng(devices=[device] if self._cuda else []):
            torch.manual_seed(seed)
            self._state = self._get()
        self._saved: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._depth = 0
        self._paused = False

    def _get(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.get_rng_state(), torch.cuda.get_rng_state(self._device) if self._cuda else None

    def _set(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.set_rng_state(state[0])
        if self._cuda and state[1] is not None:
            torch.cuda.set_rng_state(state[1], self._device)

    @property
    def active(self) -> bool:
        """Whether the per-rank stream is the one running now."""
        return self._depth > 0 and not self._paused

    @eager  # swaps generator states: eager, between graphs
    def enter(self, *_: Any) -> None:
        if self._depth == 0:
            self._saved = self._get()
            self._set(self._state)
        self._depth += 1

    @eager  # swaps generator states: eager, between graphs
    def exit(self, *_: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            if not self._paused and self._saved is not None:
                self._state = self._get()
                self._set(self._saved)
            self._saved, self._paused = None, False

    @eager  # swaps generator states: eager, between graphs
    def pause(self) -> None:
        """Run the default stream until the outermost region exits (no-op outside regions)."""
        if self.active and self._saved is not None:
            self._state = self._get()
            self._set(self._saved)
            self._paused = True

    @property
    def entered(self) -> bool:
        """Whether a region is running (its stream swapped in, or paused)."""
        return self._depth > 0

    # Activation checkpointing recomputes a block in backward: its regions must draw what they
    # drew in forward, and the stream must then continue as if nothing had been recomputed.
    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The per-rank stream's state between regions (the next region starts from it)."""
        if self._depth:
            raise RuntimeError("RNGFork.snapshot inside a region: the stream's state is the default "
                               "generator's until the region exits")
        return self._state

    def restore(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        """Make the next region start from ``state`` (a `snapshot`)."""
        if self._depth:
            raise RuntimeError("RNGFork.restore inside a region")
        self._state = state
