"""Fully sharded data parallelism (ZeRO 1/2/3, HSDP) and ZeRO-1 across pipeline replicas."""

# An internal package (no __all__): these names are `plait.FSDP`'s and its neighbours' home.
from plait.fsdp.wrapper import FSDP, FullyShardedDataParallel, MixedPrecision  # noqa: F401
from plait.fsdp.zero1 import ZeroRedundancyOptimizer  # noqa: F401
