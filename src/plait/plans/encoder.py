"""Tensor-parallel plans for encoders shaped like those of Hugging Face `transformers`: BERT and
RoBERTa (and others whose layers are built the same way), and vision transformers (ViT), with
their heads (masked LM, sequence and image classification). Recognised by module structure, as
the causal LMs of `plait.plans.causal_lm` are.

BERT's layer splits each block across sibling modules and runs replicated code around them:
its ``attention`` computes the heads in ``self`` (``query key value``) and, in ``output``,
projects them back (``dense``), adds the attention's input and normalizes; the layer runs its
MLP as ``intermediate`` (``dense``, then the activation) and ``output`` (``dense``, the residual,
a norm). So each block is a `ParallelRegion` entered at the child that starts it (``entry``):
`AttentionParallel(entry="self")` on the attention, `ParallelRegion(entry="intermediate")` on
the layer; the output projections are row-parallel and the norms and dropouts around them are
`SequenceParallel`. There is no final norm: sequence parallelism spans the encoder module
(`ScatterSequence(gather_output=True)`), so the embeddings, the pooler and the heads see the
whole sequence, replicated. The word embedding is split by vocabulary, and a masked-LM decoder
(tied to it) too; the logits come back whole unless ``loss_parallel``.

ViT's layers are shaped as a decoder's (``q_proj k_proj v_proj o_proj`` and an MLP of ``fc1
fc2``, its norms in the layer) and are planned as such; its patch embedding, class token and
positions, and its classifier run replicated. Sequence parallelism starts at the first layer and
ends before the final norm: the patches plus the class token must divide by tp.
"""

from __future__ import annotations

from torch import nn

from plait.plans.causal_lm import SEPARATE_QKV, final_norm, layers_plan
from plait.plans.structure import (
    NotPlaced,
    fail,
    geometry,
    has_params,
    head_attrs,
    is_norm,
    linears,
    same_blocks,
    sizes,
)
from plait.tp.attention import AttentionParallel
from plait.tp.layers import linear_layout
from plait.tp.sequence import GatherSequence, ScatterSequence
from plait.tp.styles import (
    ColwiseParallel,
    ParallelRegion,
    RowwiseParallel,
    SequenceParallel,
    Style,
    VocabParallelEmbedding,
    VocabParallelOutput,
)


def _one_linear(mod: nn.Module) -> str | None:
    """The name of ``mod``'s only linear child, if it has exactly one."""
    found = list(linears(mod))
    return found[0] if len(found) == 1 else None


def _linear_sizes(mod: nn.Module) -> tuple[int, int]:
    """(in, out) of ``mod``'s only linear child."""
    name = _one_linear(mod)
    assert name is not None
    return sizes(mod.get_submodule(name))


def _heads_module(mod: nn.Module) -> tuple[str, ...] | None:
    """``mod``'s q, k and v projections, when it holds those and no output projection."""
    lin = linears(mod)
    for names in SEPARATE_QKV:
        if all(n in lin for n in names) and len(lin) == 3:
            return names
    return None


def _attention_parts(block: nn.Module) -> tuple[str, str, str] | None:
    """(attention, its heads child, its output child) when ``block`` holds a BERT-shaped
    attention: a child with one child computing q, k and v, and one holding a single linear."""
    for cname, child in block.named_children():
        kids = dict(child.named_children())
        heads = [n for n, c in kids.items() if _heads_module(c)]
        outs = [n for n, c in kids.items() if n not in heads and _one_linear(c)]
        if len(heads) == 1 and len(outs) == 1:
            return cname, heads[0], outs[0]
    return None


def bert_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The ``nn.ModuleList`` of BERT-shaped layers in ``model`` (see the module docstring)."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0 and _attention_parts(mod[0]) is not None:
            return name, mod
    return None


def _mlp_parts(block: nn.Module, attention: str, where: str) -> tuple[str, str]:
    """(intermediate, output): the two children besides the attention holding one linear each,
    hidden -> inner then inner -> hidden."""
    found = [n for n, c in block.named_children() if n != attention and _one_linear(c)]
    if len(found) != 2:
        raise fail(where, block, f"expected two modules besides {attention!r} holding one linear layer each "
                                 f"(the MLP's, as BERT's intermediate and output), found {found}; train this "
                                 "model with data or fully sharded parallelism (DDP, FSDP) instead")
    first, second = (_linear_sizes(block.get_submodule(n)) for n in found)
    if first[1] != second[0] or first[0] != second[1]:
        raise fail(where, block, f"{found[0]!r} maps {first[0]} to {first[1]} features and {found[1]!r} "
                                 f"{second[0]} to {second[1]}: not an MLP's two projections")
    return found[0], found[1]


