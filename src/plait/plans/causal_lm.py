"""Tensor-parallel plans for decoder-only language models shaped like the causal LMs of Hugging
Face `transformers` (Llama, Mistral, Qwen2, Phi-3, GPT-2, GPT-NeoX, Gemma, Gemma2, CodeGen and
others of the same shapes), recognised by module structure: names and shapes of submodules, never
classes, and without importing `transformers`.

What is recognised (a model that does not fit gets an error naming the module not placed):

* the decoder layers: an ``nn.ModuleList`` of identical blocks, each holding an attention and
  an MLP, plus norms and dropouts (anything else with parameters is not placed);
* attention: ``q/k/v`` and an output projection (``q_proj k_proj v_proj o_proj``,
  ``query key value dense``...), or a fused ``qkv_proj`` / ``c_attn`` / ``W_pack`` / ``Wqkv``
  (q, k and v one after the other; with an ``mp_num`` attribute, CodeGen's, that many groups
  of [q v k], each group's heads split over the ranks on their own, so tp must divide the heads
  of a group) or GPT-NeoX's ``query_key_value`` (q, k, v per head), as
  ``nn.Linear`` or transposed ``Conv1D``; heads, KV heads and head size come from the model's
  ``config`` or the attention's attributes and are checked against the projections' shapes;
* MLP: gated (``gate_proj up_proj down_proj``, ``w1 w3 w2``), fused gated (``gate_up_proj
  down_proj``) or plain (``c_fc c_proj``, ``fc1 fc2``, ``dense_h_to_4h dense_4h_to_h``...);
* the token embedding (the ``nn.Embedding`` with one row per vocabulary entry), the final norm
  and the ``lm_head`` (a top-level linear layer onto the vocabulary).

The plan is Megatron's: attention split by heads (`AttentionParallel`, which also gives the
module its local head counts; KV heads replicated when fewer than the ranks), MLP by hidden
units, embedding and lm_head by vocabulary. Sequence parallelism starts at the first decoder
layer (`ScatterSequence`), so the positions, rotary tables and masks the model computes before
it see the whole sequence, and ends before the final norm (`GatherSequence`): what the model
does after its layers runs replicated. The logits come back whole unless ``loss_parallel``.
"""

from __future__ import annotations

import inspect

from torch import nn

from plait.plans.structure import (
    NotPlaced,
    count,
    fail,
    geometry,
    has_params,
    head_attrs,
    is_norm,
    linears,
    only_known_params,
    same_blocks,
    sizes,
)
from plait.tp.attention import AttentionParallel, HeadEmbedding, HeadNorm, SplitRMSNorm
from plait.tp.experts import MoEParallel, SplitParams
from plait.tp.layers import linear_layout
from plait.tp.sequence import GatherSequence, ScatterSequence
from plait.tp.styles import (
    ColwiseParallel,
    InlineMLP,
    ParallelRegion,
    RowwiseParallel,
    SequenceParallel,
    Style,
    VocabParallelEmbedding,
    VocabParallelOutput,
)

SEPARATE_QKV = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("wq", "wk", "wv"),
                ("q", "k", "v"))
ATTN_OUT = ("o_proj", "out_proj", "dense", "c_proj", "wo", "o")
FUSED_QKV = ("qkv_proj", "c_attn", "W_pack", "Wqkv")  # [q | k | v]
# An attention attribute saying that its fused projection is interleaved in that many groups,
# each [q v k] of its share of the heads (CodeGen's mp_num, the model-parallel degree it was
# trained at); the attention splits the projection's output into that many groups itself.
QKV_GROUPS = ("mp_num",)
PER_HEAD_QKV = ("query_key_value",)  # GPT-NeoX: [q k v] of head 0, of head 1...
GATED_MLP = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"), ("wi_0", "wi_1", "wo"))
FUSED_GATED_MLP = (("gate_up_proj", "down_proj"),)  # [gate | up]
PLAIN_MLP = (("c_fc", "c_proj"), ("fc1", "fc2"), ("dense_h_to_4h", "dense_4h_to_h"), ("fc_in", "fc_out"),
             ("up_proj", "down_proj"), ("wi", "wo"))
# Attention inputs laid out (batch * heads, ...) by the model, for all heads: Bloom's ALiBi biases.
HEAD_INPUTS = ("alibi",)
# An additive bias of all heads, (batch, heads, q, k), that the attention takes and returns (T5's).
HEAD_BIAS = ("position_bias",)
# Another activation the key and value projections read: a cross-attention's encoder states (T5's).
KV_INPUTS = ("key_value_states",)


