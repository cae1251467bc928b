"""`plait train`'s configuration: typed sections, read from flags and from a TOML file.

The sections are dataclasses (model, parallel, optimizer, data, checkpoint, run); `tyro`
turns their fields, types and docstrings into the command line, with each flag named after
its field alone (``--tp``, ``--zero-stage``, ``--lr``), so the flat flags scripts already use
keep working. ``--config run.toml`` reads the same fields grouped by section::

    [parallel]
    strategy = "fsdp"
    nproc = 4
    tp = 2

    [optimizer]
    lr = 1e-3

Flags on the command line override the file. Every combination that could not run is refused
by `TrainConfig` itself, in the parent process, before any rank is spawned.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_type_hints

import torch
import tyro
from torch import nn

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before it joined the standard library
    import tomli as tomllib

from plait.app import data as corpus
from plait.app import usermodel
from plait.env import DEFAULT_TIMEOUT_S
from plait.mesh import Mesh
from plait.models.gpt import GPT, PRESETS, GPTConfig
from plait.parallel_plan import ParallelPlan
from plait.pipeline import SCHEDULES
from plait.rules import LayoutError, MeshShape, check_layout

__all__ = ["ModelSection", "ParallelSection", "OptimizerSection", "DataSection", "CheckpointSection",
           "RunSection", "TrainConfig", "parse_args", "given_flags", "to_toml"]

# The choices the command line offers; tests keep them equal to PRESETS and SCHEDULES.
ModelName = Literal["tiny", "small", "25m", "50m", "100m", "llama3-8b", "llama3-70b"]
Strategy = Literal["none", "dp", "ddp", "fsdp"]
ScheduleName = Literal["gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"]
Precision = Literal["bf16", "fp16"]
TokenDtype = Literal["uint16", "uint32"]  # plait.app.data.TOKEN_DTYPES
CPAlgorithm = Literal["ring", "allgather", "ulysses"]  # plait.cp.ALGORITHMS
Checkpointing = Literal["none", "full", "selective"]  # "none", then plait.activation_checkpointing.POLICIES
ZeroStage = Literal[1, 2, 3]
BalanceStatistic = Literal["global", "microbatch"]  # plait.models.moe.BALANCE_STATISTICS

STRATEGIES: tuple[str, ...] = get_args(Strategy)
MIXED_PRECISIONS: tuple[str, ...] = get_args(Precision)
HF_DEFAULT_SEQ_LEN = 128  # --hf-config without --seq-len
MIN_CORPUS_BYTES = corpus.MIN_TOKENS  # load_corpus refuses less
VAL_FRACTION = inspect.signature(corpus.load_corpus).parameters["val_fraction"].default


@dataclass
class ModelSection:
    """The model: plait's GPT at one of its preset sizes, or the model a function of yours builds."""

    name: Annotated[str, tyro.conf.arg(name="model", metavar="PRESET|FACTORY")] = "tiny"
    """plait's GPT at a preset: tiny | small | 25m | 50m | 100m | llama3-8b | llama3-70b (Llama 3's
    shapes); or package.module:function, a FACTORY as plait check takes it (returns the model, or
    (model, make_batch, loss_fn): loss_fn(output, targets) replaces the next-token loss)"""
    seq_len: int | None = None
    """tokens per sequence; None: the preset's (with --hf-config or a FACTORY 128, fewer if the model's
    positions end sooner)"""
    layers: int | None = None
    """blocks of plait's GPT; None: the preset's"""
    vocab_size: int | None = None
    """plait's GPT's vocabulary; None: the preset's, or the data's (largest token id + 1) when larger"""
    hf_config: str | None = None
    """a transformers causal LM's config.json (or its folder): train that model, randomly initialised,
    instead of plait's GPT (needs plait[hf])"""
    experts: int = 0
    """mixture of experts: routed experts per MoE block of plait's GPT (0: dense MLPs)"""
    top_k: int = 2
    """with --experts: experts each token is routed to"""
    shared_experts: int = 0
    """with --experts: experts every token goes through as well"""
    capacity_factor: float | None = None
    """with --experts: drop assignments past capacity_factor x the even share per expert (None: dropless)"""
    aux_loss_coef: float = 0.01
    """with --experts: weight of the load-balancing loss (0: off)"""
    bias_update_rate: float = 0.0
    """with --experts: DeepSeek-V3's loss-free balancing, the routing bias step per optimizer step (0: off)"""
    balance_statistic: BalanceStatistic = "global"
    """with --experts: the tokens both balancings count: global (the step's whole batch, so every
    layout trains as one process) or microbatch (each rank's micro-batch on its own; the run depends
    on the layout)"""
    init_from: str | None = None
    """start from the safetensors weights in this folder (as plait export writes them; for --hf-config
    the transformers names); each rank reads its slices. With --resume a checkpoint found wins"""


@dataclass
class ParallelSection:
    """How the ranks share the work: the data-parallel strategy and the mesh degrees."""

    strategy: Strategy = "ddp"
    """on the data axes: none (one process) | dp (threads) | ddp | fsdp"""
    nproc: int = 2
    """processes (threads for dp); the data-parallel size is nproc / (pp * cp * tp)"""
    tp: int = 1
    """tensor-parallel degree"""
    sequence_parallel: bool = False
    """split norms and dropout over the tp ranks along the sequence (needs tp >= 2)"""
    ep: int = 1
    """expert-parallel degree: experts split over this many of the data-parallel ranks (needs --experts)"""
    cp: int = 1
    """context-parallel degree: each sequence split over this many ranks, attention included"""
    cp_algorithm: CPAlgorithm = "ring"
    """with --cp: ring (K/V passed around, overlapped) | allgather (all K/V gathered) | ulysses
    (all-to-all to a head split)"""
    pp: int = 1
    """pipeline stages"""
    schedule: ScheduleName = "1f1b"
    """pipeline schedule"""
    microbatches: int = 4
    """microbatches per pipeline step"""
    chunks: int = 1
    """pipeline stages per rank (interleaved schedules; zbv and dualpipev always hold 2)"""
    dp: int = 1
    """with fsdp: replicas of the fsdp shards (hybrid sharding)"""
    zero_stage: ZeroStage = 3
    """fsdp only: 1 shards optimizer state, 2 also gradients, 3 also parameters"""
    mixed_precision: Precision | None = None
    """compute in this dtype with fp32 master weights, any layout but dp (fp16: with dynamic loss scaling)"""
    offload: bool = False
    """fsdp only: parameter shards and optimizer state in CPU memory"""
    reshard_after_forward: bool = True
    """fsdp only: free gathered parameters after forward (gather again in backward)"""
    backward_prefetch: bool = True
    """fsdp only: gather the next unit during backward (off: lowest memory)"""
    ac: Checkpointing = "none"
    """activation checkpointing: keep each block's input only and recompute it in backward (full), or
    keep its matmul and attention outputs too (selective)"""
    ac_every: int = 1
    """with --ac: checkpoint every k-th block only"""
    heal: bool = False
    """data-parallel replicas that heal without a restart (--strategy ddp): a replica that dies or hangs
    is dropped, the survivors redo the step over the live ones with the same global batch, and a new
    process joins at a step boundary with a peer's state (docs/failures.md)"""
    heal_timeout: float = 5.0
    """with --heal: seconds a collective waits for a peer, and the survivors then wait for each other,
    before a silent replica is dropped (a dead one is dropped at once)"""
    heal_replace: bool = True
    """with --heal: replace each replica that dies (at most --nproc in a run) by a standby process started
    ahead, with the data and model loaded, that joins at the next step boundary"""


