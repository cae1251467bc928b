"""`context_parallel`: the sequence split across the ``cp`` ranks, under a model's own code.

Nothing in the model changes. Its attention modules (by default every module whose class name
ends in ``Attention``, the outermost ones) get a forward pre-hook that enters a torch function
mode and a forward hook that leaves it; inside, a call to
``torch.nn.functional.scaled_dot_product_attention`` on this rank's queries, keys and values
(b, heads, local tokens, d) runs one of `ALGORITHMS` over the cp group instead. Module hooks
fire again when activation checkpointing recomputes a block, so recomputation is context
parallel too.

Positions: each rank holds two chunks of the sequence (`plait.cp.layout`), so positions are not
``0 .. local - 1``. plait's GPT gets its rotary modules' positions from the layout; a model
whose ``forward`` takes ``position_ids`` (transformers' causal LMs) gets them as that argument
when the caller does not pass them; any other model has the positions its forward counts
(``torch.arange`` of the local length, a buffer sliced to it) replaced by the rank's, and is
refused if it counts none (`plait.cp.positions`).

A transformers attention with a sliding window (`sliding_window_of`) attends within it across
the whole sequence: its mask over the rank's own tokens is recognised and the window applied by
global position. What cannot be honoured is refused when it is seen: an attention mask
(padding, packed sequences), attention dropout, keys of another length than the queries (a KV
cache).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from plait._torch_compat import eager, version_of
from plait.cp.gather import allgather_attention, ulysses_attention
from plait.cp.group import CPGroup
from plait.cp.layout import Layout
from plait.cp.numeric import Verified, install_check
from plait.cp.positions import POSITIONS, Watcher, install, positions_mode
from plait.cp.ring import ring_attention
from plait.runtime.mesh import Mesh
from plait.state.names import matches

ALGORITHMS: dict[str, Callable[..., torch.Tensor]] = {
    "ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}
_ATTR = "_plait_cp"
_DATA = ("dp", "fsdp", "cp")  # the ranks that run a model's first forward together: they agree on its check


@dataclass(frozen=True)
class ContextParallelInfo:
    """What `context_parallel` installed on a model (``cp_info(model)``)."""

    cp: CPGroup
    algorithm: str
    positions: str
    attention: tuple[str, ...]  # the hooked modules' names
    # What the numeric check found on the first forward (`plait.cp.numeric`); empty until then.
    checks: list[Verified] = field(default_factory=list, compare=False, repr=False)

    def sdpa(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
             scale: float | None = None, enable_gqa: bool = False, *,
             window: int | None = None) -> torch.Tensor:
        """``scaled_dot_product_attention`` over the whole sequence, for this rank's tokens;
        ``window``: the calling module's causal sliding window (`sliding_window_of`)."""
        where = f"context parallelism ({self.algorithm})"
        if attn_mask is not None:
            causal = _mask_verdict(attn_mask, query.shape[-2], key.shape[-2], window)
            if causal is None:
                raise ValueError(f"{where}: the attention got an explicit mask or bias that is "
                                 "neither causal nor empty (padding, packed sequences, ALiBi), which is not "
                                 "supported across ranks; train on unpadded full sequences with causal or "
                                 "full attention")
            is_causal = is_causal or causal
        if window is not None and not is_causal:
            raise ValueError(f"{where}: a sliding window of {window} tokens on attention that is not causal "
                             "is not supported across ranks")
        if dropout_p:
            raise ValueError(f"{where}: attention dropout (dropout_p={dropout_p}) is not supported; set the "
                             "model's attention dropout to 0")
        if query.dim() != 4 or key.shape[-2] != query.shape[-2]:
            raise ValueError(f"{where}: queries {tuple(query.shape)} and keys {tuple(key.shape)} must be "
                             "(batch, heads, tokens, dim) of the same tokens (no KV cache or "
                             "cross-attention)")
        # One key head broadcasts over every query head (multi-query attention, as Falcon calls it):
        # grouped-query attention with a single group.
        enable_gqa = enable_gqa or key.shape[1] == 1
        if key.shape[1] != query.shape[1] and not enable_gqa:
            raise ValueError(f"{where}: {query.shape[1]} query heads but {key.shape[1]} key heads, and "
                             "enable_gqa is off")
        layout = self.cp.layout_of_local(query.shape[-2])
        return ALGORITHMS[self.algorithm](query, key, value, self.cp, layout, causal=is_causal, scale=scale,
                                          window=window)


# The last mask read and its verdict: transformers builds one mask per forward and passes the same
# tensor to every layer, so reading it once (host syncs on a GPU) serves them all. Held weakly, and
# keyed on the tensor's version as well, so a mask written in place is read again.
_last_mask: tuple[weakref.ref, int, tuple, bool | None] | None = None


def _mask_verdict(mask: torch.Tensor, queries: int, keys: int, window: int | None) -> bool | None:
    """`_plain_causal`, read once per mask tensor (and version, shape and window)."""
    global _last_mask
    key = (queries, keys, window)
    if _last_mask is not None:
        ref, version, seen_key, verdict = _last_mask
        if ref() is mask and version == version_of(mask) and seen_key == key:
            return verdict
    verdict = _plain_causal(mask, queries, keys, window)
    _last_mask = (weakref.ref(mask), version_of(mask), key, verdict)
    return verdict


