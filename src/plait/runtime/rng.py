"""A second random stream that can be swapped in around regions of a forward: tensor
parallelism's per-rank stream (`plait.tp`), which activation checkpointing replays when it
recomputes a block (`plait.activation_checkpointing`). It lives apart from both, since both use it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait._torch_compat import DropoutBase, eager

# Attribute names of the rates that make a module draw random numbers in training: dropout
# layers' ``p``; HF attention's ``attention_dropout`` (a float it passes to sdpa), GPT-2's
# ``attn_pdrop``; Mixtral's router ``jitter_noise``.
_RATE_WORDS = ("dropout", "pdrop", "jitter", "noise")


def random_rates(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """The (module, attribute) pairs under ``module`` whose positive value in training mode makes
    its forward draw random numbers: every dropout layer's ``p``, and every float attribute
    named like a dropout or noise rate."""
    found: list[tuple[nn.Module, str]] = []
    for m in module.modules():
        if isinstance(m, DropoutBase):
            found.append((m, "p"))
        found += [(m, k) for k, v in vars(m).items()
                  if isinstance(v, float) and not k.startswith("_")
                  and any(w in k.lower() for w in _RATE_WORDS)]
    return found


def fork_of(hook: Any) -> RNGFork | None:
    """The stream a forward hook swaps in (one of `RNGFork.region_hooks`, or a bound method)."""
    fork = getattr(hook, "rng_fork", None) or getattr(hook, "__self__", None)
    return fork if isinstance(fork, RNGFork) else None


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

    def region_hooks(self, module: nn.Module) -> tuple[Callable[..., None], Callable[..., None]]:
        """Forward pre- and post-hooks that run ``module`` on this stream.

        Swapping generator states cannot be traced (torch marks ``get_rng_state`` untraceable),
        so under torch.compile each swap is a graph break. A region that draws nothing needs no
        swap: while Dynamo traces, the hooks swap only if one of the module's `random_rates` is
        positive in training mode (read in the graph's guards: a change recompiles); eager
        forwards always swap. A random op that no such rate announces (``torch.rand`` called in
        a forward) then draws, under compile only, from the default stream that every tp rank
        shares."""
        rates = random_rates(module)

        def draws() -> bool:
            if not torch.compiler.is_compiling():
                return True
            return any(m.training and getattr(m, a) > 0 for m, a in rates)

        def enter(*_: Any) -> None:
            if draws():
                self.enter()

        def exit_(*_: Any) -> None:
            if draws():
                self.exit()
        enter.rng_fork = exit_.rng_fork = self  # type: ignore[attr-defined]  # found by `fork_of`
        return enter, exit_

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

    def pause(self) -> None:
        """Run the default stream until the outermost region exits (no-op outside regions)."""
        if self._depth:  # read in the graph's guards under compile: no break outside regions
            self._pause()

    @eager  # swaps generator states: eager, between graphs
    def _pause(self) -> None:
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
