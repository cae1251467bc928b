"""How `plait train` words a refusal: a value and the flag that set it, and `plait.rules`' field
names as the flags that set them."""

from __future__ import annotations

import os
import re
from pathlib import Path

from plait.rules import LayoutError

__all__ = ["in_flags", "require", "check_writable"]

_RULE_FLAGS: dict[str, str] = {"pp": "--pp", "dp": "--dp", "cp": "--cp", "tp": "--tp", "ep": "--ep",
                               "pp_schedule": "--schedule", "pp_microbatches": "--microbatches",
                               "pp_chunks": "--chunks", "zero_stage": "--zero-stage", "data": "--strategy",
                               "sequence_parallel": "--sequence-parallel",
                               "balance_statistic": "--balance-statistic", "ac_every": "--ac-every",
                               "aux_loss_coef": "--aux-loss-coef",
                               # the schedule generators' own words
                               "schedule": "--schedule", "microbatches": "--microbatches",
                               "chunks": "--chunks"}


def in_flags(error: LayoutError, microbatches: int | None = None, grad_accum: int = 1) -> str:
    """A `plait.rules` refusal as `plait train` says it: ``tp=3`` reads ``--tp 3``, and so on for
    every field with a flag (``pp_schedule='zbv'``: ``--schedule zbv``; ``fsdp=4``, which no flag
    sets directly, stays); the nearest valid layouts likewise. ``microbatches`` and ``grad_accum``:
    a pipeline step runs their product, which the rules see as one number."""
    def flag(m: re.Match[str]) -> str:
        name, value = m[1], m[2].strip("'")
        if name not in _RULE_FLAGS:
            return m[0]
        if name in ("pp_microbatches", "microbatches") and grad_accum > 1:  # a step runs mb x accum
            return f"--microbatches {microbatches} x --grad-accum {grad_accum}"
        if name == "sequence_parallel":
            return "--sequence-parallel"
        return f"{_RULE_FLAGS[name]} {value}"

    return re.sub(r"\b([a-z_]+)=('[^']*'|[\w.]+)", flag, str(error))


def require(section: object, name: str, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"--{name.replace('_', '-')} {getattr(section, name)}: must be {allowed}")


def check_writable(flag: str, path: Path, want_dir: bool) -> None:
    """A path the run will create or append to: the right kind, under a writable folder."""
    if path.exists():
        if want_dir and not path.is_dir():
            raise ValueError(f"{flag} {path}: is an existing file; the run writes into a folder there")
        if not want_dir and path.is_dir():
            raise ValueError(f"{flag} {path}: is a folder; it must name the file to append to")
        if not os.access(path, os.W_OK):
            raise ValueError(f"{flag} {path}: is not writable")
        return
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is a file, so the folders above {path.name} cannot be "
                         "created; choose a path under a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: the folder {parent} is not writable")
