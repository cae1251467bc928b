"""Tensor-parallel plans for encoder-decoder models shaped like T5 in Hugging Face
`transformers` (``T5ForConditionalGeneration``): an ``encoder`` and a ``decoder`` stack, each an
embedding, a list of blocks and a final norm; each block a list of sublayers (self-attention,
the decoder's cross-attention, the MLP), each sublayer a norm, the attention or MLP, a dropout.

Every attention is split by heads (`AttentionParallel`: ``q k v`` by output, ``o`` by input) and
every MLP by hidden units (``wi``/``wo``, or gated ``wi_0 wi_1 wo``), as in a decoder. What T5
adds: the first block of each stack computes a bias per head from relative positions
(``relative_attention_bias``, one column per head: `HeadEmbedding` gives each rank its heads),
which each attention returns for the next blocks to reuse (`AttentionParallel(head_bias=...)`:
gathered whole between blocks, each rank taking its heads); the decoder's cross-attention reads
the encoder's output in its key and value projections (``kv_inputs``: through f, replicated).
Sequence parallelism starts at the first block of each stack (`ScatterSequence`) and ends
before its final norm (`GatherSequence`), so the masks, the encoder's output that the decoder
attends to and the LM head see the whole sequence. The token embedding (shared by both stacks)
and the LM head are split by vocabulary, tied or not; the logits come back whole unless
``loss_parallel``.
"""

from __future__ import annotations

from torch import nn

from plait.plans.causal_lm import attention_kind, attention_plan, final_norm, mlp_kind, mlp_plan
from plait.plans.structure import NotPlaced, fail, has_params, is_norm, linears, sizes
from plait.tp.layers import linear_layout
from plait.tp.sequence import GatherSequence, ScatterSequence
from plait.tp.styles import SequenceParallel, Style, VocabParallelEmbedding, VocabParallelOutput


def _blocks(stack: nn.Module, where: str) -> str:
    """The name of ``stack``'s list of blocks: its one non-empty ``nn.ModuleList`` child, each of
    whose blocks holds a list of sublayers."""
    found = [(n, c) for n, c in stack.named_children() if isinstance(c, nn.ModuleList) and len(c) > 0]
    first = found[0][1][0] if len(found) == 1 and isinstance(found[0][1], nn.ModuleList) else None
    if first is None or not any(isinstance(c, nn.ModuleList) for c in first.children()):
        raise fail(where, stack, "expected one list of blocks, each a list of sublayers (T5's "
                                 "block.*.layer.*); train this model with data or fully sharded parallelism "
                                 "(DDP, FSDP) instead")
    return found[0][0]


def _sublayer_plan(model: nn.Module, sub: nn.Module, where: str, hidden: int) -> dict[str, Style]:
    """One sublayer: its attention or MLP split, its norms and dropouts `SequenceParallel`."""
    plan: dict[str, Style] = {}
    for cname, child in sub.named_children():
        if attention_kind(child):
            inner = attention_plan(model, child, f"{where}.{cname}", hidden)
        elif mlp_kind(child):
            inner = mlp_plan(child, f"{where}.{cname}")
        elif is_norm(child) or isinstance(child, nn.Dropout):
            plan[cname] = SequenceParallel()
            continue
        elif has_params(child):
            raise fail(f"{where}.{cname}", child, "a module with parameters in a sublayer that is neither an "
                                                  "attention, an MLP nor a norm")
        else:
            continue
        plan.update({f"{cname}.{k}" if k else cname: s for k, s in inner.items()})
    return plan


def _stack_plan(model: nn.Module, stack: nn.Module, name: str, hidden: int) -> dict[str, Style]:
    """One stack: every block's sublayers, the sequence split around the blocks, the embedding."""
    blocks_name = _blocks(stack, name)
    plan: dict[str, Style] = {}
    blocks = stack.get_submodule(blocks_name)
    assert isinstance(blocks, nn.ModuleList)
    for i, block in enumerate(blocks):
        where = f"{name}.{blocks_name}.{i}"
        if any(True for _ in block.parameters(recurse=False)):
            raise fail(where, block, "the block owns parameters of its own")
        for lname, sublayers in block.named_children():
            if not isinstance(sublayers, nn.ModuleList):
                if has_params(sublayers):
                    raise fail(f"{where}.{lname}", sublayers, "parameters outside the block's sublayers")
                continue
            for j, sub in enumerate(sublayers):
                plan.update({f"{where}.{lname}.{j}.{k}": s
                             for k, s in _sublayer_plan(model, sub, f"{where}.{lname}.{j}", hidden).items()})
    plan[f"{name}.{blocks_name}.0"] = ScatterSequence()
    norm = final_norm(model, f"{name}.{blocks_name}")
    if norm is None:
        raise fail(name, stack, "no norm after its blocks, where sequence parallelism would end")
    plan[norm] = GatherSequence()
    embs = [n for n, c in stack.named_children() if isinstance(c, nn.Embedding) and c.embedding_dim == hidden]
    if len(embs) != 1:
        raise fail(name, stack, f"expected one token embedding of {hidden} features, found {embs}")
    plan[f"{name}.{embs[0]}"] = VocabParallelEmbedding(shard_sequence=False)
    return plan


def _hidden(model: nn.Module, stack: nn.Module) -> int:
    """The width: the output size of the first attention's output projection in ``stack``."""
    for mod in stack.modules():
        found = attention_kind(mod)
        if found is not None:
            return sizes(linears(mod)[found[1][-1]])[1]
    raise NotPlaced(f"plan_for: cannot place {type(model).__name__}: no attention (q/k/v/o projections) "
                    "in its encoder")


def seq2seq_plan(model: nn.Module, root: str, *, loss_parallel: bool = False) -> dict[str, Style]:
    """The tensor-parallel plan of a T5-shaped encoder-decoder whose ``encoder`` and ``decoder``
    are children of module ``root`` (see the module docstring). Raises ``ValueError`` naming a
    module it cannot place."""
    base = model.get_submodule(root) if root else model
    prefix = f"{root}." if root else ""
    hidden = _hidden(model, base.get_submodule("encoder"))
    plan: dict[str, Style] = {}
    for part in ("encoder", "decoder"):
        plan.update(_stack_plan(model, base.get_submodule(part), f"{prefix}{part}", hidden))
    vocab = base.get_submodule("encoder")
    rows = {c.num_embeddings for c in vocab.children() if isinstance(c, nn.Embedding)}
    heads = [n for n, c in model.named_children()
             if linear_layout(c) is not None and sizes(c)[0] == hidden and sizes(c)[1] in rows]
    if len(heads) != 1:
        raise NotPlaced(f"plan_for: cannot place {type(model).__name__}: expected one top-level linear layer "
                        f"from the hidden size ({hidden}) to the vocabulary (the lm_head), found {heads}")
    plan[heads[0]] = VocabParallelOutput(gather_output=not loss_parallel, input_is_sequence_parallel=False)
    return plan
