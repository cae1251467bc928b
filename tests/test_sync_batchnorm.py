"""plait.SyncBatchNorm on Gloo against one process on the global batch (float64), under DDP,
FSDP (ZeRO-3) and HSDP, with uneven batches per rank (a rank with none included), and under
`DDP.join`; plus `plait check`'s explanation of BatchNorm divergence."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from plait.sync_batchnorm import SyncBatchNorm

STEPS = 3
TOL = dict(rtol=1e-10, atol=1e-12)


def _model() -> nn.Module:
    # No bias before a BatchNorm: its gradient is zero up to rounding, which AdamW would amplify.
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
        nn.Linear(3 * 3 * 3, 4, bias=False), nn.BatchNorm1d(4, momentum=None), nn.Tanh(), nn.Linear(4, 2),
    ).double()


def _batches(sizes: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(sum(sizes), 2, 3, 3, generator=g, dtype=torch.float64) * 2 + 1 for _ in range(STEPS)]


def _loss(out: torch.Tensor, world: int, total: int) -> torch.Tensor:
    # DDP and FSDP average the ranks' gradients: scaled so that the average is the gradient of
    # the mean over the global batch, whatever each rank's share.
    return (out ** 2).sum() * world / total


def _oracle(sizes: list[int]) -> dict:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = {}
    for i, b in enumerate(_batches(sizes)):
        x = b.clone().requires_grad_()
        out = model(x)
        _loss(out, 1, len(b)).backward()
        if i == 0:
            first = {"out": out.detach(), "xgrad": x.grad,
                     "grads": {k: p.grad.clone() for k, p in model.named_parameters()}}
        opt.step()
        opt.zero_grad()
    return {**first, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def _train(layout: str, sizes: list[int]) -> dict:
    from plait.ddp import DDP
    from plait.fsdp import FSDP
    from plait.state_dict import full_state_dict
    from plait.testing import cached_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = cached_mesh(dp=2) if layout == "ddp" else cached_mesh(fsdp=2) if layout == "fsdp" \
        else cached_mesh(dp=2, fsdp=2)
    model = SyncBatchNorm.convert_sync_batchnorm(_model(), mesh)
    net = DDP(model, mesh) if layout == "ddp" else FSDP(model, mesh, zero_stage=3)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    start = sum(sizes[:rank])
    first = {}
    for i, b in enumerate(_batches(sizes)):
        x = b[start:start + sizes[rank]].clone().requires_grad_()
        out = net(x)
        _loss(out, world, len(b)).backward()
        if i == 0:
            first = {"out": out.detach(), "xgrad": x.grad}
            if layout == "ddp":
                first["grads"] = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {**first, "state": full_state_dict(net), "start": start}


def _compare(got: dict, want: dict, sizes: list[int], rank: int) -> None:
    rows = slice(got["start"], got["start"] + sizes[rank])
    torch.testing.assert_close(got["out"], want["out"][rows], **TOL)
    # the input's gradient is the rank's own: its loss was scaled by the world size (see _loss)
    torch.testing.assert_close(got["xgrad"] / len(sizes), want["xgrad"][rows], **TOL)
    for k, g in got.get("grads", {}).items():
        torch.testing.assert_close(g, want["grads"][k], **TOL, msg=k)
    assert set(got["state"]) == set(want["state"])
    for k, v in want["state"].items():  # parameters after AdamW steps, running statistics
        torch.testing.assert_close(got["state"][k], v, **TOL, msg=k)


def test_ddp_and_fsdp_match_one_process_on_the_global_batch(pools):
    """DDP and FSDP (ZeRO-3) on 2 ranks with uneven batches (3 and 5 rows): outputs, input and
    parameter gradients, and parameters and running statistics after AdamW steps, equal one
    process on the 8 rows (with per-rank BatchNorm they differ: a rank normalizes its rows alone)."""
    sizes = [3, 5]
    want = _oracle(sizes)
    for layout in ("ddp", "fsdp"):
        got = pools[2].run(_train, layout, sizes)
        for rank in range(2):
            _compare(got[rank], want, sizes, rank)


def test_hsdp_with_an_empty_rank(pools):
    """HSDP (dp 2 x fsdp 2): statistics over all four ranks (both axes); a rank with no rows adds
    count 0."""
    sizes = [2, 0, 3, 3]
    want = _oracle(sizes)
    got = pools[4].run(_train, "hsdp", sizes)
    for rank in range(4):
        _compare(got[rank], want, sizes, rank)
