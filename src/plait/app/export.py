"""`plait export`: a `plait train` checkpoint as safetensors weights the ecosystem loads.

    plait export runs/ckpt --safetensors out/ [--max-shard-size 5GB] [--force]

Any layout's checkpoint holds the model under its original names and full shapes (DCP shards
plus ``plait.json``, see `plait.checkpoint`), so exporting needs no process group and no rank
of the original layout: the checkpoint is verified (sizes and sha256 of every file), then DCP
reads the model's entries offline, one output shard at a time, into full tensors (the optimizer
state is not read; the metadata goes through `plait.checkpoint.SafeReader`, which runs no
pickled code). The folder written is `plait.app.weights`' layout: ``model.safetensors`` or
``model-0000i-of-0000n.safetensors`` shards with ``model.safetensors.index.json``, and the
model's config: a ``--hf-config`` run's ``config.json`` (so
``transformers.AutoModelForCausalLM.from_pretrained(out)`` loads it), plait's GPT's
``plait_config.json``. A tied weight is written once, under its first name.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait._torch_compat import dcp_load_in_this_process
from plait.app import weights
from plait.state import checkpoint
from plait.state.checkpoint.files import step_folders
from plait.state.checkpoint.integrity import DCP_METADATA, CorruptCheckpoint, read_dcp_metadata

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``"5GB"`` (powers of 10, as Hugging Face counts), ``"500MiB"`` or a byte count, in bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB, 2GiB or 1000000")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def find_checkpoint(directory: str | Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint at ``directory`` (verified), or, for a ``--save-dir`` holding ``step_*``
    folders, the newest intact one (as ``--resume`` picks it, warning about each it skips)."""
    root = Path(directory)
    if (root / checkpoint.META).exists() or not step_folders(root):
        if not root.is_dir():
            raise ValueError(f"{root}: no such folder")
        if not (root / checkpoint.META).exists():
            raise ValueError(f"{root}: neither a checkpoint (no {checkpoint.META}) nor a --save-dir "
                             "holding step_* checkpoints")
        return root, checkpoint.verify(root)
    found = checkpoint.choose(root)
    if found is None:
        raise ValueError(f"{root}: no finished checkpoint in its step_* folders")
    return found


def _model_of(meta: dict[str, Any]) -> tuple[nn.Module, str, Any]:
    """(a meta-device copy of the checkpoint's model, "gpt" or "hf", its config) from ``plait.json``."""
    config = meta.get("config") or {}
    described = (meta.get("identity") or {}).get("model")
    if not isinstance(described, dict):
        raise ValueError("plait.json does not describe the model (no identity.model): not written by "
                         "plait train")
    if (config.get("model") or {}).get("hf_config") is None:
        from plait.models.gpt import GPT, GPTConfig

        gpt = GPTConfig(**described)
        with torch.device("meta"):
            return GPT(gpt), "gpt", gpt
    from plait.app import hf

    try:
        from transformers import AutoConfig
    except ImportError:
        raise ValueError("exporting a --hf-config run needs the transformers library: "
                         "pip install 'plait[hf]'") from None
    fields = dict(described)
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = hf.build(hf_config, 0, device="meta")
    hf_config.architectures = [type(model).__name__]
    return model, "hf", hf_config


def plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Names in order, cut into shards of at most ``max_bytes`` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _entries(path: Path, names: list[str], want: weights.ModelTensors) -> dict[str, Any]:
    """DCP's metadata of each name's ``model.`` entry, checked against the model's shape."""
    md = read_dcp_metadata(path / DCP_METADATA)
    out, problems = {}, []
    for name in names:
        entry = md.state_dict_metadata.get(f"model.{name}")
        if entry is None:
            problems.append(f"{name} is missing")
        elif tuple(entry.size) != tuple(want.shapes[name]):
            problems.append(f"{name} has shape {tuple(entry.size)}, the model's is "
                            f"{tuple(want.shapes[name])}")
        else:
            out[name] = entry
    if problems:
        raise CorruptCheckpoint(path, "its model entries do not fit the model plait.json describes: "
                                + "; ".join(problems[:8]))
    return out


