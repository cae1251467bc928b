"""`plait train`: the built-in GPT on the built-in byte corpus, under any layout.

The loop is plain PyTorch (forward, backward, clip, step) around a model wrapped by
`build_model`; only the wrapping changes with the layout flags. It spawns its own local ranks
when it is not already running under torchrun / `plait run` / Slurm.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import plait
from plait import checkpoint, comm
from plait.app.data import BatchSampler, default_corpus_path, load_corpus
from plait.clip import clip_grad_norm_
from plait.mesh import Mesh
from plait.models.gpt import GPT, PRESETS, GPTConfig, lm_loss
from plait.pipeline import SCHEDULES, Pipeline, make_schedule
from plait.pipeline.split import plan_stages, segments
from plait.tp.apply import loss_fn_for

STRATEGIES = ("none", "dp", "ddp", "fsdp")
MIXED_PRECISIONS = ("bf16", "fp16")
MIN_CORPUS_BYTES = 1024  # load_corpus refuses less
VAL_FRACTION = inspect.signature(load_corpus).parameters["val_fraction"].default
DATA_AXES = ("dp", "fsdp")  # ranks along these axes see different data


@dataclass
class TrainConfig:
    """Everything `plait train` can be told; validated before any process is spawned."""

    model: str = "tiny"
    strategy: str = "ddp"  # none | dp (threads) | ddp | fsdp, on the data axes
    nproc: int = 2  # processes (or threads for dp); data-parallel size = nproc / (pp * tp)
    tp: int = 1
    sequence_parallel: bool = False
    pp: int = 1
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zb-h1
    microbatches: int = 4
    chunks: int = 1  # pipeline stages per rank (interleaved schedules)
    dp: int = 1  # with --strategy fsdp: replicas of the fsdp shards (hybrid sharding)
    zero_stage: int = 3
    mixed_precision: str | None = None
    offload: bool = False
    reshard_after_forward: bool = True
    backward_prefetch: bool = True  # --no-backward-prefetch: FSDP's lowest-memory backward
    steps: int = 200
    batch_size: int = 16  # global batch, in sequences
    seq_len: int | None = None  # default: the preset's
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 4
    seed: int = 0
    data: str | None = None
    max_bytes: int = 16 * 2**20
    metrics: str = "runs/metrics.jsonl"
    save_dir: str | None = None  # checkpoints go to SAVE_DIR/step_NNNNNN
    save_every: int = 0  # 0: only at the end (when --save-dir is given)
    resume: bool = False  # continue from the newest intact checkpoint in --save-dir, on any world size
    resume_anyway: bool = False  # resume a checkpoint of another run (other seed, lr, data...) with a warning
    keep: int = 3  # checkpoints kept in --save-dir: older ones go once a newer one is complete
    async_save: bool = False  # write checkpoints in the background: the loop stalls only for the copy
    progress: bool = True

    def __post_init__(self) -> None:
        # Everything a rank would only find out after the job started is checked here, in the
        # parent process: a bad flag must fail before any process is spawned.
        self._check_choices()
        self._check_ranges()
        self._check_layout()
        if self.pp > 1:
            self._check_pipeline()
        self._check_model_fit()
        self._check_paths()

    def _check_choices(self) -> None:
        if self.model not in PRESETS:
            raise ValueError(f"--model must be one of {sorted(PRESETS)}, got {self.model!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"--strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.mixed_precision not in (None, *MIXED_PRECISIONS):
            raise ValueError(f"--mixed-precision must be one of {MIXED_PRECISIONS}, "
                             f"got {self.mixed_precision!r}")
        if self.zero_stage not in (1, 2, 3):
            raise ValueError(f"--zero-stage must be 1, 2 or 3, got {self.zero_stage}")

    def _check_ranges(self) -> None:
        for name in ("nproc", "steps", "batch_size", "grad_accum", "eval_batches", "tp", "dp", "pp",
                     "microbatches", "chunks"):
            _require(self, name, getattr(self, name) >= 1, "an integer >= 1")
        if self.keep < 1:
            raise ValueError(f"--keep must be >= 1 (the newest checkpoints kept), got {self.keep}")
        for name in ("eval_every", "save_every"):
            _require(self, name, getattr(self, name) >= 0, "an integer >= 0 (0: off)")
        _require(self, "seq_len", self.seq_len is None or self.seq_len >= 1, "an integer >= 1")
        _require(self, "seed", 0 <= self.seed < 2**32, "an integer in [0, 2**32)")
        _require(self, "max_bytes", self.max_bytes >= MIN_CORPUS_BYTES,
                 f"an integer >= {MIN_CORPUS_BYTES} (the smallest corpus the loader accepts)")
        # `not x > 0` and friends are also true for NaN, which every comparison rejects.
        _require(self, "lr", math.isfinite(self.lr) and self.lr > 0, "a finite number > 0")
        _require(self, "min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "a number in [0, 1]")
        _require(self, "weight_decay", math.isfinite(self.weight_decay) and self.weight_decay >= 0,
                 "a finite number >= 0")
        _require(self, "grad_clip", math.isfinite(self.grad_clip) and self.grad_clip >= 0,
                 "a finite number >= 0 (0: no clipping)")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"--warmup must be in [0, --steps); got {self.warmup} with {self.steps} steps")

    def _check_layout(self) -> None:
        if self.strategy == "none" and self.nproc != 1:
            raise ValueError(f"--strategy none runs one process; got --nproc {self.nproc} (use ddp or dp)")
        if self.strategy in ("none", "dp") and self.tp > 1:
            raise ValueError(
                f"--tp needs one process per rank: use --strategy ddp or fsdp, not {self.strategy}"
            )
        if self.strategy != "fsdp":
            # Only FSDP reads these; anywhere else they would be dropped without a word.
            for flag, given in (("--mixed-precision", self.mixed_precision), ("--offload", self.offload),
                                ("--zero-stage", self.zero_stage != 3 and self.zero_stage),
                                ("--no-reshard-after-forward", not self.reshard_after_forward),
                                ("--no-backward-prefetch", not self.backward_prefetch)):
                if given:
                    value = f" {given}" if not isinstance(given, bool) else ""
                    raise ValueError(f"{flag}{value} applies to --strategy fsdp only (FSDP's sharding, "
                                     f"mixed precision and offloading); --strategy {self.strategy} would "
                                     "ignore it: use --strategy fsdp or drop the flag")
        if self.sequence_parallel and self.tp < 2:
            raise ValueError("--sequence-parallel splits the sequence over the tensor-parallel ranks: it "
                             f"needs --tp 2 or more, got --tp {self.tp}")
        if self.dp > 1 and self.strategy != "fsdp":
            raise ValueError(
                "--dp (hybrid replicas) applies to --strategy fsdp; with ddp every data rank is dp"
            )
        if self.chunks > 1 and self.pp < 2:
            raise ValueError(f"--chunks {self.chunks} sets pipeline stages per rank: it needs --pp 2 or "
                             f"more, got --pp {self.pp}")
        if self.nproc % (self.pp * self.tp * self.dp):
            raise ValueError(f"--nproc {self.nproc} is not divisible by --pp {self.pp} x --tp {self.tp} x "
                             f"--dp {self.dp}")
        if self.batch_size % (self.data_parallel_size * self.grad_accum):
            raise ValueError(
                f"--batch-size {self.batch_size} must be divisible by the data-parallel size "
                f"{self.data_parallel_size} x --grad-accum {self.grad_accum}"
            )
        if self.resume and not self.save_dir:
            raise ValueError("--resume needs --save-dir (where to find the checkpoint)")

    def _check_pipeline(self) -> None:
        if self.strategy not in ("ddp", "fsdp"):
            raise ValueError("--pp combines with --strategy ddp or fsdp (data parallel across pipelines, "
                             "each stage its own DDP or FSDP module) and --tp; got --strategy "
                             f"{self.strategy}")
        if self.strategy == "fsdp" and self.zero_stage == 3 and self.schedule == "zb-h1":
            raise ValueError("--schedule zb-h1 with --zero-stage 3: ZeRO-3 frees each stage's gathered "
                             "parameters when a backward pass ends, so the deferred weight-gradient pass (W) "
                             "could read freed parameters; use --zero-stage 2 or another --schedule")
        # --grad-accum K runs K times the microbatches in one schedule: the same accumulation, without
        # K pipeline fills and drains, and 1F1B keeps at most --pp microbatches' activations alive.
        microbatches = self.microbatches * self.grad_accum
        per_pipeline = self.batch_size // self.data_parallel_size
        if per_pipeline % microbatches:
            raise ValueError(f"the per-pipeline batch {per_pipeline} is not divisible by --microbatches "
                             f"{self.microbatches} x --grad-accum {self.grad_accum}")
        try:  # the same generator the ranks run: a pure function, no process group needed
            make_schedule(self.schedule, self.pp, microbatches, self.chunks)
        except ValueError as e:
            raise ValueError(f"--schedule {self.schedule} with --pp {self.pp} --microbatches "
                             f"{self.microbatches} --grad-accum {self.grad_accum} --chunks {self.chunks}: "
                             f"{e}") from None

    def _check_model_fit(self) -> None:
        """Model and data against the layout: head counts, pipeline segments, sequence length."""
        gcfg = self.gpt_config()
        if self.tp > 1:
            sizes = {"attention heads": gcfg.n_heads, "KV heads": gcfg.n_kv_heads, "MLP units": gcfg.d_ff}
            if any(n % self.tp for n in sizes.values()):
                fits = [d for d in range(1, gcfg.n_heads + 1) if all(n % d == 0 for n in sizes.values())]
                have = ", ".join(f"{n} {what}" for what, n in sizes.items())
                raise ValueError(f"--tp {self.tp}: tensor parallelism splits the {self.model} model's {have} "
                                 f"evenly over the tp ranks; --tp must divide them all: one of {fits}")
            if self.sequence_parallel and gcfg.seq_len % self.tp:
                raise ValueError(f"--sequence-parallel splits the sequence over --tp {self.tp}: the sequence "
                                 f"length {gcfg.seq_len} (--seq-len) must be divisible by it")
        if self.pp > 1:
            _check_stages(self, gcfg)
        if self.data is not None and not Path(self.data).exists():
            raise ValueError(f"--data {self.data}: no such file or folder")
        total = _corpus_bytes(self.data, self.max_bytes)
        if total < MIN_CORPUS_BYTES:
            raise ValueError(f"--data {self.data}: holds {total} bytes; the corpus needs at least "
                             f"{MIN_CORPUS_BYTES}")
        held_out = total - int(total * (1 - VAL_FRACTION))  # the split load_corpus makes
        if held_out <= gcfg.seq_len + 1:
            raise ValueError(
                f"--seq-len {gcfg.seq_len}: a training window is seq_len + 1 bytes and the held-out "
                f"{VAL_FRACTION:.0%} of the corpus ({held_out} of {total} bytes read from "
                f"{self.data or 'the standard library'}, --max-bytes {self.max_bytes}) must hold one; use "
                f"--seq-len below {held_out - 1} or a larger corpus")

    def _check_paths(self) -> None:
        """Paths the run writes: found unusable only at the first write, after training started."""
        _check_writable("--metrics", Path(self.metrics), want_dir=False)
        if self.save_dir is not None:
            _check_writable("--save-dir", Path(self.save_dir), want_dir=True)

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different data (threads of dp share one process but split the batch)."""
        return self.nproc // (self.tp * self.pp)

    def gpt_config(self) -> GPTConfig:
        base = PRESETS[self.model]
        return dataclasses.replace(base, seq_len=self.seq_len or base.seq_len)

    def mesh(self) -> Mesh:
        if self.strategy == "fsdp":
            return Mesh(pp=self.pp, dp=self.dp, fsdp=-1, tp=self.tp)
        return Mesh(pp=self.pp, dp=-1, tp=self.tp)


