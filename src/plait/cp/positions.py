"""How a context-parallel rank's tokens learn where they are in the full sequence.

Each rank holds two chunks of every sequence (`plait.cp.layout`), so a model that counts its
positions from its local length (``0 .. local - 1``) trains silently wrong. The ways in:

- ``"rotary"``: modules whose forward takes ``positions`` (plait GPT's rotary tables;
  `takes_positions`) read the layout's positions;
- ``"position_ids"``: a ``forward`` that takes ``position_ids`` (transformers' causal LMs) gets
  them as that argument, and an all-ones ``attention_mask`` so that transformers does not take
  the zigzag positions for packed sequences (it looks for packing only when no mask is passed);
- ``"counted"``: a model that counts positions in its forward has them replaced as it counts:
  a ``torch.arange`` of the local length (nanoGPT's ``wpe(arange(t))``, a rotary table computed
  from ``arange``) becomes the rank's positions, and a model buffer sliced to the local length
  along its first dimension (torchtitan's ``freqs_cis[:seqlen]``) is read at them;
- ``"none"``: nothing depends on positions. The forward is still watched, and a count seen is
  refused.

Replacing every ``arange`` of the local length is safe where it is not a position: the rank's
positions include some at or past the local length on every rank, so using them as indices into
a dimension of that length raises instead of training wrong.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from plait.cp.group import CPGroup
from plait.state.blocks import blocks, checkpointed

POSITIONS = ("auto", "rotary", "position_ids", "counted", "none")


def takes_positions(module: nn.Module) -> bool:
    """The protocol of ``"rotary"``: a module whose ``forward`` takes ``positions``, the positions of
    its input's tokens (dim 1) in the full sequence, and counts them from its local length when
    it gets None (plait GPT's `Rotary`). Recognised by its signature, so the library needs no
    model's class, and a model of one's own can take part."""
    forward = type(module).forward
    return "positions" in inspect.signature(forward).parameters


def rotaries(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that take their tokens' positions (`takes_positions`)."""
    return [m for m in model.modules() if takes_positions(m)]


def positions_mode(model: nn.Module, positions: str) -> str:
    """The way ``model`` gets its positions: ``positions`` checked, or ``"auto"`` resolved."""
    takes_ids = "position_ids" in inspect.signature(model.forward).parameters
    name = type(model).__name__
    if positions == "auto":
        return "rotary" if rotaries(model) else "position_ids" if takes_ids else "counted"
    if positions == "rotary" and not rotaries(model):
        raise ValueError(f"context_parallel(positions='rotary'): {name} has no module whose forward takes "
                         "positions (plait GPT's rotary tables do)")
    if positions == "position_ids" and not takes_ids:
        raise ValueError(f"context_parallel(positions='position_ids'): {name}.forward takes no position_ids")
    return positions


def install(model: nn.Module, mode: str, cp: CPGroup) -> Watcher | None:
    """Give ``model`` this rank's positions the way ``mode`` says; return the watcher of its
    forward, if any (the attention pauses it: an algorithm's own aranges are no positions)."""
    if mode == "rotary":
        for rot in rotaries(model):
            _give_positions(rot, cp)
    elif mode == "position_ids":
        model.register_forward_pre_hook(_position_ids_hook(cp, model), with_kwargs=True)
    else:
        watcher = Watcher(model, cp, replace=mode == "counted")
        _watch(model, watcher)
        return watcher
    return None


# ------------------------------------------------------------------ rotary, position_ids
def _give_positions(rotary: nn.Module, cp: CPGroup) -> None:
    """A module that takes positions (`takes_positions`, e.g. plait GPT's rotary tables) gets this
    rank's when its caller passes none."""
    original = inspect.signature(type(rotary).forward)

    def forward(*args: Any, **kwargs: Any) -> Any:
        bound = original.bind(rotary, *args, **kwargs)
        if bound.arguments.get("positions") is None and not cp.whole.on:
            x = next(a for a in bound.args[1:] if isinstance(a, torch.Tensor))
            bound.arguments["positions"] = cp.layout_of_local(x.shape[1]).positions(device=x.device)
        return type(rotary).forward(*bound.args, **bound.kwargs)

    rotary.forward = forward


def _position_ids_hook(cp: CPGroup, model: nn.Module) -> Callable[..., Any]:
    takes_mask = "attention_mask" in inspect.signature(model.forward).parameters

    def hook(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if cp.whole.on:  # the numeric check's reference: the positions one process counts
            return args, kwargs
        if kwargs.get("labels") is not None:
            raise ValueError("context parallelism: labels=... makes the model shift them by one inside its "
                             "loss, which crosses the chunk boundaries of a rank's shard; pass targets "
                             "already shifted (next tokens) to your loss instead")
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if not isinstance(ids, torch.Tensor):
            raise ValueError("context parallelism: found no input_ids to derive position_ids from")
        if kwargs.get("position_ids") is None:
            pos = cp.layout_of_local(ids.shape[1]).positions(device=ids.device)
            kwargs = {**kwargs, "position_ids": pos.unsqueeze(0).expand(ids.shape[0], -1)}
        if takes_mask and kwargs.get("attention_mask") is None:
            # Without a mask or a cache, transformers reads position ids that do not count up by
            # one as packed sequences and masks across them; all ones masks nothing.
            kwargs["attention_mask"] = torch.ones(ids.shape[:2], dtype=torch.long, device=ids.device)
        return args, kwargs

    return hook


# ------------------------------------------------------------------ positions the forward counts
class Watcher(TorchFunctionMode):
    """Watches a forward for positions counted from the local length; replaces them by this
    rank's (``replace``) or refuses them (``positions='none'``)."""

    def __init__(self, model: nn.Module, cp: CPGroup, replace: bool) -> None:
        super().__init__()
        self.model, self.cp, self.replace = model, cp, replace
        self.local = 0
        self.seen = 0
        self.paused = False
        self.buffers: set[tuple[int, tuple[int, ...]]] = set()

    def start(self, local: int) -> None:
        self.local, self.seen, self.paused = local, 0, False
        # By memory, not identity: activation checkpointing recomputes a block on detached
        # copies of its inputs, a buffer passed down among them (torchtitan's freqs_cis).
        self.buffers = {_where(b) for b in self.model.buffers()}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.paused and self.local and not self.cp.whole.on:
            if func is torch.arange and _counts_to(args, kwargs, self.local):
                like = torch.arange(*args, **kwargs)  # the dtype and device the model asked for
                return self._counted("torch.arange", lambda pos: pos.to(like))
            if func is torch.Tensor.__getitem__ and _where(args[0]) in self.buffers:
                rest = _sliced_to(args[1], self.local)
                if rest is not None:
                    table = args[0]
                    return self._counted(f"a buffer of shape {tuple(table.shape)} sliced to the local length",
                                         lambda pos: table[(pos.to(table.device),) + rest])
        return func(*args, **kwargs)

    def _counted(self, what: str, read: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if not self.replace:
            raise ValueError(f"context_parallel(positions='none'): {type(self.model).__name__} counts token "
                             f"positions in its forward ({what}), which on each rank would count its own "
                             "tokens from 0; pass positions='auto' so that they are read at this rank's "
                             "positions in the full sequence")
        self.seen += 1
        return read(self.cp.layout_of_local(self.local).positions())


def _where(t: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    return t.data_ptr(), tuple(t.shape)


def _counts_to(args: tuple, kwargs: dict, n: int) -> bool:
    """Whether ``torch.arange(*args, **kwargs)`` is ``0, 1, .., n - 1``."""
    nums = [*args, *(kwargs[k] for k in ("start", "end", "step") if k in kwargs)]
    if not nums or any(isinstance(v, torch.Tensor) for v in nums):
        return False
    start, end, step = (0, nums[0], 1) if len(nums) == 1 else (*nums, 1)[:3]
    return start == 0 and step == 1 and end == n


def _sliced_to(index: Any, n: int) -> tuple | None:
    """The rest of ``index`` if it slices its first dimension to ``[0, n)``, else None."""
    first, rest = (index[0], index[1:]) if isinstance(index, tuple) and index else (index, ())
    if isinstance(first, slice) and first.start in (None, 0) and first.stop == n and first.step in (None, 1):
        return tuple(rest)
    return None


def _watch(model: nn.Module, mode: Watcher) -> None:
    """Run ``mode`` through the model's forward and through each block's, so that a block
    recomputed by activation checkpointing counts the same positions."""
    outer: list[nn.Module] = []  # the module whose forward entered the mode, while it is entered

    def enter(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        if outer:
            return
        outer.append(mod)
        mode.start(_local_length(model, args, kwargs))
        mode.__enter__()

    def leave(mod: nn.Module, *_: Any) -> None:
        if not outer or outer[0] is not mod:
            return
        outer.pop()
        mode.__exit__(None, None, None)
        if mod is model and mode.replace and not mode.seen and not mode.cp.whole.on:
            raise ValueError(f"context parallelism: {type(model).__name__}'s forward counted no positions "
                             "plait can place (no torch.arange of the local length, no buffer sliced to it) "
                             "and takes no position_ids, so plait cannot tell whether it has positions. "
                             "Let its forward take position_ids (plait then passes each token's position "
                             "in the full sequence) or, if nothing in it depends on a token's position "
                             "(no position embedding, rotary table or ALiBi), pass positions='none'")

    model.register_forward_pre_hook(enter, with_kwargs=True)
    model.register_forward_hook(leave, with_kwargs=True, always_call=True)
    for name in blocks(model):
        _watch_forward(model.get_submodule(name), name, enter, leave)


def _watch_forward(mod: nn.Module, name: str, enter: Callable[..., None], leave: Callable[..., None]) -> None:
    """``mod``'s forward on the instance entered through ``enter`` and left through ``leave``:
    activation checkpointing recomputes a block by calling the forward it found on the instance,
    without the module's hooks."""
    if checkpointed(mod) is not None:
        raise ValueError(f"context_parallel: block {name!r} is checkpointed already, and its recomputed "
                         "forward would count positions from 0 on every rank; apply context parallelism "
                         "before activation checkpointing (plait.parallelize does)")
    inner = mod.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        enter(mod, args, kwargs)
        try:
            return inner(*args, **kwargs)
        finally:
            leave(mod)

    mod.forward = forward


def _local_length(model: nn.Module, args: tuple, kwargs: dict) -> int:
    """Tokens per sequence this rank holds: dimension 1 of the forward's first tensor argument
    (token ids, or a block's hidden states)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.dim() >= 2:
            return a.shape[1]
    raise ValueError(f"context parallelism: {type(model).__name__}'s forward got no (batch, tokens, ...) "
                     "tensor to count this rank's tokens from")