def _read(path: Path, entries: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Full tensors of ``entries`` read offline from DCP's files (only their bytes)."""
    model = {n: torch.empty(tuple(e.size), dtype=e.properties.dtype) for n, e in entries.items()}
    dcp_load_in_this_process({"model": model}, storage_reader=checkpoint.SafeReader(path))
    return model


def _prepare(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--safetensors {out}: is a file; the weights are written into a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ValueError(f"--safetensors {out}: the folder is not empty; pass --force to overwrite "
                             "the weights in it")
        # Shards of an earlier export with more files would otherwise be listed by nothing.
        for old in [*out.glob("model*.safetensors"), out / weights.INDEX]:
            old.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)


def export(checkpoint_dir: str | Path, out_dir: str | Path, *, max_shard_size: int = 5 * 10**9,
           force: bool = False, progress: bool = True) -> list[Path]:
    """Write the model of the checkpoint at ``checkpoint_dir`` (or the newest intact one under a
    ``--save-dir``) to ``out_dir`` as safetensors; returns the files written, config last."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    out = Path(out_dir)
    _prepare(out, force)  # before reading anything: a refused folder costs nothing
    path, meta = find_checkpoint(checkpoint_dir)
    model, kind, config = _model_of(meta)
    want = weights.model_tensors(model)
    entries = _entries(path, list(want.shapes), want)
    sizes = {n: entries[n].size.numel() * entries[n].properties.dtype.itemsize for n in want.stored}
    shards = plan_shards(sizes, max_shard_size)
    files = [weights.WEIGHTS] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    written: list[Path] = []
    bar = tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, desc="export", disable=not progress)
    with bar:
        for names, file in zip(shards, files, strict=True):
            ties = [a for a, first in want.aliases.items() if first in names]
            tensors = _read(path, {n: entries[n] for n in [*names, *ties]})
            for alias in ties:  # the checkpoint holds a copy under each name: a tie must hold
                if not torch.equal(tensors.pop(alias), tensors[want.aliases[alias]]):
                    raise CorruptCheckpoint(path, f"{alias} and {want.aliases[alias]} are tied in the "
                                            "model but differ in the checkpoint")
            tmp = out / f".{file}.tmp"
            save_file(tensors, str(tmp), metadata={"format": "pt"})
            os.chmod(tmp, 0o644)  # readable like the config beside it
            os.replace(tmp, out / file)
            written.append(out / file)
            bar.update(sum(sizes[n] for n in names))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {n: f for names, f in zip(shards, files, strict=True) for n in names}}
        (out / weights.INDEX).write_text(json.dumps(index, indent=2) + "\n")
        written.append(out / weights.INDEX)
    if kind == "hf":
        config.save_pretrained(str(out))
        written.append(out / weights.HF_CONFIG)
    else:
        described = {"model": "plait.GPT", "config": dataclasses.asdict(config), "step": meta.get("step")}
        (out / weights.GPT_CONFIG).write_text(json.dumps(described, indent=1) + "\n")
        written.append(out / weights.GPT_CONFIG)
    return written


def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="plait export", description="write a plait train checkpoint as safetensors weights")
    parser.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                        help="a checkpoint folder (step_N), or a --save-dir: its newest intact checkpoint")
    parser.add_argument("--safetensors", required=True, metavar="OUT_DIR", help="the folder to write")
    parser.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="largest file (default 5GB; a bigger tensor gets a file of its own)")
    parser.add_argument("--force", action="store_true", help="write into a non-empty OUT_DIR")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        max_bytes = parse_size(args.max_shard_size)
    except ValueError as e:
        parser.error(str(e))
    try:
        written = export(args.checkpoint, args.safetensors, max_shard_size=max_bytes, force=args.force,
                         progress=not args.no_progress)
    except (ValueError, CorruptCheckpoint) as e:
        print(f"plait export: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} files to {args.safetensors}: {', '.join(p.name for p in written)}")
    return 0
