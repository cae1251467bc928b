"""Tensor-parallel plans of the models plait knows, keyed by module names (no model is edited)."""

from __future__ import annotations

from torch import nn

from plait.plans.causal_lm import causal_lm_plan
from plait.plans.encoder import bert_layers, bert_plan, encoder_decoder, is_vision, vision_plan
from plait.plans.seq2seq import seq2seq_plan
from plait.tp.styles import (
    ColwiseParallel,
    ParallelRegion,
    RowwiseParallel,
    SequenceParallel,
    Style,
    VocabParallelEmbedding,
    VocabParallelOutput,
)


def plan_for(model: nn.Module, *, loss_parallel: bool = False) -> dict[str, Style]:
    """A tensor-parallel plan for ``model``: `gpt_plan` for plait's GPT, else the plan of a
    `transformers`-shaped model recognised by its module structure: an encoder-decoder shaped like
    T5 (`plait.plans.seq2seq`), an encoder shaped like BERT or RoBERTa, or a vision transformer
    (ViT), with their heads (`plait.plans.encoder`), or a causal LM (`plait.plans.causal_lm`:
    Llama, Mistral, Qwen2, Phi-3, GPT-2, GPT-NeoX, Gemma, Gemma2, CodeGen, Mixtral and others of
    the same shapes). The model returns what it returns on one device (gathered logits), so the
    usual loss works unchanged; ``loss_parallel=True`` leaves the logits split by vocabulary for
    `plait.loss_fn_for(model)` (vocab-parallel cross-entropy), and is refused for a model with no
    vocabulary (a classifier). Raises ``ValueError`` naming the module it cannot place.
    """
    from plait.models.gpt import GPT

    if isinstance(model, GPT):
        return gpt_plan(model.cfg, loss_parallel=loss_parallel)
    seq2seq = encoder_decoder(model)
    if seq2seq is not None:
        return seq2seq_plan(model, seq2seq, loss_parallel=loss_parallel)
    if bert_layers(model) is not None:
        return bert_plan(model, loss_parallel=loss_parallel)
    if is_vision(model):
        return vision_plan(model, loss_parallel=loss_parallel)
    return causal_lm_plan(model, loss_parallel=loss_parallel)


EXPERT_TP = ("replicate", "split")


def gpt_plan(cfg: object, *, loss_parallel: bool = True, experts: str = "replicate") -> dict[str, Style]:
    """The Megatron plan for `plait.models.gpt.GPT` (pass its `GPTConfig` or the model).

    Attention is split by heads (q/k/v by output, o by input, in units of ``head_dim`` so a
    head never straddles ranks), the MLP by hidden units, embedding and lm_head by vocabulary.
    ``loss_parallel=False`` gathers the logits instead (then the plain `lm_loss` applies).

    MoE blocks (``n_experts > 0``): with ``experts="replicate"`` router and experts run
    replicated on each tp rank, on the rank's sequence shard under sequence parallelism (their
    gradients then summed over tp, as a norm's are). ``experts="split"`` splits every expert (and
    the shared one) by hidden units like a dense MLP, the router replicated and seeing every
    token on every tp rank; each expert call ends in an all-reduce over tp, so not with sequence
    parallelism (whose reduce-scatter would cut routed rows, not the sequence).
    Split experts over ranks with expert parallelism either way.
    """
    if experts not in EXPERT_TP:
        raise ValueError(f"gpt_plan(experts=...) must be one of {EXPERT_TP}, got {experts!r}")
    cfg = getattr(cfg, "cfg", cfg)
    hd = getattr(cfg, "head_dim", None)
    if not isinstance(hd, int):
        raise TypeError(f"gpt_plan(cfg=...) expects a GPTConfig or a GPT, got {type(cfg).__name__}")
    # Only the parts the model has: a pattern that matches no module is refused as a typo would be.
    parts = ("experts.*", "shared") if getattr(cfg, "n_shared_experts", 0) else ("experts.*",)
    if getattr(cfg, "n_experts", 0) and experts == "split":
        # A region per expert, not around the block: the router reads the block's input too,
        # replicated, and a region's f would sum that gradient over tp.
        mlp: dict[str, Style] = {}
        for part in parts:
            mlp[f"layers.*.mlp.{part}"] = ParallelRegion()
            mlp[f"layers.*.mlp.{part}.gate_proj"] = ColwiseParallel(input_comm=False)
            mlp[f"layers.*.mlp.{part}.up_proj"] = ColwiseParallel(input_comm=False)
            mlp[f"layers.*.mlp.{part}.down_proj"] = RowwiseParallel()
    elif getattr(cfg, "n_experts", 0):
        mlp = {"layers.*.mlp.router": SequenceParallel(),
               **{f"layers.*.mlp.{part}.*": SequenceParallel() for part in parts}}
    else:
        mlp = {"layers.*.mlp": ParallelRegion(),
               "layers.*.mlp.gate_proj": ColwiseParallel(input_comm=False),
               "layers.*.mlp.up_proj": ColwiseParallel(input_comm=False),
               "layers.*.mlp.down_proj": RowwiseParallel()}
    return {
        "tok_emb": VocabParallelEmbedding(),
        "drop": SequenceParallel(),
        "layers.*.attn_norm": SequenceParallel(),
        "layers.*.attn": ParallelRegion(),
        "layers.*.attn.q_proj": ColwiseParallel(input_comm=False, unit=hd, what="attention heads"),
        "layers.*.attn.k_proj": ColwiseParallel(input_comm=False, unit=hd, what="KV heads"),
        "layers.*.attn.v_proj": ColwiseParallel(input_comm=False, unit=hd, what="KV heads"),
        "layers.*.attn.o_proj": RowwiseParallel(unit=hd, what="attention heads"),
        "layers.*.drop": SequenceParallel(),
        "layers.*.mlp_norm": SequenceParallel(),
        **mlp,
        "norm": SequenceParallel(),
        "lm_head": VocabParallelOutput(gather_output=not loss_parallel),
    }


def splits_logits_by_default(model: nn.Module) -> bool:
    """Whether `plait train` leaves ``model``'s logits split by vocabulary under its own loss
    (plait's GPT, whose loss is plait's: the vocabulary-parallel cross-entropy)."""
    from plait.models.gpt import GPT

    return isinstance(model, GPT)
