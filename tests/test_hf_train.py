"""`plait train --hf-config`: a transformers causal LM from its config, in a layout, against one process."""

from __future__ import annotations

import re

import pytest

from plait.app.config import parse_args

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_config(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("llama")
    transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             ).save_pretrained(folder)
    return str(folder)


def _losses(tmp: str, hf_config: str, **layout) -> list[float]:
    """Per-step losses of `plait train`'s loop on ``hf_config`` (picklable for rank pools: the
    flags' parsing is `test_hf_config_is_checked_before_anything_starts`'s)."""
    from plait.app.train import TrainConfig, train

    cfg = TrainConfig.from_flags(hf_config=hf_config, steps=4, warmup=1, batch_size=4, seq_len=32,
                                 eval_every=0, progress=False, max_bytes=200_000, run_dir=tmp, name="run",
                                 **layout)
    return train(cfg)["losses"]


@pytest.fixture(scope="module")
def one_process(llama_config, tmp_path_factory) -> list[float]:
    """The one-process run every layout is compared with: the same run for each, so made once."""
    return _losses(str(tmp_path_factory.mktemp("one")), llama_config, strategy="none", nproc=1)


def test_tensor_parallel_llama_trains_as_one_process(pools, tmp_path, llama_config, one_process):
    one = one_process
    tp = pools[2].run(_losses, str(tmp_path), llama_config, nproc=2, tp=2, sequence_parallel=True)
    assert len(one) == 4 and tp[0] == tp[1]
    assert one[-1] < one[0]  # it learns
    # float32 training: tp sums the attention and MLP outputs in another order (measured <= 2e-6 here).
    assert tp[0] == pytest.approx(one, rel=1e-4)


def test_pipelined_llama_trains_as_one_process(pools, tmp_path, llama_config, one_process):
    one = one_process
    pp = pools[2].run(_losses, str(tmp_path), llama_config, nproc=2, pp=2, schedule="zb-h1", microbatches=2)
    # float32: microbatches sum the gradients in another order (measured <= 1e-6 here).
    for losses in pp:
        assert losses == pytest.approx(one, rel=1e-4)


def test_hf_config_is_checked_before_anything_starts(tmp_path, llama_config, capsys):
    small = tmp_path / "small"
    transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, max_position_embeddings=64).save_pretrained(small)
    cases = [
        (["--hf-config", str(tmp_path / "none")], "--hf-config .*none: no such file or folder"),
        (["--hf-config", str(tmp_path)], "the folder holds no config.json"),
        (["--hf-config", str(small)],
         "vocab_size 100 cannot embed the data's token ids: byte-level text holds ids up to 255"),
        (["--hf-config", llama_config, "--model", "small"], "--model small and --hf-config both name"),
        (["--hf-config", llama_config, "--seq-len", "65"], "--seq-len 65: the model's positions end at 64"),
        (["--hf-config", llama_config, "--nproc", "8", "--pp", "8", "--batch-size", "32"],
         r"--pp 8 x 1 stages per rank \(the chunks.*\) = 8 pipeline stages, but LlamaForCausalLM has only 6 "
         "segments"),
    ]
    for argv, match in cases:
        with pytest.raises(SystemExit) as stop:
            parse_args(argv)
        assert stop.value.code == 2
        assert re.search(match, capsys.readouterr().err), argv
    cfg = parse_args(["--hf-config", llama_config, "--tp", "2", "--nproc", "2"])
    assert cfg.seq_len == 64  # 128 by default, cut to the model's positions
