"""plait: train any PyTorch model on many devices with every classic form of parallelism.

The public names load on first use (PEP 562): ``import plait`` costs nothing until a name is
used, so ``plait --help`` and ``plait --version`` answer without importing torch.
"""

import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Where each public name lives, in the order the first use loads them all (None: a module, which
# `_MODULES` names). `plait.activation_checkpointing`, `plait.check`, `plait.parallelize` and
# `plait.pipeline` are modules that are also their namesake function (`plait.runtime.callable_module`):
# ``plait.pipeline(model, mesh, ...)`` and ``plait.pipeline.zbv`` both work.
_SOURCES = {
    "comm": None, "cp": None, "CheckReport": "plait.check", "clip_grad_norm_": "plait.state.clip",
    "context_parallel": "plait.cp", "DataParallel": "plait.data_parallel", "DDP": "plait.ddp",
    "DistributedDataParallel": "plait.ddp", "get_logger": "plait.runtime.env",
    "init": "plait.runtime.env", "expert_parallel": "plait.ep", "FSDP": "plait.fsdp",
    "FullyShardedDataParallel": "plait.fsdp", "ZeroRedundancyOptimizer": "plait.fsdp",
    "init_weights": "plait.state.materialize", "Mesh": "plait.runtime.mesh", "gpt_plan": "plait.plans",
    "plan_for": "plait.plans", "ParallelPlan": "plait.compose.parallelize", "Pipeline": "plait.pipeline",
    "MixedPrecision": "plait.state.precision", "mixed_precision": "plait.state.precision",
    "GradScaler": "plait.compose.scaler", "full_state_dict": "plait.state.state_dict",
    "SyncBatchNorm": "plait.compose.sync_batchnorm", "load_full_state_dict": "plait.state.state_dict",
    "ColwiseParallel": "plait.tp", "ParallelRegion": "plait.tp", "RowwiseParallel": "plait.tp",
    "SequenceParallel": "plait.tp", "VocabParallelEmbedding": "plait.tp", "VocabParallelOutput": "plait.tp",
    "loss_fn_for": "plait.tp", "tensor_parallel": "plait.tp", "vocab_parallel_cross_entropy": "plait.tp",
    "activation_checkpointing": None, "check": None, "parallelize": None, "pipeline": None,
}
# The modules plait gives a short name, each under its full path: `plait.comm` is
# `plait.runtime.comm`, whose full path alone imports (``import plait.runtime.comm``).
# `plait.checkpoint` loads on its own first use, not with the public names (and type checkers see
# it through `__getattr__`: its module imports `plait.__version__`, so the facade may not import it).
_MODULES = {
    "comm": "plait.runtime.comm", "cp": "plait.cp", "checkpoint": "plait.state.checkpoint",
    "activation_checkpointing": "plait.compose.activation_checkpointing", "check": "plait.check",
    "parallelize": "plait.compose.parallelize", "pipeline": "plait.pipeline",
}
_loading = False

if TYPE_CHECKING:  # type checkers see the names as plain imports (the callable modules as functions)
    from plait import cp
    from plait.check import CheckReport, check
    from plait.compose.activation_checkpointing import activation_checkpointing
    from plait.compose.parallelize import ParallelPlan, parallelize
    from plait.compose.scaler import GradScaler
    from plait.compose.sync_batchnorm import SyncBatchNorm
    from plait.cp import context_parallel
    from plait.data_parallel import DataParallel
    from plait.ddp import DDP, DistributedDataParallel
    from plait.ep import expert_parallel
    from plait.fsdp import FSDP, FullyShardedDataParallel, ZeroRedundancyOptimizer
    from plait.pipeline import Pipeline, pipeline
    from plait.plans import gpt_plan, plan_for
    from plait.runtime import comm
    from plait.runtime.env import get_logger, init
    from plait.runtime.mesh import Mesh
    from plait.state.clip import clip_grad_norm_
    from plait.state.materialize import init_weights
    from plait.state.precision import MixedPrecision, mixed_precision
    from plait.state.state_dict import full_state_dict, load_full_state_dict
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
    "SyncBatchNorm",
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


def _resolve(name: str) -> Any:
    source = _SOURCES[name]
    return importlib.import_module(_MODULES[name]) if source is None else \
        getattr(importlib.import_module(source), name)


def _mid_import() -> bool:
    """Whether a plait module is being executed right now (importlib marks its spec meanwhile):
    its ``from plait import cp`` must get that module alone, since loading every name from a
    half-run module would import modules that need it whole."""
    from plait._torch_compat import module_initializing

    return any(module_initializing(m) for n, m in list(sys.modules.items()) if n.startswith("plait"))


def __getattr__(name: str) -> Any:
    """The first use of a public name or subpackage from outside the library loads every public
    name, as the whole library's ``import plait`` would (``plait.models.gpt`` is then there too)."""
    global _loading
    known = name in _SOURCES or name in _MODULES
    if not known and (name.startswith("__") or importlib.util.find_spec(f"plait.{name}") is None):
        raise AttributeError(f"module 'plait' has no attribute {name!r}")
    if not _loading and not _mid_import():
        _loading = True
        try:
            for each in _SOURCES:
                globals()[each] = _resolve(each)
        finally:
            _loading = False
    if name not in globals():
        globals()[name] = _resolve(name) if name in _SOURCES else \
            importlib.import_module(_MODULES.get(name, f"plait.{name}"))
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *_SOURCES, *_MODULES})
