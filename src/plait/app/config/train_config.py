"""`TrainConfig`: the sections together, checked on construction so that a config that exists can
run; what the parent process checks before any rank is spawned."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import torch
from torch import nn

if sys.version_info >= (3, 11):
    pass
else:  # the same parser, before it joined the standard library
    pass

from plait.app import data as corpus
from plait.app import usermodel
from plait.app.config.refusals import check_writable, in_flags, require
from plait.app.config.sections import (
    FLAGS,
    HF_DEFAULT_SEQ_LEN,
    MIN_CORPUS_BYTES,
    MIXED_PRECISIONS,
    SECTIONS,
    STRATEGIES,
    VAL_FRACTION,
    Checkpointing,
    CheckpointSection,
    DataSection,
    ModelSection,
    OptimizerSection,
    ParallelSection,
    RunSection,
)
from plait.compose.parallel_plan import ParallelPlan
from plait.compose.rules import LayoutError, MeshShape, check_layout
from plait.models.gpt import GPT, PRESETS, GPTConfig
from plait.pipeline import SCHEDULES
from plait.runtime.mesh import Mesh


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
            require(sec, name, getattr(sec, name) >= 1, "an integer >= 1")
        if self.checkpoint.keep < 1:
            raise ValueError(f"--keep must be >= 1 (the newest checkpoints kept), got {self.checkpoint.keep}")
        for sec, name in ((run, "eval_every"), (run, "straggler_every"), (self.checkpoint, "save_every")):
            require(sec, name, getattr(sec, name) >= 0, "an integer >= 0 (0: off)")
        seq_len = self.model.seq_len
        require(self.model, "seq_len", seq_len is None or seq_len >= 1, "an integer >= 1")
        require(self.model, "layers", self.model.layers is None or self.model.layers >= 1, "an integer >= 1")
        if self.model.layers is not None and self.model.hf_config is not None:
            raise ValueError("--layers sets the blocks of plait's GPT; --hf-config's model has its own "
                             "(edit num_hidden_layers in its config)")
        require(run, "seed", 0 <= run.seed < 2**32, "an integer in [0, 2**32)")
        require(run, "timeout", math.isfinite(run.timeout) and run.timeout > 0,
                 "a finite number of seconds > 0")
        step_timeout = run.step_timeout
        if step_timeout is not None and not (math.isfinite(step_timeout) and step_timeout > run.timeout):
            raise ValueError(f"--step-timeout {step_timeout:g} must be longer than --timeout "
                             f"{run.timeout:g}: the collective timeout fires first and names the rank that "
                             "did not arrive; the step timeout catches a rank stuck outside collectives "
                             "(docs/failures.md)")
        cap = self.data.max_bytes
        require(self.data, "max_bytes", cap is None or cap >= MIN_CORPUS_BYTES,
                 f"an integer >= {MIN_CORPUS_BYTES} (the smallest corpus the loader accepts)")
        require(self.model, "vocab_size", self.model.vocab_size is None or self.model.vocab_size >= 1,
                 "an integer >= 1")
        peak = run.peak_tflops
        require(run, "peak_tflops", peak is None or (math.isfinite(peak) and peak > 0),
                 "a finite number > 0")
        run_name = run.name
        if run_name is not None and (Path(run_name).name != run_name or run_name[:1] in ("", ".")):
            raise ValueError(f"--name {run.name!r}: names one folder under --run-dir (no '/', not hidden)")
        # `not x > 0` and friends are also true for NaN, which every comparison rejects.
        require(opt, "lr", math.isfinite(opt.lr) and opt.lr > 0, "a finite number > 0")
        require(opt, "min_lr_ratio", 0 <= opt.min_lr_ratio <= 1, "a number in [0, 1]")
        require(opt, "weight_decay", math.isfinite(opt.weight_decay) and opt.weight_decay >= 0,
                 "a finite number >= 0")
        require(opt, "grad_clip", math.isfinite(opt.grad_clip) and opt.grad_clip >= 0,
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
        # The plan's own rules (FSDP options under another strategy, --ac-every without --ac),
        # before the model is built; the rules against the model and the mesh: _check_model_layout.
        try:
            self.parallel_plan(None, tp_styles=False)
        except LayoutError as e:
            raise ValueError(self._in_flags(e)) from None
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
        """--heal: data parallelism over whole replicas (DDP, or HSDP's replicas of FSDP shards), and what
        the healing loop does not do yet."""
        par, run, ck = self.parallel, self.run, self.checkpoint
        require(par, "heal_timeout", math.isfinite(par.heal_timeout) and par.heal_timeout > 0,
                 "a finite number of seconds > 0")
        if not par.heal:
            given = [flag for flag, on in
                     (("--heal-timeout", par.heal_timeout != ParallelSection.heal_timeout),
                      ("--no-heal-replace", not par.heal_replace)) if on]
            if given:
                raise ValueError(f"{given[0]} applies to --heal only; without it, it would be ignored")
            return
        if par.strategy not in ("ddp", "fsdp"):
            raise ValueError(f"--heal heals DDP replicas (--strategy ddp) or HSDP's (--strategy fsdp --dp R: "
                             f"R replicas, each sharding the model); got --strategy {par.strategy}")
        if par.strategy == "fsdp" and par.dp < 2:
            raise ValueError(f"--heal with --strategy fsdp heals HSDP's replicas: it needs --dp 2 or more "
                             f"(got --dp {par.dp}: one copy of the model, sharded over every rank, which a "
                             "lost rank would leave incomplete)")
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
        `plait.plan_for` makes for it passes the layout trace the ranks would run."""
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
                            trace_tp: bool = True) -> None:
        """A meta-device model against the layout: `plait.compose.rules.check_layout`, the rules
        `plait.parallelize` applies on the ranks, with the plan `build_model` will use (its numeric
        check included), its refusal told in flags."""
        try:
            plan = self.parallel_plan(model, tp_styles=trace_tp)
        except LayoutError as e:  # refused by _check_layout already; here for a caller that skipped it
            raise ValueError(self._in_flags(e)) from None
        except ValueError as e:  # plan_for knows no plan for the model
            raise ValueError(f"--tp {self.parallel.tp} with {flag}: {e}{advice}") from None
        try:
            # plait's GPT plan is plait's own (tested); a transformers or FACTORY model's plan is
            # also traced and checked by its numbers, one block of each kind materialized.
            # --strategy dp (threads in one process) is checked too: its plan's data is 'none', and
            # its tp, cp and pp were refused above, which leaves the plan's and the experts' rules.
            foreign = trace_tp and not (self.model.hf_config is None and self.model_factory is None)
            check_layout(model, self.mesh_shape(), plan, tp_trace=foreign, numeric=foreign)
        except LayoutError as e:
            raise ValueError(f"{flag}: {self._in_flags(e)}{advice if 'tp' in e.fields else ''}") from None

    def _in_flags(self, error: LayoutError) -> str:
        """A `plait.compose.rules` or `ParallelPlan` refusal in these flags."""
        par = self.parallel
        return in_flags(error, par.microbatches, self.run.grad_accum, par.strategy,
                        _STRATEGY_DATA[par.strategy])

    def parallel_plan(self, model: nn.Module | None, tp_styles: bool = True) -> ParallelPlan:
        """The `plait.ParallelPlan` these flags ask of ``model`` (`plait train` parallelizes with it;
        under --strategy dp it is checked only). ``tp_styles=False`` (``model`` may then be None):
        with --tp, an empty plan stands for `plan_for`'s (not made)."""
        from plait.plans import plan_for

        par = self.parallel
        own_gpt = self.model.hf_config is None and self.model_factory is None
        styles = None
        if par.tp > 1:
            styles = plan_for(model, loss_parallel=own_gpt) if tp_styles and model is not None else {}
        # The pipeline's fields only with --pp (a step's microbatches count --grad-accum's), but
        # --chunks always: the rules refuse it without a pipeline.
        pipeline: dict[str, Any] = {"pp_chunks": par.chunks}
        if par.pp > 1:
            pipeline.update(pp_schedule=par.schedule, pp_microbatches=self.pipeline_microbatches)
        return ParallelPlan(tp=styles,
                            sequence_parallel=par.sequence_parallel,
                            data=_STRATEGY_DATA[par.strategy], seed=self.run.seed,
                            zero_stage=par.zero_stage, mixed_precision=par.mixed_precision,
                            offload=par.offload,
                            reshard_after_forward=par.reshard_after_forward,
                            backward_prefetch=par.backward_prefetch,
                            ac=None if par.ac == "none" else par.ac, ac_every=par.ac_every,
                            cp=par.cp_algorithm if par.cp > 1 else None, **pipeline)

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
        check_writable("--run-dir", Path(self.run.run_dir), want_dir=True)
        if self.run.name is not None:
            folder = Path(self.run.run_dir) / self.run.name
            if (folder / "metrics.jsonl").exists() and not self.checkpoint.resume:
                raise ValueError(f"--name {self.run.name}: {folder} holds a run already; add --resume to "
                                 "continue it, or choose another --name (or leave it out for a new id)")
        if self.checkpoint.save_dir is not None:
            check_writable("--save-dir", Path(self.checkpoint.save_dir), want_dir=True)

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


# The plan's data strategy for each --strategy: none runs one process, where DDP does nothing;
# dp's threads are no torch.distributed data strategy (its plan is checked, not applied).
_STRATEGY_DATA = {"ddp": "ddp", "fsdp": "fsdp", "none": "ddp", "dp": "none"}

# `plait.compose.rules` names mesh axes and `ParallelPlan` fields; `plait train` says them as its flags.
