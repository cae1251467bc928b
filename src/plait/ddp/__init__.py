"""Distributed data parallelism: gradients all-reduced in buckets, overlapped with backward."""

# An internal package (no __all__): these names are `plait.DDP`'s home.
from plait.ddp.wrapper import DDP, DistributedDataParallel  # noqa: F401
