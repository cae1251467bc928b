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
from oracle import train_cp_against_one_process

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


def _rows(step: int) -> torch.Tensor:
    """The global batch at ``step``: 4 rows of 17 tokens (inputs and targets shifted by one)."""
    return torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(step))


def _parity_of(oracle: torch.nn.Module, algorithm: str, tol: dict = TOL) -> bool:
    """Two SGD steps of ``oracle`` and of a cp=2 copy on the same batches: this rank's logits at the
    first, every parameter after each (`oracle.train_cp_against_one_process`)."""
    import copy

    import plait

    mesh = cached_mesh(cp=2)
    net = plait.parallelize(copy.deepcopy(oracle), mesh, plait.ParallelPlan(cp=algorithm))
    train_cp_against_one_process(oracle, net, mesh, _rows, tol)
    return True


def _parities(cases: list[tuple[str, str]]) -> bool:
    return all(_parity(family, algorithm) for family, algorithm in cases)


def _parity(family: str, algorithm: str) -> bool:
    return _parity_of(_build(family), algorithm)


# Every other family `plan_for` plans (tests/test_hf_tp.py builds them, without a KV cache), ring
# attention at cp=2. Falcon builds its causal mask itself and broadcasts one key head over its
# query heads. Gemma3's layers attend within a sliding window of 8 tokens, half the sequence.
# Gemma's norms compute in float32 inside the float64 model: its weight's gradient is
# a sum over the cp ranks' tokens in another order, float32 rounding (measured 6e-7 of it).
CP_FAMILIES = ["llama-mqa", "phi3", "neox", "codegen", "qwen3", "stablelm", "granite", "starcoder2", "phi",
               "smollm3", "falcon", "bigcode", "cohere", "olmo2", "opt", "mixtral", "qwen2-moe", "gemma",
               "gemma3"]


def _families_ring(families: list[str]) -> bool:
    from test_hf_tp import TOL_FLOAT32_NORMS, build_family

    for family in families:
        torch.manual_seed(0)
        tol = TOL_FLOAT32_NORMS if family.startswith("gemma") else TOL
        _parity_of(build_family(family, use_cache=False), "ring", tol)
    return True


def test_hf_cp2_ring_trains_like_one_process_in_every_other_planned_family(pools):
    assert all(pools[2].run(_families_ring, CP_FAMILIES))


def _family_refusals() -> list[str]:
    from test_hf_tp import build_family

    import plait

    mesh, said = cached_mesh(cp=2), []
    for family in ("gemma2", "bloom"):  # transformers gives them no sdpa attention to load
        with pytest.raises(ValueError, match="train it without context parallelism") as no_sdpa:
            plait.context_parallel(build_family(family, use_cache=False), mesh)
        said.append(str(no_sdpa.value))
    return said


def test_hf_cp2_refuses_by_name_the_families_it_cannot_split(pools):
    for said in pools[2].run(_family_refusals):
        assert "Gemma2ForCausalLM" in said[0] and "BloomForCausalLM" in said[1], said


@pytest.mark.parametrize("family,algorithm", [("llama", "ring"), ("llama", "allgather"), ("qwen2", "ulysses"),
                                              ("gpt2", "ring")])
def test_hf_cp2_trains_like_one_process(pools, family, algorithm):
    assert all(pools[2].run(_parity, family, algorithm))


def _sliding_windows() -> bool:
    # Windows of 8 and 3 tokens over 16: keys leave the window on the other rank's chunks, and
    # whole blocks fall outside it; each rank's model builds its windowed mask over its own tokens.
    for window, algorithm in ((8, "ring"), (3, "ring"), (8, "allgather"), (3, "ulysses")):
        _parity_of(_build("mistral", sliding_window=window, use_cache=False), algorithm)
    return True


def test_hf_cp2_sliding_window_attention_trains_like_one_process(pools):
    assert all(pools[2].run(_sliding_windows))


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
    return [str(e.value) for e in (eager, labels, silent)]


def test_hf_refusals(pools):
    assert all(pools[2].run(_refusals))