def _around(mod: nn.Module, prefix: str, known: str, where: str) -> dict[str, Style]:
    """`SequenceParallel` on the norms and dropouts of ``mod`` beside its linear ``known``."""
    plan: dict[str, Style] = {}
    for cname, child in mod.named_children():
        if cname == known:
            continue
        if is_norm(child) or isinstance(child, nn.Dropout):
            plan[f"{prefix}.{cname}"] = SequenceParallel()
        elif has_params(child):
            raise fail(f"{where}.{cname}", child, "a module with parameters beside the projection that is "
                                                  "neither a norm nor a dropout")
    return plan


def _bert_layer_plan(model: nn.Module, block: nn.Module, where: str) -> tuple[dict[str, Style], int]:
    """The plan of one BERT-shaped layer (names under it), and the hidden size."""
    if any(True for _ in block.parameters(recurse=False)):
        raise fail(where, block, "the layer owns parameters of its own")
    parts = _attention_parts(block)
    assert parts is not None
    attn, heads_name, out_name = parts
    inter, out = _mlp_parts(block, attn, where)
    attention = block.get_submodule(attn)
    known = {heads_name, out_name}
    extra = [n for n, c in attention.named_children() if n not in known and has_params(c)]
    others = [n for n, c in block.named_children() if n not in (attn, inter, out) and has_params(c)]
    if extra or others:  # a decoder's cross-attention
        what = extra and f"{attn}.{extra[0]}" or others[0]
        raise fail(f"{where}.{what}", block.get_submodule(what),
                   "a module with parameters in the layer besides its attention and its MLP (a decoder's "
                   "cross-attention is not planned); train this model with data or fully sharded "
                   "parallelism (DDP, FSDP) instead")
    heads_mod, out_mod = attention.get_submodule(heads_name), attention.get_submodule(out_name)
    o = _one_linear(out_mod)
    assert o is not None
    hidden = sizes(getattr(out_mod, o))[1]
    q, k, v = _heads_module(heads_mod) or ()
    loose = [n for n, c in heads_mod.named_children() if n not in (q, k, v) and has_params(c)]
    if loose or any(True for _ in heads_mod.parameters(recurse=False)):
        raise fail(f"{where}.{attn}.{heads_name}", heads_mod,
                   f"parameters besides its q, k and v projections ({loose or 'its own'}: relative position "
                   "embeddings over each head's features?); train this model with data or fully sharded "
                   "parallelism (DDP, FSDP) instead")
    n_heads, kv, d = geometry(model, heads_mod, f"{where}.{attn}.{heads_name}", hidden)
    if kv != n_heads or sizes(getattr(heads_mod, q))[1] != n_heads * d:
        raise fail(f"{where}.{attn}", attention,
                   f"its projections do not fit {n_heads} heads of {d} features")
    attrs = tuple((f"{heads_name}.{a}", what) for a, what in head_attrs(heads_mod, n_heads, kv, d))
    plan: dict[str, Style] = {
        attn: AttentionParallel(heads=n_heads, head_dim=d, attrs=attrs, entry=heads_name),
        **{f"{attn}.{heads_name}.{p}": ColwiseParallel(input_comm=False, unit=d, what="attention heads")
           for p in (q, k, v)},
        f"{attn}.{out_name}.{o}": RowwiseParallel(unit=d, what="attention heads"),
        **_around(out_mod, f"{attn}.{out_name}", o, f"{where}.{attn}.{out_name}"),
        "": ParallelRegion(entry=inter),
    }
    up, down = _one_linear(block.get_submodule(inter)), _one_linear(block.get_submodule(out))
    plan[f"{inter}.{up}"] = ColwiseParallel(input_comm=False)
    plan[f"{out}.{down}"] = RowwiseParallel()
    plan.update(_around(block.get_submodule(out), out, down or "", f"{where}.{out}"))
    if any(has_params(c) for n, c in block.get_submodule(inter).named_children() if n != up):
        raise fail(f"{where}.{inter}", block.get_submodule(inter), "parameters beside its projection")
    return plan, hidden


