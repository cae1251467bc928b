"""Tensor-parallel plans of the models plait knows, keyed by module names (no model is edited)."""

from __future__ import annotations

from plait.tp.styles import (
    ColwiseParallel,
    ParallelRegion,
    RowwiseParallel,
    SequenceParallel,
    Style,
    VocabParallelEmbedding,
    VocabParallelOutput,
)

__all__ = ["gpt_plan"]


def gpt_plan(cfg: object, *, loss_parallel: bool = True) -> dict[str, Style]:
    """The Megatron plan for `plait.models.gpt.GPT` (pass its `GPTConfig` or the model).

    Attention is split by heads (q/k/v by output, o by input, in units of ``head_dim`` so a
    head never straddles ranks), the MLP by hidden units, embedding and lm_head by vocabulary.
    ``loss_parallel=False`` gathers the logits instead (then the plain `lm_loss` applies).
    """
    cfg = getattr(cfg, "cfg", cfg)
    hd = getattr(cfg, "head_dim", None)
    if not isinstance(hd, int):
        raise TypeError(f"gpt_plan(cfg=...) expects a GPTConfig or a GPT, got {type(cfg).__name__}")
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
        "layers.*.mlp": ParallelRegion(),
        "layers.*.mlp.gate_proj": ColwiseParallel(input_comm=False),
        "layers.*.mlp.up_proj": ColwiseParallel(input_comm=False),
        "layers.*.mlp.down_proj": RowwiseParallel(),
        "norm": SequenceParallel(),
        "lm_head": VocabParallelOutput(gather_output=not loss_parallel),
    }
