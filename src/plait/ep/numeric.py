"""Verify an expert-parallel dispatch by its numbers, on its first call: the check that shapes
cannot do.

A dispatch that sends a row to the wrong expert, or returns the outputs in another order than
the rows came, keeps every shape and trains wrong. So each `ExpertDispatch` (each MoE layer,
each stacked expert module), once its first forward has computed the real result, checks a few
of its rows: every ep rank picks up to ``max(1, ROWS // n_experts)`` rows of each expert's block
(evenly spaced, its first and last among them), and the ranks gather the picked rows with the
outputs the dispatch returned for them. Each rank then runs its own experts on the rows routed
to them from every rank, independently of the dispatch's `_compute` (plait's MoE: the expert
module itself; stacked experts: the module's own forward, one expert at a time), and compares
with what the dispatch returned to each source. The worst difference per expert is agreed over
the ep group, so every rank refuses the layout together, naming the layer and the expert.

Bound (`plait.runtime.tolerance`): both sides run the same expert on the same rows, so only the kernels'
order of sums over a different number of rows can differ (a few ulps): a difference passes at
1e-8 of the expert output's largest entry in float64, and at ``256 * eps`` of the lowest floating
dtype the rows, the outputs or the expert's recomputation use otherwise (float32: 3e-5; capped
at 5%). A wrong expert or order moves rows by O(1) of their size.

Cost, per dispatch and once: one all-gather over ep of at most ``max(n_experts, ROWS)`` rows per
rank (inputs and outputs), each local expert run once on what every rank picked for it, one
all-reduce of one float64 per expert and one read from the device (logged at INFO). It runs under
``torch.no_grad()`` on detached tensors and draws no random numbers: gradients, the random state
and the balancing statistics are untouched. It does not verify where the weights came from
(experts are placed by their global names, `plait.expert_parallel`), only that each row meets
the expert it was routed to and comes back to its place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from plait.runtime import comm
from plait.runtime.tolerance import rtol_for

ROWS = 256  # rows a rank picks per dispatch, at most (at least one per expert)
_log = logging.getLogger("plait.ep.numeric")


class Dispatch(Protocol):
    """What the check reads of an `ExpertDispatch` (which imports this module)."""

    name: str
    n_experts: int
    first: int
    per_rank: int
    size: int
    group: dist.ProcessGroup | None

    def reference(self, rows: torch.Tensor, e: int) -> torch.Tensor:
        """Local expert ``e``'s output on ``rows``, computed without the dispatch."""
        ...


