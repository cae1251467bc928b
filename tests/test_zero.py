"""ZeRO-1 optimizer wrapper: a single-process oracle on 2 and 4 Gloo ranks, under DDP and
across pipeline replicas (where FSDP's module hooks cannot serve)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from oracle import assert_params_close, global_batches, tiny_gpt, train_single

from plait.fsdp.zero1 import ZeroRedundancyOptimizer, partition
from plait.models.gpt import lm_loss
from plait.testing import cached_mesh


def test_partition_balances_sizes_the_same_way_everywhere():
    sizes = [100, 10, 10, 60, 40, 5, 5]
    owner = partition(sizes, 3)
    assert owner == partition(list(sizes), 3)
    loads = [sum(s for s, o in zip(sizes, owner) if o == r) for r in range(3)]
    assert loads == [100, 65, 65] and partition([1], 4) == [0]  # largest first, to the least loaded


def _ddp_zero(steps: int, batch: int) -> dict:
    from plait.ddp.wrapper import DDP

    world = dist.get_world_size()
    model = DDP(tiny_gpt(seed=0), cached_mesh(dp=world))
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, None, lr=1e-2, weight_decay=0.1)
    for b in global_batches(steps, batch):
        x = b.chunk(world)[dist.get_rank()]
        opt.zero_grad()
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
    names = {id(p): n for n, p in model.module.named_parameters()}
    return {"params": {k.removeprefix("module."): v for k, v in model.state_dict().items()},
            "owned": sorted(names[id(p)] for p in opt.owned),
            "state": sum(t.numel() for s in opt.state.values() for t in s.values() if t.dim())}


@pytest.mark.parametrize("world", [2, 4])
def test_zero1_under_ddp_matches_single_process(pools, world):
    want = train_single(tiny_gpt(seed=0), global_batches(5, 8))
    out = pools[world].run(_ddp_zero, 5, 8)
    for o in out:
        assert_params_close(o["params"], want)  # every rank holds every updated parameter
    owned = [n for o in out for n in o["owned"]]
    assert sorted(owned) == sorted(n for n, _ in tiny_gpt().named_parameters())  # each once
    # Adam's two moments for this rank's share only: about 1/world of 2 x the parameters.
    total = 2 * sum(p.numel() for p in tiny_gpt().parameters())
    assert all(o["state"] < total / world * 1.3 for o in out) and sum(o["state"] for o in out) == total


def _ddp_tp_zero(steps: int, batch: int) -> dict:
    """ZeRO-1 over the dp ranks of DDP over tensor parallelism, whose parameters are DTensors over tp."""
    import plait
    from plait.ddp.wrapper import DDP

    mesh = cached_mesh(dp=2, tp=2)
    model = tiny_gpt(seed=0)
    plait.tensor_parallel(model, mesh, plait.gpt_plan(model.cfg, loss_parallel=False))
    net = DDP(model, mesh)
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, mesh.group("dp"), lr=1e-2,
                                  weight_decay=0.1)
    for b in global_batches(steps, batch):
        x = b.chunk(2)[mesh.rank("dp")]
        opt.zero_grad()
        lm_loss(net(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
    return plait.full_state_dict(net)


def test_zero1_under_ddp_over_tensor_parallel_matches_single_process(pools):
    want = train_single(tiny_gpt(seed=0), global_batches(5, 8))
    for got in pools[4].run(_ddp_tp_zero, 5, 8):
        assert_params_close(got, want, rtol=1e-4, atol=1e-5)  # fp32: tp sums in another order


def test_wrong_optimizer_class_is_rejected():
    with pytest.raises(TypeError, match="optimizer_class must be a torch.optim.Optimizer subclass"):
        ZeroRedundancyOptimizer([torch.nn.Parameter(torch.zeros(2))], lm_loss)
