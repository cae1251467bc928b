"""Context parallelism on unmodified Hugging Face `transformers` causal LMs.

Tiny configs built in code (nothing downloaded), float64, cp=2 with DDP over the cp ranks,
against one process on the same batches: this rank's tokens of the logits, and every parameter
after each of two SGD steps, at ``rtol=1e-9`` (see `test_context_parallel.py`). Positions reach
the model as ``position_ids`` (Llama, Qwen2 and Mistral: rotary; GPT-2: a learned position
table), with and without a KV cache.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import step_and_compare

from plait.testing import cached_mesh

transformers = pytest.importorskip("transformers")

TOL = {"rtol": 1e-9, "atol": 1e-12}
VOCAB = 96


def _build(family: str, attn: str = "sdpa", **extra) -> torch.nn.Module:
    if family.endswith("-nocache"):  # as in training: no KV cache
        return _build(family.removesuffix("-nocache"), attn, use_cache=False, **extra)
    t = transformers
    t.logging.set_verbosity_error()
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                  attn_implementation=attn, **extra)
    if family == "llama":
        model = t.LlamaForCausalLM(t.LlamaConfig(**common, num_key_value_heads=2))
    elif family == "qwen2":
        model = t.Qwen2ForCausalLM(t.Qwen2Config(**common, num_key_value_heads=2))
    elif family == "mistral":  # a sliding window (default 4096) longer than the sequences
        model = t.MistralForCausalLM(t.MistralConfig(**common, num_key_value_heads=2))
    else:
        model = t.GPT2LMHeadModel(t.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attn, **extra))
    torch.manual_seed(0)
    model.apply(model._init_weights)
    return model.to(torch.float64)


def _loss(out, tgt: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), tgt.flatten())


def _parities(cases: list[tuple[str, str]]) -> bool:
    return all(_parity(family, algorithm) for family, algorithm in cases)


def _parity(family: str, algorithm: str) -> bool:
    import copy

    import plait

    mesh = cached_mesh(cp=2)
    oracle = _build(family)
    net = plait.parallelize(copy.deepcopy(oracle), mesh, plait.ParallelPlan(cp=algorithm))
    opt_ref, opt = torch.optim.SGD(oracle.parameters(), lr=0.5), torch.optim.SGD(net.parameters(), lr=0.5)
    for step in range(2):
        w = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(step))
        idx, tgt = w[:, :-1], w[:, 1:]
        want = oracle(idx)
        _loss(want, tgt).backward()
        got = net(plait.cp.shard(idx, mesh))
        if step == 0:
            torch.testing.assert_close(got.logits, plait.cp.shard(want.logits.detach(), mesh), **TOL)
        _loss(got, plait.cp.shard(tgt, mesh)).backward()
        step_and_compare(net, oracle, (opt_ref, opt), TOL, f"after SGD step {step + 1}")
    return True


@pytest.mark.parametrize("family,algorithm", [("llama", "ring"), ("llama", "allgather"), ("qwen2", "ulysses"),
                                              ("gpt2", "ring")])
def test_hf_cp2_trains_like_one_process(pools, family, algorithm):
    assert all(pools[2].run(_parity, family, algorithm))


def test_hf_cp2_without_a_kv_cache_is_not_taken_for_packed_sequences(pools):
    # use_cache=False: with no cache and no mask, transformers reads the zigzag position ids as
    # packed sequences and builds a mask (refused: "an explicit mask"); an all-ones mask keeps it
    # causal. Mistral: its sliding window (4096) is longer than the sequence.
    cases = [("llama-nocache", "ring"), ("mistral-nocache", "allgather")]
    assert all(pools[2].run(_parities, cases))


def _refusals() -> list[str]:
    import plait

    mesh = cached_mesh(cp=2)
    with pytest.raises(ValueError, match="attn_implementation='sdpa'") as eager:
        plait.context_parallel(_build("llama", attn="eager"), mesh)
    model = plait.context_parallel(_build("llama"), mesh)
    x = plait.cp.shard(torch.zeros(2, 16, dtype=torch.long), mesh)
    with pytest.raises(ValueError, match="labels=") as labels:
        model(x, labels=x)
    # An attention that computes its own way under the sdpa setting is caught when it runs.
    model.model.layers[0].self_attn.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="ran without calling") as silent:
        model(x)
    # A sliding window shorter than the sequence: each rank's attention would see a causal mask.
    windowed = plait.context_parallel(_build("mistral", sliding_window=8), mesh)
    with pytest.raises(ValueError, match="sliding window of 8 tokens") as window:
        windowed(x)
    return [str(e.value) for e in (eager, labels, silent, window)]


def test_hf_refusals(pools):
    assert all(pools[2].run(_refusals))
