"""`plait export --safetensors` and `plait train --init-from`: weights out of any layout and back in.

Checkpoints are written by `plait train`'s loop on a 4-rank pool (tiny Llamas under fsdp2 x tp2
and a 2-stage pipeline x tp2, plait's GPT as a pipeline of ZeRO-3 stages). The oracle for an
export is the same checkpoint loaded into one process by `plait.checkpoint.load` (DCP's own
resharding, not the exporter's code); the oracle for `--init-from` is the file itself and a
single-process run started from it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

import plait
from plait import checkpoint
from plait.app import export as export_mod
from plait.app.config import TrainConfig, parse_args

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402 (after the skip: an optional extra)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process

BASE = dict(steps=2, warmup=1, batch_size=4, seq_len=32, eval_every=0, progress=False, max_bytes=100_000)
PIPE = dict(microbatches=2)


def _llama(folder: Path, tied: bool) -> str:
    transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=tied).save_pretrained(folder)
    return str(folder)


def _train(tmp: str, **flags) -> list[float]:
    """`plait train`'s loop on this rank (picklable for the pool)."""
    from plait.app.train import train

    return train(TrainConfig.from_flags(**{**BASE, **flags}, run_dir=tmp))["losses"]


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory) -> dict[str, dict]:
    """Three trained runs: their flags and save dirs."""
    root = tmp_path_factory.mktemp("export")
    layouts = {
        "tied-fsdp2-tp2": dict(hf_config=_llama(root / "tied", True), strategy="fsdp", nproc=4, tp=2,
                               save_every=1),
        "untied-pp2-tp2": dict(hf_config=_llama(root / "untied", False), nproc=4, pp=2, tp=2, **PIPE),
        "gpt-pp2-zero3": dict(strategy="fsdp", nproc=4, pp=2, **PIPE),
    }
    out = {}
    for name, flags in layouts.items():
        save = root / name / "ckpt"
        pools[4].run(_train, str(root / name), save_dir=str(save), **flags)
        out[name] = {"flags": flags, "save_dir": save, "root": root / name}
    return out


def _oracle(run: dict, step: int = 2) -> torch.nn.Module:
    """The run's model in one process, loaded from its checkpoint by plait.checkpoint.load."""
    from plait.app.step import unwrapped_model

    cfg = TrainConfig.from_flags(**{**BASE, **run["flags"], "strategy": "none", "nproc": 1, "tp": 1, "pp": 1})
    model = unwrapped_model(cfg, "cpu")
    checkpoint.load(run["save_dir"] / f"step_{step:06d}", model, torch.optim.AdamW(model.parameters()))
    return model


