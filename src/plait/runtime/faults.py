"""Test-only fault switches: known layout bugs, injected on purpose, to prove `plait check` and its
fuzzer find them (tests/test_check.py).

    with faults.inject("ddp-divisor"):          # from plait.runtime import faults
        report = plait.check(build, mesh={"dp": 2})   # inside a job: these ranks carry the bug

Every switch is off unless a ``with inject(...)`` block in this process turns it on; the
one-process reference of a check runs in a process of its own and never has one. Library code asks
`active(name)` at the one place each bug would live: a lookup in a small set, negligible beside the
collective next to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

FAULTS = {
    "ddp-divisor": "DDP divides the summed gradients by world size + 1 (an off-by-one divisor)",
    "tp-backward-all-reduce": "a column-parallel input's backward skips its all-reduce over the tp ranks",
    "tp-vocab-padding": "the vocabulary-parallel loss counts the last shard's padding columns",
    "pp-recv-order": "a pipeline stage receives microbatch pairs swapped (0 gets 1's activations)",
    "fsdp-reduce-scatter-shard": "FSDP reduces gradients into the wrong shard (rank r keeps r-1's rows)",
    "pp-tied-grad": "a weight tied across pipeline stages keeps only its own stage's gradient",
    "ep-expert-divisor": "expert gradients are summed over their replicas but not divided",
    "cp-ring-grad": "ring attention returns another rank's key/value block gradient",
}
_on: set[str] = set()


def active(name: str) -> bool:
    return name in _on


def injected() -> frozenset[str]:
    """The switches on now (a result that depends on them must not outlive them)."""
    return frozenset(_on)


@contextlib.contextmanager
def inject(*names: str) -> Iterator[None]:
    unknown = sorted(set(names) - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown faults {unknown}; the faults are {sorted(FAULTS)}")
    before = set(_on)
    _on.update(names)
    try:
        yield
    finally:
        _on.clear()
        _on.update(before)