def _plain_causal(mask: torch.Tensor, queries: int, keys: int, window: int | None = None) -> bool | None:
    """What an explicit attention mask over this rank's own tokens asks for: True when it is exactly
    causal (each token sees itself and those before it; with the module's sliding ``window``, also
    what transformers builds for it over the rank's tokens: causal, at most ``window`` back), False
    when it masks nothing, None for anything else. Some models (Falcon) build their causal mask
    themselves instead of passing ``is_causal``; context parallelism then applies the same causality
    (and window) across the whole sequence."""
    if queries != keys or tuple(mask.shape[-2:]) != (queries, keys):
        return None
    if mask.dtype == torch.bool:
        seen = mask
    else:  # additive: 0 where a key is seen, the dtype's most negative values (or -inf) where not
        seen = mask > torch.finfo(mask.dtype).min / 2
        if bool(mask.masked_select(seen).ne(0).any()):
            return None  # a bias on the scores (ALiBi), not a mask
    causal = torch.ones(queries, keys, dtype=torch.bool, device=mask.device).tril()
    if bool(torch.equal(seen, causal.expand_as(seen))):
        return True
    if window is not None and bool(torch.equal(seen, causal.triu(1 - window).expand_as(seen))):
        return True
    return False if bool(seen.all()) else None


class _Intercept(TorchFunctionMode):
    """Routes scaled_dot_product_attention to the context-parallel algorithm."""

    def __init__(self, info: ContextParallelInfo, watcher: Watcher | None, window: int | None) -> None:
        super().__init__()
        self.info, self.watcher, self.window = info, watcher, window
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is F.scaled_dot_product_attention:
            self.calls += 1
            if self.info.cp.whole.on:  # the numeric check's reference: attention as the model has it
                return func(*args, **(kwargs or {}))
            if self.watcher is None:
                return self.info.sdpa(*args, **(kwargs or {}), window=self.window)
            self.watcher.paused = True  # the algorithm's own aranges are no positions
            try:
                return self.info.sdpa(*args, **(kwargs or {}), window=self.window)
            finally:
                self.watcher.paused = False
        return func(*args, **(kwargs or {}))


def cp_info(model: nn.Module) -> ContextParallelInfo | None:
    """What `context_parallel` installed on ``model`` (or a wrapper of it), else None."""
    for mod in model.modules():
        info = getattr(mod, _ATTR, None)
        if isinstance(info, ContextParallelInfo):
            return info
    return None


def verified(model: nn.Module) -> Verified | None:
    """The numeric check's result on ``model`` (None before its first forward, or when off)."""
    info = cp_info(model)
    return info.checks[-1] if info is not None and info.checks else None


