"""What the plans of `transformers`-shaped models share: recognising modules by their structure
(names and shapes of submodules, never classes), attention geometry, and the error that names a
module a plan cannot place."""

from __future__ import annotations

from typing import Any

from torch import nn

from plait.tp.layers import linear_layout

# Attention attributes some families read in forward, and the count each holds.
HEAD_ATTRS = {"num_heads": "heads", "num_attention_heads": "heads", "n_head": "heads",
              "num_key_value_heads": "kv_heads", "num_kv_heads": "kv_heads", "num_key_value_groups": "groups",
              "kv_heads": "kv_heads", "split_size": "width", "embed_dim": "width", "n_embd": "width",
              "hidden_size": "width", "kv_dim": "kv_width", "all_head_size": "width", "n_heads": "heads",
              "inner_dim": "width"}
CONFIG_ATTRS = {"num_attention_heads": "heads", "num_key_value_heads": "kv_heads"}


class NotPlaced(ValueError):
    pass


def fail(name: str, mod: nn.Module, why: str) -> NotPlaced:
    return NotPlaced(f"plan_for: cannot place module {name!r} ({type(mod).__name__}): {why}")


def linears(mod: nn.Module) -> dict[str, nn.Module]:
    return {n: c for n, c in mod.named_children() if linear_layout(c) is not None}


def sizes(mod: nn.Module) -> tuple[int, int]:
    layout = linear_layout(mod)
    assert layout is not None
    return layout.sizes(mod)


def is_norm(mod: nn.Module) -> bool:
    params = list(mod.parameters())
    named = isinstance(mod, (nn.LayerNorm, nn.RMSNorm)) or "norm" in type(mod).__name__.lower()
    return named and bool(params) and all(p.dim() == 1 for p in params) and not any(
        True for c in mod.children() if any(True for _ in c.parameters()))


def has_params(mod: nn.Module) -> bool:
    return any(True for _ in mod.parameters())


def count(sources: list[Any], names: tuple[str, ...]) -> int | None:
    for src in sources:
        for n in names:
            value = getattr(src, n, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def geometry(model: nn.Module, attn: nn.Module, name: str, hidden: int) -> tuple[int, int, int]:
    """(heads, KV heads, head size) from the config or the attention's own attributes."""
    sources = [getattr(model, "config", None), getattr(attn, "config", None), attn]
    sources = [s for s in sources if s is not None]
    heads = count(sources, ("num_attention_heads", "n_head", "num_heads"))
    if heads is None:
        raise fail(name, attn, "no head count found (config.num_attention_heads or the module's num_heads)")
    # The attention's own KV count first: Falcon's config says 4 KV heads where its multi-query
    # attention uses 1.
    kv = count(sources[::-1], ("num_key_value_heads", "num_kv_heads", "n_head_kv", "kv_heads")) or heads
    dim = count(sources, ("head_dim", "head_size", "d_kv", "key_value_proj_dim")) or hidden // heads
    return heads, kv, dim


def head_attrs(attn: nn.Module, heads: int, kv: int, d: int) -> tuple[tuple[str, str], ...]:
    full = {"heads": heads, "kv_heads": kv, "groups": heads // kv, "width": heads * d, "kv_width": kv * d}
    out = [(a, what) for a, what in HEAD_ATTRS.items() if getattr(attn, a, None) == full[what]]
    cfg = getattr(attn, "config", None)
    out += [(f"config.{a}", what) for a, what in CONFIG_ATTRS.items() if getattr(cfg, a, None) == full[what]]
    return tuple(out)


def only_known_params(mod: nn.Module, name: str, known: set[str]) -> None:
    if any(True for _ in mod.parameters(recurse=False)):
        raise fail(name, mod, "it owns parameters besides its projections")
    for child_name, child in mod.named_children():
        if child_name not in known and has_params(child):
            raise fail(f"{name}.{child_name}", child, "a module with parameters inside the attention or MLP "
                                                       "that is not one of its recognised projections")


def same_blocks(layers: nn.ModuleList, name: str) -> None:
    def shape(block: nn.Module) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(n, type(m).__name__, tuple(p.shape)) for n, m in block.named_modules()
                for p in m.parameters(recurse=False)]

    first = shape(layers[0])
    for i, block in enumerate(layers):
        if type(block) is not type(layers[0]) or shape(block) != first:
            raise fail(f"{name}.{i}", block, f"the decoder layers differ ({name}.0 is a "
                                              f"{type(layers[0]).__name__}); one plan needs identical layers")