@dataclass
class OptimizerSection:
    """AdamW (betas 0.9, 0.95) with linear warm-up and cosine decay."""

    lr: float = 3e-3
    """peak learning rate"""
    min_lr_ratio: float = 0.1
    """the cosine decays to min_lr_ratio * lr"""
    warmup: int = 20
    """warm-up steps"""
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    """clip the global gradient norm to this (0: no clipping; the norm is still logged)"""


@dataclass
class DataSection:
    """The corpus (text as bytes, a token file, or documents for a tokenizer) and the global batch."""

    path: Annotated[str | None, tyro.conf.arg(name="data")] = None
    """a token file (.bin, .npy), or a text file or folder (bytes; .git and binary files skipped); with
    --tokenizer, text, JSON Lines or Parquet file(s); None: the Python standard library's sources"""
    tokenizer: str | None = None
    """a folder holding a transformers tokenizer: --data is read through Hugging Face datasets, tokenized
    once and cached (needs plait[data])"""
    text_field: str = "text"
    """with --tokenizer: the field of a JSON Lines record or Parquet row that holds a document's text"""
    data_cache: str | None = None
    """with --tokenizer: where tokenized data is cached (DATA_CACHE/tokens/KEY.npy); None: ~/.cache/plait"""
    data_dtype: TokenDtype | None = None
    """a raw .bin's token width: uint16 (nanoGPT's) | uint32; None: from the Megatron .idx beside it"""
    eval_data: str | None = None
    """held-out data for the validation loss, in any --data format; None: the last 5% of --data"""
    max_bytes: int | None = None
    """read at most this many bytes of a text corpus (said in the log when it cuts); None: all of it"""
    batch_size: int = 16
    """the global batch, in sequences"""


@dataclass
class CheckpointSection:
    """Saving, resuming and keeping checkpoints."""

    save_dir: str | None = None
    """checkpoints go to SAVE_DIR/step_NNNNNN"""
    save_every: int = 0
    """steps between checkpoints (0: only at the end, when save_dir is given)"""
    resume: bool | Literal["auto"] = False
    """continue from the newest intact checkpoint in save_dir, on any world size (--resume alone: one must
    exist; --resume auto: the newest if there is one, else step 0, for commands a launcher restarts)"""
    resume_anyway: bool = False
    """resume a checkpoint of another run (other seed, lr, data...) with a warning"""
    keep: int = 3
    """checkpoints kept: older ones go once a newer one is complete"""
    async_save: bool = False
    """write checkpoints in the background: the loop stalls only for the copy to CPU"""


@dataclass
class RunSection:
    """The loop: steps, accumulation, evaluation, seeds and what it writes."""

    steps: int = 200
    grad_accum: int = 1
    """micro-batches per optimizer step (pipelines: that many times the microbatches)"""
    seed: int = 0
    eval_every: int = 50
    """steps between held-out evaluations (0: off)"""
    eval_batches: int = 4
    run_dir: str = "runs"
    """the folder of run folders: each run writes RUN_DIR/NAME/ (config.toml, metrics.jsonl, flight/,
    checkpoints/)"""
    name: str | None = None
    """the run's folder under --run-dir; None: a new timestamped id. An existing run continues only
    with --resume"""
    tensorboard: bool = False
    """also write TensorBoard event files to RUN_DIR/NAME/tensorboard (needs the tensorboard package)"""
    wandb: bool = False
    """also log the step records to Weights & Biases (needs the wandb package; WANDB_MODE=offline writes
    them under RUN_DIR/NAME/wandb without a network)"""
    log_samples: bool = False
    """record each step's global batch in metrics.jsonl as "samples": the sample ids (window offsets in
    the training tokens) the data ranks read, gathered in rank order"""
    peak_tflops: float | None = None
    """one device's peak dense TFLOP/s in the training dtype, for MFU; None: known GPUs' (CPUs: no MFU)"""
    progress: bool = True
    """a progress bar on rank 0"""
    straggler_every: int = 10
    """steps between straggler reports: a rank the others waited for in two reports' windows in a row,
    per axis and phase, logged and written to metrics.jsonl as "stragglers" (0: off; measured by the
    desync check)"""
    timeout: float = DEFAULT_TIMEOUT_S
    """seconds a collective waits for its peers before failing with an error naming the ranks that did
    not arrive (the innermost timeout: docs/failures.md)"""
    step_timeout: float | None = None
    """seconds a rank may go without finishing a step, evaluation or checkpoint before it writes every
    thread's stack to its run folder and exits (a rank stuck outside any collective); longer than
    --timeout. None: 3 x --timeout"""


SECTIONS: dict[str, type] = {"model": ModelSection, "parallel": ParallelSection,
                             "optimizer": OptimizerSection, "data": DataSection,
                             "checkpoint": CheckpointSection, "run": RunSection}


def _flag_of(cls: type, name: str) -> str:
    """A section field's flag (underscored): its own name, or the one its `tyro.conf.arg` gives."""
    extras = getattr(get_type_hints(cls, include_extras=True)[name], "__metadata__", ())
    return next((e.name for e in extras if getattr(e, "name", None)), name)


