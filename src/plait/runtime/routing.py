"""The seams a layout fills on a mixture-of-experts layer (`plait.models.moe.MoE`) whose tokens
are split over ranks: its balancing counts summed over those ranks (``token_statistics``) and the
experts any of them routed a token to (``experts_in_use``, so that every rank that sums an
expert's gradient as it is made makes it).

Expert parallelism fills them over the data, ep and cp ranks (`plait.expert_parallel`); tensor
parallelism over its own group under sequence parallelism, where each tp rank routes its shard of
the sequence (`plait.tensor_parallel`, which runs before expert parallelism in `plait.parallelize`'s
order and so also serves a model made tensor-parallel alone)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from plait._torch_compat import eager
from plait.runtime import comm


def routing_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of ``model`` that offer the seams (plait's MoE), by what they offer."""
    seams = ("token_statistics", "experts_in_use", "token_shards", "restart_statistics")
    return [m for m in model.modules() if all(hasattr(m, s) for s in seams)]


def share_routing(layer: nn.Module, shards: int, counted_over: Sequence[dist.ProcessGroup | None],
                  used_by: Sequence[dist.ProcessGroup | None]) -> None:
    """``layer`` runs on one of ``shards`` parts of each forward's tokens; its balancing counts are
    summed over ``counted_over`` and the experts in use over ``used_by`` (a seam left as the
    layer has it where its groups are empty). Counting restarts: forwards before this one (a
    plan's check) are not the layout's."""
    layer.token_shards = shards  # type: ignore[assignment]
    layer.restart_statistics()  # type: ignore[operator]
    if counted_over:
        layer.token_statistics = summed_over(counted_over)  # type: ignore[assignment]
    if used_by:
        layer.experts_in_use = used_over(used_by)  # type: ignore[assignment]


def share_routing_over(model: nn.Module, group: dist.ProcessGroup | None, size: int) -> None:
    """Every routing layer of ``model`` runs on one of ``size`` shards of each batch's tokens, the
    shards held by ``group``'s ranks: its counts and the experts in use are summed over them."""
    for layer in routing_layers(model):
        share_routing(layer, size, [group], [group])


def summed_over(groups: Sequence[dist.ProcessGroup | None]) -> Callable[[torch.Tensor], torch.Tensor]:
    @eager  # under torch.compile: between graphs (plait.comm's bookkeeping)
    def token_statistics(counts: torch.Tensor) -> torch.Tensor:
        """One small all-reduce per group (orthogonal groups: their product's sum), in forward,
        where every rank of a group runs the layer at the same point; not differentiable."""
        total = counts.detach()
        for group in groups:
            total = total.to(comm.device_of(group), copy=True)
            with comm.operation("MoE balancing counts"):
                comm.all_reduce(total, group)
        return total.to(counts.device)

    return token_statistics


def used_over(groups: Sequence[dist.ProcessGroup | None]) -> Callable[[torch.Tensor], torch.Tensor]:
    @eager  # under torch.compile: between graphs (plait.comm's bookkeeping)
    def experts_in_use(counts: torch.Tensor) -> torch.Tensor:
        """The experts any rank of ``groups`` routed a token to (one small all-reduce per group)."""
        used = (counts > 0).to(torch.int32)
        for group in groups:
            used = used.to(comm.device_of(group))
            with comm.operation("MoE experts in use"):
                comm.all_reduce(used, group)
        return used.to(counts.device) > 0

    return experts_in_use
