"""plait: train any PyTorch model on many devices with every classic form of parallelism."""

from typing import TYPE_CHECKING

from plait import comm, cp
from plait.check import CheckReport
from plait.clip import clip_grad_norm_
from plait.cp import context_parallel
from plait.data_parallel import DataParallel
from plait.ddp import DDP, DistributedDataParallel
from plait.env import get_logger, init
from plait.ep import expert_parallel
from plait.fsdp import FSDP, FullyShardedDataParallel, ZeroRedundancyOptimizer
from plait.materialize import init_weights
from plait.mesh import Mesh
from plait.models.plans import gpt_plan, plan_for
from plait.parallelize import ParallelPlan
from plait.pipeline import Pipeline
from plait.precision import MixedPrecision, mixed_precision
from plait.scaler import GradScaler
from plait.state_dict import full_state_dict, load_full_state_dict
from plait.tp import (
    ColwiseParallel,
    ParallelRegion,
    RowwiseParallel,
    SequenceParallel,
    VocabParallelEmbedding,
    VocabParallelOutput,
    loss_fn_for,
    tensor_parallel,
    vocab_parallel_cross_entropy,
)

# `plait.activation_checkpointing`, `plait.check`, `plait.parallelize` and `plait.pipeline` are
# modules that are also their namesake function (`plait.callable_module`):
# ``plait.pipeline(model, mesh, ...)`` and ``plait.pipeline.zbv`` both work. Type checkers do not
# model a callable module, so to them these names are the functions, the common use; typed code
# imports the modules' other names (``from plait.pipeline import zbv``).
if TYPE_CHECKING:
    from plait.activation_checkpointing import activation_checkpointing
    from plait.check import check
    from plait.parallelize import parallelize
    from plait.pipeline import pipeline
else:
    from plait import activation_checkpointing, check, parallelize, pipeline

__all__ = [
    "init",
    "get_logger",
    "Mesh",
    "comm",
    "init_weights",
    "DataParallel",
    "DistributedDataParallel",
    "DDP",
    "FullyShardedDataParallel",
    "FSDP",
    "MixedPrecision",
    "mixed_precision",
    "GradScaler",
    "tensor_parallel",
    "context_parallel",
    "expert_parallel",
    "cp",
    "gpt_plan",
    "plan_for",
    "loss_fn_for",
    "vocab_parallel_cross_entropy",
    "ColwiseParallel",
    "RowwiseParallel",
    "VocabParallelEmbedding",
    "VocabParallelOutput",
    "SequenceParallel",
    "ParallelRegion",
    "pipeline",
    "Pipeline",
    "parallelize",
    "ParallelPlan",
    "activation_checkpointing",
    "clip_grad_norm_",
    "full_state_dict",
    "load_full_state_dict",
    "ZeroRedundancyOptimizer",
    "check",
    "CheckReport",
]
__version__ = "0.1.0"
