"""`plait train`'s options, one typed section per concern (model, parallel, optimizer, data,
checkpoint, run): each field is a flag named after it, its docstring the flag's help."""

from __future__ import annotations

import dataclasses
import inspect
import sys
from dataclasses import dataclass
from typing import Annotated, Literal, get_args, get_type_hints

import tyro

if sys.version_info >= (3, 11):
    pass
else:  # the same parser, before it joined the standard library
    pass

from plait.app import data as corpus
from plait.runtime.env import DEFAULT_TIMEOUT_S

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
    """data-parallel replicas that heal without a restart (--strategy ddp, or HSDP's replicas with
    --strategy fsdp --dp R): a replica that dies or hangs is dropped, the survivors redo the step over
    the live ones with the same global batch, and a new replica joins at a step boundary with a peer's
    state (docs/failures.md)"""
    heal_timeout: float = 5.0
    """with --heal: seconds a collective waits for a peer, and the survivors then wait for each other,
    before a silent replica is dropped (a dead one is dropped at once)"""
    heal_replace: bool = True
    """with --heal: replace each replica that dies (at most as many as were started) by a standby one
    started ahead, with the data and model loaded, that joins at the next step boundary"""


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
