"""The byte corpus, the resumable sampler, deterministic init and the reference GPT."""

from __future__ import annotations

import pytest
import torch

import plait
from plait.app.data import BatchSampler, load_corpus
from plait.models.gpt import GPT, PRESETS, GPTConfig
from plait.state.materialize import full_values, owner_modules


def test_default_corpus_is_python_source():
    c = load_corpus(max_bytes=100_000)
    assert len(c.train) + len(c.val) == 100_000
    assert b"def " in bytes(c.train[:50_000].tolist())


def test_corpus_from_a_file_and_missing_path(tmp_path):
    f = tmp_path / "text.txt"
    f.write_bytes(b"hello world " * 500)
    c = load_corpus(f, val_fraction=0.1)
    assert len(c.val) == 601 and c.source == str(f)  # 6000 bytes and the end of the document
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_corpus(tmp_path / "nope")


def test_sampler_slices_compose_the_global_batch_and_resume():
    tokens = torch.arange(10_000) % 256
    whole = BatchSampler(tokens, 8, 6, seed=3)
    parts = [BatchSampler(tokens, 8, 6, dp_rank=r, dp_size=3, seed=3) for r in range(3)]
    x, y = whole.batch_at(5)
    assert torch.equal(torch.cat([p.batch_at(5)[0] for p in parts]), x)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    next(whole), next(whole)
    resumed = BatchSampler(tokens, 8, 6, seed=0)
    resumed.load_state_dict(whole.state_dict())
    assert torch.equal(next(resumed)[0], next(whole)[0])
    with pytest.raises(ValueError, match="not divisible"):
        BatchSampler(tokens, 8, 7, dp_size=2)


def test_meta_build_materializes_to_the_same_values_one_module_at_a_time():
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, tie_embeddings=True)
    ref = plait.init_weights(GPT(cfg), seed=7)
    with torch.device("meta"):
        meta = GPT(cfg)
    seen = set()
    for name, mod in owner_modules(meta):
        for key, value in full_values(mod, name, seed=7).items():
            full_name = f"{name}.{key}" if name else key
            if full_name == "lm_head.weight":  # tied: takes its first owner's (tok_emb) values
                continue
            seen.add(full_name)
            torch.testing.assert_close(value, dict(ref.named_buffers(remove_duplicate=False)).get(
                full_name, ref.state_dict().get(full_name)), rtol=0, atol=0)
    assert "layers.1.mlp.down_proj.weight" in seen and "layers.0.attn.rotary.cos" in seen
    assert ref.lm_head.weight is ref.tok_emb.weight
    assert ref.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.1)
    # A different seed gives different weights; the same seed the same.
    assert not torch.equal(plait.init_weights(GPT(cfg), seed=8).layers[0].attn.q_proj.weight,
                           ref.layers[0].attn.q_proj.weight)


def test_presets_span_tiny_to_100m():
    sizes = {}
    for name, cfg in PRESETS.items():
        with torch.device("meta"):
            sizes[name] = GPT(cfg).num_parameters()
    assert sizes["tiny"] < 1e6 and 20e6 <= sizes["25m"] <= 30e6 and 90e6 <= sizes["100m"] <= 130e6
    # Llama 3's own parameter counts (untied embeddings).
    assert sizes["llama3-8b"] == 8_030_261_248 and sizes["llama3-70b"] == 70_553_706_496


def test_gqa_and_bad_config():
    m = plait.init_weights(GPT(GPTConfig(d_model=32, n_heads=4, n_kv_heads=2, vocab_size=64)), 0)
    assert m(torch.randint(0, 64, (2, 8))).shape == (2, 8, 64)
    with pytest.raises(ValueError, match="not divisible by n_heads"):
        GPTConfig(d_model=30, n_heads=4)


def test_parallelize_materializes_a_tied_meta_model_without_untying_it():
    import plait
    from plait.models.gpt import GPT, GPTConfig

    plait.init()  # one process
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, tie_embeddings=True)
    with torch.device("meta"):
        model = GPT(cfg)
    model = plait.parallelize(model, plait.Mesh(dp=1), plait.ParallelPlan(data="none"))
    assert model.tok_emb.weight is model.lm_head.weight  # one tensor, as in the single-process model
    want = plait.init_weights(GPT(cfg), 0).state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0)