@pytest.mark.parametrize("name", ["tied-fsdp2-tp2", "untied-pp2-tp2"])
def test_export_loads_with_from_pretrained_and_gives_the_same_logits(runs, name, tmp_path):
    run = runs[name]
    out = tmp_path / "hf"
    # 20 kB shards: the 107 kB model comes out in several files with an index.
    assert export_mod.cli_main([str(run["save_dir"]), "--safetensors", str(out), "--max-shard-size", "20KB",
                                "--no-progress"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    stored = {k: v for s in shards for k, v in load_file(out / s).items()}
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in stored.values())
    assert ("lm_head.weight" in stored) == name.startswith("untied")  # a tied head is written once

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    oracle = _oracle(run)
    assert set(loaded.state_dict()) == set(oracle.state_dict())
    for k, v in oracle.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # The same float32 weights in the same code: equal up to rounding (measured: identical).
        torch.testing.assert_close(loaded(x).logits, oracle(x).logits, rtol=1e-6, atol=1e-6)


def test_gpt_pipeline_of_zero3_stages_exports_under_the_models_names(runs, tmp_path):
    run = runs["gpt-pp2-zero3"]
    files = export_mod.export(run["save_dir"], tmp_path / "gpt", progress=False)
    assert [f.name for f in files] == ["model.safetensors", "plait_config.json"]
    stored = load_file(tmp_path / "gpt" / "model.safetensors")
    oracle = _oracle(run).state_dict()
    assert set(stored) == set(oracle)  # safetensors keeps its own order in the file
    assert all(torch.equal(stored[k], v) for k, v in oracle.items())
    described = json.loads((tmp_path / "gpt" / "plait_config.json").read_text())
    assert described["config"] == dataclasses.asdict(TrainConfig.from_flags(**BASE).gpt_config())


# ------------------------------------------------------------------ --init-from
@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name in runs:
        out[name] = tmp_path_factory.mktemp("weights") / name
        export_mod.export(runs[name]["save_dir"], out[name], progress=False)
    return out


class _Counting:
    """A `TensorSource` that counts the elements it hands out (what a rank read from the file)."""

    def __init__(self, source, name: str, counts: dict[str, int]) -> None:
        self.source, self.name, self.counts, self.shape = source, name, counts, source.shape

    def _counted(self, t: torch.Tensor) -> torch.Tensor:
        self.counts[self.name] = self.counts.get(self.name, 0) + t.numel()
        return t

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._counted(self.source.narrow(dim, start, length))

    def read(self) -> torch.Tensor:
        return self._counted(self.source.read())


def _loaded(weights_dir: str, **flags) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The layout built and given the weights as `plait train --init-from` does: (its full state
    dict, the elements this rank read per file tensor)."""
    from plait.app import weights
    from plait.app.step import build_model, unwrapped_model

    cfg = TrainConfig.from_flags(**{**BASE, **flags}, init_from=weights_dir)
    model = build_model(cfg, cfg.mesh(), plait.init(seed=cfg.run.seed))
    counts: dict[str, int] = {}
    sources = weights.init_sources(weights_dir, unwrapped_model(cfg, "meta"))
    wrapped = {id(v): _Counting(v, v.name, counts) for v in sources.values()}  # a tie keeps one source
    plait.load_full_state_dict(model, {k: wrapped[id(v)] for k, v in sources.items()})
    return plait.full_state_dict(model), counts


# layout -> (its flags, the weights (a tied Llama's, or an untied one's where ties across pipeline
# ranks cannot be FSDP-sharded), the most of the file's elements one rank may read): FSDP and tp
# read their slices (fsdp x tp: the tp shard, then cut), pipeline stages and DDP replicas whole tensors.
LOADS = {
    "ddp4": (dict(strategy="ddp", nproc=4), "tied-fsdp2-tp2", 1.0),
    "zero3x4": (dict(strategy="fsdp", nproc=4), "tied-fsdp2-tp2", 0.3),
    "fsdp2-tp2": (dict(strategy="fsdp", nproc=4, tp=2), "tied-fsdp2-tp2", 0.55),
    "pp2-tp2": (dict(nproc=4, pp=2, tp=2, **PIPE), "tied-fsdp2-tp2", 0.45),
    "pp2-zero3x2": (dict(strategy="fsdp", nproc=4, pp=2, **PIPE), "untied-pp2-tp2", 0.3),
}


@pytest.mark.parametrize("layout", list(LOADS))
def test_init_from_gives_every_layout_the_files_weights_reading_its_slices(pools, runs, exported, layout):
    flags, source, most = LOADS[layout]
    file = load_file(exported[source] / "model.safetensors")
    total = sum(v.numel() for v in file.values())
    results = pools[4].run(_loaded, str(exported[source]), hf_config=runs[source]["flags"]["hf_config"],
                           **flags)
    for state, counts in results:
        assert set(state) == set(file) | {"lm_head.weight"}
        for k, v in state.items():  # a tied head is the embedding
            assert torch.equal(v, file.get(k, file["model.embed_tokens.weight"])), (layout, k)
        assert sum(counts.values()) <= most * total, (layout, sum(counts.values()) / total)
    read = [sum(c.values()) / total for _, c in results]
    assert layout != "ddp4" or read == [1.0] * 4  # a full replica reads everything, once


@pytest.fixture(scope="module")
def one_process_from_tied(runs, exported, tmp_path_factory) -> list[float]:
    """Three steps in one process from the tied Llama's exported weights: what the next two tests
    compare with (the same run for both, so made once)."""
    return _train(str(tmp_path_factory.mktemp("one")), strategy="none", nproc=1, steps=3,
                  hf_config=runs["tied-fsdp2-tp2"]["flags"]["hf_config"],
                  init_from=str(exported["tied-fsdp2-tp2"]))


def test_init_from_into_a_pipeline_x_tp_trains_as_one_process(pools, runs, exported, one_process_from_tied,
                                                              tmp_path):
    flags = dict(hf_config=runs["tied-fsdp2-tp2"]["flags"]["hf_config"],
                 init_from=str(exported["tied-fsdp2-tp2"]), steps=3)
    one = one_process_from_tied
    four = pools[4].run(_train, str(tmp_path / "pp"), nproc=4, pp=2, tp=2, **PIPE, **flags)[0]
    # It starts from the trained weights: 5.18 on the first batch, where the model's own
    # initialisation gives 5.44 (both measured; seeded, so deterministic).
    assert one[0] < 5.3
    # float32: tp and the pipeline sum in another order (measured <= 2e-7 relative here).
    assert four == pytest.approx(one, rel=1e-5)


def test_resume_wins_over_init_from(runs, exported, one_process_from_tied, tmp_path):
    hf_config, weights = runs["tied-fsdp2-tp2"]["flags"]["hf_config"], exported["tied-fsdp2-tp2"]
    other = _damaged(weights, tmp_path / "other", lambda t: t.update(
        {k: torch.zeros_like(v) for k, v in t.items() if k.endswith("norm.weight")}))
    flags = dict(hf_config=hf_config, strategy="none", nproc=1)
    straight = one_process_from_tied  # 3 steps from `weights`, in one process
    _train(str(tmp_path / "b"), init_from=str(weights), save_dir=str(tmp_path / "ckpt"), **flags)
    # Resuming continues the checkpoint: the other --init-from weights (zeroed norms) are not read.
    resumed = _train(str(tmp_path / "c"), init_from=other, save_dir=str(tmp_path / "ckpt"), resume=True,
                     steps=3, **flags)
    fresh = _train(str(tmp_path / "d"), init_from=other, steps=3, **flags)
    assert resumed == pytest.approx(straight[2:], rel=1e-6) and fresh[0] != pytest.approx(straight[0])


def test_gpt_weights_round_trip_into_one_process(exported):
    state, counts = _loaded(str(exported["gpt-pp2-zero3"]), strategy="none", nproc=1)
    file = load_file(exported["gpt-pp2-zero3"] / "model.safetensors")
    assert set(state) == set(file) and all(torch.equal(state[k], file[k]) for k in file)


# ------------------------------------------------------------------ refusals
def _damaged(src: Path, dst: Path, change) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors")
    return str(dst)


def test_weights_that_do_not_fit_are_refused_before_any_rank_starts(runs, exported, tmp_path, capsys):
    src, hf_config = exported["untied-pp2-tp2"], runs["untied-pp2-tp2"]["flags"]["hf_config"]
    cases = [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing: model.layers.1.mlp.up_proj.weight"),
        (lambda t: t.update({"model.norm.weight": torch.ones(16)}),
         r"wrong shape: model.norm.weight \(16,\) \(the model's is \(32,\)\)"),
        (lambda t: t.update({"extra.bias": torch.ones(3)}), "unexpected: extra.bias"),
    ]
    for i, (change, match) in enumerate(cases):
        bad = _damaged(src, tmp_path / str(i), change)
        with pytest.raises(ValueError, match=f"--init-from {bad}: the weights do not fit the model; {match}"):
            TrainConfig.from_flags(**BASE, hf_config=hf_config, init_from=bad)
    with pytest.raises(SystemExit) as stop:  # the command line reports it as one line, exit 2
        parse_args(["--hf-config", hf_config, "--init-from", str(tmp_path / "0")])
    assert stop.value.code == 2 and "missing: model.layers.1.mlp.up_proj.weight" in capsys.readouterr().err
    with pytest.raises(ValueError, match="holds plait's GPT's weights: train it without --hf-config"):
        TrainConfig.from_flags(**BASE, hf_config=hf_config, init_from=str(exported["gpt-pp2-zero3"]))
    with pytest.raises(ValueError, match="another model .*num_key_value_heads: 2 there, 4 here"):
        other = _llama(tmp_path / "mha", tied=False)
        cfg = json.loads(Path(other, "config.json").read_text())
        Path(other, "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 4}))
        TrainConfig.from_flags(**BASE, hf_config=other, init_from=str(src))


def test_export_picks_the_newest_intact_checkpoint_and_refuses_a_corrupt_one(runs, tmp_path, capsys):
    run = runs["tied-fsdp2-tp2"]  # saved at steps 1 and 2
    save = tmp_path / "ckpt"
    shutil.copytree(run["save_dir"], save)
    data = save / "step_000002" / "__1_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert export_mod.cli_main([str(save / "step_000002"), "--safetensors", str(tmp_path / "a")]) == 2
    assert "__1_0.distcp does not match its sha256" in capsys.readouterr().err
    export_mod.export(save, tmp_path / "b", progress=False)  # falls back to step 1, with a warning
    oracle = _oracle(run, step=1)
    stored = load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(stored[k], oracle.state_dict()[k]) for k in stored)


def test_export_refuses_a_non_empty_folder_unless_forced(runs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "model-00009-of-00009.safetensors").write_text("an older export's shard")
    with pytest.raises(ValueError, match="the folder is not empty; pass --force"):
        export_mod.export(runs["gpt-pp2-zero3"]["save_dir"], out, progress=False)
    export_mod.export(runs["gpt-pp2-zero3"]["save_dir"], out, force=True, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "notes.txt", "plait_config.json"]


def test_max_shard_size_parses_hugging_face_units():
    assert export_mod.parse_size("5GB") == 5 * 10**9 and export_mod.parse_size("2GiB") == 2 * 2**30
    assert export_mod.parse_size("1000") == 1000
    for bad in ("five", "0", "3XB"):
        with pytest.raises(ValueError, match="--max-shard-size"):
            export_mod.parse_size(bad)
    assert export_mod.plan_shards({"a": 6, "b": 6, "c": 20, "d": 1}, 10) == [["a"], ["b"], ["c"], ["d"]]
    assert export_mod.plan_shards({"a": 3, "b": 3, "c": 3}, 10) == [["a", "b", "c"]]
