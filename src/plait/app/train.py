"""`plait train`: plait's GPT, a transformers model or the user's own, on text or token files, under
any layout.

The loop is plain PyTorch (forward, backward, clip, step) around a model wrapped by
`build_model`; only the wrapping changes with the layout flags. Each run writes its folder
(`plait.app.runlog`). It spawns its own local ranks when it is not already running under
torchrun / `plait run` / Slurm.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import plait
from plait import checkpoint, comm
from plait.app import runlog, usermodel
from plait.app.config import TrainConfig, given_flags, parse_args, to_toml
from plait.app.data import BatchSampler, Corpus, fingerprint, load_corpus
from plait.app.stop import StopRequest
from plait.app.watchdog import StepWatchdog
from plait.clip import clip_grad_norm_
from plait.env import launch_from_env
from plait.mesh import Mesh
from plait.models.gpt import GPT, lm_loss
from plait.models.moe import MoE, moe_layers, update_balance
from plait.pipeline import Pipeline
from plait.straggler import StragglerTracker
from plait.tp.apply import loss_fn_for

__all__ = ["TrainConfig", "parse_args", "train", "build_model", "lr_at", "cli_main"]

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
    from plait.parallelize import parallelize

    # plait's GPT starts on the meta device: each strategy materializes only what this rank keeps.
    own_gpt = cfg.model.hf_config is None and cfg.model_factory is None
    model = unwrapped_model(cfg, "meta" if own_gpt else device)
    plan = cfg.parallel_plan(model)  # the plan the config's checks ran
    if par.pp > 1:
        # With --tp the last stage computes the vocab-parallel loss (loss_fn unset); a FACTORY's model
        # gets gathered logits and its own loss.
        loss_fn = _factory_loss(cfg) if cfg.model_factory is not None else lm_loss if par.tp == 1 else None
        plan = dataclasses.replace(plan, loss_fn=loss_fn)
    return parallelize(model, mesh, plan)


def _factory_loss(cfg: TrainConfig) -> Callable:
    assert cfg.model_factory is not None
    return usermodel.loss_of(cfg.model_factory) or lm_loss


def _mean_over(value: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
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
    return _mean_over(loss_sum, mesh.group(LOSS_AXES), mesh.size(LOSS_AXES)), grad_norm


def _evaluate(model: nn.Module | Pipeline, sampler: BatchSampler, cfg: TrainConfig, device: torch.device,
              mesh: Mesh, loss_fn: Callable) -> float:
    total = 0.0
    if isinstance(model, Pipeline):
        for i in range(cfg.run.eval_batches):
            x, y = rank_tokens(sampler.batch_at(i), device, mesh)
            total += float(model.eval_step(x, y))
        return float(_mean_over(torch.tensor(total / cfg.run.eval_batches), mesh.group(LOSS_AXES),
                                mesh.size(LOSS_AXES)))
    model.eval()
    with torch.no_grad():
        for i in range(cfg.run.eval_batches):
            x, y = rank_tokens(sampler.batch_at(i), device, mesh)
            total += loss_fn(model(x), y).item()
    model.train()
    return float(_mean_over(torch.tensor(total / cfg.run.eval_batches), mesh.group(LOSS_AXES),
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


def _gathered_ids(local: np.ndarray, mesh: Mesh) -> list[int]:
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


def _run_name(cfg: TrainConfig) -> str:
    """--name, or a new id chosen by rank 0 and agreed by all (under torchrun each rank parsed the
    command line itself, so each would pick its own)."""
    if cfg.run.name is not None:
        return cfg.run.name
    return comm.all_gather_object(runlog.new_run_id())[0]


def _header(cfg: TrainConfig, name: str, mesh: Mesh, corpus: Corpus, n_params: int, flops: tuple[float, str],
            start: int) -> dict[str, Any]:
    info = corpus.info
    data = {"source": info.source, "kind": info.kind, "tokens": info.tokens, "vocab": info.vocab,
            "train_tokens": len(corpus.train), "eval_tokens": len(corpus.val), "files": info.files,
            "skipped_binary": len(info.skipped), "truncated": info.truncated,
            "tokens_before_max_bytes": info.total_tokens, "eval_data": cfg.data.eval_data}
    if info.kind == "tokenized":
        data.update(tokenizer=cfg.data.tokenizer, cache=info.cache, cache_reused=info.reused, eod=info.eod,
                    documents=info.documents)
    return {"run_id": name, "start_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "resumed_from_step": start or None, "config": dataclasses.asdict(cfg),
            "plait_version": _version(), "torch_version": torch.__version__, "world": dist.get_world_size(),
            "layout": _layout(cfg), "mesh": str(mesh), "params": n_params, "flops_per_token": flops[0],
            "flops_formula": flops[1], "tokens_per_step": cfg.data.batch_size * cfg.seq_len, "data": data}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("plait")
    except PackageNotFoundError:
        return "unknown"


def _say_what_was_read(corpus: Corpus, log: Any) -> None:
    info = corpus.info
    if info.skipped:
        log.warning("--data %s: skipped %d binary files (a NUL byte in their first 8000 bytes), e.g. %s",
                    info.source, len(info.skipped), info.skipped[0])
    if info.truncated:
        log.warning("--data %s: --max-bytes read %d of its %d bytes; leave --max-bytes out to train on all",
                    info.source, info.tokens, info.total_tokens)
    if info.kind == "tokenized":
        how = "read from the cache" if info.reused else "tokenized to"
        log.info("--data %s: %d documents, %d tokens (each document ended by token %s), %s %s", info.source,
                 info.documents, info.tokens, info.eod, how, info.cache)


def train(cfg: TrainConfig, stop: StopRequest | None = None, resume: str | None = None) -> dict[str, Any]:
    """Run on this rank (inside an initialised job); returns the summary on every rank.

    With ``stop`` (the command's), a SIGTERM or SIGINT ends the run after the step every rank
    agrees on, with a checkpoint of it; ``resume`` is the command that continues it, to say so.
    A rank that makes no progress for ``--step-timeout`` seconds ends itself (app/watchdog.py)."""
    step_timeout = cfg.run.step_timeout if cfg.run.step_timeout is not None else 3 * cfg.run.timeout
    with StepWatchdog(step_timeout, launch_from_env().rank) as watchdog:
        return _train(cfg, stop, resume, watchdog)


def _train(cfg: TrainConfig, stop: StopRequest | None, resume: str | None,
           watchdog: StepWatchdog) -> dict[str, Any]:
    device = plait.init(seed=cfg.run.seed, timeout_s=cfg.run.timeout)
    log = plait.get_logger("plait.train")
    mesh = cfg.mesh()
    is_main = dist.get_rank() == 0
    name = _run_name(cfg)
    folder = Path(cfg.run.run_dir) / name
    comm.configure(run_dir=str(folder))  # flight records of a failing collective go to the run's folder
    watchdog.stacks_dir = folder / "flight"  # beside the flight records
    dp_rank, dp_size = mesh.rank(DATA_AXES), mesh.size(DATA_AXES)
    corpus = load_corpus(cfg.data.path, max_bytes=cfg.data.max_bytes, dtype=cfg.data.data_dtype,
                         eval_path=cfg.data.eval_data, info=getattr(cfg, "_data_info", None),
                         tokenizing=cfg.tokenizing())
    if is_main:
        _say_what_was_read(corpus, log)
    model = build_model(cfg, mesh, device)
    if cfg.model_factory is not None:
        loss_fn = _factory_loss(cfg)
    else:
        loss_fn = lm_loss if isinstance(model, Pipeline) else loss_fn_for(model)
    moe = moe_layers_of(model)
    for layer in moe:  # each forward's balancing loss weighs what its micro-batch's loss weighs
        parts = cfg.pipeline_microbatches if isinstance(model, Pipeline) else cfg.run.grad_accum
        layer.aux_loss_scale = 1 / parts
    seq = cfg.seq_len
    sampler = BatchSampler(corpus.train, seq, cfg.data.batch_size, dp_rank, dp_size, seed=cfg.run.seed)
    val = BatchSampler(corpus.val, seq, cfg.data.batch_size, dp_rank, dp_size, seed=cfg.run.seed + 1)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay,
                            betas=(0.9, 0.95))
    # fp16 needs dynamic loss scaling (bf16 has fp32's range): every rank skips the same steps.
    scaler = plait.GradScaler(mesh, enabled=cfg.parallel.mixed_precision == "fp16")
    save_dir = Path(cfg.checkpoint.save_dir) if cfg.checkpoint.save_dir else folder / "checkpoints"
    start = _maybe_resume(cfg, save_dir, model, opt, sampler, scaler, log)
    if start == 0 and cfg.model.init_from is not None:  # a checkpoint found by --resume wins
        _init_from(cfg, model, log)
    meta_model = unwrapped_model(cfg, "meta")
    n_params = sum(p.numel() for p in meta_model.parameters())
    flops = runlog.flops_per_token(meta_model, seq)
    log.info("%s, %s params, corpus %s (%s tokens), %s %s, global batch %d x %d tokens; run folder %s",
             cfg.model_factory or cfg.model.hf_config or cfg.model.name, f"{n_params:,}", corpus.source,
             f"{len(corpus.train):,}", cfg.parallel.strategy,
             mesh if cfg.parallel.strategy != "dp" else f"{cfg.parallel.nproc} threads",
             cfg.data.batch_size, seq, folder)
    run = runlog.RunLog(folder, is_main, tensorboard=cfg.run.tensorboard,
                        wandb_config=dataclasses.asdict(cfg) if cfg.run.wandb else None)
    resolved = copy.copy(cfg)  # not dataclasses.replace: that would check the whole config again
    resolved.run = dataclasses.replace(cfg.run, name=name)
    run.write_config(to_toml(resolved))
    run.header(_header(cfg, name, mesh, corpus, n_params, flops, start))
    if start >= cfg.run.steps:
        log.info("nothing to do: the checkpoint in %s is at step %d and --steps is %d; pass a larger --steps "
                 "to train on", save_dir, start, cfg.run.steps)
        summary: dict[str, Any] = {
            "steps": cfg.run.steps, "steps_this_run": 0, "first_loss": None, "final_loss": None,
            "eval_loss": None, "tokens_per_s": None, "params": n_params, "strategy": cfg.parallel.strategy,
            "world": dist.get_world_size(), "run_dir": str(folder)}
        run.summary(summary)
        return {**summary, "losses": []}
    peak = runlog.peak_tflops(cfg.run.peak_tflops, device, cfg.parallel.mixed_precision is not None)
    devices = cfg.parallel.nproc if cfg.parallel.strategy == "dp" else dist.get_world_size()
    bar = _progress(cfg, is_main, start)
    tokens_per_step = cfg.data.batch_size * seq
    first_loss = last_loss = float("nan")
    losses: list[float] = []
    eval_loss = None
    t_start = time.perf_counter()
    end = cfg.run.steps  # the step the run ends after: a stop (SIGTERM, SIGINT) may end it sooner
    # Blame measures the desync check's waits, which a caller's plait.init may have turned off.
    stragglers = StragglerTracker() if cfg.run.straggler_every and comm.desync_mode() != "off" else None
    if cfg.run.straggler_every and stragglers is None and is_main:
        log.warning("straggler blame is off: it measures the desync check's waits, and this process runs "
                    "with desync_check='off'")
    for step in range(start, cfg.run.steps):
        watchdog.beat(f"step {step + 1}")
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        ids = _gathered_ids(sampler.local_ids(step), mesh) if cfg.run.log_samples else None
        x, y = rank_tokens(next(sampler), device, mesh)
        with comm.scope(f"step {step + 1}"):  # named in desync reports, timeouts and flight records
            mean_loss, norm = train_step(model, opt, x, y, cfg, mesh, loss_fn, scaler, moe)
            last_loss, grad_norm = float(mean_loss), float(norm)
        losses.append(last_loss)
        if step == start:  # the first step this run took (after a resume, not step 0)
            first_loss = last_loss
        dt = time.perf_counter() - t0
        achieved = flops[0] * tokens_per_step / dt
        mem, mem_source = runlog.peak_memory(device)
        record: dict[str, Any] = {
            "step": step + 1, "loss": last_loss, "lr": lr_at(step, cfg), "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_step / dt, "step_time_s": dt, "model_flops_per_s": achieved,
            "mfu": achieved / (peak * 1e12 * devices) if peak is not None else None,
            "peak_mem_bytes": mem, "peak_mem_source": mem_source}
        if ids is not None:
            record["samples"] = ids
        if moe and cfg.model.capacity_factor is not None:
            record["moe_drop_rate"] = sum(layer.last_drop_rate for layer in moe) / len(moe)
        if scaler.enabled:
            record.update(loss_scale=scaler.get_scale(), skipped=scaler.skipped)
            if scaler.skipped and is_main:
                log.warning("step %d: fp16 gradients overflowed on some rank; step skipped on every rank, "
                            "loss scale now %g (%d skipped so far)", step + 1, scaler.get_scale(),
                            scaler.skipped_steps)
        if stragglers is not None:
            if step == start:  # the first step's one-time work is nobody's slowness
                stragglers.restart()
            else:
                stragglers.step()
            if (step + 1) % cfg.run.straggler_every == 0:
                blamed = stragglers.blame()  # every rank: one gather of the ranks' waits
                record["stragglers"] = [dataclasses.asdict(b) for b in blamed]
                for b in blamed if is_main else []:
                    log.warning("step %d: %s", step + 1, b)
        if cfg.run.eval_every and ((step + 1) % cfg.run.eval_every == 0 or step + 1 == cfg.run.steps):
            eval_loss = _evaluate(model, val, cfg, device, mesh, loss_fn)
            record["eval_loss"] = eval_loss
            if is_main and bar is None:
                log.info("step %d: validation loss %.4f", step + 1, eval_loss)
        run.step(record)
        if is_main:
            if bar is not None:
                bar.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                bar.update(1)
            elif (step + 1) % max(1, cfg.run.steps // 10) == 0:
                log.info("step %d/%d loss %.4f tok/s %.0f", step + 1, cfg.run.steps, last_loss,
                         record["tokens_per_s"])
        stopping = stop.agreed() if stop is not None else 0  # every rank stops after the same step
        every = cfg.checkpoint.save_every
        due = (every and (step + 1) % every == 0) or step + 1 == cfg.run.steps or stopping
        if (cfg.checkpoint.save_dir or every or stopping) and due:
            meta = {"step": step + 1, "sampler": sampler.state_dict(), "config": dataclasses.asdict(cfg),
                    "identity": _identity(cfg, sampler), "layout": _layout(cfg)}
            if scaler.enabled:
                meta["grad_scaler"] = scaler.state_dict()  # the same on every rank (agreed)
            saving = checkpoint.save(save_dir / f"step_{step + 1:06d}", model, opt, meta,
                                     keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
            if step + 1 == cfg.run.steps or stopping:
                saving.wait()  # the run ends with its last checkpoint complete
        if stopping:
            assert stop is not None
            again = resume
            if resume is not None and cfg.run.name is None:  # the id chosen at start: name it
                again = resume.replace(" --resume", f" --name {name} --resume", 1)
            stop.report(step + 1, cfg.run.steps, str(save_dir), again, log)
            end = step + 1
            break
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t_start
    done = end - start  # the steps this run took: after a resume or a stop, not all of them
    summary = {"first_loss": first_loss, "final_loss": last_loss, "eval_loss": eval_loss,
               "steps": cfg.run.steps, "steps_this_run": done,
               "tokens_per_s": done * tokens_per_step / elapsed,
               "params": n_params, "strategy": cfg.parallel.strategy, "world": dist.get_world_size(),
               "run_dir": str(folder)}
    if scaler.enabled:
        summary.update(loss_scale=scaler.get_scale(), skipped_steps=scaler.skipped_steps)
    log.info("done: steps %d-%d, loss %.3f -> %.3f, eval %s, %.0f tokens/s; metrics in %s", start + 1,
             end, first_loss, last_loss, f"{eval_loss:.3f}" if eval_loss is not None else "-",
             summary["tokens_per_s"], run.metrics)
    run.summary(summary)
    return {**summary, "losses": losses, "stopped_by": stop.stopped if stop is not None else 0}


def _maybe_resume(cfg: TrainConfig, save_dir: Path, model: nn.Module | Pipeline, opt: torch.optim.Optimizer,
                  sampler: BatchSampler, scaler: plait.GradScaler, log: Any) -> int:
    """Load the newest intact checkpoint of this run when ``--resume``; return the step to continue from.

    Corrupt ones are skipped with a warning (`checkpoint.choose`), another run's are refused
    unless ``--resume-anyway``; a different world size or layout is fine (the state reshards).
    """
    if not cfg.checkpoint.resume:
        return 0
    auto = cfg.checkpoint.resume == "auto"
    found = checkpoint.choose(save_dir, _identity(cfg, sampler), resume_anyway=cfg.checkpoint.resume_anyway,
                              missing_ok=auto)
    if found is None:
        if auto:
            log.info("--resume auto: no checkpoint in %s yet, starting from step 0", save_dir)
        else:
            log.warning("--resume: no save in %s ever finished, starting from step 0", save_dir)
        return 0
    path, meta = found
    checkpoint.load(path, model, opt, check=False)  # choose() verified it on rank 0
    sampler.load_state_dict(meta["sampler"])
    if scaler.enabled and "grad_scaler" in meta:  # an fp16 run's loss scale (others start afresh)
        scaler.load_state_dict(meta["grad_scaler"])
    log.info("resumed from %s (step %d, written by %s)", path, meta["step"], meta.get("layout"))
    return int(meta["step"])


def _init_from(cfg: TrainConfig, model: nn.Module | Pipeline, log: Any) -> None:
    """Load the ``--init-from`` weights into the built layout (checked already by the config):
    each rank reads from the files the part of each tensor it keeps (`plait.load_full_state_dict`
    with `plait.app.weights.FileTensor` sources)."""
    from plait.app import weights

    assert cfg.model.init_from is not None
    plait.load_full_state_dict(model, weights.init_sources(cfg.model.init_from, unwrapped_model(cfg, "meta")))
    log.info("initialised from the weights in %s", cfg.model.init_from)


def _identity(cfg: TrainConfig, sampler: BatchSampler) -> dict[str, Any]:
    """What makes two runs one run, compared on ``--resume``: the model, the data (by content:
    the same bytes under another path are the same data), the seed, the global batch size and
    the optimizer and learning-rate settings. ``--steps`` is left out (resuming with more steps
    to train longer is legitimate; the cosine decay then follows the new length), and so is
    the layout, precision and offload included (checkpoints reshard)."""
    opt = cfg.optimizer
    model: dict[str, Any]
    if cfg.model_factory is not None:  # the function's name: what it builds is the user's to keep stable
        model = {"factory": cfg.model_factory}
    elif cfg.model.hf_config is None:
        model = dataclasses.asdict(cfg.gpt_config())
    else:  # the architecture, not the library version that wrote it
        from plait.app import hf

        model = hf.load_config(cfg.model.hf_config).to_diff_dict()
        model.pop("transformers_version", None)
    return {"model": model, "seed": cfg.run.seed,
            "batch_size": cfg.data.batch_size, "lr": opt.lr, "min_lr_ratio": opt.min_lr_ratio,
            "warmup": opt.warmup, "weight_decay": opt.weight_decay, "grad_clip": opt.grad_clip,
            "data": {"bytes": len(sampler.tokens), "sha256": fingerprint(sampler.tokens)}}


def _layout(cfg: TrainConfig) -> dict[str, Any]:
    """How the run was spread over ranks: recorded in checkpoints, not compared on resume."""
    par = cfg.parallel
    return {"world_size": dist.get_world_size(), "strategy": par.strategy, "pp": par.pp, "tp": par.tp,
            "cp": par.cp, "data_parallel": cfg.data_parallel_size, "hybrid_dp": par.dp,
            "zero_stage": par.zero_stage}


def _progress(cfg: TrainConfig, is_main: bool, start: int):
    if not (cfg.run.progress and is_main):
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.run.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)


def _spawned_rank(cfg: TrainConfig, resume: str) -> None:
    # No teardown here: `plait.init` registered the one shutdown path (a barrier, then every
    # group destroyed in order), which runs when this process exits, as under any launcher.
    with StopRequest() as stop:
        train(cfg, stop, resume)
    if stop.exit_code:  # the same on every rank: the launcher exits with it
        raise SystemExit(stop.exit_code)


def _run_here(cfg: TrainConfig, resume: str, rank: int, traces: Path) -> int:
    """Train in this process (a rank of torchrun or srun, or the whole run): an error is one line
    on stderr, its traceback in a file."""
    from plait.app.launch import one_line, record_failure

    with StopRequest() as stop:
        try:
            train(cfg, stop, resume)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # some of torch's errors are BaseExceptions (DCP's CheckpointException)
            from plait.env import mark_failed

            mark_failed()
            path = record_failure(rank, e, traces)
            print(f"plait train: error: rank {rank}: {one_line(e)}; full traceback in {path}",
                  file=sys.stderr)
            return 1
    return stop.exit_code


def _fit_launcher(cfg: TrainConfig, argv: list[str], world: int) -> TrainConfig:
    """Under torchrun / `plait run` / srun the launcher chose the world size: --nproc must agree."""
    if cfg.parallel.strategy in ("none", "dp"):
        if world > 1:
            raise ValueError(f"--strategy {cfg.parallel.strategy} runs in one process, but the launcher "
                             f"started {world} ranks: use --strategy ddp or fsdp")
        return cfg
    if cfg.parallel.nproc == world:
        return cfg
    if "nproc" in given_flags(argv):
        raise ValueError(f"--nproc {cfg.parallel.nproc}: the launcher started {world} ranks; pass --nproc "
                         f"{world} or leave --nproc out")
    return parse_args([*argv, "--nproc", str(world)])  # checked like a flag given by hand


def cli_main(argv: list[str]) -> int:
    from plait.app.launch import RanksFailed, spawn
    from plait.app.stop import resume_command

    cfg = parse_args(argv)
    launch = launch_from_env()
    under_launcher = launch.source != "single"
    try:
        if under_launcher:
            cfg = _fit_launcher(cfg, argv, launch.world_size)
        if cfg.checkpoint.resume is True:  # a mistyped --save-dir or --name must not train from step 0
            checkpoint.check_resumable(cfg.checkpoint.save_dir
                                       or Path(cfg.run.run_dir) / str(cfg.run.name) / "checkpoints")
    except (ValueError, checkpoint.NoCheckpoint) as e:
        print(f"plait train: error: {e}", file=sys.stderr)
        return 2
    if not under_launcher and cfg.run.name is None:  # spawned ranks (and their traces) share one folder
        run_id = runlog.new_run_id()
        cfg.run.name = run_id  # set in place: the parent's checks and data scan stay with cfg
        argv = [*argv, "--name", run_id]  # what the resume command must name
    if cfg.parallel.heal:  # replicas that heal: a supervisor of their own, never under a launcher
        if under_launcher:
            print("plait train: error: --heal starts and replaces its own replicas: run it without "
                  "torchrun, plait run or srun", file=sys.stderr)
            return 2
        from plait.app import healing

        return healing.cli_main(cfg)
    resume = resume_command(argv, launch.source if under_launcher else None)
    traces = Path(cfg.run.run_dir) / (cfg.run.name or "") / "traces"
    if under_launcher or cfg.parallel.strategy in ("none", "dp"):
        return _run_here(cfg, resume, launch.rank, traces)
    if launch.note:
        print(f"plait train: note: {launch.note}; here it starts --nproc {cfg.parallel.nproc} local ranks",
              file=sys.stderr)
    threads = max(1, (os.cpu_count() or 1) // cfg.parallel.nproc)
    try:
        return spawn(_spawned_rank, cfg.parallel.nproc, (cfg, resume), threads=threads, trace_dir=traces)
    except RanksFailed as e:
        print(f"plait train: error: {e}", file=sys.stderr)
        return 1