def sample(counts: Sequence[int], per: int) -> tuple[list[int], list[int]]:
    """Which rows of consecutive blocks of ``counts`` rows to check (up to ``per`` of each, evenly
    spaced from its first row to its last), and the slot each takes: block e's from ``e * per``.
    Fixed slots let every rank find another's rows for an expert without reading its counts."""
    rows: list[int] = []
    slots: list[int] = []
    start = 0
    for e, c in enumerate(counts):
        k = min(c, per)
        rows += [start + i * (c - 1) // max(1, k - 1) for i in range(k)]
        slots += range(e * per, e * per + k)
        start += c
    return rows, slots


def verify(dispatch: Dispatch, tokens: torch.Tensor, outputs: torch.Tensor,
           counts: Sequence[int]) -> float:
    """Check ``outputs``, what ``dispatch`` returned for ``tokens`` (``counts[e]`` rows for global
    expert e, in expert order), on every ep rank at once; return the largest relative difference,
    or raise naming the layer and the experts that exceed the bound."""
    start = time.perf_counter()
    with torch.no_grad():
        worst, dtypes = _differences(dispatch, tokens.detach(), outputs.detach(), counts)
        with comm.operation("MoE dispatch check verdict"):
            comm.all_reduce(worst, dispatch.group, op=comm.ReduceOp.MAX)
        errors = worst.tolist()  # the check's one read from the device
    limit = rtol_for(dtypes)
    bad = sorted(((err, e) for e, err in enumerate(errors) if not err <= limit), reverse=True)
    if bad:
        raise RuntimeError(_refusal(dispatch.name, bad, limit))
    _log.info("expert parallelism's numeric check: %s: %d experts over ep=%d agree within %.2g of their "
              "largest entries (bound %.0e) in %.1f ms", dispatch.name or "experts", dispatch.n_experts,
              dispatch.size, max(errors, default=0.0), limit, 1e3 * (time.perf_counter() - start))
    return max(errors, default=0.0)


def _differences(dispatch: Dispatch, tokens: torch.Tensor, outputs: torch.Tensor,
                 counts: Sequence[int]) -> tuple[torch.Tensor, list[torch.dtype]]:
    """Per global expert, the largest difference between what the dispatch returned and the
    expert's own output on the rows every rank picked, relative to the latter's largest entry
    (this rank's experts only; zeros elsewhere); and the dtypes the comparison involved."""
    d = dispatch
    dev = comm.device_of(d.group)
    per = max(1, ROWS // d.n_experts)
    rows, slots = sample(counts, per)
    w_in, w_out = tokens.shape[-1], outputs.shape[-1]
    common = torch.promote_types(tokens.dtype, outputs.dtype)
    at = torch.tensor(rows, dtype=torch.int64, device=tokens.device)
    valid = torch.ones(len(rows), 1, dtype=common, device=tokens.device)
    picked = torch.cat([tokens[at].to(common), outputs[at].to(common), valid], dim=1).to(dev)
    # Slots left empty stay zeros: their flag (the last column) marks them as no row.
    mine = torch.zeros(d.n_experts * per, w_in + w_out + 1, dtype=common, device=dev)
    mine.index_copy_(0, torch.tensor(slots, dtype=torch.int64, device=dev), picked)
    every = torch.empty(d.size * mine.shape[0], mine.shape[1], dtype=common, device=dev)
    with comm.operation("MoE dispatch check rows"):
        comm.all_gather_into(every, mine, d.group)
    blocks = every.view(d.size, d.n_experts, per, -1)
    worst = torch.zeros(d.n_experts, dtype=torch.float64, device=dev)
    dtypes = [tokens.dtype, outputs.dtype]
    for e in range(d.per_rank):
        # Every source's picked rows for this expert, empty slots included: each rank makes the
        # same calls whatever the routing (tensor-parallel experts run collectives inside).
        got = blocks[:, d.first + e].reshape(d.size * per, -1)
        want = d.reference(got[:, :w_in].to(tokens.dtype).to(tokens.device), e).to(dev)
        dtypes.append(want.dtype)
        worst[d.first + e] = _relative(got[:, w_in:w_in + w_out], want, got[:, -1:] > 0)
    return worst, dtypes


def _relative(got: torch.Tensor, want: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The largest difference of the ``real`` rows, relative to ``want``'s largest finite entry
    there; infinite where a value is not finite on one side only (NaN would not compare)."""
    got, want = got.to(torch.float64), want.to(torch.float64)
    same = (got == want) | (got.isnan() & want.isnan())
    diff = torch.where(same | ~real, 0.0, (got - want).abs()).nan_to_num(nan=torch.inf)
    scale = torch.where(real & want.isfinite(), want.abs(), 0.0).max()
    top = diff.max()
    return torch.where(top > 0, top / scale.clamp_min(torch.finfo(torch.float64).tiny), 0.0)


def _refusal(name: str, bad: list[tuple[float, int]], limit: float) -> str:
    err, e = bad[0]
    others = "" if len(bad) == 1 else f" (also experts {', '.join(str(x) for _, x in bad[1:])})"
    return (f"expert parallelism's numeric check: {name or 'experts'} expert {e}{others}: the dispatch "
            f"returned rows that differ from the expert's own output by {err:.2g} of its largest entry "
            f"(bound {limit:.0e}). Its rows went to another expert or came back out of order, and the "
            "layout would train wrong (plait.ep.dispatch)")
