"""Tensor and sequence parallelism (Megatron-LM), applied to unmodified models by a plan."""

from plait.state.placement.records import TPInfo, tp_info
from plait.tp.apply import check_plan, loss_fn_for, tensor_parallel
from plait.tp.attention import AttentionParallel, HeadEmbedding, HeadNorm, SplitRMSNorm
from plait.tp.context import Style
from plait.tp.experts import MoEParallel, SplitParams
from plait.tp.layout_trace import PlanError
from plait.tp.loss import vocab_parallel_cross_entropy
from plait.tp.sequence import GatherSequence, ScatterSequence
from plait.tp.styles import (
    ColwiseParallel,
    InlineMLP,
    ParallelRegion,
    RowwiseParallel,
    SequenceParallel,
    VocabParallelEmbedding,
    VocabParallelOutput,
)

__all__ = ["tensor_parallel", "check_plan", "PlanError", "loss_fn_for", "tp_info", "TPInfo",
           "vocab_parallel_cross_entropy", "Style", "ColwiseParallel", "RowwiseParallel",
           "VocabParallelEmbedding", "VocabParallelOutput", "SequenceParallel", "ParallelRegion", "InlineMLP",
           "AttentionParallel", "HeadEmbedding", "HeadNorm", "SplitRMSNorm", "MoEParallel", "SplitParams",
           "ScatterSequence", "GatherSequence"]
