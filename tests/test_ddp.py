"""DistributedDataParallel against a single-process oracle, on 2 and 4 Gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from oracle import assert_params_close, global_batches, make_opt, tiny_gpt, train_single
from torch import nn

from plait import comm
from plait.ddp.wrapper import DDP
from plait.models.gpt import lm_loss
from plait.testing import cached_mesh


def _local(batch: torch.Tensor, world: int) -> torch.Tensor:
    return batch.chunk(world)[dist.get_rank()]


def _ddp_train(steps: int, batch: int, **ddp_kw) -> dict:
    world = dist.get_world_size()
    model = DDP(tiny_gpt(seed=0), cached_mesh(dp=world), **ddp_kw)
    opt = make_opt(model.parameters())
    with comm.counting() as counts:
        for b in global_batches(steps, batch):
            x = _local(b, world)
            opt.zero_grad()
            lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
            opt.step()
    return {"params": {k.removeprefix("module."): v for k, v in model.state_dict().items()},
            "buckets": len(model._buckets), "stats": counts.total("all_reduce", "dp")}


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_matches_single_process(pools, world):
    want = train_single(tiny_gpt(seed=0), global_batches(5, 8))
    # A tiny bucket cap forces several buckets, so ordering and overlap are exercised.
    out = pools[world].run(_ddp_train, 5, 8, bucket_cap_mb=0.01)
    assert out[0]["buckets"] > 3
    for r in range(world):
        assert_params_close(out[r]["params"], want)


def _tied_and_frozen() -> nn.Module:
    # float64: after 5 AdamW steps float32 rounding alone moves single entries past 1e-5.
    m = tiny_gpt(seed=0, tie_embeddings=True).double()
    m.layers[0].mlp.up_proj.weight.requires_grad_(False)
    return m


def test_ddp_tied_weights_and_frozen(pools):
    want = train_single(_tied_and_frozen(), global_batches(5, 8))
    out = pools[2].run(_ddp_train_built, _tied_and_frozen, 5, 8)
    assert_params_close(out[1]["params"], want, rtol=1e-9, atol=1e-12)
    assert out[1]["params"]["lm_head.weight"].dtype == torch.float64


def _ddp_train_built(build, steps: int, batch: int) -> dict:
    world = dist.get_world_size()
    model = DDP(build(), cached_mesh(dp=world), bucket_cap_mb=0.02)
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    for b in global_batches(steps, batch):
        x = _local(b, world)
        opt.zero_grad()
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
    return {"params": {k.removeprefix("module."): v for k, v in model.state_dict().items()}}


def _no_sync_accumulation(micro: int) -> dict:
    world = dist.get_world_size()
    model = DDP(tiny_gpt(seed=0), cached_mesh(dp=world))
    (big,) = global_batches(1, 8 * micro)
    mine = _local(big, world)
    chunks = mine.chunk(micro)
    with comm.counting() as counts:
        for i, x in enumerate(chunks):
            ctx = model.no_sync() if i < micro - 1 else _null()
            with ctx:
                (lm_loss(model(x[:, :-1]), x[:, 1:]) / micro).backward()
            if i == micro - 2:
                calls_mid = counts.calls("all_reduce", "dp")
    return {"grads": {n: p.grad.clone() for n, p in model.module.named_parameters()},
            "no_sync_calls": calls_mid}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_no_sync_accumulation_equals_big_batch(pools):
    model = tiny_gpt(seed=0)
    (big,) = global_batches(1, 8 * 3)
    lm_loss(model(big[:, :-1]), big[:, 1:]).backward()
    out = pools[2].run(_no_sync_accumulation, 3)
    # forward broadcasts buffers (broadcast, not all_reduce): no all-reduce while in no_sync
    assert out[0]["no_sync_calls"] == 0
    want = {n: p.grad for n, p in model.named_parameters()}
    assert_params_close(out[0]["grads"], want, rtol=1e-5, atol=1e-7)


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)  # used only when use_b
        self.c = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.a(x)
        return self.c(self.b(h) if use_b else h)


def _unused(find: bool, b_on_rank1: bool) -> dict:
    torch.manual_seed(0)
    model = DDP(_Branchy(), cached_mesh(dp=2), find_unused_parameters=find)
    x = torch.randn(4, 4) + dist.get_rank()
    use_b = b_on_rank1 and dist.get_rank() == 1
    model(x, use_b).sum().backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.module.named_parameters()}


def test_unused_parameters(pools):
    # Unused on every rank: grads of b stay None, the rest are averaged.
    out = pools[2].run(_unused, True, False)
    assert out[0]["b.weight"] is None and out[1]["b.weight"] is None
    torch.manual_seed(0)
    ref = _Branchy()
    x0 = torch.randn(4, 4)  # each rank draws the same x0 and adds its rank
    xs = [x0 + r for r in range(2)]
    (sum(ref(x, False).sum() for x in xs) / 2).backward()
    torch.testing.assert_close(out[0]["a.weight"], ref.a.weight.grad, rtol=1e-5, atol=1e-7)
    # Used on one rank only: the average includes that rank's gradient and a zero.
    out = pools[2].run(_unused, True, True)
    torch.testing.assert_close(out[0]["b.weight"], out[1]["b.weight"])
    assert out[0]["b.weight"].abs().sum() > 0


def test_unused_parameter_without_detection_names_it(pools):
    errors = pools[2].errors(_unused, False, False)
    for text in errors.values():
        assert "b.weight" in text and "find_unused_parameters=True" in text


def _uneven(steps_by_rank: list[int], by_world: bool) -> dict:
    world = dist.get_world_size()
    model = DDP(tiny_gpt(seed=0), cached_mesh(dp=world))
    opt = make_opt(model.parameters())
    batches = global_batches(max(steps_by_rank), 8)
    with model.join(divide_by_initial_world_size=by_world):
        for b in batches[: steps_by_rank[dist.get_rank()]]:
            x = _local(b, world)
            opt.zero_grad()
            lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
            opt.step()
    return {k.removeprefix("module."): v for k, v in model.state_dict().items()}


def test_uneven_inputs_join(pools):
    steps = [2, 4, 3, 4]
    out = pools[4].run(_uneven, steps, False)
    # Every rank ends with the same (longest-running rank's) parameters, and nobody hung.
    for r in range(1, 4):
        assert_params_close(out[r], out[0], rtol=0, atol=0)
    # Oracle: dividing by the ranks still training == averaging over their batches only.
    model = tiny_gpt(seed=0)
    opt = make_opt(model.parameters())
    for i, b in enumerate(global_batches(4, 8)):
        live = [r for r in range(4) if steps[r] > i]
        opt.zero_grad()
        chunks = b.chunk(4)
        loss = sum(lm_loss(model(chunks[r][:, :-1]), chunks[r][:, 1:]) for r in live) / len(live)
        loss.backward()
        opt.step()
    assert_params_close(out[0], {k: v.detach() for k, v in model.state_dict().items()})


def _compressed(kind: str) -> dict:
    model = DDP(tiny_gpt(seed=0), cached_mesh(dp=2), gradient_compression=kind)
    (b,) = global_batches(1, 8)
    x = _local(b, 2)
    with comm.counting() as counts:
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    return {"grads": {n: p.grad for n, p in model.module.named_parameters()},
            "bytes": counts.total("all_reduce", "dp")}


@pytest.mark.parametrize("kind,rtol", [("bf16", 2e-2), ("fp16", 2e-3)])
def test_gradient_compression(pools, kind, rtol):
    model = tiny_gpt(seed=0)
    (b,) = global_batches(1, 8)
    lm_loss(model(b[:, :-1]), b[:, 1:]).backward()
    out = pools[2].run(_compressed, kind)
    n_params = sum(p.numel() for p in model.parameters())
    assert out[0]["bytes"] == 2 * n_params  # half-precision wire format
    # bf16 keeps 8 bits of mantissa, fp16 11: relative error of the rounded sum.
    assert_params_close(out[0]["grads"], {n: p.grad for n, p in model.named_parameters()}, rtol=rtol, atol=0,
                        atol_of_max=rtol)


def _mismatched() -> None:
    dims = 32 if dist.get_rank() == 0 else 48
    DDP(tiny_gpt(seed=0, d_model=dims), cached_mesh(dp=2))


def test_mismatched_models_error(pools):
    errors = pools[2].errors(_mismatched)
    assert all("differs across ranks" in e and "tok_emb.weight" in e for e in errors.values())


def _bytes_per_step() -> float:
    model = DDP(tiny_gpt(seed=0), cached_mesh(dp=2))
    (b,) = global_batches(1, 8)
    x = _local(b, 2)
    with comm.counting() as counts:
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    n = sum(p.numel() for p in model.parameters())
    return counts.total("all_reduce", "dp") / (4 * n)


def test_bytes_all_reduced_equal_parameter_bytes(pools):
    assert pools[2].run(_bytes_per_step) == [1.0, 1.0]


def test_bad_arguments_fail_before_communication():
    import plait

    plait.init()
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DDP(nn.Linear(2, 2), None, bucket_cap_mb=0)
    with pytest.raises(ValueError, match="gradient_compression"):
        DDP(nn.Linear(2, 2), None, gradient_compression="int8")
    with pytest.raises(TypeError, match="plait.Mesh"):
        DDP(nn.Linear(2, 2), "dp")


def test_bucket_plan_small_at_both_ends_and_covers_everything():
    from plait.ddp.buckets import plan_buckets

    mib = 2**20
    sizes = [mib // 2] * 100 + [30 * mib] + [mib // 4] * 20
    plan = plan_buckets(sizes, 25 * mib, mib)
    assert [i for b in plan for i in b] == list(range(len(sizes)))  # every item once, in order
    sums = [sum(sizes[i] for i in b) for b in plan]
    assert sums[0] <= mib and sums[-1] <= mib and sums[-2] <= 4 * mib
    assert all(s <= 25 * mib or len(b) == 1 for s, b in zip(sums, plan))  # only a lone giant exceeds


def _deleted_ddp_is_freed() -> bool:
    import gc
    import weakref

    import plait
    from plait.testing import cached_mesh

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    ddp = plait.DDP(model, cached_mesh(dp=2))
    ddp(torch.randn(3, 4)).sum().backward()
    alive = weakref.ref(ddp)
    del ddp, model
    gc.collect()
    return alive() is None


def test_a_deleted_ddp_is_freed(pools):
    # Its gradient hooks hold it weakly: a strong hook tied the wrapper to its parameters in a cycle
    # through the tensors' C++ hooks, and every deleted model stayed in memory with its buckets.
    assert pools[2].run(_deleted_ddp_is_freed) == [True, True]
