"""Weights as the Hugging Face ecosystem keeps them: safetensors files under a model's own names.

A folder holds ``model.safetensors``, or shards listed by ``model.safetensors.index.json``
(``{"metadata": {"total_size": N}, "weight_map": {name: file}}``), beside the model's config:
``config.json`` for a `transformers` model, ``plait_config.json`` (the `GPTConfig` fields) for
plait's GPT. The names are those of the unwrapped model's ``state_dict()``; a weight tied to
another (an LM head sharing the embedding) is stored once, under its first name.

`plait export` writes such folders; `plait train --init-from` reads them, each rank asking
for the rows it keeps only (`FileTensor` is a `plait.state.tensor_source.TensorSource` over
``safe_open(...).get_slice(name)``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
HF_CONFIG = "config.json"
GPT_CONFIG = "plait_config.json"
# Config fields that change no weight and no computation on the weights (bookkeeping, dropout,
# the longest sequence): they may differ between the weights' model and the run's.
ARCHITECTURE_NEUTRAL = {"transformers_version", "_name_or_path", "architectures", "torch_dtype", "dtype",
                        "use_cache", "max_position_embeddings", "seq_len", "bos_token_id", "eos_token_id",
                        "pad_token_id", "output_attentions", "output_hidden_states", "return_dict"}
SHOWN = 8  # names listed in an error before "and N more"


class FileTensor:
    """One tensor of a safetensors file, read only when asked: `narrow` reads the given rows
    (``get_slice(name)[...]``), `read` the whole tensor."""

    def __init__(self, handle: Any, name: str, file: Path) -> None:
        self._handle, self.name, self.file = handle, name, file
        self.shape = torch.Size(handle.get_slice(name).get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._handle.get_slice(self.name)[index]

    def read(self) -> torch.Tensor:
        return self._handle.get_tensor(self.name)


@dataclass
class ModelTensors:
    """What a model's ``state_dict()`` holds: every name's shape, and the names tied to an
    earlier one (``aliases``: tied name -> first name), which weight files store once."""

    shapes: dict[str, torch.Size]
    aliases: dict[str, str]

    @property
    def stored(self) -> list[str]:
        """The names a weight file holds, in ``state_dict()`` order."""
        return [n for n in self.shapes if n not in self.aliases]


def model_tensors(model: nn.Module) -> ModelTensors:
    """The `ModelTensors` of ``model`` (a meta-device copy does: only shapes are read)."""
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    order = {n: i for i, n in enumerate(shapes)}
    for name, t in sorted((nt for nt in named if nt[0] in order), key=lambda nt: order[nt[0]]):
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)] = name
    return ModelTensors(shapes, aliases)


def weight_files(folder: str | Path) -> dict[str, Path]:
    """Each tensor's file in ``folder`` (from the index, else the one ``model.safetensors``)."""
    root = Path(folder)
    if (root / INDEX).is_file():
        try:
            weight_map = json.loads((root / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{root / INDEX}: not a safetensors index ({e!r})") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{root / INDEX}: its weight_map is not an object")
        files = {name: root / str(file) for name, file in weight_map.items()}
        absent = sorted({f.name for f in files.values() if not f.is_file()})
        if absent:
            raise ValueError(f"{root / INDEX} lists files that are missing: {', '.join(absent)}")
        return files
    if (root / WEIGHTS).is_file():
        from safetensors import safe_open

        with safe_open(str(root / WEIGHTS), framework="pt") as f:
            return {name: root / WEIGHTS for name in f.keys()}  # noqa: SIM118 (not a dict)
    raise ValueError(f"{root}: holds neither {WEIGHTS} nor {INDEX}")


def open_weights(folder: str | Path) -> dict[str, FileTensor]:
    """Every tensor in ``folder``, unread (each file opened once; headers only)."""
    from safetensors import safe_open

    handles: dict[Path, Any] = {}
    out: dict[str, FileTensor] = {}
    for name, file in weight_files(folder).items():
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt")
        if name not in handles[file].keys():  # noqa: SIM118 (not a dict)
            raise ValueError(f"{file}: has no tensor {name!r}, which the index places there")
        out[name] = FileTensor(handles[file], name, file)
    return out


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def match(found: dict[str, FileTensor], want: ModelTensors, where: str) -> dict[str, FileTensor]:
    """A source for every name of the model's ``state_dict()`` (a tied name shares its first
    name's); ``ValueError`` naming every missing, unexpected or mis-shaped tensor."""
    out: dict[str, FileTensor] = {}
    for name in want.shapes:
        first = want.aliases.get(name, name)
        ties = [first, *(a for a, f in want.aliases.items() if f == first)]
        present = next((n for n in ties if n in found), None)  # a tie stored under any of its names
        if present is not None:
            out[name] = found[present]
    missing = [n for n in want.shapes if n not in out]
    unexpected = sorted(set(found) - set(want.shapes))
    shaped = [f"{n} {tuple(out[n].shape)} (the model's is {tuple(s)})" for n, s in want.shapes.items()
              if n in out and out[n].shape != s]
    problems = [f"{what}: {_listed(names)}" for what, names in
                (("missing", missing), ("unexpected", unexpected), ("wrong shape", shaped)) if names]
    if problems:
        raise ValueError(f"{where}: the weights do not fit the model; " + "; ".join(problems))
    return out


def check_config(folder: str | Path, kind: str, config: dict[str, Any]) -> None:
    """The weights' model config (written beside them) against the run's, ``config`` as a dict;
    ``kind`` is "gpt" or "hf". ``ValueError`` naming every field that differs (those of
    `ARCHITECTURE_NEUTRAL` and dropouts may), or when the weights are another kind of model's.
    A folder without a config is checked by names and shapes alone."""
    root = Path(folder)
    theirs_file = root / (GPT_CONFIG if kind == "gpt" else HF_CONFIG)
    other = root / (HF_CONFIG if kind == "gpt" else GPT_CONFIG)
    if not theirs_file.is_file():
        if other.is_file():
            model = "a transformers model's (config.json)" if kind == "gpt" else "plait's GPT's"
            hint = "train it with --hf-config" if kind == "gpt" else "train it without --hf-config"
            raise ValueError(f"{root} holds {model} weights: {hint}")
        return
    if kind == "gpt":
        theirs = json.loads(theirs_file.read_text()).get("config", {})
    else:
        from plait.app import hf

        theirs = hf.load_config(str(root)).to_dict()
    keys = sorted(set(theirs) | set(config))
    differ = [f"{k}: {theirs.get(k, 'absent')!r} there, {config.get(k, 'absent')!r} here" for k in keys
              if k not in ARCHITECTURE_NEUTRAL and "dropout" not in k and theirs.get(k) != config.get(k)]
    if differ:
        raise ValueError(f"{root}: the weights are of another model ({'; '.join(differ)})")


def check_init_from(folder: str | Path, model: nn.Module, kind: str, config: dict[str, Any]) -> None:
    """What ``plait train --init-from folder`` checks before any rank starts: the config beside
    the weights (`check_config`), every tensor's name and shape (`match`, headers only), and,
    where a tied weight is stored under two names, that both hold the same values."""
    flag = f"--init-from {folder}"
    if not Path(folder).is_dir():
        raise ValueError(f"{flag}: no such folder")
    try:
        check_config(folder, kind, config)
        want = model_tensors(model)
        found = open_weights(folder)
        match(found, want, flag)
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith(flag) else f"{flag}: {e}") from None
    for alias, first in want.aliases.items():
        if alias in found and first in found and not torch.equal(found[alias].read(), found[first].read()):
            raise ValueError(f"{flag}: {alias} and {first} are one tied tensor in the model, but the files "
                             "hold different values for them")


def init_sources(folder: str | Path, model: nn.Module) -> dict[str, FileTensor]:
    """The weights in ``folder`` as sources for `plait.load_full_state_dict` (read on demand),
    under every name of ``model``'s state dict (a meta-device copy of the unwrapped model)."""
    return match(open_weights(folder), model_tensors(model), f"--init-from {folder}")
