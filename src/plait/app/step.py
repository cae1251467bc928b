"""One step of `plait train`: the model built for the layout, its forward and backward (with
gradient accumulation or a pipeline schedule), clipping and the optimizer step, the learning rate at
each step and the held-out evaluation. `plait.app.train` runs them in a loop; `plait plan` rehearses
one of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import plait
from plait.app import usermodel
from plait.app.config import TrainConfig
from plait.app.data import BatchSampler
from plait.models.gpt import GPT, lm_loss
from plait.models.moe import MoE, moe_layers, update_balance
from plait.pipeline import Pipeline
from plait.runtime import comm
from plait.runtime.mesh import Mesh
from plait.state.clip import clip_grad_norm_

DATA_AXES = ("dp", "fsdp")  # ranks along these axes see different data
# ... and along these different tokens: each rank's loss is the mean over its own tokens.
LOSS_AXES = ("dp", "fsdp", "cp")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr``."""
    opt = cfg.optimizer
    if step < opt.warmup:
        return opt.lr * (step + 1) / opt.warmup
    progress = (step - opt.warmup) / max(1, cfg.run.steps - opt.warmup)
    return opt.lr * (opt.min_lr_ratio + (1 - opt.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def unwrapped_model(cfg: TrainConfig, device: torch.device | str) -> nn.Module:
    """The model as one process would build it: plait's GPT (``device="meta"``: shapes only, for
    the layout to materialize its own part), or the ``--hf-config`` transformers model, built
    whole with its own initialisation under the seed (transformers' norms cannot be materialized
    from the meta device, so each rank builds it and keeps its slices)."""
    make_model = getattr(cfg, "make_model", None)  # `plait plan FACTORY`: the user's function, on meta
    if make_model is not None:
        if str(device) != "meta":
            raise ValueError("a FACTORY model is built on the meta device only (plait plan)")
        return make_model()
    if cfg.model_factory is not None:
        return usermodel.build(cfg.model_factory, cfg.run.seed, device)
    if cfg.model.hf_config is not None:
        from plait.app import hf

        return hf.build(hf.load_config(cfg.model.hf_config), cfg.run.seed,
                        device="meta" if str(device) == "meta" else device)
    if str(device) == "meta":
        with torch.device("meta"):
            return GPT(cfg.gpt_config())
    return plait.init_weights(GPT(cfg.gpt_config()), cfg.run.seed).to(device)


def build_model(cfg: TrainConfig, mesh: Mesh, device: torch.device) -> nn.Module | Pipeline:
    """Build the model and wrap it for the layout through `plait.parallelize` (threads: DataParallel)."""
    par = cfg.parallel
    if par.strategy == "dp":
        from plait.data_parallel import DataParallel

        devices = list(range(par.nproc)) if device.type == "cuda" else ["cpu"] * par.nproc
        return DataParallel(unwrapped_model(cfg, device), devices)
    from plait.compose.parallelize import parallelize

    # plait's GPT starts on the meta device: each strategy materializes only what this rank keeps.
    own_gpt = cfg.model.hf_config is None and cfg.model_factory is None
    model = unwrapped_model(cfg, "meta" if own_gpt else device)
    plan = cfg.parallel_plan(model)  # the plan the config's checks ran
    if par.pp > 1:
        # With --tp the last stage computes the vocab-parallel loss (loss_fn unset); a FACTORY's model
        # gets gathered logits and its own loss.
        loss_fn = factory_loss(cfg) if cfg.model_factory is not None else lm_loss if par.tp == 1 else None
        plan = dataclasses.replace(plan, loss_fn=loss_fn)
    return parallelize(model, mesh, plan)


def factory_loss(cfg: TrainConfig) -> Callable:
    assert cfg.model_factory is not None
    return usermodel.loss_of(cfg.model_factory) or lm_loss


def mean_over(value: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    t = value.detach().to(torch.float64).reshape(1).to(comm.device_of(group))
    comm.all_reduce(t, group)
    return t[0] / size


def _forward_backward(model: nn.Module | Pipeline, x: torch.Tensor, y: torch.Tensor,
                      cfg: TrainConfig, loss_fn: Callable, scaler: plait.GradScaler) -> torch.Tensor:
    """One optimizer step's gradients (left in ``.grad``, times the loss scale under fp16);
    returns this rank's mean loss (a tensor: reading it would wait for the device)."""
    if isinstance(model, Pipeline):
        # Microbatches (x --grad-accum) run on the schedule; each stage's last backward reduces
        # the accumulated gradients over the data axes while it runs.
        with comm.phase("pipeline"):
            return model.step(x, y, loss_scale=scaler.get_scale() if scaler.enabled else None)
    loss_sum = torch.zeros((), device=x.device)
    for i, (xm, ym) in enumerate(zip(x.chunk(cfg.run.grad_accum), y.chunk(cfg.run.grad_accum))):
        # Only the last micro-batch communicates; the others accumulate locally.
        no_sync = getattr(model, "no_sync", None)  # DDP and FSDP; DataParallel has nothing to defer
        quiet = no_sync if no_sync is not None and i < cfg.run.grad_accum - 1 else contextlib.nullcontext
        with quiet():
            with comm.phase("forward"):
                loss = loss_fn(model(xm), ym) / cfg.run.grad_accum
            with comm.phase("backward"):
                scaler.scale(loss).backward()
        loss_sum = loss_sum + loss.detach()
    return loss_sum


def train_step(model: nn.Module | Pipeline, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               cfg: TrainConfig, mesh: Mesh, loss_fn: Callable, scaler: plait.GradScaler,
               moe: list[MoE]) -> tuple[torch.Tensor, torch.Tensor]:
    """One training step of ``plait train`` (what ``plait plan`` rehearses): gradients, clipping,
    the optimizer step; returns the loss averaged over the data ranks and the gradient norm, as
    tensors (the caller reads them)."""
    opt.zero_grad(set_to_none=True)
    loss_sum = _forward_backward(model, x, y, cfg, loss_fn, scaler)
    scaler.unscale_(opt)  # fp16: the true gradients, before clipping measures them
    # --grad-clip 0: no clipping (torch's formula would zero every gradient); the norm is still
    # measured for the metrics.
    with comm.phase("optimizer"):
        grad_norm = clip_grad_norm_(model, cfg.optimizer.grad_clip or math.inf)
        scaler.step(opt)  # skipped on every rank when any rank's gradients overflowed
        scaler.update()
        if cfg.model.bias_update_rate:
            _balance_experts(moe, mesh)
    if scaler.skipped:  # no optimizer step ended this one: the next step's statistics start afresh
        for layer in moe:
            layer.restart_statistics()
    return mean_over(loss_sum, mesh.group(LOSS_AXES), mesh.size(LOSS_AXES)), grad_norm


def evaluate(model: nn.Module | Pipeline, sampler: BatchSampler, cfg: TrainConfig, device: torch.device,
              mesh: Mesh, loss_fn: Callable) -> float:
    total = 0.0
    if isinstance(model, Pipeline):
        for i in range(cfg.run.eval_batches):
            x, y = rank_tokens(sampler.batch_at(i), device, mesh)
            total += float(model.eval_step(x, y))
        return float(mean_over(torch.tensor(total / cfg.run.eval_batches), mesh.group(LOSS_AXES),
                                mesh.size(LOSS_AXES)))
    model.eval()
    with torch.no_grad():
        for i in range(cfg.run.eval_batches):
            x, y = rank_tokens(sampler.batch_at(i), device, mesh)
            total += loss_fn(model(x), y).item()
    model.train()
    return float(mean_over(torch.tensor(total / cfg.run.eval_batches), mesh.group(LOSS_AXES),
                            mesh.size(LOSS_AXES)))


def moe_layers_of(model: nn.Module | Pipeline) -> list[MoE]:
    modules = model.stages.values() if isinstance(model, Pipeline) else [model]
    return [m for mod in modules for m in moe_layers(mod)]


def _balance_experts(layers: list[MoE], mesh: Mesh) -> None:
    """DeepSeek-V3's balancing step on the routing counts of every data rank (summed), so every
    replica moves its biases alike: under the global statistic each layer counted them so; per
    micro-batch, they are summed here."""
    for layer in layers:
        if layer.balance_statistic == "global":
            update_balance(layer)
    layers = [layer for layer in layers if layer.balance_statistic != "global"]
    if not layers:
        return
    group = mesh.group(LOSS_AXES)
    counts = [layer.load if layer.load is not None else torch.zeros_like(layer.expert_bias)
              for layer in layers]
    flat = torch.cat([c.to(torch.float64).reshape(-1) for c in counts]).to(comm.device_of(group))
    comm.all_reduce(flat, group)
    for layer, total in zip(layers, flat.split([c.numel() for c in counts])):
        update_balance(layer, [total.to(layer.expert_bias.device)])


def gathered_ids(local: np.ndarray, mesh: Mesh) -> list[int]:
    """The global batch's sample ids as the data ranks drew them, in rank order (`--log-samples`):
    what was read, not what the sampler would give, so a rank reading the wrong slice shows."""
    if mesh.size(DATA_AXES) == 1:
        return local.tolist()
    parts = comm.all_gather_object(local.tolist(), mesh.group(DATA_AXES))
    return [i for part in parts for i in part]


def rank_tokens(batch: tuple[torch.Tensor, torch.Tensor], device: torch.device,
            mesh: Mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets on the device; with context parallelism, this rank's tokens of them."""
    x, y = (t.to(device) for t in batch)
    if mesh.size("cp") > 1:
        x, y = plait.cp.shard(x, mesh), plait.cp.shard(y, mesh)
    return x, y
