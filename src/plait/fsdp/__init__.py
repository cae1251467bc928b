"""Fully sharded data parallelism (ZeRO 1/2/3, HSDP) and ZeRO-1 across pipeline replicas."""

from plait.fsdp.wrapper import FSDP, FullyShardedDataParallel, MixedPrecision
from plait.fsdp.zero1 import ZeroRedundancyOptimizer

__all__ = ["FullyShardedDataParallel", "FSDP", "MixedPrecision", "ZeroRedundancyOptimizer"]