def _require(cfg: TrainConfig, name: str, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be {allowed}")


def _check_stages(cfg: TrainConfig, gcfg: GPTConfig) -> None:
    """Cut the model as the pipeline will (a meta-device copy, nothing allocated): every pp rank
    needs at least one stage that holds parameters, or its optimizer would have nothing to step."""
    with torch.device("meta"):
        segs = segments(GPT(gcfg))
    names = [n for n, _ in segs]
    n_stages = cfg.pp * cfg.chunks
    if n_stages > len(segs):
        raise ValueError(f"--pp {cfg.pp} x --chunks {cfg.chunks} = {n_stages} pipeline stages, but the "
                         f"{cfg.model} model has only {len(segs)} segments to split ({', '.join(names)}): "
                         f"--pp x --chunks must be at most {len(segs)}")
    sched = make_schedule(cfg.schedule, cfg.pp, cfg.microbatches, cfg.chunks)
    plan = plan_stages(segs, sched.stages, "auto")
    for rank in range(cfg.pp):
        mine = [i for s in sched.rank_stages(rank) for i in plan[s]]
        if not any(p.numel() for i in mine for p in segs[i][1].parameters()):
            held = ", ".join(names[i] for i in mine)
            raise ValueError(f"--pp {cfg.pp} x --chunks {cfg.chunks}: cutting the {cfg.model} model's "
                             f"{len(segs)} segments into {n_stages} stages leaves pipeline rank {rank} "
                             f"with only {held}, which holds no parameters; use fewer stages")


def _corpus_bytes(data: str | None, max_bytes: int) -> int:
    """How many bytes `load_corpus` will read: the files' total size, capped at ``max_bytes``."""
    root = Path(data) if data is not None else default_corpus_path()
    if root.is_file():
        return min(root.stat().st_size, max_bytes)
    suffix = ".py" if data is None else ""  # the default corpus is the standard library's .py files
    total = 0
    for folder, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        for f in files:
            if f.endswith(suffix):
                with contextlib.suppress(OSError):
                    total += os.stat(os.path.join(folder, f)).st_size
            if total >= max_bytes:
                return max_bytes
    return total


def _check_writable(flag: str, path: Path, want_dir: bool) -> None:
    """A path the run will create or append to: the right kind, under a writable folder."""
    if path.exists():
        if want_dir and not path.is_dir():
            raise ValueError(f"{flag} {path}: is an existing file; checkpoints are written into a folder")
        if not want_dir and path.is_dir():
            raise ValueError(f"{flag} {path}: is a folder; it must name the file to append to")
        if not os.access(path, os.W_OK):
            raise ValueError(f"{flag} {path}: is not writable")
        return
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is a file, so the folders above {path.name} cannot be "
                         "created; choose a path under a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: the folder {parent} is not writable")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_model(cfg: TrainConfig, mesh: Mesh, device: torch.device) -> nn.Module | Pipeline:
    """Build the GPT and wrap it for the layout through `plait.parallelize` (threads: DataParallel)."""
    gcfg = cfg.gpt_config()
    if cfg.strategy == "dp":
        from plait.data_parallel import DataParallel

        gpt = plait.init_weights(GPT(gcfg), cfg.seed).to(device)
        devices = list(range(cfg.nproc)) if device.type == "cuda" else ["cpu"] * cfg.nproc
        return DataParallel(gpt, devices)
    from plait.models.plans import gpt_plan
    from plait.parallelize import ParallelPlan, parallelize

    with torch.device("meta"):  # each strategy materializes only what this rank keeps
        gpt = GPT(gcfg)
    # With --tp the pipeline's last stage computes the vocab-parallel loss (loss_fn unset).
    pipelined = dict(pp_schedule=cfg.schedule, pp_microbatches=cfg.microbatches * cfg.grad_accum,
                     pp_chunks=cfg.chunks, loss_fn=lm_loss if cfg.tp == 1 else None) if cfg.pp > 1 else {}
    fsdp = dict(zero_stage=cfg.zero_stage, mixed_precision=cfg.mixed_precision, offload=cfg.offload,
                reshard_after_forward=cfg.reshard_after_forward,
                backward_prefetch=cfg.backward_prefetch) if cfg.strategy == "fsdp" else {}
    plan = ParallelPlan(tp=gpt_plan(gcfg) if cfg.tp > 1 else None, sequence_parallel=cfg.sequence_parallel,
                        data="fsdp" if cfg.strategy == "fsdp" else "ddp", seed=cfg.seed, **fsdp, **pipelined)
    return parallelize(gpt, mesh, plan)


