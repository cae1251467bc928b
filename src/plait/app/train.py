"""`plait train`: plait's GPT, a transformers model or the user's own, on text or token files, under
any layout.

The loop (`TrainingRun`) is plain PyTorch (forward, backward, clip, step: `plait.app.step`) around a
model wrapped by `build_model`; only the wrapping changes with the layout flags. Each run writes its folder
(`plait.app.runlog`). It spawns its own local ranks when it is not already running under
torchrun / `plait run` / Slurm.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import plait
from plait.app import runlog
from plait.app.config import TrainConfig, given_flags, parse_args, to_toml
from plait.app.data import BatchSampler, Corpus, fingerprint, load_corpus
from plait.app.step import (
    DATA_AXES,
    build_model,
    evaluate,
    factory_loss,
    gathered_ids,
    lr_at,
    moe_layers_of,
    rank_tokens,
    train_step,
    unwrapped_model,
)
from plait.app.stop import StopRequest
from plait.app.watchdog import StepWatchdog
from plait.models.gpt import lm_loss
from plait.pipeline import Pipeline
from plait.runtime import comm
from plait.runtime.env import launch_from_env
from plait.runtime.mesh import Mesh
from plait.runtime.straggler import StragglerTracker
from plait.state import checkpoint
from plait.tp.apply import loss_fn_for


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
        return TrainingRun(cfg, stop, resume, watchdog).run()




class TrainingRun:
    """One run of ``plait train`` on this rank: built in steps (`_open`, `_build`, `_start`), then
    `run` loops over `_step`, `_measure`, `_evaluate_if_due`, `_log` and `_save_if_due`."""

    def __init__(self, cfg: TrainConfig, stop: StopRequest | None, resume: str | None,
                 watchdog: StepWatchdog) -> None:
        self.cfg, self.stop, self.resume, self.watchdog = cfg, stop, resume, watchdog
        self._open()
        self._build()
        self._start()

    def _open(self) -> None:
        """The job, the mesh, the run's folder and the data."""
        cfg = self.cfg
        self.device = plait.init(seed=cfg.run.seed, timeout_s=cfg.run.timeout)
        self.log = plait.get_logger("plait.train")
        self.mesh = cfg.mesh()
        self.is_main = dist.get_rank() == 0
        self.name = _run_name(cfg)
        self.folder = Path(cfg.run.run_dir) / self.name
        comm.configure(run_dir=str(self.folder))  # a failing collective's flight records go here
        self.watchdog.stacks_dir = self.folder / "flight"  # beside the flight records
        self.corpus = load_corpus(cfg.data.path, max_bytes=cfg.data.max_bytes, dtype=cfg.data.data_dtype,
                                  eval_path=cfg.data.eval_data, info=getattr(cfg, "_data_info", None),
                                  tokenizing=cfg.tokenizing())
        if self.is_main:
            _say_what_was_read(self.corpus, self.log)
        dp_rank, dp_size = self.mesh.rank(DATA_AXES), self.mesh.size(DATA_AXES)
        self.sampler = BatchSampler(self.corpus.train, cfg.seq_len, cfg.data.batch_size, dp_rank, dp_size,
                                    seed=cfg.run.seed)
        self.val = BatchSampler(self.corpus.val, cfg.seq_len, cfg.data.batch_size, dp_rank, dp_size,
                                seed=cfg.run.seed + 1)

    def _build(self) -> None:
        """The model for the layout, its loss, the optimizer and the loss scaler."""
        cfg = self.cfg
        self.model = model = build_model(cfg, self.mesh, self.device)
        if cfg.model_factory is not None:
            self.loss_fn = factory_loss(cfg)
        else:
            self.loss_fn = lm_loss if isinstance(model, Pipeline) else loss_fn_for(model)
        self.moe = moe_layers_of(model)
        for layer in self.moe:  # each forward's balancing loss weighs what its micro-batch's loss weighs
            parts = cfg.pipeline_microbatches if isinstance(model, Pipeline) else cfg.run.grad_accum
            layer.aux_loss_scale = 1 / parts
        params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay,
                                     betas=(0.9, 0.95))
        # fp16 needs dynamic loss scaling (bf16 has fp32's range): every rank skips the same steps.
        self.scaler = plait.GradScaler(self.mesh, enabled=cfg.parallel.mixed_precision == "fp16")

    def _start(self) -> None:
        """Resume or initialise, then open the run's log with its header."""
        cfg, log = self.cfg, self.log
        given = cfg.checkpoint.save_dir
        self.save_dir = Path(given) if given else self.folder / "checkpoints"
        self.start = _maybe_resume(cfg, self.save_dir, self.model, self.opt, self.sampler, self.scaler, log)
        if self.start == 0 and cfg.model.init_from is not None:  # a checkpoint found by --resume wins
            _init_from(cfg, self.model, log)
        meta_model = unwrapped_model(cfg, "meta")
        self.n_params = sum(p.numel() for p in meta_model.parameters())
        self.flops = runlog.flops_per_token(meta_model, cfg.seq_len)
        log.info("%s, %s params, corpus %s (%s tokens), %s %s, global batch %d x %d tokens; run folder %s",
                 cfg.model_factory or cfg.model.hf_config or cfg.model.name, f"{self.n_params:,}",
                 self.corpus.source, f"{len(self.corpus.train):,}", cfg.parallel.strategy,
                 self.mesh if cfg.parallel.strategy != "dp" else f"{cfg.parallel.nproc} threads",
                 cfg.data.batch_size, cfg.seq_len, self.folder)
        self.runlog = runlog.RunLog(self.folder, self.is_main, tensorboard=cfg.run.tensorboard,
                                    wandb_config=dataclasses.asdict(cfg) if cfg.run.wandb else None)
        resolved = copy.copy(cfg)  # not dataclasses.replace: that would check the whole config again
        resolved.run = dataclasses.replace(cfg.run, name=self.name)
        self.runlog.write_config(to_toml(resolved))
        self.runlog.header(_header(cfg, self.name, self.mesh, self.corpus, self.n_params, self.flops,
                                   self.start))

    def run(self) -> dict[str, Any]:
        """The loop; returns the summary (and the losses) on every rank."""
        cfg = self.cfg
        if self.start >= cfg.run.steps:
            return self._nothing_to_do()
        peak = runlog.peak_tflops(cfg.run.peak_tflops, self.device, cfg.parallel.mixed_precision is not None)
        self.peak_flops = peak * 1e12 * self._devices() if peak is not None else None
        self.bar = _progress(cfg, self.is_main, self.start)
        self.losses: list[float] = []
        self.eval_loss: float | None = None
        self.stragglers = self._straggler_tracker()
        t_start = time.perf_counter()
        end = cfg.run.steps  # the step the run ends after: a stop (SIGTERM, SIGINT) may end it sooner
        for step in range(self.start, cfg.run.steps):
            self.watchdog.beat(f"step {step + 1}")
            record = self._step(step)
            self._evaluate_if_due(step, record)
            self.runlog.step(record)
            self._log(step, record)
            # every rank stops after the same step
            stopping = self.stop.agreed() if self.stop is not None else 0
            self._save_if_due(step, stopping)
            if stopping:
                self._report_stop(step)
                end = step + 1
                break
        if self.bar is not None:
            self.bar.close()
        return self._summary(end, time.perf_counter() - t_start)

    def _devices(self) -> int:
        cfg = self.cfg
        return cfg.parallel.nproc if cfg.parallel.strategy == "dp" else dist.get_world_size()

    def _straggler_tracker(self) -> StragglerTracker | None:
        # Blame measures the desync check's waits, which a caller's plait.init may have turned off.
        every = self.cfg.run.straggler_every
        if every and comm.desync_mode() != "off":
            return StragglerTracker()
        if every and self.is_main:
            self.log.warning("straggler blame is off: it measures the desync check's waits, and this process "
                             "runs with desync_check='off'")
        return None

    def _step(self, step: int) -> dict[str, Any]:
        """One optimizer step; its metrics record."""
        cfg, mesh = self.cfg, self.mesh
        t0 = time.perf_counter()
        for g in self.opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        ids = gathered_ids(self.sampler.local_ids(step), mesh) if cfg.run.log_samples else None
        x, y = rank_tokens(next(self.sampler), self.device, mesh)
        with comm.scope(f"step {step + 1}"):  # named in desync reports, timeouts and flight records
            mean_loss, norm = train_step(self.model, self.opt, x, y, cfg, mesh, self.loss_fn, self.scaler,
                                         self.moe)
            loss, grad_norm = float(mean_loss), float(norm)
        self.losses.append(loss)
        record = self._measure(step, loss, grad_norm, time.perf_counter() - t0)
        if ids is not None:
            record["samples"] = ids
        self._blame_stragglers(step, record)
        return record

    def _measure(self, step: int, loss: float, grad_norm: float, dt: float) -> dict[str, Any]:
        cfg, scaler = self.cfg, self.scaler
        tokens = cfg.data.batch_size * cfg.seq_len
        achieved = self.flops[0] * tokens / dt
        mem, mem_source = runlog.peak_memory(self.device)
        record: dict[str, Any] = {
            "step": step + 1, "loss": loss, "lr": lr_at(step, cfg), "grad_norm": grad_norm,
            "tokens_per_s": tokens / dt, "step_time_s": dt, "model_flops_per_s": achieved,
            "mfu": achieved / self.peak_flops if self.peak_flops is not None else None,
            "peak_mem_bytes": mem, "peak_mem_source": mem_source}
        if self.moe and cfg.model.capacity_factor is not None:
            record["moe_drop_rate"] = sum(layer.last_drop_rate for layer in self.moe) / len(self.moe)
        if scaler.enabled:
            record.update(loss_scale=scaler.get_scale(), skipped=scaler.skipped)
            if scaler.skipped and self.is_main:
                self.log.warning("step %d: fp16 gradients overflowed on some rank; step skipped on every "
                                 "rank, loss scale now %g (%d skipped so far)", step + 1, scaler.get_scale(),
                                 scaler.skipped_steps)
        return record

    def _blame_stragglers(self, step: int, record: dict[str, Any]) -> None:
        if self.stragglers is None:
            return
        if step == self.start:  # the first step's one-time work is nobody's slowness
            self.stragglers.restart()
        else:
            self.stragglers.step()
        if (step + 1) % self.cfg.run.straggler_every == 0:
            blamed = self.stragglers.blame()  # every rank: one gather of the ranks' waits
            record["stragglers"] = [dataclasses.asdict(b) for b in blamed]
            for b in blamed if self.is_main else []:
                self.log.warning("step %d: %s", step + 1, b)

    def _evaluate_if_due(self, step: int, record: dict[str, Any]) -> None:
        cfg = self.cfg
        if cfg.run.eval_every and ((step + 1) % cfg.run.eval_every == 0 or step + 1 == cfg.run.steps):
            self.eval_loss = evaluate(self.model, self.val, cfg, self.device, self.mesh, self.loss_fn)
            record["eval_loss"] = self.eval_loss
            if self.is_main and self.bar is None:
                self.log.info("step %d: validation loss %.4f", step + 1, self.eval_loss)

    def _log(self, step: int, record: dict[str, Any]) -> None:
        if not self.is_main:
            return
        steps = self.cfg.run.steps
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
            self.bar.update(1)
        elif (step + 1) % max(1, steps // 10) == 0:
            self.log.info("step %d/%d loss %.4f tok/s %.0f", step + 1, steps, record["loss"],
                          record["tokens_per_s"])

    def _save_if_due(self, step: int, stopping: int) -> None:
        cfg = self.cfg
        every = cfg.checkpoint.save_every
        due = (every and (step + 1) % every == 0) or step + 1 == cfg.run.steps or stopping
        if not ((cfg.checkpoint.save_dir or every or stopping) and due):
            return
        meta = {"step": step + 1, "sampler": self.sampler.state_dict(), "config": dataclasses.asdict(cfg),
                "identity": _identity(cfg, self.sampler), "layout": _layout(cfg)}
        if self.scaler.enabled:
            meta["grad_scaler"] = self.scaler.state_dict()  # the same on every rank (agreed)
        saving = checkpoint.save(self.save_dir / f"step_{step + 1:06d}", self.model, self.opt, meta,
                                 keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
        if step + 1 == cfg.run.steps or stopping:
            saving.wait()  # the run ends with its last checkpoint complete

    def _report_stop(self, step: int) -> None:
        assert self.stop is not None
        again = self.resume
        if again is not None and self.cfg.run.name is None:  # the id chosen at start: name it
            again = again.replace(" --resume", f" --name {self.name} --resume", 1)
        self.stop.report(step + 1, self.cfg.run.steps, str(self.save_dir), again, self.log)

    def _base_summary(self) -> dict[str, Any]:
        return {"steps": self.cfg.run.steps, "params": self.n_params, "strategy": self.cfg.parallel.strategy,
                "world": dist.get_world_size(), "run_dir": str(self.folder)}

    def _nothing_to_do(self) -> dict[str, Any]:
        self.log.info("nothing to do: the checkpoint in %s is at step %d and --steps is %d; pass a larger "
                      "--steps to train on", self.save_dir, self.start, self.cfg.run.steps)
        summary = {**self._base_summary(), "steps_this_run": 0, "first_loss": None, "final_loss": None,
                   "eval_loss": None, "tokens_per_s": None}
        self.runlog.summary(summary)
        return {**summary, "losses": []}

    def _summary(self, end: int, elapsed: float) -> dict[str, Any]:
        done = end - self.start  # the steps this run took: after a resume or a stop, not all of them
        first_loss = self.losses[0] if self.losses else float("nan")
        last_loss = self.losses[-1] if self.losses else float("nan")
        tokens = self.cfg.data.batch_size * self.cfg.seq_len
        summary = {**self._base_summary(), "first_loss": first_loss, "final_loss": last_loss,
                   "eval_loss": self.eval_loss, "steps_this_run": done,
                   "tokens_per_s": done * tokens / elapsed}
        if self.scaler.enabled:
            summary.update(loss_scale=self.scaler.get_scale(), skipped_steps=self.scaler.skipped_steps)
        eval_text = f"{self.eval_loss:.3f}" if self.eval_loss is not None else "-"
        self.log.info("done: steps %d-%d, loss %.3f -> %.3f, eval %s, %.0f tokens/s; metrics in %s",
                      self.start + 1, end, first_loss, last_loss, eval_text, summary["tokens_per_s"],
                      self.runlog.metrics)
        self.runlog.summary(summary)
        return {**summary, "losses": self.losses,
                "stopped_by": self.stop.stopped if self.stop is not None else 0}


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
            from plait.runtime.env import mark_failed

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