# flag (underscored) -> (section, field), and back; read once from the sections' annotations.
FLAGS: dict[str, tuple[str, str]] = {_flag_of(cls, f.name): (s, f.name)
                                     for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
FIELD_FLAGS: dict[tuple[str, str], str] = {where: flag for flag, where in FLAGS.items()}


@dataclass
class TrainConfig:
    """Everything `plait train` can be told, by section; checked on construction, so a config
    that exists can run (up to the machine it meets)."""

    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    data: DataSection = field(default_factory=DataSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    run: RunSection = field(default_factory=RunSection)

    @classmethod
    def from_flags(cls, **flags: Any) -> TrainConfig:
        """Build from flat keywords named like the flags: ``from_flags(tp=2, lr=1e-3, data="x.txt")``."""
        names = FLAGS
        unknown = sorted(set(flags) - set(names))
        if unknown:
            raise TypeError(f"unknown options {unknown}; known: {sorted(names)}")
        by_section: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
        for flag, value in flags.items():
            section, name = names[flag]
            by_section[section][name] = value
        return cls(**{s: SECTIONS[s](**kw) for s, kw in by_section.items()})

    def __post_init__(self) -> None:
        # Everything a rank would only find out after the job started is checked here, in the
        # parent process: a bad flag must fail before any process is spawned.
        self._check_choices()
        self._check_ranges()
        self._check_layout()
        self._data_info = self._check_data()
        if self.parallel.pp > 1:
            self._check_pipeline()
        self._check_heal()
        self._check_model_fit()
        self._check_paths()
        if self.model.init_from is not None:
            self._check_init_from()

    def _check_choices(self) -> None:
        par = self.parallel
        if self.model.name not in PRESETS and not usermodel.is_factory(self.model.name):
            raise ValueError(f"--model must be one of {sorted(PRESETS)} or a FACTORY "
                             f"(package.module:function), got {self.model.name!r}")
        if par.strategy not in STRATEGIES:
            raise ValueError(f"--strategy must be one of {STRATEGIES}, got {par.strategy!r}")
        if par.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {SCHEDULES}, got {par.schedule!r}")
        if par.mixed_precision not in (None, *MIXED_PRECISIONS):
            raise ValueError(f"--mixed-precision must be one of {MIXED_PRECISIONS}, "
                             f"got {par.mixed_precision!r}")
        if par.zero_stage not in (1, 2, 3):
            raise ValueError(f"--zero-stage must be 1, 2 or 3, got {par.zero_stage}")
        if par.ac not in get_args(Checkpointing):
            raise ValueError(f"--ac must be one of {get_args(Checkpointing)}, got {par.ac!r}")

    def _check_ranges(self) -> None:
        par, opt, run = self.parallel, self.optimizer, self.run
        sec: object
        for sec, name in ((par, "nproc"), (run, "steps"), (self.data, "batch_size"), (run, "grad_accum"),
                          (run, "eval_batches"), (par, "tp"), (par, "dp"), (par, "pp"), (par, "cp"),
                          (par, "ep"),
                          (par, "microbatches"), (par, "chunks"), (par, "ac_every")):
            _require(sec, name, getattr(sec, name) >= 1, "an integer >= 1")
        if self.checkpoint.keep < 1:
            raise ValueError(f"--keep must be >= 1 (the newest checkpoints kept), got {self.checkpoint.keep}")
        for sec, name in ((run, "eval_every"), (run, "straggler_every"), (self.checkpoint, "save_every")):
            _require(sec, name, getattr(sec, name) >= 0, "an integer >= 0 (0: off)")
        seq_len = self.model.seq_len
        _require(self.model, "seq_len", seq_len is None or seq_len >= 1, "an integer >= 1")
        _require(self.model, "layers", self.model.layers is None or self.model.layers >= 1, "an integer >= 1")
        if self.model.layers is not None and self.model.hf_config is not None:
            raise ValueError("--layers sets the blocks of plait's GPT; --hf-config's model has its own "
                             "(edit num_hidden_layers in its config)")
        _require(run, "seed", 0 <= run.seed < 2**32, "an integer in [0, 2**32)")
        _require(run, "timeout", math.isfinite(run.timeout) and run.timeout > 0,
                 "a finite number of seconds > 0")
        step_timeout = run.step_timeout
        if step_timeout is not None and not (math.isfinite(step_timeout) and step_timeout > run.timeout):
            raise ValueError(f"--step-timeout {step_timeout:g} must be longer than --timeout "
                             f"{run.timeout:g}: the collective timeout fires first and names the rank that "
                             "did not arrive; the step timeout catches a rank stuck outside collectives "
                             "(docs/failures.md)")
        cap = self.data.max_bytes
        _require(self.data, "max_bytes", cap is None or cap >= MIN_CORPUS_BYTES,
                 f"an integer >= {MIN_CORPUS_BYTES} (the smallest corpus the loader accepts)")
        _require(self.model, "vocab_size", self.model.vocab_size is None or self.model.vocab_size >= 1,
                 "an integer >= 1")
        peak = run.peak_tflops
        _require(run, "peak_tflops", peak is None or (math.isfinite(peak) and peak > 0),
                 "a finite number > 0")
        run_name = run.name
        if run_name is not None and (Path(run_name).name != run_name or run_name[:1] in ("", ".")):
            raise ValueError(f"--name {run.name!r}: names one folder under --run-dir (no '/', not hidden)")
        # `not x > 0` and friends are also true for NaN, which every comparison rejects.
        _require(opt, "lr", math.isfinite(opt.lr) and opt.lr > 0, "a finite number > 0")
        _require(opt, "min_lr_ratio", 0 <= opt.min_lr_ratio <= 1, "a number in [0, 1]")
        _require(opt, "weight_decay", math.isfinite(opt.weight_decay) and opt.weight_decay >= 0,
                 "a finite number >= 0")
        _require(opt, "grad_clip", math.isfinite(opt.grad_clip) and opt.grad_clip >= 0,
                 "a finite number >= 0 (0: no clipping)")
        if not 0 <= opt.warmup < run.steps:
            raise ValueError(f"--warmup must be in [0, --steps); got {opt.warmup} with {run.steps} steps")

    def _check_layout(self) -> None:
        par = self.parallel
        if par.strategy == "none" and par.nproc != 1:
            raise ValueError(f"--strategy none runs one process; got --nproc {par.nproc} (use ddp or dp)")
        if par.strategy in ("none", "dp") and par.tp > 1:
            raise ValueError(f"--tp needs one process per rank: use --strategy ddp or fsdp, not "
                             f"{par.strategy}")
        if par.strategy == "dp" and par.mixed_precision:
            raise ValueError(f"--mixed-precision {par.mixed_precision} with --strategy dp: DataParallel's "
                             "threads would share the modules' low-precision copies; use --strategy ddp")
        if par.strategy != "fsdp":
            # Only FSDP reads these; anywhere else they would be dropped without a word.
            for flag, given in (("--offload", par.offload),
                                ("--zero-stage", par.zero_stage != 3 and par.zero_stage),
                                ("--no-reshard-after-forward", not par.reshard_after_forward),
                                ("--no-backward-prefetch", not par.backward_prefetch)):
                if given:
                    value = f" {given}" if not isinstance(given, bool) else ""
                    raise ValueError(f"{flag}{value} applies to --strategy fsdp only (FSDP's sharding "
                                     f"and offloading); --strategy {par.strategy} would "
                                     "ignore it: use --strategy fsdp or drop the flag")
        if par.ac == "none" and par.ac_every != 1:
            raise ValueError(f"--ac-every {par.ac_every} chooses the blocks to checkpoint: it needs --ac "
                             "full or selective; --ac none would ignore it")
        if par.ac != "none" and par.strategy == "dp":
            raise ValueError("--ac with --strategy dp: DataParallel's threads run the shared modules "
                             "under torch.func.functional_call, which a recomputation in backward would not "
                             "see; use --strategy ddp (or none)")
        self._check_experts()
        if par.cp > 1 and par.strategy not in ("ddp", "fsdp"):
            raise ValueError(f"--cp {par.cp} needs one process per rank and gradients averaged over the cp "
                             f"ranks: use --strategy ddp or fsdp, not {par.strategy}")
        if par.cp == 1 and par.cp_algorithm != "ring":
            raise ValueError(f"--cp-algorithm {par.cp_algorithm} chooses how --cp splits attention; --cp 1 "
                             "would ignore it: add --cp 2 or more")
        if par.dp > 1 and par.strategy != "fsdp":
            raise ValueError("--dp (hybrid replicas) applies to --strategy fsdp; with ddp every data rank "
                             "is dp")
        if par.chunks > 1 and par.pp < 2:
            raise ValueError(f"--chunks {par.chunks} sets pipeline stages per rank: it needs --pp 2 or "
                             f"more, got --pp {par.pp}")
        if par.nproc % (par.pp * par.cp * par.tp * par.dp):
            raise ValueError(f"--nproc {par.nproc} is not divisible by --pp {par.pp} x --cp {par.cp} x "
                             f"--tp {par.tp} x --dp {par.dp}")
        if self.data.batch_size % (self.data_parallel_size * self.run.grad_accum):
            raise ValueError(f"--batch-size {self.data.batch_size} must be divisible by the data-parallel "
                             f"size {self.data_parallel_size} x --grad-accum {self.run.grad_accum}")
        if self.checkpoint.resume and not (self.checkpoint.save_dir or self.run.name):
            raise ValueError("--resume needs --name (the run whose checkpoints to continue) or --save-dir "
                             "(where to find the checkpoint)")

    def _check_heal(self) -> None:
        """--heal: pure data parallelism over DDP replicas, and what the healing loop does not do yet."""
        par, run, ck = self.parallel, self.run, self.checkpoint
        _require(par, "heal_timeout", math.isfinite(par.heal_timeout) and par.heal_timeout > 0,
                 "a finite number of seconds > 0")
        if not par.heal:
            given = [flag for flag, on in
                     (("--heal-timeout", par.heal_timeout != ParallelSection.heal_timeout),
                      ("--no-heal-replace", not par.heal_replace)) if on]
            if given:
                raise ValueError(f"{given[0]} applies to --heal only; without it, it would be ignored")
            return
        if par.strategy != "ddp":
            hsdp = " (HSDP, --strategy fsdp --dp, is not healed yet)" if par.strategy == "fsdp" else ""
            raise ValueError(f"--heal heals DDP replicas: it needs --strategy ddp, got --strategy "
                             f"{par.strategy}{hsdp}")
        layout = [f"--{name.replace('_', '-')} {getattr(par, name)}" for name in ("tp", "pp", "cp", "ep")
                  if getattr(par, name) > 1]
        if layout or self.model.experts:
            what = ", ".join(layout) or f"--experts {self.model.experts}"
            raise ValueError(f"--heal heals pure data parallelism (every rank a whole replica); {what} "
                             "splits the model over ranks, which a lost rank would leave incomplete")
        refused = (("--mixed-precision", par.mixed_precision),
                   ("--grad-accum", run.grad_accum > 1 and run.grad_accum),
                   ("--save-dir", ck.save_dir), ("--save-every", ck.save_every), ("--resume", ck.resume),
                   ("--init-from", self.model.init_from), ("--tensorboard", run.tensorboard),
                   ("--wandb", run.wandb))
        for flag, value in refused:
            if value:
                raise ValueError(f"{flag} with --heal: not supported yet by the healing loop "
                                 "(docs/failures.md, \"Healing replicas\"); drop one of them")

    def _check_pipeline(self) -> None:
        par = self.parallel
        if par.strategy not in ("ddp", "fsdp"):
            raise ValueError("--pp combines with --strategy ddp or fsdp (data parallel across pipelines, "
                             "each stage its own DDP or FSDP module) and --tp; got --strategy "
                             f"{par.strategy}")
        # --grad-accum K runs K times the microbatches in one schedule: the same accumulation, without
        # K pipeline fills and drains, and 1F1B keeps at most --pp microbatches' activations alive.
        microbatches = self.pipeline_microbatches
        per_pipeline = self.data.batch_size // self.data_parallel_size
        if per_pipeline % microbatches:
            raise ValueError(f"the per-pipeline batch {per_pipeline} is not divisible by --microbatches "
                             f"{par.microbatches} x --grad-accum {self.run.grad_accum}")

    def _check_model_fit(self) -> None:
        """Model and data against the layout: head counts, pipeline segments, sequence length."""
        par, seq_len = self.parallel, self.seq_len
        if self.model.hf_config is not None:
            self._check_hf_model()
        elif self.model_factory is not None:
            self._check_factory_model()
        else:
            self._check_gpt_model()
        if par.cp > 1:
            self._check_cp(seq_len)
        if par.sequence_parallel and seq_len % (par.tp * par.cp):
            cut = f"each --cp {par.cp} rank's share of " if par.cp > 1 else ""
            by = f"{par.cp * par.tp} (--cp x --tp)" if par.cp > 1 else "it"
            raise ValueError(f"--sequence-parallel splits {cut}the sequence over --tp {par.tp}: the sequence "
                             f"length {seq_len} (--seq-len) must be divisible by {by}")
        self._check_windows(seq_len)

    def _check_gpt_model(self) -> None:
        """plait's GPT against the layout (its heads and MLP units over --tp, its blocks over --pp)
        and the data (its vocabulary)."""
        gcfg = self.gpt_config()
        self._check_vocab(gcfg.vocab_size, f"--model {self.model.name} (--vocab-size)")
        with torch.device("meta"):
            self._check_model_layout(GPT(gcfg), f"--model {self.model.name}")

    def _check_data(self) -> corpus.DataInfo:
        """What --data holds (sizes, and the largest token id of a token file), read once here; the
        --eval-data file must be in a format the loader reads too."""
        data = self.data
        tokenizing = self.tokenizing()
        try:
            info = corpus.scan(data.path, data.data_dtype, data.max_bytes, tokenizing)
            if data.eval_data is not None:
                eval_dtype = data.data_dtype if corpus.is_token_file(data.eval_data) else None
                self._eval_info = corpus.scan(data.eval_data, eval_dtype, data.max_bytes, tokenizing)
                if self._eval_info.vocab > info.vocab:
                    info = dataclasses.replace(info, vocab=self._eval_info.vocab)
        except (OSError, ValueError) as e:
            raise ValueError(str(e)) from None
        if info.tokens < MIN_CORPUS_BYTES:
            raise ValueError(f"--data {info.source}: holds {info.tokens} tokens; the corpus needs at least "
                             f"{MIN_CORPUS_BYTES}")
        return info

    def tokenizing(self) -> corpus.Tokenizing | None:
        """--tokenizer and the flags that go with it, checked before anything is tokenized."""
        data = self.data
        if data.tokenizer is None:
            given_alone = (("--text-field", data.text_field != "text"), ("--data-cache", data.data_cache))
            for flag, given in given_alone:
                if given:
                    raise ValueError(f"{flag} applies to data read through --tokenizer; without it, it would "
                                     "be ignored: add --tokenizer DIR or drop the flag")
            return None
        for flag, value in (("--data-dtype", data.data_dtype), ("--max-bytes", data.max_bytes)):
            if value is not None:
                raise ValueError(f"{flag} {value} applies to token files and byte-level text; --tokenizer "
                                 "reads every document of --data whole: drop one of them")
        for flag, path in (("--data", data.path), ("--eval-data", data.eval_data)):
            if path is not None and corpus.is_token_file(path):
                raise ValueError(f"{flag} {path} is a token file already; drop --tokenizer to train on it, "
                                 "or give text, JSON Lines or Parquet files to tokenize")
        return corpus.Tokenizing(data.tokenizer, data.text_field, data.data_cache)

    def _check_windows(self, seq_len: int) -> None:
        """A training window is seq_len + 1 tokens, and the held-out data must hold one as well."""
        info, data = self._data_info, self.data
        if data.eval_data is not None:
            held_out, where = self._eval_info.tokens, f"--eval-data {data.eval_data}"
        else:
            held_out = info.tokens - int(info.tokens * (1 - VAL_FRACTION))  # the split load_corpus makes
            cap = f", --max-bytes {data.max_bytes}" if data.max_bytes is not None else ""
            where = (f"the held-out {VAL_FRACTION:.0%} of the corpus ({held_out} of {info.tokens} tokens "
                     f"read from {data.path or 'the standard library'}{cap})")
        if held_out <= seq_len + 1:
            raise ValueError(f"--seq-len {seq_len}: a training window is seq_len + 1 tokens and {where} must "
                             f"hold one; use --seq-len below {held_out - 1} or more data")

    def _check_vocab(self, vocab: int | None, what: str) -> None:
        """The data's token ids against the model's vocabulary, before any rank embeds one past it."""
        info = self._data_info
        if vocab is not None and info.vocab > vocab:
            source = {"text": "byte-level text", "tokenized": f"{info.source} tokenized by --tokenizer "
                      f"{self.data.tokenizer}"}.get(info.kind, f"the token file {info.source}")
            raise ValueError(f"{what}: vocab_size {vocab} cannot embed the data's token ids: {source} holds "
                             f"ids up to {info.vocab - 1} (needs a vocabulary of at least {info.vocab}); use "
                             "a model with a larger vocabulary or data tokenized for this one")

    def _check_experts(self) -> None:
        m, par = self.model, self.parallel
        if not m.experts:
            defaults = ModelSection()
            for name in ("top_k", "shared_experts", "capacity_factor", "aux_loss_coef", "bias_update_rate",
                         "balance_statistic"):
                if getattr(m, name) != getattr(defaults, name):
                    raise ValueError(f"--{name.replace('_', '-')} {getattr(m, name)} configures "
                                     "mixture-of-experts blocks; without --experts the model has none: add "
                                     "--experts E")
            if par.ep > 1:
                raise ValueError(f"--ep {par.ep} splits experts over ranks: it needs --experts")
            return
        if m.hf_config is not None or usermodel.is_factory(m.name):
            other = ("--hf-config the model is the transformers one" if m.hf_config
                     else f"--model {m.name} the factory builds the model")
            raise ValueError(f"--experts builds MoE blocks in plait's GPT; with {other}: drop one of them")
        if m.experts < 0 or not 1 <= m.top_k <= m.experts or m.shared_experts < 0:
            raise ValueError(f"--experts {m.experts} --top-k {m.top_k} --shared-experts {m.shared_experts}: "
                             "need experts >= 1, 1 <= top-k <= experts, shared-experts >= 0")
        if m.capacity_factor is not None and not m.capacity_factor > 0:
            raise ValueError(f"--capacity-factor {m.capacity_factor}: must be > 0 (leave it unset: dropless)")
        if par.strategy == "dp":
            raise ValueError("--experts with --strategy dp: use ddp, fsdp or none")
        if par.strategy == "fsdp" and (par.mixed_precision or par.offload):
            raise ValueError("--experts with --strategy fsdp: the experts stay whole outside FSDP's shards, "
                             "where --mixed-precision and --offload would not reach them")
        if m.balance_statistic == "global" and m.aux_loss_coef:
            self._check_global_balance()

    def _check_global_balance(self) -> None:
        """The balancing loss's statistic over the step's whole batch is read by the first backward:
        every forward of the step must have run by then."""
        par, accum = self.parallel, self.run.grad_accum
        advice = ("or --balance-statistic microbatch (each micro-batch's own statistic; the run then "
                  "depends on the layout)")
        if par.pp == 1 and accum > 1:
            raise ValueError(f"--grad-accum {accum} with the MoE balancing loss over the step's whole "
                             "batch (--balance-statistic global): each micro-batch's backward runs before "
                             "the next micro-batch's forward, so the statistic over the step is not known "
                             "when the first backward needs it; use a larger --nproc or --batch-size per "
                             f"step instead, {advice}")

    def _check_cp(self, seq_len: int) -> None:
        par = self.parallel
        if seq_len % (2 * par.cp):
            raise ValueError(f"--cp {par.cp} cuts each sequence into {2 * par.cp} equal chunks (two per "
                             f"rank, balancing causal attention); --seq-len {seq_len} must be divisible by "
                             f"{2 * par.cp}")

    def _check_hf_model(self) -> None:
        """A transformers model against the corpus and the layout, on a meta-device copy: its
        vocabulary holds the bytes, its positions the sequence, and the tensor-parallel plan
        `plait.plan_for` makes for it passes the dry run the ranks would run."""
        from plait.app import hf

        assert self.model.hf_config is not None
        flag = f"--hf-config {self.model.hf_config}"
        if self.model.name != ModelSection.name:
            raise ValueError(f"--model {self.model.name} and --hf-config both name the model: give one")
        config = hf.load_config(self.model.hf_config)
        self._check_vocab(getattr(config, "vocab_size", 0), flag)
        longest = hf.max_positions(config)
        if longest is not None and self.seq_len > longest:
            raise ValueError(f"--seq-len {self.seq_len}: the model's positions end at {longest}")
        self._check_model_layout(hf.build(config, self.run.seed, device="meta"), flag)

    @property
    def model_factory(self) -> str | None:
        """``--model package.module:function``: the FACTORY that builds the model (None: a preset)."""
        return self.model.name if usermodel.is_factory(self.model.name) else None

    def _check_factory_model(self) -> None:
        """The user's model on the meta device, against the data and the layout, as `_check_hf_model`
        does for transformers models: what plait's GPT alone has is refused by name."""
        assert self.model_factory is not None
        m, par, flag = self.model, self.parallel, f"--model {self.model_factory}"
        for given, what in ((m.hf_config, "--hf-config"), (m.layers, "--layers"),
                            (m.vocab_size, "--vocab-size"), (m.init_from, "--init-from")):
            if given is not None:
                raise ValueError(f"{what} applies to plait's GPT (and --init-from to it and --hf-config); "
                                 f"{flag} builds its own model: drop {what}, or do it in the factory")
        if par.cp > 1:
            raise ValueError(f"--cp {par.cp} with {flag}: context parallelism replaces the attention of "
                             "plait's GPT and of transformers models only; drop --cp")
        model = usermodel.build(self.model_factory, self.run.seed, "meta")
        self._check_vocab(usermodel.vocab_size_of(model), flag)
        longest = usermodel.max_positions(model)
        if longest is not None and self.seq_len > longest:
            raise ValueError(f"--seq-len {self.seq_len}: the positions of {flag}'s model end at {longest}")
        self._check_model_layout(model, flag, "; plait.plan_for knows plait's GPT and the common "
                                 "transformers families: use --strategy fsdp or ddp without --tp")

    def _check_model_layout(self, model: nn.Module, flag: str, advice: str = "",
                            dry_run: bool = True) -> None:
        """A meta-device model against the layout: `plait.rules.check_layout`, the rules
        `plait.parallelize` applies on the ranks, with the plan `build_model` will use (its numeric
        check included), its refusal told in flags."""
        if self.parallel.strategy == "dp":  # threads: no mesh, and DataParallel's own checks
            return
        try:
            plan = self.parallel_plan(model, tp_styles=dry_run)
        except ValueError as e:  # plan_for knows no plan for the model
            raise ValueError(f"--tp {self.parallel.tp} with {flag}: {e}{advice}") from None
        try:
            # plait's GPT plan is plait's own (tested); a transformers or FACTORY model's plan is
            # also dry-run and checked by its numbers, one block of each kind materialized.
            foreign = dry_run and not (self.model.hf_config is None and self.model_factory is None)
            check_layout(model, self.mesh_shape(), plan, tp_dry_run=foreign, numeric=foreign)
        except LayoutError as e:
            said = in_flags(e, self.parallel.microbatches, self.run.grad_accum)
            raise ValueError(f"{flag}: {said}{advice if 'tp' in e.fields else ''}") from None

    def parallel_plan(self, model: nn.Module, tp_styles: bool = True) -> ParallelPlan:
        """The `plait.ParallelPlan` these flags ask of ``model`` (`plait train` parallelizes with it).
        ``tp_styles=False``: with --tp, an empty plan stands for `plan_for`'s (not made)."""
        from plait.plans import plan_for

        par = self.parallel
        own_gpt = self.model.hf_config is None and self.model_factory is None
        styles = (plan_for(model, loss_parallel=own_gpt) if tp_styles else {}) if par.tp > 1 else None
        plan = ParallelPlan(tp=styles,
                            sequence_parallel=par.sequence_parallel,
                            data="fsdp" if par.strategy == "fsdp" else "ddp", seed=self.run.seed,
                            zero_stage=par.zero_stage, mixed_precision=par.mixed_precision,
                            offload=par.offload,
                            reshard_after_forward=par.reshard_after_forward,
                            backward_prefetch=par.backward_prefetch,
                            ac=None if par.ac == "none" else par.ac, ac_every=par.ac_every,
                            cp=par.cp_algorithm if par.cp > 1 else None)
        if par.pp > 1:
            plan = dataclasses.replace(plan, pp_schedule=par.schedule, pp_chunks=par.chunks,
                                       pp_microbatches=self.pipeline_microbatches)
        return plan

    def mesh_shape(self) -> MeshShape:
        """The shape of `mesh`, without process groups: the data ranks on fsdp (with --dp replicas)
        or on dp."""
        par = self.parallel
        rest = par.nproc // (par.pp * par.cp * par.tp)
        if par.strategy == "fsdp":
            return MeshShape(pp=par.pp, dp=par.dp, fsdp=rest // par.dp, cp=par.cp, tp=par.tp, ep=par.ep)
        return MeshShape(pp=par.pp, dp=rest, cp=par.cp, tp=par.tp, ep=par.ep)

    def _check_init_from(self) -> None:
        """The weights against the model: config, names and shapes (file headers only), here,
        before any rank starts; a run must not train from half of them."""
        from plait.app import weights

        assert self.model.init_from is not None
        if self.model.hf_config is None:
            kind, config = "gpt", dataclasses.asdict(self.gpt_config())
            with torch.device("meta"):
                model: torch.nn.Module = GPT(self.gpt_config())
        else:
            from plait.app import hf

            loaded = hf.load_config(self.model.hf_config)
            kind, config, model = "hf", loaded.to_dict(), hf.build(loaded, self.run.seed, device="meta")
        weights.check_init_from(self.model.init_from, model, kind, config)

    def _check_paths(self) -> None:
        """Paths the run writes: found unusable only at the first write, after training started."""
        if self.run.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("--tensorboard writes event files with the tensorboard package, which is not "
                             "installed: pip install 'plait[tensorboard]' (or drop --tensorboard)")
        if self.run.wandb and importlib.util.find_spec("wandb") is None:
            raise ValueError("--wandb logs to Weights & Biases with the wandb package, which is not "
                             "installed: pip install 'plait[wandb]' (or drop --wandb)")
        _check_writable("--run-dir", Path(self.run.run_dir), want_dir=True)
        if self.run.name is not None:
            folder = Path(self.run.run_dir) / self.run.name
            if (folder / "metrics.jsonl").exists() and not self.checkpoint.resume:
                raise ValueError(f"--name {self.run.name}: {folder} holds a run already; add --resume to "
                                 "continue it, or choose another --name (or leave it out for a new id)")
        if self.checkpoint.save_dir is not None:
            _check_writable("--save-dir", Path(self.checkpoint.save_dir), want_dir=True)

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different data (threads of dp share one process but split the batch)."""
        return self.parallel.nproc // (self.parallel.tp * self.parallel.pp * self.parallel.cp)

    @property
    def pipeline_microbatches(self) -> int:
        """Microbatches in one pipeline step: --grad-accum K runs K times --microbatches."""
        return self.parallel.microbatches * self.run.grad_accum

    @property
    def seq_len(self) -> int:
        """The tokens per training sequence."""
        if self.model_factory is not None:
            if self.model.seq_len is not None:
                return self.model.seq_len
            if "_factory_positions" not in self.__dict__:  # built on meta once, not at every call
                model = usermodel.build(self.model_factory, self.run.seed, "meta")
                self._factory_positions = usermodel.max_positions(model)
            return min(HF_DEFAULT_SEQ_LEN, self._factory_positions or HF_DEFAULT_SEQ_LEN)
        if self.model.hf_config is None:
            return self.gpt_config().seq_len
        if self.model.seq_len is not None:
            return self.model.seq_len
        from plait.app import hf

        longest = hf.max_positions(hf.load_config(self.model.hf_config))
        return min(HF_DEFAULT_SEQ_LEN, longest or HF_DEFAULT_SEQ_LEN)

    def gpt_config(self) -> GPTConfig:
        base, m = PRESETS[self.model.name], self.model
        moe: dict[str, Any] = {} if not m.experts else dict(
            n_experts=m.experts, top_k=m.top_k, n_shared_experts=m.shared_experts,
            capacity_factor=m.capacity_factor, aux_loss_coef=m.aux_loss_coef,
            bias_update_rate=m.bias_update_rate, balance_statistic=m.balance_statistic)
        # The data's vocabulary grows the preset's (a token file of GPT-2 ids on --model tiny); a
        # --vocab-size too small for it was refused.
        info = getattr(self, "_data_info", None)
        vocab = m.vocab_size or max(base.vocab_size, info.vocab if info is not None else 0)
        return dataclasses.replace(base, seq_len=m.seq_len or base.seq_len, vocab_size=vocab,
                                   n_layers=m.layers or base.n_layers, **moe)

    def mesh(self) -> Mesh:
        par = self.parallel
        if par.strategy == "fsdp":
            return Mesh(pp=par.pp, dp=par.dp, fsdp=-1, tp=par.tp, cp=par.cp, ep=par.ep)
        return Mesh(pp=par.pp, dp=-1, tp=par.tp, cp=par.cp, ep=par.ep)

    def flags(self) -> dict[str, Any]:
        """The flat view, keyed like the flags (``from_flags(**cfg.flags())`` gives the same config)."""
        return {flag: getattr(getattr(self, s), name) for flag, (s, name) in FLAGS.items()}


# `plait.rules` names mesh axes and `ParallelPlan` fields; `plait train` says them as its flags.
_RULE_FLAGS: dict[str, str] = {"pp": "--pp", "dp": "--dp", "cp": "--cp", "tp": "--tp", "ep": "--ep",
                               "pp_schedule": "--schedule", "pp_microbatches": "--microbatches",
                               "pp_chunks": "--chunks", "zero_stage": "--zero-stage", "data": "--strategy",
                               "sequence_parallel": "--sequence-parallel",
                               "balance_statistic": "--balance-statistic", "ac_every": "--ac-every",
                               "aux_loss_coef": "--aux-loss-coef",
                               # the schedule generators' own words
                               "schedule": "--schedule", "microbatches": "--microbatches",
                               "chunks": "--chunks"}


def in_flags(error: LayoutError, microbatches: int | None = None, grad_accum: int = 1) -> str:
    """A `plait.rules` refusal as `plait train` says it: ``tp=3`` reads ``--tp 3``, and so on for
    every field with a flag (``pp_schedule='zbv'``: ``--schedule zbv``; ``fsdp=4``, which no flag
    sets directly, stays); the nearest valid layouts likewise. ``microbatches`` and ``grad_accum``:
    a pipeline step runs their product, which the rules see as one number."""
    def flag(m: re.Match[str]) -> str:
        name, value = m[1], m[2].strip("'")
        if name not in _RULE_FLAGS:
            return m[0]
        if name in ("pp_microbatches", "microbatches") and grad_accum > 1:  # a step runs mb x accum
            return f"--microbatches {microbatches} x --grad-accum {grad_accum}"
        if name == "sequence_parallel":
            return "--sequence-parallel"
        return f"{_RULE_FLAGS[name]} {value}"

    return re.sub(r"\b([a-z_]+)=('[^']*'|[\w.]+)", flag, str(error))


def _require(section: object, name: str, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"--{name.replace('_', '-')} {getattr(section, name)}: must be {allowed}")


def _check_writable(flag: str, path: Path, want_dir: bool) -> None:
    """A path the run will create or append to: the right kind, under a writable folder."""
    if path.exists():
        if want_dir and not path.is_dir():
            raise ValueError(f"{flag} {path}: is an existing file; the run writes into a folder there")
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


# ---- the command line and the config file ----------------------------------------------------


class ConfigFileError(ValueError):
    """A config file that cannot be read, or holds a section or key `plait train` does not know."""


def _config_file_args(path: str) -> list[str]:
    """A TOML config file as the flags it stands for, so one parser checks both the same way."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise ConfigFileError(f"--config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigFileError(f"--config {path}: not valid TOML: {e}") from None
    flags = FIELD_FLAGS
    args: list[str] = []
    for section, table in doc.items():
        if section not in SECTIONS:
            raise ConfigFileError(f"--config {path}: unknown section [{section}]; the sections are "
                                  f"{', '.join(f'[{s}]' for s in SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigFileError(f"--config {path}: {section} must be a [{section}] table, got "
                                  f"{type(table).__name__} {table!r}")
        keys = {f.name for f in dataclasses.fields(SECTIONS[section])}
        for key, value in table.items():
            if key not in keys:
                raise ConfigFileError(f"--config {path}: [{section}] has no option {key!r}; it has "
                                      f"{', '.join(sorted(keys))}")
            flag = "--" + flags[(section, key)].replace("_", "-")
            if isinstance(value, bool):
                args.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, (int, float, str)):
                args += [flag, str(value)]
            else:
                raise ConfigFileError(f"--config {path}: [{section}] {key} = {value!r}: expected a "
                                      "number, a string or a boolean")
    return args


def _config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigFileError("--config needs a path: --config run.toml")
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _command(model: ModelSection, parallel: ParallelSection, optimizer: OptimizerSection,
             data: DataSection, checkpoint: CheckpointSection, run: RunSection, config: str | None = None,
             print_config: bool = False) -> tuple[TrainConfig, bool]:
    """Train plait's GPT on a byte-level corpus under any layout.

    Args:
        config: a TOML file of these options, one table per section; flags given here override it
        print_config: print the whole configuration as TOML (what --config reads) and exit
    """
    # A function, not the dataclass, is what tyro calls: the ValueError a bad combination raises
    # reaches parse_args, which reports it as one line naming the flag.
    return TrainConfig(model, parallel, optimizer, data, checkpoint, run), print_config


def parse_args(argv: list[str]) -> TrainConfig:
    """``plait train``'s flags (and ``--config FILE``) as a checked `TrainConfig`; exits 2 on bad input
    with one line naming the flag and what it allows. ``--print-config`` prints it and exits 0."""
    try:
        path = _config_path(argv)
        file_args = _config_file_args(path) if path is not None else []
        # The file's options come first, so the same flag given on the command line wins.
        cfg, show = tyro.cli(_command, args=_resume_valued([*file_args, *argv]), prog="plait train",
                             config=(tyro.conf.OmitArgPrefixes,))
    except ValueError as e:
        print(f"plait train: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if show:
        print(to_toml(cfg), end="")
        raise SystemExit(0)
    return cfg


_RESUME_VALUES = {"auto": "auto", "true": "True", "false": "False"}


def _resume_valued(args: list[str]) -> list[str]:
    """``--resume`` is a switch that may take one value: alone it means True (a checkpoint must
    exist), ``--resume auto`` resumes if there is one; ``--no-resume`` is False. The parser sees
    each as ``--resume VALUE``."""
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--no-resume":
            out += ["--resume", "False"]
        elif arg.startswith("--resume="):
            out += ["--resume", _RESUME_VALUES.get(arg.split("=", 1)[1].lower(), arg.split("=", 1)[1])]
        elif arg == "--resume":
            following = args[i + 1].lower() if i + 1 < len(args) else ""
            out.append("--resume")
            if following not in _RESUME_VALUES:
                out.append("True")
        elif i and args[i - 1] == "--resume" and arg.lower() in _RESUME_VALUES:
            out.append(_RESUME_VALUES[arg.lower()])
        else:
            out.append(arg)
    return out


def given_flags(argv: list[str]) -> set[str]:
    """The options set explicitly, on the command line or in its ``--config`` file (underscored names)."""
    path = _config_path(argv)
    words = [*(_config_file_args(path) if path is not None else []), *argv]
    given = {w[2:].split("=", 1)[0].replace("-", "_") for w in words if w.startswith("--")}
    return given | {name[3:] for name in given if name.startswith("no_")}


def to_toml(cfg: TrainConfig) -> str:
    """The configuration as a TOML file that ``--config`` reads back to the same config (options
    left unset, such as the default ``seq_len``, are omitted: TOML has no null)."""
    lines: list[str] = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for f in dataclasses.fields(getattr(cfg, section)):
            value = getattr(getattr(cfg, section), f.name)
            if value is None:
                continue
            # JSON's strings, numbers and booleans are TOML's too (finite floats: the config refuses others).
            lines.append(f"{f.name} = {json.dumps(value)}")
        lines.append("")
    return "\n".join(lines)
