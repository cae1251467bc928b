"""Distributed data parallelism: gradients all-reduced in buckets, overlapped with backward."""

from plait.ddp.wrapper import DDP, DistributedDataParallel

__all__ = ["DistributedDataParallel", "DDP"]
