"""plait.SyncBatchNorm on Gloo against one process on the global batch (float64), under DDP,
FSDP (ZeRO-3) and HSDP, with uneven batches per rank (a rank with none included), and under
`DDP.join`; plus `plait check`'s explanation of BatchNorm divergence."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from oracle import assert_params_close
from torch import nn

from plait.compose.sync_batchnorm import SyncBatchNorm
from plait.data_parallel import DataParallel

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
    from plait.state.state_dict import full_state_dict
    from plait.testing import cached_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = cached_mesh(dp=2) if layout == "ddp" else cached_mesh(fsdp=2) if layout == "fsdp" \
        else cached_mesh(dp=2, fsdp=2)
    model = SyncBatchNorm.convert_sync_batchnorm(_model(), mesh)
    assert copy.deepcopy(model)[1].join_mirror is model[1].join_mirror  # a copy shares the group
    with pytest.raises(ValueError, match="1, 5 synchronize batch statistics across ranks"):
        DataParallel(model, ["cpu", "cpu"])(torch.zeros(4, 2, 3, 3, dtype=torch.float64))
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
    if "grads" in got:
        assert_params_close(got["grads"], want["grads"], **TOL, what="gradient of")
    # parameters after AdamW steps, running statistics
    assert_params_close(got["state"], want["state"], **TOL, what="after AdamW steps,")


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


JOIN_SIZES = [[3, 5], [3, 5], [0, 4]]  # per step, per rank; rank 0 has run out of batches at the last


def _join_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randn(sum(s), 2, 3, 3, generator=g, dtype=torch.float64) for s in JOIN_SIZES]


def _join_oracle() -> dict:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outs = []
    for b in _join_batches():
        out = model(b)
        _loss(out, 1, len(b)).backward()
        outs.append(out.detach())
        opt.step()
        opt.zero_grad()
    return {"outs": outs, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def _train_join() -> dict:
    from plait.ddp import DDP
    from plait.state.state_dict import full_state_dict
    from plait.testing import cached_mesh

    rank = dist.get_rank()
    mesh = cached_mesh(dp=2)
    net = DDP(SyncBatchNorm.convert_sync_batchnorm(_model(), mesh), mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    outs = []
    with net.join():
        for sizes, b in zip(JOIN_SIZES, _join_batches()):
            if sizes[rank] == 0:
                break  # this rank has no more batches: it joins, and mirrors the other's steps
            start = sum(sizes[:rank])
            out = net(b[start:start + sizes[rank]])
            _loss(out, 2, len(b)).backward()
            outs.append(out.detach())
            opt.step()
            opt.zero_grad()
    return {"outs": outs, "state": full_state_dict(net)}


def test_join_a_rank_without_batches_adds_count_zero(pools):
    """Under `DDP.join`, a rank that ran out of batches mirrors the other's SyncBatchNorm
    collectives with count 0 and zero gradient sums: the last step normalizes the other rank's 4
    rows by their own statistics, and the gradients (divided by the initial world size, DDP's
    default) are those of the mean over those rows; both ranks end with one process's model and
    running statistics. Without the mirror the other rank would wait for ever."""
    want = _join_oracle()
    got = pools[2].run(_train_join)
    starts = [0, 3]
    for rank in range(2):
        for step, out in enumerate(got[rank]["outs"]):
            rows = slice(starts[rank] if step < 2 else 0, None)
            torch.testing.assert_close(out, want["outs"][step][rows][:len(out)], **TOL)
        assert_params_close(got[rank]["state"], want["state"], **TOL, what=f"rank {rank} after AdamW steps,")
    assert len(got[0]["outs"]) == 2 and len(got[1]["outs"]) == 3


def _per_rank_batchnorm(folder: str) -> dict:
    from plait import checkpoint
    from plait.ddp import DDP
    from plait.state.state_dict import full_state_dict
    from plait.testing import cached_mesh

    rank = dist.get_rank()
    model = _model()
    net = DDP(model, cached_mesh(dp=2))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for b in _batches([4, 4]):
        _loss(net(b[4 * rank:4 * rank + 4]), 2, 8).backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(folder, net, opt, {"step": STEPS})
    return {"own": {k: b.clone() for k, b in model.named_buffers()}, "full": full_state_dict(net)}


def test_buffers_of_a_full_state_dict_and_a_checkpoint_are_rank_0s(pools, tmp_path):
    """Under DDP with per-rank BatchNorm the ranks' running statistics differ after a step (each
    updates them from its own rows after the broadcast); `plait.full_state_dict` gives rank 0's
    on every rank, and a checkpoint holds rank 0's (it held whichever rank DCP picked: rank 1's)."""
    from plait import checkpoint

    got = pools[2].run(_per_rank_batchnorm, str(tmp_path))
    own0, own1 = got[0]["own"], got[1]["own"]
    assert not torch.equal(own0["1.running_mean"], own1["1.running_mean"])
    one = _model()
    checkpoint.load(tmp_path, one, torch.optim.AdamW(one.parameters(), lr=1e-2))
    for rank in range(2):
        full = {name: got[rank]["full"][name] for name in own0}
        assert_params_close(full, own0, rtol=0, atol=0, what=f"rank {rank}'s full state dict:")
    loaded = dict(one.named_buffers())
    assert_params_close({name: loaded[name] for name in own0}, own0, rtol=0, atol=0, what="loaded:")


def _bn_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 2, 3, 3, generator=g, dtype=torch.float64), torch.randn(8, 2, generator=g,
                                                                                   dtype=torch.float64)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def bn_factory():
    """A `plait check` factory: the model with per-rank BatchNorm."""
    return _model(), _bn_batch, _mse


def sync_bn_factory():
    """The same model with its BatchNorm layers converted (over every rank; plain in one process)."""
    return SyncBatchNorm.convert_sync_batchnorm(_model()), _bn_batch, _mse


def _check_both() -> tuple:
    import plait
    from plait.testing import cached_mesh

    mesh = cached_mesh(dp=2)
    with plait.check.shared_reference():  # one reference process for both checks
        return (plait.check(bn_factory, mesh=mesh, steps=2, batch_size=8),
                plait.check(sync_bn_factory, mesh=mesh, steps=2, batch_size=8))


def test_check_explains_batchnorm_divergence(pools):
    """`plait check` of a BatchNorm model under DDP diverges (per-rank statistics) and says why:
    it names the BatchNorm layers and the two ways to compare alike; converted to SyncBatchNorm
    the same model passes."""
    per_rank, synced = pools[2].run(_check_both)[0]
    text = per_rank.format()
    assert not per_rank.ok and "FAILED" in text
    assert "note: the model has BatchNorm layers (1, 5)" in text, text
    assert "plait.SyncBatchNorm.convert_sync_batchnorm(model)" in text and "per-rank statistics" in text
    assert synced.ok, synced.format()
    assert "BatchNorm" not in synced.format()


def test_a_rank_that_joins_before_any_step_says_why():
    """A rank with no batch at all cannot know which collectives to mirror: it raises, naming the
    reason, rather than leaving the others waiting silently."""
    from plait.compose.sync_batchnorm import _Sync

    with pytest.raises(RuntimeError, match="joined before it trained a step"):
        _Sync(group=None, world=2).shadow_step()  # type: ignore[arg-type]
    sync = _Sync(group=None, world=2)  # type: ignore[arg-type]
    for _ in range(5000):  # train-mode forwards without backward: the log stays bounded
        sync.record("forward", 9, torch.float64)
    assert 0 < len(sync.last_step) <= 4096
