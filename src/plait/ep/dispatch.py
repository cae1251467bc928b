"""Expert-parallel token dispatch: an MoE layer's routed tokens to the ranks holding their
experts and the outputs back, with all-to-alls of variable sizes.

The rank of ``ep`` index j holds experts ``j * E/ep .. (j+1) * E/ep - 1``. The layer hands over its
routed tokens sorted by expert with each expert's count. Per layer and direction:

1. the counts go first (an all-to-all of ``E`` integers per rank), so every rank knows how
   many rows it receives from each rank for each of its experts;
2. the tokens go to their experts' ranks (all-to-all, ``in_splits[j]`` rows to rank j);
3. the rank regroups what it received (by source, then expert) by expert, runs each local
   expert once on all its rows, and restores the order;
4. the outputs go back the way they came.

Backward runs the two all-to-alls in reverse (`_AllToAll`), so an expert's gradient gathers
every token of the ep group that was routed to it.

The first call also verifies the result by its numbers (`plait.ep.numeric`): a dispatch that
sent rows to the wrong expert or returned them out of order refuses to train.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait._torch_compat import eager
from plait.ep import numeric
from plait.runtime import comm


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, in_splits: list[int], out_splits: list[int],
                group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all_v(out, x.contiguous(), out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        in_splits, out_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        comm.all_to_all_v(back, grad.contiguous(), in_splits, out_splits, ctx.group)
        return back, None, None, None


class ExpertDispatch:
    """`MoE.experts_forward` over an ep group: ``local`` are this rank's experts (global indices
    ``first .. first + len(local) - 1``) of ``n_experts``. ``name`` (the layer's, in errors and
    logs) and ``check``: verify the first call by its numbers (`plait.ep.numeric`)."""

    def __init__(self, experts: nn.ModuleList, n_experts: int, first: int, group: dist.ProcessGroup | None,
                 size: int, name: str = "", check: bool = True) -> None:
        self.experts, self.n_experts, self.first = experts, n_experts, first
        self.group, self.size, self.name = group, size, name
        self.per_rank = n_experts // size
        self.last_counts: torch.Tensor | None = None  # (ep, local experts) rows received, last forward
        self.to_check = check
        # The largest relative difference the numeric check measured (None: not checked).
        self.check_error: float | None = None

    # Under torch.compile the dispatch runs eagerly between graphs, one clean break per MoE layer:
    # its split sizes are read on the host from the counts (data-dependent shapes), and its
    # exchanges and first-call check are plait.comm's.
    @eager
    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor,
                 run: torch.Tensor | None = None) -> torch.Tensor:
        n, per = self.size, self.per_rank
        send_counts = counts.reshape(n, per).to(torch.int64)
        dev = comm.device_of(self.group)
        recv_counts = torch.empty_like(send_counts, device=dev)
        sent = send_counts.to(dev)
        with comm.operation("MoE token counts"):
            comm.all_to_all_into(recv_counts, sent, self.group)
        # The all-to-alls need their split sizes on the host: one device-to-host read per layer,
        # the sent and received counts together, with the flags of this rank's experts that run
        # on no tokens too (`MoE.experts_in_use`: every expert's, alike on the ep ranks).
        mine = run[self.first:self.first + per] if run is not None else torch.zeros(per, dtype=torch.bool)
        host = torch.cat([sent.view(-1), recv_counts.view(-1), mine.to(dev, torch.int64)]).tolist()
        sent_rows, recv_rows = (host[i * n * per:(i + 1) * n * per] for i in (0, 1))
        runs = [bool(f) for f in host[2 * n * per:]]
        self.last_counts = torch.tensor(recv_rows, device="cpu").reshape(n, per)
        in_splits = [sum(sent_rows[j * per:(j + 1) * per]) for j in range(n)]
        out_splits = [sum(recv_rows[j * per:(j + 1) * per]) for j in range(n)]
        with comm.operation("MoE dispatch"):
            received = _AllToAll.apply(tokens, in_splits, out_splits, self.group)
        assert isinstance(received, torch.Tensor)
        outputs = self._compute(received, recv_rows, runs)
        with comm.operation("MoE combine"):
            back = _AllToAll.apply(outputs, out_splits, in_splits, self.group)
        assert isinstance(back, torch.Tensor)
        if self.to_check:  # every ep rank calls its dispatch alike: they check the same call
            self.to_check = False
            self.check_error = numeric.verify(self, tokens, back, sent_rows)
        return back

    def reference(self, rows: torch.Tensor, e: int) -> torch.Tensor:
        """Local expert ``e``'s output on ``rows``, computed without `_compute`: the numeric
        check's reference."""
        out = self.experts[self.first + e](rows)
        assert isinstance(out, torch.Tensor)
        return out

    def _compute(self, received: torch.Tensor, sizes: list[int],
                 runs: list[bool] | None = None) -> torch.Tensor:
        """Run each local expert on its rows (received by source, then expert) in one call, and
        on none where ``runs`` says so; ``sizes`` are the (source, expert) blocks' rows in arrival
        order."""
        blocks = list(received.split(sizes))
        per = self.per_rank
        outs: list[torch.Tensor | None] = [None] * len(blocks)
        for e in range(per):
            mine = [s * per + e for s in range(self.size)]
            rows = torch.cat([blocks[i] for i in mine])
            if not rows.shape[0] and not (runs and runs[e]):
                for i in mine:
                    outs[i] = blocks[i]
                continue
            y = self.experts[self.first + e](rows)
            for i, part in zip(mine, y.split([sizes[i] for i in mine])):
                outs[i] = part
        return torch.cat([o for o in outs if o is not None]) if blocks else received


def expert_ranges(n_experts: int, size: int) -> Sequence[range]:
    """The global expert indices each ep rank holds."""
    per = n_experts // size
    return [range(j * per, (j + 1) * per) for j in range(size)]