# ------------------------------------------------------------------ attention and MLP
def attention_kind(mod: nn.Module) -> tuple[str, tuple[str, ...]] | None:
    lin = linears(mod)
    out = next((o for o in ATTN_OUT if o in lin), None)
    if out is None:
        return None
    for names in SEPARATE_QKV:
        if all(n in lin for n in names) and out not in names:
            return "separate", (*names, out)
    for n in FUSED_QKV:
        if n in lin and n != out:
            return "fused", (n, out)
    for n in PER_HEAD_QKV:
        if n in lin:
            return "per_head", (n, out)
    return None


def mlp_kind(mod: nn.Module) -> tuple[str, tuple[str, ...]] | None:
    lin = linears(mod)
    for kind, table in (("gated", GATED_MLP), ("fused_gated", FUSED_GATED_MLP), ("plain", PLAIN_MLP)):
        for names in table:
            if all(n in lin for n in names):
                return kind, names
    return None


def attention_plan(model: nn.Module, attn: nn.Module, name: str, hidden: int) -> dict[str, Style]:
    found = attention_kind(attn)
    assert found is not None
    kind, names = found
    heads, kv, d = geometry(model, attn, name, hidden)
    if kind == "per_head" and kv == 1 < heads:  # Falcon's multi-query: [q of every head | k | v]
        kind = "fused"
    elif kind == "per_head" and kv != heads:  # checked first: the sizes below assume one KV head per head
        raise fail(name, attn, f"its fused {names[0]!r} serves {heads} heads with {kv} KV heads (Falcon's "
                                "grouped layout, [q... k v] per KV head, read from the attention), and plait "
                                f"splits {names[0]!r} only as [q k v] per head (GPT-NeoX's) or as "
                                "[q | k | v] with one KV head (multi-query); train this model with data or "
                                "fully sharded parallelism (DDP, FSDP) instead")
    elif kind == "fused" and getattr(attn, "multi_query", None) is False and kv == heads:
        kind = "per_head"  # GPT-BigCode without multi-query: c_attn holds [q k v] per head
    lin = linears(attn)
    qkv_out = sum(sizes(lin[n])[1] for n in names[:-1])
    want = 3 * heads * d if kind == "per_head" else (heads + 2 * kv) * d
    if qkv_out != want or sizes(lin[names[-1]])[0] != heads * d:
        raise fail(name, attn, f"its projections have {qkv_out} q/k/v outputs and "
                                f"{sizes(lin[names[-1]])[0]} inputs to {names[-1]!r}, which do not fit "
                                f"{heads} heads and {kv} KV heads of {d} features")
    groups = _qkv_groups(attn, name, heads, kv) if kind == "fused" else 1
    signature = inspect.signature(attn.forward).parameters
    head_inputs = tuple(n for n in HEAD_INPUTS if n in signature)
    plan: dict[str, Style] = {"": AttentionParallel(
        heads=heads, kv_heads=kv, head_dim=d, head_groups=groups, attrs=head_attrs(attn, heads, kv, d),
        head_inputs=head_inputs, head_bias=next((n for n in HEAD_BIAS if n in signature), ""),
        kv_inputs=tuple(n for n in KV_INPUTS if n in signature))}
    out_parts: tuple[int, ...] = ()
    if kind == "separate":
        q, k, v, o = names
        plan[q] = ColwiseParallel(input_comm=False, unit=d, what="attention heads")
        plan[k] = plan[v] = ColwiseParallel(input_comm=False, unit=d, what="KV heads", replicate=True)
    elif kind == "fused" and groups > 1:  # the q, v and k of each group split on their own
        o, out_parts = names[1], (heads * d // groups,) * groups
        plan[names[0]] = ColwiseParallel(input_comm=False, unit=d, what="heads", parts=out_parts * 3)
    elif kind == "fused":
        o = names[1]
        # Fewer KV heads than ranks (multi-query): k and v kept whole, each rank computing the one
        # its query heads use, as with separate projections.
        plan[names[0]] = ColwiseParallel(input_comm=False, unit=d, what="heads",
                                         parts=(heads * d, kv * d, kv * d), replicate=True)
    else:
        o = names[1]
        plan[names[0]] = ColwiseParallel(input_comm=False, unit=3 * d, what="attention heads",
                                         parts=(3 * heads * d,) * (names[0] != "query_key_value"))
    # The rank's heads in the order its attention outputs them: with groups, its share of each.
    plan[o] = RowwiseParallel(unit=d, what="attention heads", parts=out_parts)
    norms = _head_norms(attn, name, heads, kv, d)
    plan.update(norms)
    # An embedding of one column per head: T5's relative_attention_bias.
    biases = {n: HeadEmbedding(heads=heads) for n, c in attn.named_children()
              if isinstance(c, nn.Embedding) and c.embedding_dim == heads}
    plan.update(biases)
    only_known_params(attn, name, set(names) | set(norms) | set(biases))
    return plan


def _head_norms(attn: nn.Module, name: str, heads: int, kv: int, d: int) -> dict[str, Style]:
    """The norms inside ``attn``: over one head's ``d`` features (Qwen3's, Gemma3's: replicated,
    `HeadNorm`) or over the whole q or k projection (OLMo2's: `SplitRMSNorm`, its statistic
    summed over tp); a norm of another width is refused."""
    found: dict[str, Style] = {}
    for cname, child in attn.named_children():
        if not is_norm(child):
            continue
        widths = {p.shape[0] for p in child.parameters()}
        if widths == {d}:
            found[cname] = HeadNorm()
        elif widths <= {heads * d, kv * d} and len(widths) == 1:
            found[cname] = SplitRMSNorm(width=widths.pop(), unit=d, what="heads")
        else:
            raise fail(f"{name}.{cname}", child,
                        f"it normalizes {sorted(widths)} features at once, neither one head's {d} nor a "
                        f"whole projection's ({heads} or {kv} heads); train this model with data or fully "
                        "sharded parallelism (DDP, FSDP) instead")
    return found


def _qkv_groups(attn: nn.Module, name: str, heads: int, kv: int) -> int:
    """How many interleaved groups the fused projection of ``attn`` holds (`QKV_GROUPS`; 1: none)."""
    groups = count([attn], QKV_GROUPS)
    if groups is None or groups == 1:
        return 1
    if kv != heads or heads % groups:
        raise fail(name, attn, f"a fused projection in {groups} groups of [q v k] ({QKV_GROUPS[0]}) needs "
                                f"as many KV heads as heads, and whole heads in each group; it has {heads} "
                                f"heads and {kv} KV heads")
    return groups


def mlp_plan(mlp: nn.Module, name: str) -> dict[str, Style]:
    found = mlp_kind(mlp)
    assert found is not None
    kind, names = found
    plan: dict[str, Style] = {"": ParallelRegion(), names[-1]: RowwiseParallel()}
    if kind == "fused_gated":
        width = sizes(linears(mlp)[names[0]])[1]
        plan[names[0]] = ColwiseParallel(input_comm=False, parts=(width // 2, width // 2))
    else:
        for n in names[:-1]:
            plan[n] = ColwiseParallel(input_comm=False)
    only_known_params(mlp, name, set(names))
    return plan


# ------------------------------------------------------------------ the whole model
def _decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            block = mod[0]
            kids = list(block.children())
            mlp = any(mlp_kind(c) or _is_moe(c) for c in kids) or mlp_kind(block)  # OPT's: in the layer
            if any(attention_kind(c) for c in kids) and mlp:
                return name, mod
    for name, mod in model.named_modules():  # say what the closest candidate lacks
        candidate = mod[0] if isinstance(mod, nn.ModuleList) and len(mod) > 0 else None
        if candidate is not None and any(attention_kind(c) for c in candidate.children()):
            loose = sorted(linears(candidate))
            where = f" (its linear layers {loose} are not an MLP's)" if loose else ""
            raise fail(f"{name}.0", candidate,
                        f"the decoder layer holds an attention but no MLP{where}; plan_for splits an MLP "
                        "held in a module of its own or as linear layers of the layer named as in "
                        f"{[n for n, _ in PLAIN_MLP]}: train this model with data or fully sharded "
                        "parallelism (DDP, FSDP) instead, or write a plan by hand")
    raise NotPlaced(f"plan_for: cannot place {type(model).__name__}: no nn.ModuleList of decoder layers, "
                     "each holding an attention (q/k/v/o or fused qkv projections) and an MLP")


def _is_moe(mod: nn.Module) -> bool:
    """Whether ``mod`` is a mixture of experts stacked in 3-D tensors (transformers' Mixtral and
    Qwen2-MoE: ``experts.gate_up_proj`` of shape (experts, 2 * inner, hidden))."""
    return any(_stacked(c) for c in mod.children())


def _stacked(mod: nn.Module) -> bool:
    params = list(mod.parameters(recurse=False))
    return bool(params) and all(p.dim() == 3 for p in params)


def _moe_plan(moe: nn.Module, name: str, hidden: int) -> dict[str, Style]:
    """`MoEParallel` on the block: each expert split by its hidden units (`SplitParams` on the
    stacked tensors, a shared expert's linear layers likewise), the rest (the router, a shared
    expert's gate) replicated."""
    plan: dict[str, Style] = {"": MoEParallel()}
    for cname, child in moe.named_children():
        where = f"{name}.{cname}"
        if _stacked(child):
            dims: list[tuple[str, int, tuple[int, ...]]] = []
            for k, p in child.named_parameters(recurse=False):
                # By name where the shape cannot tell (inner == hidden), else by shape.
                up = "down" not in k if "down" in k or "up" in k else p.shape[2] == hidden != p.shape[1]
                if (p.shape[2] if up else p.shape[1]) != hidden or not ("up" in k or "down" in k or
                                                                        p.shape[1] != p.shape[2]):
                    raise fail(where, child, f"its expert tensor {k!r} of shape {tuple(p.shape)} is neither "
                                              f"(experts, inner, {hidden}) nor (experts, {hidden}, inner)")
                inner = p.shape[1] if up else p.shape[2]
                dims.append((k, 1 if up else 2, (inner // 2,) * 2 if up and "gate_up" in k else ()))
            if any(has_params(c) for c in child.children()):
                raise fail(where, child, "experts with submodules holding parameters")
            plan[cname] = SplitParams(dims=tuple(dims))
        elif mlp_kind(child):  # a shared expert, which every token goes through
            kind, names = mlp_kind(child)  # type: ignore[misc]
            lin = linears(child)
            for n in names:
                layout = linear_layout(lin[n])
                assert layout is not None
                if n == names[-1]:
                    if getattr(lin[n], "bias", None) is not None:
                        raise fail(f"{where}.{n}", lin[n], "a shared expert's output projection with a "
                                                             "bias, which a split expert adds on every rank")
                    plan[f"{cname}.{n}"] = SplitParams(dims=(("weight", layout.in_dim, ()),))
                    continue
                out = layout.sizes(lin[n])[1]
                parts = (out // 2,) * 2 if kind == "fused_gated" else ()
                bias = (("bias", 0, parts),) if getattr(lin[n], "bias", None) is not None else ()
                plan[f"{cname}.{n}"] = SplitParams(dims=(("weight", layout.out_dim, parts), *bias))
            only_known_params(child, where, set(names))
    return plan


def _layer_plan(model: nn.Module, block: nn.Module, prefix: str) -> dict[str, Style]:
    plan: dict[str, Style] = {}
    attn = mlp = None
    if any(True for _ in block.parameters(recurse=False)):
        raise fail(prefix, block, "the decoder layer owns parameters of its own")
    hidden = _hidden(block)
    inline = () if any(mlp_kind(c) or _is_moe(c) for c in block.children()) else mlp_kind(block)
    if inline:  # OPT: fc1 and fc2 in the layer itself, which is then the region (without f)
        kind, names = inline
        plan[""] = InlineMLP()
        plan[names[-1]] = RowwiseParallel()
        for n in names[:-1]:
            plan[n] = ColwiseParallel() if kind != "fused_gated" else ColwiseParallel(
                parts=(sizes(linears(block)[n])[1] // 2,) * 2)
        mlp = "(the layer)"
    for cname, child in block.named_children():
        where = f"{prefix}.{cname}"
        if inline and cname in inline[1]:
            continue
        if attn is None and attention_kind(child):
            attn = cname
            plan.update({f"{cname}.{k}" if k else cname: s
                         for k, s in attention_plan(model, child, where, hidden).items()})
        elif mlp is None and (mlp_kind(child) or _is_moe(child)):
            mlp = cname
            sub = _moe_plan(child, where, hidden) if _is_moe(child) else mlp_plan(child, where)
            plan.update({f"{cname}.{k}" if k else cname: s for k, s in sub.items()})
        elif is_norm(child) or isinstance(child, nn.Dropout):
            plan[cname] = SequenceParallel()
        elif has_params(child):
            raise fail(where, child, "a module with parameters in the decoder layer that is neither its "
                                      "attention, its MLP nor a norm")
    return plan


def _hidden(block: nn.Module) -> int:
    """The model's width: the output size of the attention's output projection."""
    attn = next(c for c in block.children() if attention_kind(c))
    found = attention_kind(attn)
    assert found is not None
    return sizes(linears(attn)[found[1][-1]])[1]


def _top_level(model: nn.Module, layers_name: str, hidden: int) -> tuple[str, str]:
    """(lm_head name, token embedding name)."""
    heads = [(n, c) for n, c in model.named_children()
             if linear_layout(c) is not None and sizes(c)[0] == hidden]
    if len(heads) != 1:
        raise NotPlaced(f"plan_for: cannot place {type(model).__name__}: expected one top-level linear "
                        f"layer from the hidden size ({hidden}) to the vocabulary (the lm_head), found "
                        f"{[n for n, _ in heads]}")
    head_name, head = heads[0]
    vocab = sizes(head)[1]
    base_name = layers_name.rpartition(".")[0]
    base = model.get_submodule(base_name) if base_name else model
    prefix = f"{base_name}." if base_name else ""
    embs = [n for n, c in base.named_children()
            if isinstance(c, nn.Embedding) and c.num_embeddings == vocab and c.embedding_dim == hidden]
    if len(embs) != 1:
        raise NotPlaced(f"plan_for: cannot place {type(model).__name__}: expected one token embedding with "
                        f"{vocab} rows of {hidden} in {base_name or 'the model'}, found {embs}")
    return head_name, prefix + embs[0]


def layers_plan(model: nn.Module) -> tuple[str, dict[str, Style], int]:
    """(name of the decoder layers' ``nn.ModuleList``, the plan of its layers under
    ``<name>.*``, the hidden size): what every plan of a model with decoder-shaped layers
    shares, whatever comes before and after them (a causal LM's vocabulary, ViT's patches)."""
    layers_name, layers = _decoder_layers(model)
    same_blocks(layers, layers_name)
    plan = {f"{layers_name}.*" + f".{k}" * bool(k): s
            for k, s in _layer_plan(model, layers[0], f"{layers_name}.0").items()}
    return layers_name, plan, _hidden(layers[0])


def final_norm(model: nn.Module, layers_name: str) -> str | None:
    """The name of the norm that follows the layers named ``layers_name`` (a sibling of the list
    registered after it, or one named ``final``), or None."""
    base_name, _, last = layers_name.rpartition(".")
    base = model.get_submodule(base_name) if base_name else model
    children = list(base.named_children())
    after = [n for n, c in children[[n for n, _ in children].index(last) + 1:] if is_norm(c)]
    if not after:  # OPT registers its final_layer_norm before its layers
        after = [n for n, c in children if is_norm(c) and "final" in n]
    if len(after) > 1:
        raise NotPlaced(f"plan_for: cannot place {type(model).__name__}: several norms after the decoder "
                        f"layers ({after}); which one is final is ambiguous")
    return f"{base_name}.{after[0]}" if after and base_name else after[0] if after else None


def causal_lm_plan(model: nn.Module, *, loss_parallel: bool = False) -> dict[str, Style]:
    """The tensor-parallel plan of a `transformers`-shaped causal LM (see the module docstring).
    ``loss_parallel=True`` leaves the logits split by vocabulary for
    `plait.vocab_parallel_cross_entropy`; by default they are gathered, so the model's output is
    what it returns on one device. Raises ``ValueError`` naming a module it cannot place."""
    layers_name, plan, hidden = layers_plan(model)
    head_name, emb = _top_level(model, layers_name, hidden)
    norm = final_norm(model, layers_name)
    if not isinstance(plan.get(f"{layers_name}.*"), InlineMLP):  # InlineMLP refuses SP itself
        plan[f"{layers_name}.0"] = ScatterSequence()
    plan[emb] = VocabParallelEmbedding(shard_sequence=False)
    if norm is not None:
        plan[norm] = GatherSequence()
    plan[head_name] = VocabParallelOutput(gather_output=not loss_parallel,
                                          input_is_sequence_parallel=norm is None)
    return plan
