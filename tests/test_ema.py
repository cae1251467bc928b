"""An exponential moving average of the weights (diffusion models, self-supervised teachers) on
every data layout: kept beside the parameters as tensors of the same placement (FSDP's and tensor
parallelism's DTensor shards, DDP's replicas), saved and resharded with the checkpoint
(`plait.checkpoint.save(..., extra={"ema": ema})`), equal to one process's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from oracle import assert_params_close, global_batches, loss64, make_opt, tiny_gpt

DECAY = 0.9
STEPS = 3


def _ema_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The recipe: one tensor per parameter, placed as the parameter is, under the model's names."""
    return {name.removeprefix("module."): p.detach().clone() for name, p in model.named_parameters()}


@torch.no_grad()
def _update(ema: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        ema[name.removeprefix("module.")].lerp_(p.detach(), 1 - DECAY)


def _train(model: torch.nn.Module, share: int, of: int) -> tuple[dict, torch.optim.Optimizer]:
    opt = make_opt(model.parameters())
    ema = _ema_of(model)
    for batch in global_batches(STEPS, 8):
        x = batch.chunk(of)[share]
        loss64(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        _update(ema, model)
    return ema, opt


def _layout(kind: str, directory: str) -> dict[str, torch.Tensor]:
    import plait
    from plait import checkpoint
    from plait.testing import cached_mesh

    world = dist.get_world_size()
    model = tiny_gpt(seed=0).double()
    if kind == "ddp":
        net: torch.nn.Module = plait.DDP(model, cached_mesh(dp=world))
    elif kind == "fsdp":
        net = plait.FSDP(model, cached_mesh(fsdp=world), zero_stage=3)
    else:
        net = plait.tensor_parallel(model, cached_mesh(tp=world), plait.plan_for(model))
    ema, opt = _train(net, dist.get_rank() if kind != "tp" else 0, world if kind != "tp" else 1)
    checkpoint.save(directory, net, opt, {"step": STEPS}, extra={"ema": ema})
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in ema.items()}


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "tp"])
def test_ema_on_a_layout_equals_one_process_and_reshards_with_the_checkpoint(pools, tmp_path, kind):
    from plait import checkpoint

    want, _ = _train(tiny_gpt(seed=0).double(), 0, 1)
    folder = str(tmp_path / "ckpt")
    for got in pools[2].run(_layout, kind, folder):
        assert_params_close(got, want, rtol=1e-10, atol=1e-12, what=f"{kind}: EMA of")
    # Into one process, another layout: the shards come back as whole tensors.
    plain = tiny_gpt(seed=1).double()
    ema = {k: torch.zeros_like(v) for k, v in _ema_of(plain).items()}
    checkpoint.load(folder, plain, make_opt(plain.parameters()), extra={"ema": ema})
    assert_params_close(ema, want, rtol=1e-10, atol=1e-12, what="loaded into one process: EMA of")
