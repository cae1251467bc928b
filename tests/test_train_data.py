"""`plait train` on real data and the user's own model, as a user runs it: token files, text folders,
--eval-data, --model FACTORY, the run folder and its strict metrics, the summary after --resume."""

from __future__ import annotations

import json
import re
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.app import data
from plait.app.config import TrainConfig, parse_args

# Short runs of the tiny GPT in this process (one rank); the layouts' own tests cover the rest.
BASE = dict(strategy="none", nproc=1, steps=12, warmup=1, batch_size=8, seq_len=16, eval_every=6,
            eval_batches=2, progress=False, lr=3e-2)
FACTORY = """
    import torch
    from torch import nn

    class Tiny(nn.Module):  # no parallel code, nothing plait knows by name
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(300, 16)
            self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
            self.head = nn.Linear(16, 300)

        def forward(self, ids):
            return self.head(torch.relu(self.emb(ids)) + self.body(self.emb(ids)))

    def build():
        return Tiny()
"""


def _strict(line: str) -> dict:
    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")

    return json.loads(line, parse_constant=refuse)


def _tokens(path: Path, n: int = 40_000, dtype=np.uint16, vocab: int = 300) -> Path:
    """A learnable stream: runs of consecutive ids (the next token is the last plus one, mostly)."""
    rng = np.random.default_rng(0)
    starts = rng.integers(0, vocab, n // 20)
    ids = (starts[:, None] + np.arange(20)) % vocab
    flat = ids.reshape(-1).astype(dtype)
    if path.suffix == ".npy":
        np.save(path, flat)
    else:
        flat.tofile(path)  # as nanoGPT's prepare.py writes train.bin
    return path


def _train(tmp_path: Path, **flags) -> tuple[dict, list[dict]]:
    from plait.app.train import train

    out = train(TrainConfig.from_flags(**{**BASE, "run_dir": str(tmp_path), **flags}))
    lines = (Path(out["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return out, [_strict(line) for line in lines]


def test_a_uint16_token_file_trains_and_logs_validation_loss_in_strict_json(tmp_path):
    train_file = _tokens(tmp_path / "train.bin")
    val_file = _tokens(tmp_path / "val.npy", n=4_000)
    out, rows = _train(tmp_path, data=str(train_file), data_dtype="uint16", eval_data=str(val_file),
                       name="tok")
    header, steps, summary = rows[0]["header"], [r for r in rows if "step" in r], rows[-1]["summary"]
    assert header["run_id"] == "tok" and header["data"]["kind"] == "tokens" and header["data"]["vocab"] == 300
    assert header["config"]["model"]["name"] == "tiny" and header["torch_version"] == torch.__version__
    assert header["flops_per_token"] > 6 * 100_000 and header["flops_formula"].startswith("6N + 12Lds")
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert all(r["lr"] > 0 and r["grad_norm"] > 0 and r["peak_mem_bytes"] > 0 for r in steps)
    assert all(r["mfu"] is None and r["model_flops_per_s"] > 0 for r in steps)  # a CPU has no known peak
    evals = [r["eval_loss"] for r in steps if "eval_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0] < 6.0  # ln(300) = 5.7 at the start
    assert summary["final_loss"] < out["first_loss"] - 1.0  # the vocabulary grew to the data's: 300
    assert TrainConfig.from_flags(data=str(train_file), data_dtype="uint16").gpt_config().vocab_size == 300
    config = (tmp_path / "tok" / "config.toml").read_text()
    assert 'name = "tok"' in config and "data_dtype = \"uint16\"" in config
    assert parse_args(["--config", str(tmp_path / "tok" / "config.toml"), "--name", "other"]).data.eval_data


def test_token_files_are_memory_mapped_and_their_dtype_is_never_guessed(tmp_path):
    raw = _tokens(tmp_path / "t.bin", dtype=np.uint32)
    mapped = data.load_tokens(raw, "uint32")
    assert isinstance(mapped, np.memmap) and mapped.dtype == np.uint32 and len(mapped) == 40_000
    x, y = data.BatchSampler(mapped, 16, 4, seed=1).batch_at(0)
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match="a raw .bin does not say how wide its tokens are; add --data-dtype"):
        TrainConfig.from_flags(data=str(raw))
    with pytest.raises(ValueError, match="is a .npy of uint16; drop --data-dtype"):
        TrainConfig.from_flags(data=str(_tokens(tmp_path / "t.npy")), data_dtype="uint32")
    with pytest.raises(ValueError, match="is read as text: drop --data-dtype"):
        TrainConfig.from_flags(data_dtype="uint16")
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\1" * 4097)
    with pytest.raises(ValueError, match="not a whole number of uint16 tokens"):
        TrainConfig.from_flags(data=str(odd), data_dtype="uint16")
    # Megatron's .idx says the dtype: version 1, dtype code 4 (int32), then the counts.
    (tmp_path / "t.idx").write_bytes(data.MEGATRON_MAGIC + (1).to_bytes(8, "little") + bytes([4]) + bytes(16))
    assert data.load_tokens(raw).dtype == np.int32
    with pytest.raises(ValueError, match="the Megatron index .* says .* holds int32 tokens"):
        data.load_tokens(raw, "uint16")


def test_a_text_folder_skips_git_and_binary_files_and_ends_each_document(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / ".git").mkdir(parents=True)
    (corpus / ".git" / "HEAD").write_text("ref: refs/heads/main\n" * 100)
    (corpus / "a.txt").write_text("alpha " * 200)
    (corpus / "b.md").write_text("beta " * 300)
    (corpus / "logo.png").write_bytes(b"\x89PNG\0\0" * 100)
    info = data.scan(corpus)
    assert (info.files, info.tokens, [Path(s).name for s in info.skipped]) == (2, 1200 + 1 + 1500 + 1,
                                                                             ["logo.png"])
    c = data.load_corpus(corpus, val_fraction=0.5)
    whole = np.concatenate([c.train, c.val]).tobytes()
    assert whole == b"alpha " * 200 + b"\0" + b"beta " * 300 + b"\0"  # byte 0 ends each document
    assert data.scan(corpus, max_bytes=1500).truncated
    with pytest.raises(ValueError, match="holds NUL bytes, so it is not text"):
        TrainConfig.from_flags(data=str(corpus / "logo.png"))


def test_the_data_vocabulary_is_checked_against_the_model_before_any_rank_starts(tmp_path, monkeypatch,
                                                                                    capsys):
    from plait.app import launch, train
    from plait.app.cli import main

    def no_ranks(*args, **kwargs):
        raise AssertionError("plait train started ranks for a run it should have refused")

    monkeypatch.setattr(launch, "spawn", no_ranks)
    monkeypatch.setattr(train, "train", no_ranks)
    tokens = _tokens(tmp_path / "t.bin")  # ids up to 299
    cases = [(["--vocab-size", "256"], "--model tiny .*: vocab_size 256 cannot embed the data's token ids: "
              f"the token file {tokens} holds ids up to 299 .*at least 300"),
             (["--model", "mymodel:build", "--data", str(tmp_path / "small.bin")], "--model mymodel:build: "
              "vocab_size 300 cannot embed .* ids up to 511")]
    _tokens(tmp_path / "small.bin", vocab=512)
    (tmp_path / "mymodel.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            main(["train", "--data", str(tokens), "--data-dtype", "uint16", "--run-dir", str(tmp_path),
                  *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert re.search(message, err), err


def _factory_run(tmp: str, **flags) -> list[float]:
    """`plait train --model mymodel:build` on this rank (picklable for the rank pools)."""
    sys.path.insert(0, tmp)
    from plait.app.train import train

    try:
        return train(TrainConfig.from_flags(**{**BASE, "eval_every": 0, "steps": 4, "run_dir": tmp,
                                               "model": "mymodel:build", "data": f"{tmp}/t.bin",
                                               "data_dtype": "uint16", **flags}))["losses"]
    finally:
        sys.path.remove(tmp)


def test_your_own_model_trains_under_ddp_as_in_one_process(pools, tmp_path):
    _tokens(tmp_path / "t.bin")
    (tmp_path / "mymodel.py").write_text(textwrap.dedent(FACTORY))
    one = _factory_run(str(tmp_path))
    assert one[-1] < one[0]
    two = pools[2].run(_factory_run, str(tmp_path), strategy="ddp", nproc=2)
    for losses in two:  # the layout tests' tolerance: fp32 reductions in another order
        assert losses == pytest.approx(one, rel=1e-4)
    with pytest.raises(ValueError, match="--tp 2 with --model mymodel:build: .*use --strategy fsdp or ddp"):
        TrainConfig.from_flags(model="mymodel:build", data=str(tmp_path / "t.bin"), data_dtype="uint16",
                               tp=2, nproc=2)
    with pytest.raises(ValueError, match="--experts builds MoE blocks in plait's GPT; with --model"):
        TrainConfig.from_flags(model="mymodel:build", experts=2)


def test_the_summary_after_resume_counts_this_runs_steps_and_a_finished_run_has_nothing_to_do(tmp_path):
    flags = dict(data=str(_tokens(tmp_path / "t.bin")), data_dtype="uint16", eval_every=0, name="r",
                 save_every=2)
    first, _ = _train(tmp_path, steps=4, **flags)
    assert first["steps_this_run"] == 4 and (tmp_path / "r" / "checkpoints" / "step_000004").is_dir()
    more, rows = _train(tmp_path, steps=6, resume=True, **flags)
    assert more["steps_this_run"] == 2 and len(more["losses"]) == 2
    headers = [r["header"] for r in rows if "header" in r]
    assert [h["resumed_from_step"] for h in headers] == [None, 4]
    times = [r["step_time_s"] for r in rows if r.get("step", 0) > 4]
    assert more["tokens_per_s"] <= 2 * 8 * 16 / sum(times)  # over the 2 steps this run took, not 6
    done, rows = _train(tmp_path, steps=6, resume=True, **flags)
    assert done["steps_this_run"] == 0 and done["tokens_per_s"] is None and done["final_loss"] is None
    assert rows[-1]["summary"]["steps_this_run"] == 0


@pytest.mark.parametrize("package", ["tensorboard", "wandb"])
def test_a_logger_is_refused_before_the_run_when_it_is_not_installed(monkeypatch, package):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else
                        real(name, *a))
    with pytest.raises(ValueError, match=rf"--{package} .* pip install 'plait\[{package}\]'"):
        TrainConfig.from_flags(**{package: True})


def test_tensorboard_event_files_hold_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _train(tmp_path, steps=3, eval_every=0, max_bytes=20_000, name="tb", tensorboard=True)
    events = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    events.Reload()
    assert {"loss", "lr", "grad_norm", "tokens_per_s"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]


def test_a_step_that_diverged_is_written_as_null_and_flagged(tmp_path):
    from plait.app.runlog import RunLog

    log = RunLog(tmp_path / "r", active=True)
    log.step({"step": 7, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3})
    log.summary({"first_loss": 5.0, "final_loss": float("nan")})
    step, summary = map(_strict, (tmp_path / "r" / "metrics.jsonl").read_text().splitlines())
    assert step == {"step": 7, "loss": None, "grad_norm": None, "lr": 1e-3,
                    "nonfinite": ["loss", "grad_norm"]}
    assert summary["summary"] == {"first_loss": 5.0, "final_loss": None, "nonfinite": ["final_loss"]}


# ------------------------------------------------------------------ --tokenizer: datasets + transformers
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
         "twelve", "thirteen", "fourteen"]


def _tokenizer(folder: Path) -> Path:
    """A word-level transformers tokenizer built here with `tokenizers` (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[EOD]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOD]")
    fast.save_pretrained(folder)
    return folder


def _documents(path: Path, n: int = 300) -> list[str]:
    """JSON Lines of counting documents (the next word is the last plus one): learnable."""
    rng = np.random.default_rng(0)
    docs = [" ".join(WORDS[(s + i) % len(WORDS)] for i in range(int(k)))
            for s, k in zip(rng.integers(0, len(WORDS), n), rng.integers(3, 12, n))]
    path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
    return docs


def test_json_lines_tokenized_through_datasets_train_and_the_tokens_are_cached(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    from transformers import AutoTokenizer

    from plait.app import hfdata

    docs = _documents(tmp_path / "docs.jsonl")
    tok_dir = _tokenizer(tmp_path / "tok")
    flags = dict(data=str(tmp_path / "docs.jsonl"), tokenizer=str(tok_dir),
                 data_cache=str(tmp_path / "cache"))
    out, rows = _train(tmp_path, name="first", **flags)
    header, steps = rows[0]["header"]["data"], [r for r in rows if "step" in r]
    assert header["kind"] == "tokenized" and header["documents"] == len(docs) and not header["cache_reused"]
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0
    assert [r["step"] for r in steps if "eval_loss" in r] == [6, 12]
    # Packed: every document's tokens, then the end-of-document token, back to back.
    tok = AutoTokenizer.from_pretrained(tok_dir)
    want = [i for d in docs for i in [*tok(d, add_special_tokens=False)["input_ids"], tok.eos_token_id]]
    cached = np.load(header["cache"])
    assert cached.dtype == np.uint16 and cached.tolist() == want
    assert Path(header["cache"]).parent == tmp_path / "cache" / "tokens"

    def no_tokenizing(*args):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(hfdata, "_write", no_tokenizing)  # the second run reads the cache
    again, rows = _train(tmp_path, name="second", **flags)
    assert rows[0]["header"]["data"]["cache_reused"] and again["losses"] == out["losses"]


def test_a_tokenizer_the_model_cannot_embed_is_refused_before_any_rank_starts(tmp_path):
    pytest.importorskip("datasets")
    _documents(tmp_path / "docs.jsonl", n=200)
    flags = dict(data=str(tmp_path / "docs.jsonl"), tokenizer=str(_tokenizer(tmp_path / "tok")),
                 data_cache=str(tmp_path / "cache"), run_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"vocab_size 8 cannot embed .* tokenized by --tokenizer .* 17"):
        TrainConfig.from_flags(**flags, vocab_size=8)
    with pytest.raises(ValueError, match="--text-field body: .* have no such field; they have id, text"):
        TrainConfig.from_flags(**flags, text_field="body")
    with pytest.raises(ValueError, match="--max-bytes 2000 applies to token files and byte-level text"):
        TrainConfig.from_flags(**flags, max_bytes=2000)


# ------------------------------------------------------------------ --wandb
def test_wandb_gets_the_step_scalars_under_the_run_name(tmp_path, monkeypatch):
    # A stand-in for the wandb package (installing it costs CI minutes): what plait calls, recorded.
    import importlib.machinery
    import types

    calls: list[tuple] = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    class Run:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    _train(tmp_path, steps=3, eval_every=0, max_bytes=20_000, name="wb", wandb=True)
    (_, init_kw), *logs, finish = calls
    assert init_kw["name"] == "wb" and init_kw["dir"] == str(tmp_path / "wb")
    assert init_kw["config"]["run"]["wandb"] and finish == ("finish",)
    assert [step for _, step, _ in logs] == [1, 2, 3]
    assert all({"loss", "lr", "grad_norm", "tokens_per_s"} <= set(data) for _, _, data in logs)


def test_wandb_offline_writes_the_run_files(tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # not in requirements-dev.txt: it takes minutes to install
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out, _ = _train(tmp_path, steps=3, eval_every=0, max_bytes=20_000, name="wb", wandb=True)
    [run] = (tmp_path / "wb" / "wandb").glob("offline-run-*")
    [records] = run.glob("run-*.wandb")  # W&B's binary log: values are held as JSON text in it
    wanted = [json.dumps(loss).encode() for loss in out["losses"]]
    deadline = time.monotonic() + 30  # W&B's own service process may still be writing the file
    while not all(w in records.read_bytes() for w in wanted) and time.monotonic() < deadline:
        time.sleep(0.5)
    held = records.read_bytes()
    assert all(w in held for w in wanted) and b"grad_norm" in held
