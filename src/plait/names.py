"""Module-name patterns: the one rule every plan uses (tensor-parallel plans, FSDP units).

A pattern is matched against a qualified module name segment by segment: it must have as
many dot-separated segments as the name, and each pattern segment is an `fnmatch` pattern for
the name segment in its place. So ``*`` stands for exactly one segment: ``layers.*.attn``
matches ``layers.3.attn``, not ``layers.3.x.attn`` or ``layers.attn``; ``layers.1?`` matches
``layers.10`` to ``layers.19``.
"""

from __future__ import annotations

import fnmatch

__all__ = ["matches"]


def matches(pattern: str, name: str) -> bool:
    """Whether the qualified module ``name`` matches ``pattern`` (see the module docstring)."""
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatch.fnmatchcase(b, a) for a, b in zip(p, n, strict=True))
