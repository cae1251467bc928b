"""How `plait train` words a refusal: a value and the flag that set it, and the field names of
`plait.compose.rules` and `ParallelPlan` as the flags that set them."""

from __future__ import annotations

import os
import re
from pathlib import Path

from plait.compose.rules import LayoutError

_RULE_FLAGS: dict[str, str] = {"pp": "--pp", "dp": "--dp", "cp": "--cp", "tp": "--tp", "ep": "--ep",
                               "pp_schedule": "--schedule", "pp_microbatches": "--microbatches",
                               "pp_chunks": "--chunks", "zero_stage": "--zero-stage", "data": "--strategy",
                               "sequence_parallel": "--sequence-parallel", "offload": "--offload",
                               "reshard_after_forward": "--reshard-after-forward",
                               "backward_prefetch": "--backward-prefetch",
                               "mixed_precision": "--mixed-precision", "ac": "--ac", "ac_every": "--ac-every",
                               "cp_algorithm": "--cp-algorithm",
                               "balance_statistic": "--balance-statistic",
                               "aux_loss_coef": "--aux-loss-coef",
                               # the schedule generators' own words
                               "schedule": "--schedule", "microbatches": "--microbatches",
                               "chunks": "--chunks"}
# Fields set by an on/off flag: True reads --offload, False --no-offload.
_SWITCHES = {"sequence_parallel", "offload", "reshard_after_forward", "backward_prefetch"}
_FIELD = re.compile(r"\b([a-z_]+)=('[^']*'|[\w.]+)")
_PLAN = re.compile(r"ParallelPlan\(([^()]*)\)")


def in_flags(error: LayoutError, microbatches: int | None = None, grad_accum: int = 1,
             strategy: str | None = None, data: str | None = None) -> str:
    """A `plait.compose.rules` or `ParallelPlan` refusal as `plait train` says it: ``tp=3`` reads ``--tp 3``,
    and so on for every field with a flag (``pp_schedule='zbv'``: ``--schedule zbv``;
    ``offload=True``: ``--offload``; ``fsdp=4``, which no flag sets directly, stays); a plan's fields
    (``ParallelPlan(zero_stage=2)``) read as the flags alone when each has one; the nearest valid
    layouts likewise. ``microbatches`` and ``grad_accum``: a pipeline step runs their product, which
    the rules see as one number. ``strategy`` and ``data``: the --strategy given and the plan's
    ``data`` it made; where a refusal names that value it reads as the strategy typed (--strategy
    none makes data='ddp' as ddp does), any other value (advice: ``use data='fsdp'``) as itself."""
    def flag(m: re.Match[str]) -> str:
        name, value = m[1], m[2].strip("'")
        if name == "cp" and m[2].startswith("'"):  # the plan's algorithm, not the mesh's degree
            name = "cp_algorithm"
        if name not in _RULE_FLAGS or value == "...":
            return m[0]
        if name in ("pp_microbatches", "microbatches") and grad_accum > 1:  # a step runs mb x accum
            return f"--microbatches {microbatches} x --grad-accum {grad_accum}"
        if name in _SWITCHES:
            return _RULE_FLAGS[name] if value != "False" else f"--no-{_RULE_FLAGS[name][2:]}"
        if name == "data" and strategy is not None and value == data:
            value = strategy
        return f"{_RULE_FLAGS[name]} {'none' if value == 'None' else value}"

    def plan(m: re.Match[str]) -> str:
        said = [_FIELD.sub(flag, item) for item in m[1].split(", ")]
        return " ".join(said) if all(s.startswith("--") and "=" not in s for s in said) else m[0]

    return _FIELD.sub(flag, _PLAN.sub(plan, str(error)))


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
