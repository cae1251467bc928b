"""How each parameter is placed: one record per parameter (`placement_of`, a `ParamPlacement`) and
the records tensor and expert parallelism write on the model (`records`), the row layout of a tp
shard (`shards`), the state of a tp-placed model (`state`) and the gradient reduction experts need
(`grads`). DDP, FSDP, clipping, state dicts and
checkpoints read these instead of the strategies that wrote them."""

from plait.state.placement.records import (
    ExpertParallelInfo,
    ExpertPlacement,
    ParamPlacement,
    ParamState,
    TPInfo,
    ep_info,
    placement_of,
    tp_info,
    tp_module,
)
from plait.state.placement.shards import ShardSpec

__all__ = ["TPInfo", "tp_info", "tp_module", "ExpertPlacement", "ExpertParallelInfo", "ep_info",
           "placement_of", "ParamPlacement", "ParamState", "ShardSpec"]