def _vocabulary(model: nn.Module, base: nn.Module, hidden: int) -> tuple[str | None, int]:
    """(name under ``base`` of its word embedding, vocabulary size): the ``nn.Embedding`` of
    ``config.vocab_size`` rows of ``hidden`` in the module that runs before the layers."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    found = [n for n, m in base.named_modules() if isinstance(m, nn.Embedding) and m.embedding_dim == hidden
             and (m.num_embeddings == vocab or vocab is None and "word" in n)]
    if len(found) > 1:
        raise NotPlaced(f"plan_for: cannot place {type(model).__name__}: several embeddings could be the "
                        f"word embedding ({found})")
    if not found:
        return None, 0
    emb = base.get_submodule(found[0])
    assert isinstance(emb, nn.Embedding)
    return found[0], emb.num_embeddings


def _no_vocabulary(model: nn.Module, loss_parallel: bool) -> None:
    if loss_parallel:
        raise NotPlaced(f"plan_for: {type(model).__name__} has no output over a vocabulary to leave split "
                        "(loss_parallel=True applies to language-model heads); use loss_parallel=False")


def bert_plan(model: nn.Module, *, loss_parallel: bool = False) -> dict[str, Style]:
    """The tensor-parallel plan of a BERT-shaped encoder and its head (see the module docstring).
    Raises ``ValueError`` naming a module it cannot place."""
    found = bert_layers(model)
    assert found is not None
    layers_name, layers = found
    same_blocks(layers, layers_name)
    layer, hidden = _bert_layer_plan(model, layers[0], f"{layers_name}.0")
    plan = {f"{layers_name}.*" + f".{k}" * bool(k): s for k, s in layer.items()}
    encoder_name = layers_name.rpartition(".")[0]
    base_name = encoder_name.rpartition(".")[0]
    if not encoder_name:
        raise NotPlaced(f"plan_for: cannot place {type(model).__name__}: its layers are not held by an "
                        "encoder module, where sequence parallelism would end")
    plan[encoder_name] = ScatterSequence(gather_output=True)
    base = model.get_submodule(base_name) if base_name else model
    word, vocab = _vocabulary(model, base, hidden)
    if word is not None:
        plan[f"{base_name}.{word}" if base_name else word] = VocabParallelEmbedding(shard_sequence=False)
    # The heads: modules outside the base model (none when the model is the base itself).
    heads = [(n, m) for n, m in model.named_modules() if base_name and n and n != base_name
             and not n.startswith(f"{base_name}.")]
    decoders = [n for n, m in heads if linear_layout(m) is not None and sizes(m) == (hidden, vocab)]
    if len(decoders) > 1:
        raise NotPlaced(f"plan_for: cannot place {type(model).__name__}: several linear layers onto the "
                        f"vocabulary ({decoders}); which one is the LM head is ambiguous")
    if decoders:
        plan[decoders[0]] = VocabParallelOutput(gather_output=not loss_parallel,
                                                input_is_sequence_parallel=False)
    else:
        _no_vocabulary(model, loss_parallel)
    return plan


def encoder_decoder(model: nn.Module) -> str | None:
    """The name of the module of ``model`` holding an ``encoder`` and a ``decoder`` (T5's is the
    model itself: ``""``), or None."""
    for name, mod in model.named_modules():
        kids = dict(mod.named_children())
        if "encoder" in kids and "decoder" in kids:
            return name
    return None


def is_vision(model: nn.Module) -> bool:
    """Whether ``model`` embeds no tokens (no ``nn.Embedding`` anywhere: ViT's patches)."""
    return not any(isinstance(m, nn.Embedding) for m in model.modules())


def vision_plan(model: nn.Module, *, loss_parallel: bool = False) -> dict[str, Style]:
    """The tensor-parallel plan of a vision transformer with decoder-shaped layers (ViT; see the
    module docstring): its layers split as a decoder's, everything else replicated."""
    _no_vocabulary(model, loss_parallel)
    layers_name, plan, _ = layers_plan(model)
    norm = final_norm(model, layers_name)
    plan[f"{layers_name}.0"] = ScatterSequence()
    if norm is not None:
        plan[norm] = GatherSequence()
    return plan