def context_parallel(model: nn.Module, mesh: Mesh, algorithm: str = "ring", *, positions: str = "auto",
                     attention: Sequence[type | str] | None = None, check: bool = True) -> nn.Module:
    """Make ``model``'s attention context parallel over ``mesh``'s ``cp`` axis, in place; return it.

    Each rank then runs the model on its shard of every sequence (`shard` cuts them: inputs and
    targets alike) and gets its shard of the outputs. The ``cp`` ranks hold the same parameters
    and see different tokens, so their gradients must be averaged as data-parallel ones are:
    `plait.DDP` averages over dp and cp, and `plait.FSDP` shards over fsdp and cp, by default.

    Args:
        algorithm: ``"ring"`` (K/V blocks passed around the ring, overlapped with attention),
            ``"allgather"`` (gather all K/V: cheap with few KV heads) or ``"ulysses"``
            (all-to-all to a head split; heads must divide by cp).
        positions: ``"auto"`` (plait GPT's rotary modules, else a ``position_ids`` argument of
            ``forward``, else the positions the forward counts), one of those by name
            (``"rotary"``, ``"position_ids"``, ``"counted"``), or ``"none"`` (a forward that
            counts positions is then refused); see `plait.cp.positions`.
        attention: the modules whose forward calls scaled_dot_product_attention, as classes or
            name patterns (default: the outermost modules whose class name ends in ``Attention``).
        check: verify the layout by its numbers on the first forward (`plait.cp.numeric`): the
            batch's first sequence, cut short, run whole and split must agree, or every data rank
            refuses it before it trains.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"context_parallel(algorithm=...) must be one of {tuple(ALGORITHMS)}, got "
                         f"{algorithm!r}")
    if positions not in POSITIONS:
        raise ValueError(f"context_parallel(positions=...) must be one of {POSITIONS}, got {positions!r}")
    if cp_info(model) is not None:
        raise ValueError("context_parallel: the model is already context parallel")
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa")
    if implementation != "sdpa":
        why = (f"context_parallel: {type(model).__name__} computes attention with {implementation!r}; "
               "context parallelism replaces torch's scaled_dot_product_attention call")
        if getattr(model, "_supports_sdpa", True) is False:  # transformers' flag: no sdpa path to load
            raise ValueError(f"{why}, which this model's transformers implementation never makes: train it "
                             "without context parallelism (data, tensor or pipeline parallelism)")
        raise ValueError(f"{why}: load the model with attn_implementation='sdpa'")
    targets = _attention_modules(model, attention)
    mode = positions_mode(model, positions)
    info = ContextParallelInfo(CPGroup.of(mesh), algorithm, mode, tuple(n for n, _ in targets))
    setattr(model, _ATTR, info)
    watcher = install(model, mode, info.cp)
    for name, mod in targets:
        _hook(mod, name, info, watcher, sliding_window_of(mod, model))
    if check and info.cp.size > 1:
        install_check(model, info.cp, mesh.group(_DATA), info.checks.append)
    return model


def _attention_modules(model: nn.Module,
                       attention: Sequence[type | str] | None) -> list[tuple[str, nn.Module]]:
    named = list(model.named_modules())
    if attention is None:
        found = [(n, m) for n, m in named if type(m).__name__.endswith("Attention")]
        what = "no module whose class name ends in 'Attention'"
    else:
        found = [(n, m) for n, m in named
                 if any(isinstance(m, a) if isinstance(a, type) else matches(a, n) for a in attention)]
        what = f"no module matching attention={list(attention)!r}"
    outer = [(n, m) for n, m in found if not any(n != o and n.startswith(o + ".") for o, _ in found if o)]
    if not outer:
        raise ValueError(f"context_parallel: {type(model).__name__} has {what}; name the modules that call "
                         "scaled_dot_product_attention with attention=[...]")
    return outer


def has_attention(model: nn.Module, attention: Sequence[type | str] | None = None) -> bool:
    """Whether ``model`` holds a module `context_parallel` would hook (a pipeline stage may not)."""
    try:
        _attention_modules(model, attention)
    except ValueError:
        return False
    return True


def sliding_window_of(attention: nn.Module, model: nn.Module) -> int | None:
    """The causal sliding window a transformers attention module attends within, else None: its
    own ``sliding_window`` attribute where it has one (Gemma3, Qwen2/3, Cohere2: None on full
    layers); else, by its config (or the model's), the window of its layer when the config names
    each layer's kind (``layer_types``), or the model's window when it names none (Mistral, Phi-3,
    Starcoder2: every layer slides)."""
    if hasattr(attention, "sliding_window"):
        own = attention.sliding_window
        return own if isinstance(own, int) and own > 0 else None
    cfg = getattr(attention, "config", getattr(model, "config", None))
    window = getattr(cfg, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return None
    kinds, layer = getattr(cfg, "layer_types", None), getattr(attention, "layer_idx", None)
    if kinds is None:
        return window
    if isinstance(layer, int) and layer < len(kinds):
        return window if kinds[layer] == "sliding_attention" else None
    if "sliding_attention" not in kinds:
        return None
    raise ValueError(f"context parallelism: {type(attention).__name__} belongs to a model whose config has "
                     "sliding-window layers, but it has no layer_idx to say whether it is one")


def _hook(mod: nn.Module, name: str, info: ContextParallelInfo, watcher: Watcher | None,
          window: int | None) -> None:
    """``mod``'s forward, on the instance, runs inside an `_Intercept` mode. Under torch.compile it
    runs eagerly between graphs (a clean graph break at each attention module): the algorithms'
    point-to-point exchanges cannot be traced, and neither can a mode entered mid-graph."""
    inner = mod.forward

    @eager
    def forward(*args: Any, **kwargs: Any) -> Any:
        mode = _Intercept(info, watcher, window)
        with mode:
            out = inner(*args, **kwargs)
        if not mode.calls:  # it attended its local tokens only: refuse rather than train wrong
            raise ValueError(f"context parallelism: {name or 'the model'} ({type(mod).__name__}) ran without "
                             "calling torch.nn.functional.scaled_dot_product_attention, so it attended only "
                             "this rank's tokens; context parallelism replaces that call (a transformers "
                             "model: load it with attn_implementation='sdpa')")
        return out

    mod.forward = forward


def _layout_for(t: torch.Tensor, mesh: Mesh, dim: int) -> Layout:
    layout = CPGroup.of(mesh).layout(t.shape[dim])
    if not layout.even:
        chunks = 2 * layout.size
        raise ValueError(f"context parallelism over cp={layout.size} cuts each sequence into {chunks} "
                         f"equal chunks; {t.shape[dim]} tokens do not divide by {chunks} (pad or crop the "
                         "sequences)")
    return layout


def shard(t: torch.Tensor, mesh: Mesh, dim: int = 1) -> torch.Tensor:
    """This cp rank's tokens of a full-sequence tensor (inputs, targets, ...) along ``dim``."""
    return _layout_for(t, mesh, dim).shard(t, dim)


def unshard(t: torch.Tensor, mesh: Mesh, dim: int = 1) -> torch.Tensor:
    """The full sequence from every cp rank's shard ``t`` (an all-gather over cp; not
    differentiable: for outputs to inspect, such as logits in a test)."""
    return CPGroup.of(mesh).unshard(t, dim)