def _mean_over(value: float, group: dist.ProcessGroup, size: int) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=comm.device_of(group))
    comm.all_reduce(t, group)
    return t.item() / size


def _forward_backward(model: nn.Module | Pipeline, x: torch.Tensor, y: torch.Tensor,
                      cfg: TrainConfig, loss_fn: Callable) -> float:
    """One optimizer step's gradients (left in ``.grad``); returns this rank's mean loss."""
    if isinstance(model, Pipeline):
        # Microbatches (x --grad-accum) run on the schedule; each stage's last backward reduces
        # the accumulated gradients over the data axes while it runs.
        return model.step(x, y).item()
    loss_sum = 0.0
    for i, (xm, ym) in enumerate(zip(x.chunk(cfg.grad_accum), y.chunk(cfg.grad_accum))):
        # Only the last micro-batch communicates; the others accumulate locally.
        quiet = hasattr(model, "no_sync") and i < cfg.grad_accum - 1
        with model.no_sync() if quiet else contextlib.nullcontext():
            loss = loss_fn(model(xm), ym) / cfg.grad_accum
            loss.backward()
        loss_sum += loss.item()
    return loss_sum


def _evaluate(model: nn.Module | Pipeline, sampler: BatchSampler, cfg: TrainConfig, device: torch.device,
              mesh: Mesh) -> float:
    total = 0.0
    if isinstance(model, Pipeline):
        for i in range(cfg.eval_batches):
            x, y = sampler.batch_at(i)
            total += float(model.eval_step(x.to(device), y.to(device)))
        return _mean_over(total / cfg.eval_batches, mesh.group(DATA_AXES), mesh.size(DATA_AXES))
    loss_fn = loss_fn_for(model)
    model.eval()
    with torch.no_grad():
        for i in range(cfg.eval_batches):
            x, y = sampler.batch_at(i)
            total += loss_fn(model(x.to(device)), y.to(device)).item()
    model.train()
    return _mean_over(total / cfg.eval_batches, mesh.group(DATA_AXES), mesh.size(DATA_AXES))


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run on this rank (inside an initialised job); returns the summary on every rank."""
    device = plait.init(seed=cfg.seed)
    log = plait.get_logger("plait.train")
    mesh = cfg.mesh()
    dp_rank, dp_size = mesh.rank(DATA_AXES), mesh.size(DATA_AXES)
    corpus = load_corpus(cfg.data, max_bytes=cfg.max_bytes)
    model = build_model(cfg, mesh, device)
    loss_fn = lm_loss if isinstance(model, Pipeline) else loss_fn_for(model)
    seq = cfg.gpt_config().seq_len
    sampler = BatchSampler(corpus.train, seq, cfg.batch_size, dp_rank, dp_size, seed=cfg.seed)
    val = BatchSampler(corpus.val, seq, cfg.batch_size, dp_rank, dp_size, seed=cfg.seed + 1)
    params = [p for p in model.parameters() if p.requires_grad]
    adam = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    opt = torch.optim.AdamW(params, **adam)
    is_main = dist.get_rank() == 0
    start = _maybe_resume(cfg, model, opt, sampler, log)
    with torch.device("meta"):
        n_params = GPT(cfg.gpt_config()).num_parameters()
    log.info("%s, %s params, corpus %s (%.1f MB), %s %s, global batch %d x %d tokens",
             cfg.model, f"{n_params:,}", corpus.source, len(corpus.train) / 1e6, cfg.strategy,
             mesh if cfg.strategy != "dp" else f"{cfg.nproc} threads", cfg.batch_size, seq)
    metrics_path = Path(cfg.metrics)
    if is_main:
        metrics_path.parent.mkdir(parents=True, exist_ok=True)
    bar = _progress(cfg, is_main, start)
    tokens_per_step = cfg.batch_size * seq
    first_loss = last_loss = float("nan")
    losses: list[float] = []
    eval_loss = None
    t_start = time.perf_counter()
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        x, y = next(sampler)
        x, y = x.to(device), y.to(device)
        opt.zero_grad(set_to_none=True)
        with comm.scope(f"step {step + 1}"):  # named in desync reports, timeouts and flight records
            loss_sum = _forward_backward(model, x, y, cfg, loss_fn)
            # --grad-clip 0: no clipping (torch's formula would zero every gradient); the norm
            # is still measured for the metrics.
            grad_norm = float(clip_grad_norm_(model, cfg.grad_clip or math.inf))
            opt.step()
            last_loss = _mean_over(loss_sum, mesh.group(DATA_AXES), dp_size)
        losses.append(last_loss)
        if step == start:  # the first step this run took (after a resume, not step 0)
            first_loss = last_loss
        dt = time.perf_counter() - t0
        record = {"step": step + 1, "loss": last_loss, "lr": lr_at(step, cfg), "grad_norm": grad_norm,
                  "tokens_per_s": tokens_per_step / dt, "step_time_s": dt}
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            eval_loss = _evaluate(model, val, cfg, device, mesh)
            record["eval_loss"] = eval_loss
        if is_main:
            with metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if bar is not None:
                bar.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                bar.update(1)
            elif (step + 1) % max(1, cfg.steps // 10) == 0:
                log.info("step %d/%d loss %.4f tok/s %.0f", step + 1, cfg.steps, last_loss,
                         record["tokens_per_s"])
        due = (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps
        if cfg.save_dir and due:
            meta = {"step": step + 1, "sampler": sampler.state_dict(), "config": dataclasses.asdict(cfg),
                    "identity": _identity(cfg, sampler), "layout": _layout(cfg)}
            saving = checkpoint.save(Path(cfg.save_dir) / f"step_{step + 1:06d}", model, opt, meta,
                                     keep=cfg.keep, async_save=cfg.async_save)
            if step + 1 == cfg.steps:
                saving.wait()  # the run ends with its last checkpoint complete
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t_start
    summary = {"first_loss": first_loss, "final_loss": last_loss, "eval_loss": eval_loss,
               "steps": cfg.steps, "tokens_per_s": cfg.steps * tokens_per_step / elapsed,
               "params": n_params, "strategy": cfg.strategy, "world": dist.get_world_size()}
    log.info("done: loss %.3f -> %.3f, eval %s, %.0f tokens/s; metrics in %s", first_loss, last_loss,
             f"{eval_loss:.3f}" if eval_loss is not None else "-", summary["tokens_per_s"], metrics_path)
    if is_main:
        with metrics_path.open("a") as f:
            f.write(json.dumps({"summary": summary}) + "\n")
    return {**summary, "losses": losses}


def _maybe_resume(cfg: TrainConfig, model: nn.Module | Pipeline, opt: torch.optim.Optimizer,
                  sampler: BatchSampler, log: Any) -> int:
    """Load the newest intact checkpoint of this run when ``--resume``; return the step to continue from.

    Corrupt ones are skipped with a warning (`checkpoint.choose`), another run's are refused
    unless ``--resume-anyway``; a different world size or layout is fine (the state reshards).
    """
    if not cfg.resume:
        return 0
    found = checkpoint.choose(cfg.save_dir, _identity(cfg, sampler),  # type: ignore[arg-type]
                              resume_anyway=cfg.resume_anyway)
    if found is None:
        log.info("--resume: no checkpoint in %s yet, starting from step 0", cfg.save_dir)
        return 0
    path, meta = found
    checkpoint.load(path, model, opt, check=False)  # choose() verified it on rank 0
    sampler.load_state_dict(meta["sampler"])
    log.info("resumed from %s (step %d, written by %s)", path, meta["step"], meta.get("layout"))
    return int(meta["step"])


def _identity(cfg: TrainConfig, sampler: BatchSampler) -> dict[str, Any]:
    """What makes two runs one run, compared on ``--resume``: the model, the data (by content:
    the same bytes under another path are the same data), the seed, the global batch size and
    the optimizer and learning-rate settings. ``--steps`` is left out (resuming with more steps
    to train longer is legitimate; the cosine decay then follows the new length), and so is
    the layout, precision and offload included (checkpoints reshard)."""
    return {"model": dataclasses.asdict(cfg.gpt_config()), "seed": cfg.seed, "batch_size": cfg.batch_size,
            "lr": cfg.lr, "min_lr_ratio": cfg.min_lr_ratio, "warmup": cfg.warmup,
            "weight_decay": cfg.weight_decay, "grad_clip": cfg.grad_clip,
            "data": {"bytes": len(sampler.tokens), "sha256": checkpoint.digest(sampler.tokens)}}


def _layout(cfg: TrainConfig) -> dict[str, Any]:
    """How the run was spread over ranks: recorded in checkpoints, not compared on resume."""
    return {"world_size": dist.get_world_size(), "strategy": cfg.strategy, "pp": cfg.pp, "tp": cfg.tp,
            "data_parallel": cfg.data_parallel_size, "hybrid_dp": cfg.dp, "zero_stage": cfg.zero_stage}


def _progress(cfg: TrainConfig, is_main: bool, start: int):
    if not (cfg.progress and is_main):
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)


def _spawned_rank(cfg: TrainConfig) -> None:
    # No teardown here: `plait.init` registered the one shutdown path (a barrier, then every
    # group destroyed in order), which runs when this process exits, as under any launcher.
    train(cfg)


def parse_args(argv: list[str]) -> TrainConfig:
    p = argparse.ArgumentParser(prog="plait train", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default  # the field's, not an instance's: making one would check its paths
        if isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            kind = {int: int, float: float}.get(type(default), str)
            if f.name in ("seq_len",):
                kind = int
            choices = {"model": sorted(PRESETS), "strategy": STRATEGIES, "schedule": SCHEDULES,
                       "mixed_precision": MIXED_PRECISIONS, "zero_stage": (1, 2, 3)}.get(f.name)
            p.add_argument(flag, type=kind, default=default, choices=choices)
    args = p.parse_args(argv)
    try:
        return TrainConfig(**vars(args))
    except ValueError as e:
        p.error(str(e))
        raise


def _fit_launcher(cfg: TrainConfig, argv: list[str], world: int) -> TrainConfig:
    """Under torchrun / `plait run` / srun the launcher chose the world size: --nproc must agree."""
    if cfg.strategy in ("none", "dp"):
        if world > 1:
            raise ValueError(f"--strategy {cfg.strategy} runs in one process, but the launcher started "
                             f"{world} ranks: use --strategy ddp or fsdp")
        return cfg
    if cfg.nproc == world:
        return cfg
    if any(a == "--nproc" or a.startswith("--nproc=") for a in argv):
        raise ValueError(f"--nproc {cfg.nproc}: the launcher started {world} ranks; pass --nproc {world} "
                         "or leave --nproc out")
    return parse_args([*argv, "--nproc", str(world)])  # checked like a flag given by hand


def cli_main(argv: list[str]) -> int:
    from plait.env import launch_from_env

    cfg = parse_args(argv)
    launch = launch_from_env()
    under_launcher = launch.source != "single"
    if under_launcher:
        try:
            cfg = _fit_launcher(cfg, argv, launch.world_size)
        except ValueError as e:
            print(f"plait train: error: {e}", file=sys.stderr)
            return 2
    if under_launcher or cfg.strategy in ("none", "dp"):
        train(cfg)
        return 0
    from plait.app.launch import spawn

    threads = max(1, (os.cpu_count() or 1) // cfg.nproc)
    spawn(_spawned_rank, cfg.nproc, (cfg,), threads=threads)
    return 0
