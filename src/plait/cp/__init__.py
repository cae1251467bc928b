"""Context parallelism: every sequence split across the ranks of the mesh's ``cp`` axis, attention
included (`context_parallel`; the algorithms `ring_attention`, `allgather_attention`,
`ulysses_attention`; the zigzag `Layout`; `shard` / `unshard` of full-sequence tensors)."""

from plait.cp.apply import (  # noqa: F401 (cp_info: the library's)
                            ALGORITHMS,
                            ContextParallelInfo,
                            context_parallel,
                            cp_info,
                            shard,
                            unshard,
                            verified,
)
from plait.cp.gather import allgather_attention, ulysses_attention
from plait.cp.group import CPGroup
from plait.cp.layout import Layout, Span  # noqa: F401
from plait.cp.numeric import Verified
from plait.cp.ring import ring_attention

__all__ = ["context_parallel", "shard", "unshard", "ALGORITHMS", "ring_attention", "allgather_attention",
           "ulysses_attention", "CPGroup", "Layout", "verified", "Verified"]
