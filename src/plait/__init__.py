"""plait: train any PyTorch model on many devices with every classic form of parallelism."""

from plait import comm
from plait.data_parallel import DataParallel
from plait.ddp import DDP, DistributedDataParallel
from plait.env import get_logger, init
from plait.materialize import init_weights
from plait.mesh import Mesh

__all__ = [
    "init",
    "get_logger",
    "Mesh",
    "comm",
    "init_weights",
    "DataParallel",
    "DistributedDataParallel",
    "DDP",
]
__version__ = "0.1.0"
