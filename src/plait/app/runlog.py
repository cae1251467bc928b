"""A run's folder, ``RUN_DIR/NAME/``: what `plait train` writes besides its checkpoints.

* ``config.toml``: the resolved configuration, which ``plait train --config`` reads back;
* ``metrics.jsonl``: a header record (``{"header": {...}}``: run id, start time, config, plait and
  torch versions, world and layout, the model's size and FLOPs per token, what was read of the
  data), one record per step, and ``{"summary": {...}}`` at the end. A resumed run appends its own
  header. Every line is strict JSON: a value that is not finite is written as null and its key
  listed under ``"nonfinite"``;
* ``flight/``: the ranks' flight records when a collective fails (`plait.comm`);
* ``checkpoints/``, unless ``--save-dir`` names another folder;
* ``tensorboard/`` with ``--tensorboard``;
* ``wandb/`` with ``--wandb``: the Weights & Biases run (its offline files when ``WANDB_MODE=offline``),
  named after the run, with the resolved config; W&B's own variables (``WANDB_PROJECT``,
  ``WANDB_MODE``...) choose the rest.

MFU (model FLOPs utilization) counts the FLOPs the model needs, not those the layout spends
(recomputation excluded), as in PaLM (Chowdhery et al. 2022, appendix B): per token,
``6 N + 12 L d s`` -- 6 per matmul parameter (forward 2, backward 4), with N the parameters less
the input embeddings (a lookup), plus attention's scores and weighted sum, ``12 L d s`` for L
layers of width d over sequences of s tokens (causal masking not discounted). For a model whose
layers and width plait cannot read (a FACTORY's), the attention term is left out. MFU is those
FLOPs per second over the devices' peak (``--peak-tflops``, or a known GPU's dense bf16/fp16 peak
under --mixed-precision); null when the peak is unknown (CPUs).
"""

from __future__ import annotations

import json
import math
import resource
import secrets
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Dense bf16/fp16 tensor-core peaks per device, in TFLOP/s (the vendors' data sheets, without sparsity).
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}


def new_run_id() -> str:
    """A run's default name: its start time (UTC) and 4 random hex digits, so two runs started in the
    same second do not share a folder."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(2)


def strict(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with every non-finite float as None and their keys under ``"nonfinite"``."""
    out: dict[str, Any] = {}
    bad = []
    for key, value in record.items():
        if isinstance(value, float) and not math.isfinite(value):
            out[key] = None
            bad.append(key)
        elif isinstance(value, dict):
            out[key] = strict(value)
        else:
            out[key] = value
    if bad:
        out["nonfinite"] = bad
    return out


def _matmul_params(model: nn.Module) -> int:
    """Parameters that take part in matmuls: all, less the input embeddings' (a lookup) unless an
    output projection shares them (tied weights)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    shared = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(p.numel() for p in model.parameters() if id(p) not in embeddings - shared)


def _layers_and_width(model: nn.Module) -> tuple[int, int] | None:
    """(layers, model width) of plait's GPT (``cfg``) or a transformers model (``config``)."""
    cfg = getattr(model, "cfg", None)
    if cfg is not None and hasattr(cfg, "n_layers") and hasattr(cfg, "d_model"):
        return int(cfg.n_layers), int(cfg.d_model)
    config = getattr(model, "config", None)
    layers, width = getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None)
    if isinstance(layers, int) and isinstance(width, int):
        return layers, width
    return None


def flops_per_token(model: nn.Module, seq_len: int) -> tuple[float, str]:
    """Training FLOPs per token of ``model`` (may be on meta) and the formula used, for the header."""
    n = _matmul_params(model)
    shape = _layers_and_width(model)
    if shape is None:
        return 6.0 * n, f"6N (N={n}; attention not counted: layers and width unknown)"
    layers, width = shape
    formula = f"6N + 12Lds (N={n}, L={layers}, d={width}, s={seq_len})"
    return 6.0 * n + 12.0 * layers * width * seq_len, formula


def peak_tflops(given: float | None, device: torch.device, low_precision: bool) -> float | None:
    """One device's peak: ``--peak-tflops``, else a known GPU's under bf16/fp16, else None."""
    if given is not None:
        return given
    if device.type != "cuda" or not low_precision:
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in GPU_PEAK_TFLOPS.items() if k in name), None)


def peak_memory(device: torch.device) -> tuple[int, str]:
    """This process's peak memory so far: allocated on its GPU, or its resident set on CPUs."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "cpu_max_rss"  # Linux: KiB


class RunLog:
    """The run folder's files, written by rank 0 only (the others hold a RunLog that writes nothing)."""

    def __init__(self, folder: Path, active: bool, tensorboard: bool = False,
                 wandb_config: dict[str, Any] | None = None) -> None:
        """``wandb_config``: log to Weights & Biases too, this config with the run (None: not)."""
        self.folder, self.active = folder, active
        self.metrics = folder / "metrics.jsonl"
        self._tb: Any = None
        self._wb: Any = None
        if active:
            folder.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter  # the optional extra, only when asked

                self._tb = SummaryWriter(str(folder / "tensorboard"))
            if wandb_config is not None:
                self._wb = _wandb_run(folder, wandb_config)

    def write_config(self, toml: str) -> None:
        if self.active:
            (self.folder / "config.toml").write_text(toml)

    def _append(self, record: dict[str, Any]) -> None:
        with self.metrics.open("a") as f:
            f.write(json.dumps(strict(record), allow_nan=False) + "\n")

    def header(self, header: dict[str, Any]) -> None:
        if self.active:
            self._append({"header": header})

    def step(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        self._append(record)
        scalars = {key: value for key, value in record.items()
                   if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, record["step"])
        if self._wb is not None:
            self._wb.log(scalars, step=record["step"])

    def summary(self, summary: dict[str, Any]) -> None:
        if not self.active:
            return
        self._append({"summary": summary})
        if self._tb is not None:
            self._tb.close()
        if self._wb is not None:
            self._wb.finish()


def _wandb_run(folder: Path, config: dict[str, Any]) -> Any:
    """A W&B run writing under ``folder`` (the optional extra, imported only when asked for). A
    resumed run is a new W&B run of the same name: W&B's own resumption needs its server."""
    import wandb

    return wandb.init(name=folder.name, dir=str(folder), config=config)
