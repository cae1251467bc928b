"""DDP's optimizer_in_backward against one process, its refusals, and the buffer broadcast's check."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from oracle import assert_params_close, global_batches, tiny_gpt
from torch import nn

from plait import comm
from plait.ddp.wrapper import DDP
from plait.models.gpt import lm_loss
from plait.testing import cached_mesh

STEPS, BATCH = 4, 8
# float64 and torch's AdamW with its default settings on both sides: what differs is the order
# of the sums (the mean of two ranks' means against one mean over the batch), so 1e-9.
TOL = dict(rtol=1e-9, atol=1e-12)


def _model() -> nn.Module:
    return tiny_gpt(seed=0).double()


def _single() -> dict[str, torch.Tensor]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    for b in global_batches(STEPS, BATCH):
        opt.zero_grad()
        lm_loss(model(b[:, :-1]), b[:, 1:]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _in_backward(micro: int) -> dict:
    """STEPS steps of DDP(optimizer_in_backward=AdamW) on this rank's share, in ``micro``
    microbatches (all but the last under no_sync); no optimizer step is called."""
    world = dist.get_world_size()
    model = DDP(_model(), cached_mesh(dp=world), bucket_cap_mb=0.01,
                optimizer_in_backward=(torch.optim.AdamW, {}))
    grads_after = []
    for b in global_batches(STEPS, BATCH):
        chunks = b.chunk(world)[dist.get_rank()].chunk(micro)
        for k, x in enumerate(chunks):
            if k < micro - 1:
                with model.no_sync():
                    lm_loss(model(x[:, :-1]), x[:, 1:]).div(micro).backward()
            else:
                lm_loss(model(x[:, :-1]), x[:, 1:]).div(micro).backward()
        grads_after.append(sum(p.grad is not None for p in model.parameters()))
    return {"params": {k.removeprefix("module."): v for k, v in model.state_dict().items()},
            "buckets": len(model._buckets), "optimizers": len(model.in_backward_optimizers),
            "grads_after": grads_after}


@pytest.mark.parametrize("micro", [1, 2])
def test_optimizer_in_backward_matches_one_process(pools, micro):
    want = _single()
    out = pools[2].run(_in_backward, micro)
    assert out[0]["buckets"] > 2 and out[0]["optimizers"] == out[0]["buckets"]
    assert out[0]["grads_after"] == [0] * STEPS  # stepped and dropped in backward, as torch's
    for r in range(2):
        assert_params_close(out[r]["params"], want, **TOL)


def _torch_marked() -> dict:
    """torch's own way: ``_apply_optimizer_in_backward`` marks the parameters before DDP wraps them
    (AdamW on all but the embedding, which an AdamW after backward steps): DDP steps each marked
    parameter's optimizer after its bucket's all-reduce."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    world = dist.get_world_size()
    model = _model()
    marked = [p for n, p in model.named_parameters() if n != "tok_emb.weight"]
    _apply_optimizer_in_backward(torch.optim.AdamW, marked, {})
    ddp = DDP(model, cached_mesh(dp=world), bucket_cap_mb=0.01)
    after = torch.optim.AdamW([model.tok_emb.weight])
    for b in global_batches(STEPS, BATCH):
        x = b.chunk(world)[dist.get_rank()]
        lm_loss(ddp(x[:, :-1]), x[:, 1:]).backward()
        assert all(p.grad is None for p in marked) and model.tok_emb.weight.grad is not None
        after.step()
        after.zero_grad()
    return {"params": {k.removeprefix("module."): v for k, v in ddp.state_dict().items()},
            "optimizers": len(ddp.in_backward_optimizers)}


def test_torch_apply_optimizer_in_backward_is_stepped_after_the_all_reduce(pools):
    want = _single()
    out = pools[2].run(_torch_marked)
    assert out[0]["optimizers"] == sum(1 for n, _ in _model().named_parameters() if n != "tok_emb.weight")
    for r in range(2):
        assert_params_close(out[r]["params"], want, **TOL)


def test_optimizer_in_backward_refusals_before_communication():
    import plait

    plait.init()
    with pytest.raises(TypeError, match="optimizer class, keyword"):
        DDP(nn.Linear(2, 2), None, optimizer_in_backward=torch.optim.AdamW)
    with pytest.raises(ValueError, match="must not name params"):
        DDP(nn.Linear(2, 2), None, optimizer_in_backward=(torch.optim.SGD, {"params": [], "lr": 1.0}))
    with pytest.raises(ValueError, match="sparse gradients"):
        DDP(nn.Embedding(4, 2, sparse=True), None, optimizer_in_backward=(torch.optim.SGD, {"lr": 1.0}))
    model = DDP(nn.Linear(2, 2), None, optimizer_in_backward=(torch.optim.SGD, {"lr": 1.0}))
    with pytest.raises(ValueError, match="cannot be clipped"):
        model.grad_norm_parts()
    marked = nn.Linear(2, 2)
    from torch.distributed.optim import _apply_optimizer_in_backward

    _apply_optimizer_in_backward(torch.optim.SGD, marked.parameters(), {"lr": 1.0})
    with pytest.raises(ValueError, match="one or the other"):
        DDP(marked, None, optimizer_in_backward=(torch.optim.SGD, {"lr": 1.0}))
    with pytest.raises(RuntimeError, match="without optimizer_in_backward"):
        DDP(nn.Linear(2, 2), None).in_backward_optimizers  # noqa: B018


def _buffer_broadcast_meets_another_collective() -> tuple[str, list[float]]:
    """Rank 0 runs a DDP forward (its buffers broadcast first) while rank 1 all-reduces, with the
    per-call check on (the suite's pools run with it off)."""
    model = DDP(nn.BatchNorm1d(3), cached_mesh(dp=2))
    model.module.running_mean.fill_(float(dist.get_rank() + 1))
    with comm.desync_check("fast"):
        try:
            if dist.get_rank() == 0:
                model(torch.randn(4, 3))
            else:
                comm.all_reduce(torch.zeros(5), model.group)
        except comm.CollectiveError as e:
            return str(e), model.module.running_mean.tolist()
    return "no error", []


def test_a_desync_at_the_buffer_broadcast_names_it_before_any_buffer_moves(pools):
    out = pools[2].run(_buffer_broadcast_meets_another_collective)
    for message, _ in out:
        assert "collective desync on axis 'dp'" in message, message
        assert "DDP buffer broadcast" in message and "all_reduce of a (5,)" in message, message
    assert out[1][1] == [2.0] * 3  # rank 1 kept its own buffers: nothing was exchanged
