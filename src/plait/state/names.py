"""Module-name patterns: the one rule every plan uses (tensor-parallel plans, FSDP units).

A pattern is matched against a qualified module name segment by segment: it must have as
many dot-separated segments as the name, and each pattern segment is an `fnmatch` pattern for
the name segment in its place. So ``*`` stands for exactly one segment: ``layers.*.attn``
matches ``layers.3.attn``, not ``layers.3.x.attn`` or ``layers.attn``; ``layers.1?`` matches
``layers.10`` to ``layers.19``.

Names are matched as the model's own: ``torch.compile(block)`` puts the block under a wrapper at
the block's place, with the block itself one segment deeper (``layers.3._orig_mod.attn``), so the
``_orig_mod`` segments are dropped first (`plain_name`), as torch's own state-dict helpers drop
them. The wrapper then carries the block's name and the block itself, at ``layers.3._orig_mod``,
matches nothing: a pattern selects the module the model holds at that place, once.
"""

from __future__ import annotations

import fnmatch

from plait._torch_compat import COMPILED_CHILD

COMPILED = COMPILED_CHILD  # the child under which torch.compile's wrapper holds the compiled module


def plain_name(name: str) -> str:
    """``name`` without the segments torch.compile's wrappers add (``layers.3._orig_mod.attn`` ->
    ``layers.3.attn``): the name of the same module or tensor in the uncompiled model."""
    if COMPILED not in name:
        return name
    return ".".join(s for s in name.split(".") if s != COMPILED)


def matches(pattern: str, name: str) -> bool:
    """Whether the qualified module ``name`` matches ``pattern`` (see the module docstring)."""
    if name == COMPILED or name.endswith("." + COMPILED):  # its wrapper matches in its place
        return False
    p, n = pattern.split("."), plain_name(name).split(".")
    return len(p) == len(n) and all(fnmatch.fnmatchcase(b, a) for a, b in zip(p, n, strict=True))
