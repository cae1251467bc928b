"""Tensor and sequence parallelism on unmodified Hugging Face `transformers` models.

Tiny configs built in code (hidden 32, 2 layers, vocabulary 96, random init, nothing
downloaded), `plait.plan_for` plans, float64. Next to each layout the single-process oracle trains
(same init, same batches: `oracle.train_against_one_process`); after 5 AdamW steps (default
settings) the gathered parameters must equal the oracle's.

Tolerance: float64, ``rtol=1e-9, atol=1e-12``. Sharding only changes the order of
floating-point sums (a matmul split in two and added, an all-reduce), a few ulps (~1e-16
relative) per operation, ~1e-12 after 5 steps (measured: at most 3e-12 of a tensor's largest
entry, GPT-NeoX). AdamW divides each gradient by its running magnitude plus ``eps`` (1e-8), so
rounding noise in a near-zero gradient moves a parameter by at most ``lr * noise / eps`` ~ 1e-11
over 5 steps; any real error (a wrong shard, a missing or doubled gradient sum) moves it by
~lr = 1e-3.

Families: grouped-query attention split (Llama: 2 KV heads over tp=2) and replicated (Llama
with 1 KV head), GPT-2's transposed ``Conv1D`` layers with the fused ``c_attn`` and tied
embeddings, Phi-3's fused ``qkv_proj`` (with GQA) and ``gate_up_proj``, GPT-NeoX's per-head fused
``query_key_value`` and parallel residual, Qwen2's q/k/v biases, Mistral, Gemma and Gemma2's
scaled embeddings (a subclass of ``nn.Embedding`` whose forward scales the lookup), CodeGen's
``qkv_proj`` in ``mp_num`` interleaved groups of [q v k], Qwen3's and Gemma3's per-head
``q_norm``/``k_norm`` (replicated, gradients summed over tp), StableLM (reads its
``hidden_size``), Granite's multipliers, StarCoder2, Phi's parallel block, SmolLM3's NoPE
layers, Llama and GPT-2 built with
``use_cache=False`` (no KV cache, as in training); OLMo2's q/k norms over the whole projection
(their mean of squares summed over tp), Falcon's and GPT-BigCode's fused multi-query
projections, Cohere, OPT's MLP in the decoder layer (tp only), Bloom's ALiBi biases split with
the heads, and Mixtral's and Qwen2-MoE's experts stacked in 3-D tensors. Plans that must be
refused are checked without spawning: `plait.tp.check_plan` needs no process group.

tp=2 runs on the session's pool of 2 ranks, fsdp x tp on its pool of 4 (fsdp=2, tp=2); each
launch checks several things.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from oracle import compare_with_oracle, loss64, train_against_one_process

transformers = pytest.importorskip("transformers")

TOL = {"rtol": 1e-9, "atol": 1e-12}
# Gemma's RMSNorm computes in float32 (``x.float()``) whatever the model's dtype. Under sequence
# parallelism its weight's gradient is a sum over the tp ranks' sequence shards, in another order
# than one process's: float32 rounding (measured: 2e-7 of the gradient, 1e-9 on parameters of
# ~5e-3 after 5 steps), still far below the ~lr = 1e-3 a real error moves a parameter by.
TOL_FLOAT32_NORMS = {"rtol": 1e-6, "atol": 1e-8}
FLOAT32_NORMS = ("gemma", "gemma2", "gemma3")
# OLMo2's q_norm/k_norm compute in float32 in one process; split, in float64, the mean of
# squares a sum over tp (`plait.tp.SplitRMSNorm`): the oracle's float32 rounding shows in the
# forward (measured: logits 5e-8 off, of 0.4), and after 5 steps up to 1e-5 of a tensor's
# largest entry with one KV head (2e-7 with two) -- the oracle itself moves by 5e-6 when its
# norms compute in float64 -- against ~lr = 1e-3 for a real error.
FLOAT32_WIDE_NORMS = ("olmo2", "olmo2-mqa")
# Mixtral's and Qwen2-MoE's routers take their softmax in float32, yet they are held to TOL: the
# gradient of the routing weights is summed over tp in float64 before the router rounds it
# (`plait.tp.collectives.sum_grad_on_first`). Rounding each rank's partial gradient to float32
# first, as the model's code does on its own, left the routers' gradients 1.2e-7 off at the
# first step and the parameters 4e-9 off after 5 (2e-7 of the entries' size); now ~1e-15.
TOL_FLOAT32_FORWARD = {"rtol": 1e-4, "atol": 1e-6}
STEPS = 5
VOCAB, HIDDEN, SEQ, BATCH = 96, 32, 16, 4
FAMILIES = ["llama", "llama-mqa", "gpt2", "phi3", "neox", "qwen2", "mistral", "gemma", "gemma2", "codegen",
            "qwen3", "gemma3", "stablelm", "granite", "starcoder2", "phi", "smollm3", "llama-nocache",
            "gpt2-nocache", "falcon", "bigcode", "cohere", "olmo2", "olmo2-mqa", "opt", "bloom", "mixtral",
            "qwen2-moe"]


def _build(family: str, **extra) -> torch.nn.Module:
    """A tiny randomly initialised causal LM of ``family``, float64, every dropout 0; a family
    ending in ``-nocache`` is built with ``use_cache=False``, as for training."""
    if family.endswith("-nocache"):
        return _build(family.removesuffix("-nocache"), use_cache=False, **extra)
    t = transformers
    t.logging.set_verbosity_error()
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    if family == "llama":  # eager attention here, sdpa (the default) in the others
        cfg = t.LlamaConfig(**common, num_key_value_heads=2, attn_implementation="eager", **extra)
        model = t.LlamaForCausalLM(cfg)
    elif family == "llama-mqa":  # one KV head: replicated over tp=2
        model = t.LlamaForCausalLM(t.LlamaConfig(**common, num_key_value_heads=1, **extra))
    elif family == "gpt2":
        model = t.GPT2LMHeadModel(t.GPT2Config(
            vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
            eos_token_id=0, **{"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, **extra}))
    elif family == "phi3":
        model = t.Phi3ForCausalLM(t.Phi3Config(**common, num_key_value_heads=2, pad_token_id=0, **extra))
    elif family == "neox":
        model = t.GPTNeoXForCausalLM(t.GPTNeoXConfig(**common, **{"hidden_dropout": 0.0, **extra}))
    elif family == "qwen2":
        model = t.Qwen2ForCausalLM(t.Qwen2Config(**common, num_key_value_heads=2, **extra))
    elif family == "mistral":
        model = t.MistralForCausalLM(t.MistralConfig(**common, num_key_value_heads=2, **extra))
    elif family == "gemma":  # the embedding scales its lookup by sqrt(hidden); tied lm_head
        model = t.GemmaForCausalLM(t.GemmaConfig(**common, num_key_value_heads=2, head_dim=8, **extra))
    elif family == "gemma2":  # scaled embedding, 4 norms per layer, soft-capping, a sliding window
        model = t.Gemma2ForCausalLM(t.Gemma2Config(
            **common, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=8,
            attn_implementation="eager", **extra))
    elif family == "codegen":  # qkv_proj: mp_num=4 groups of [q v k]; 8 heads, 2 per group
        model = t.CodeGenForCausalLM(t.CodeGenConfig(
            vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=8, rotary_dim=2, n_positions=64,
            n_inner=64, bos_token_id=0, eos_token_id=0, **extra))
    elif family == "qwen3":  # q_norm and k_norm over each head's features
        model = t.Qwen3ForCausalLM(t.Qwen3Config(**common, num_key_value_heads=2, head_dim=8, **extra))
    elif family == "gemma3":  # per-head q/k norms, scaled embedding, sliding-window layers
        model = t.Gemma3ForCausalLM(t.Gemma3TextConfig(
            **common, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=8, **extra))
    elif family == "olmo2":  # q_norm and k_norm over the whole projection (32 and 16 features)
        model = t.Olmo2ForCausalLM(t.Olmo2Config(**common, num_key_value_heads=2, **extra))
    elif family == "olmo2-mqa":  # one KV head: k_norm over its 8 features, replicated over tp=2
        model = t.Olmo2ForCausalLM(t.Olmo2Config(**common, num_key_value_heads=1, **extra))
    elif family == "falcon-grouped":  # 2 KV heads, [q... k v] per KV head: refused
        model = t.FalconForCausalLM(t.FalconConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
            new_decoder_architecture=True, bos_token_id=0, eos_token_id=0, **extra))
    elif family == "falcon":  # multi-query: 1 KV head (where the config says 4) in a fused projection
        model = t.FalconForCausalLM(t.FalconConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
            multi_query=True, new_decoder_architecture=False, bos_token_id=0, eos_token_id=0, **extra))
    elif family == "bigcode":  # GPT-BigCode: multi-query in a fused c_attn, [q | k | v]
        model = t.GPTBigCodeForCausalLM(t.GPTBigCodeConfig(
            vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64, multi_query=True,
            bos_token_id=0, eos_token_id=0,
            **{"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, **extra}))
    elif family == "cohere":  # attention and MLP in parallel, LayerNorm without bias, logit scale, tied
        model = t.CohereForCausalLM(t.CohereConfig(**common, num_key_value_heads=2, **extra))
    elif family == "opt":  # fc1/fc2 in the decoder layer itself; the final norm registered first
        model = t.OPTForCausalLM(t.OPTConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
            max_position_embeddings=64, word_embed_proj_dim=HIDDEN, pad_token_id=1, bos_token_id=0,
            eos_token_id=0, dropout=0.0, **extra))
    # Experts stacked in 3-D tensors, run one by one: transformers' default grouped_mm takes no float64.
    elif family == "mixtral":
        model = t.MixtralForCausalLM(t.MixtralConfig(
            **common, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            experts_implementation="eager", **extra))
    elif family == "qwen2-moe":  # and a shared expert with a sigmoid gate
        model = t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(
            **common, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=32, experts_implementation="eager", **extra))
    elif family == "bloom":  # ALiBi biases for all heads, built by the model; residuals added inside
        model = t.BloomForCausalLM(t.BloomConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=2, n_head=4, hidden_dropout=0.0,
            attention_dropout=0.0, bos_token_id=0, eos_token_id=0, **extra))
    elif family == "stablelm":  # its attention reads hidden_size and num_heads; partial rotary
        model = t.StableLmForCausalLM(t.StableLmConfig(**common, num_key_value_heads=2, **extra))
    elif family == "granite":  # embedding, attention, residual and logit multipliers
        model = t.GraniteForCausalLM(t.GraniteConfig(
            **common, num_key_value_heads=2, embedding_multiplier=2.0, attention_multiplier=0.3,
            residual_multiplier=0.5, logits_scaling=4.0, **extra))
    elif family == "starcoder2":  # biases everywhere, a plain MLP (c_fc, c_proj)
        model = t.Starcoder2ForCausalLM(t.Starcoder2Config(
            **common, num_key_value_heads=2, residual_dropout=0.0, embedding_dropout=0.0, **extra))
    elif family == "phi":  # attention and MLP in parallel off one norm; dense as output
        model = t.PhiForCausalLM(t.PhiConfig(
            **common, num_key_value_heads=2, resid_pdrop=0.0, embd_pdrop=0.0, **extra))
    elif family == "smollm3":  # some layers without rotary positions (NoPE)
        model = t.SmolLM3ForCausalLM(t.SmolLM3Config(
            **common, num_key_value_heads=2, pad_token_id=0, **extra))
    else:
        raise ValueError(family)
    return model.to(torch.float64)


build_family = _build  # the other transformers tests' builder of every family's tiny model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    w = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return w[:, :-1], w[:, 1:]


# ------------------------------------------------------------------ parity with one process
def tp_plan(sp: bool, data: str):
    """``plan(model)`` for `oracle.train_against_one_process`: `plait.plan_for`'s tensor-parallel plan,
    with sequence parallelism or not, and ``data`` (``'fsdp'``: FSDP over fsdp=2 as well)."""
    import plait

    return lambda model: plait.ParallelPlan(tp=plait.plan_for(model), sequence_parallel=sp, data=data)


def tp_mesh(data: str):
    """tp=2, inside fsdp=2 when ``data='fsdp'``."""
    from plait.testing import cached_mesh

    return cached_mesh(fsdp=2, tp=2) if data == "fsdp" else cached_mesh(tp=2)


def digest(state: dict[str, torch.Tensor]) -> float:
    """One number of a gathered state, for the ranks to show they hold the same."""
    return sum(float(v.double().sum()) for v in state.values())


def _train(family: str, sp: bool, data: str) -> float:
    """5 AdamW steps of ``family`` under tp=2 (``data='fsdp'``: FSDP over fsdp=2 as well) and of
    the oracle, compared by `oracle.train_against_one_process`."""
    # Gemma3's q_norm/k_norm (float32 inside) have their gradients summed over tp with or without
    # SP (each rank normalizes its own heads): float32 rounding as above (measured 3e-7 relative).
    tol = TOL_FLOAT32_NORMS if family in FLOAT32_NORMS and (sp or family == "gemma3") else TOL
    # OLMo2's forward itself differs by float32 rounding, the others' only in gradients.
    wide = family in FLOAT32_WIDE_NORMS
    trained = train_against_one_process(lambda: _build(family), _token_batch, tp_mesh(data),
                                        tp_plan(sp, data), TOL_FLOAT32_FORWARD if wide else tol,
                                        TOL_FLOAT32_FORWARD if wide else TOL, steps=STEPS, label=family)
    return digest(trained.full)


def _token_batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    ids, tgt = _batch(step)
    return {"input_ids": ids}, tgt


def _tp2(runs: list[tuple[str, bool]]) -> dict:
    return {(family, sp): _train(family, sp, "none") for family, sp in runs}


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3"])  # GQA; Conv1D, fused, tied; fused with GQA
def test_tp2_with_and_without_sp_matches_single_process(pools, family):
    out = pools[2].run(_tp2, [(family, False), (family, True)])
    assert all(o == out[0] for o in out)  # the gathered parameters are the same on every rank


def test_tp2_with_and_without_sp_matches_single_process_in_more_families(pools):
    both = [(f, sp) for f in ("neox", "qwen2", "mistral") for sp in (False, True)]
    pools[2].run(_tp2, [("llama-mqa", True), *both])


def test_tp2_keeps_what_a_scaled_embedding_does_after_its_lookup(pools):
    # Gemma's and Gemma2's embeddings multiply the lookup by sqrt(hidden): the split lookup must
    # take the place of the lookup only (the logits were 30% and 14% off when it replaced forward).
    pools[2].run(_tp2, [("gemma", False), ("gemma", True), ("gemma2", False), ("gemma2", True)])


def test_tp2_splits_each_group_of_codegens_fused_qkv(pools):
    # CodeGen's qkv_proj holds mp_num=4 groups of [q v k]: each rank takes its heads of every group
    # (split as [q | k | v], the logits were 62% off).
    pools[2].run(_tp2, [("codegen", False), ("codegen", True)])


def test_tp2_splits_attention_with_per_head_qk_norms(pools):
    # Qwen3's and Gemma3's q_norm and k_norm act on each head's 8 features: replicated, their
    # gradients summed over tp (each rank applies them to its own heads). Before: refused.
    pools[2].run(_tp2, [("qwen3", False), ("qwen3", True), ("gemma3", False), ("gemma3", True)])


def test_tp2_splits_olmo2s_norms_over_the_whole_projection(pools):
    # OLMo2's q_norm and k_norm normalize all heads' features at once: each rank normalizes its
    # heads by the mean of squares summed over tp. Before: refused. With one KV head, k_norm is
    # replicated and each rank applies it to the head it computes.
    pools[2].run(_tp2, [("olmo2", False), ("olmo2", True), ("olmo2-mqa", True)])


def test_a_layer_norm_across_heads_planned_as_an_rms_norm_is_refused_by_the_numeric_check():
    import plait
    from plait.tp import PlanError, check_plan

    model = _build("olmo2")  # q_norm swapped for a bias-free LayerNorm: the same parameters
    for layer in model.model.layers:
        layer.self_attn.q_norm = torch.nn.LayerNorm(HIDDEN, bias=False, dtype=torch.float64)
    with pytest.raises(PlanError, match=r"'model.layers.0.self_attn' \(Olmo2Attention\) split over tp=2 does "
                                        "not compute what it computes in one process: output 0"):
        check_plan(model, plait.plan_for(model), tp=2)


def test_tp2_splits_opts_mlp_in_the_decoder_layer_and_sp_is_refused_by_name(pools):
    # OPT's fc1 and fc2 sit in the decoder layer (InlineMLP: the layer is the region, without f);
    # before: refused. Under SP the layer would flatten batch and sequence shards: refused first.
    import plait
    from plait.tp import check_plan

    model = _build("opt")
    with pytest.raises(ValueError, match=r"InlineMLP\(fork_rng=False, entry=''\) on "
                                         r"'model.decoder.layers.0' "
                                         r"\(OPTDecoderLayer\): .* use sequence_parallel=False"):
        check_plan(model, plait.plan_for(model), tp=2, sequence_parallel=True)
    pools[2].run(_tp2, [("opt", False)])


def test_tp2_gives_each_rank_the_alibi_biases_of_its_heads(pools):
    # Bloom builds the ALiBi biases of all 4 heads, (batch * heads, 1, seq), before its layers:
    # each rank's attention takes the rows of its 2 heads (AttentionParallel(head_inputs=...)).
    # Before: a shape error in baddbmm.
    import plait
    from plait.tp import check_plan

    # Falcon's ALiBi is (batch, heads, 1, seq) and folded into its attention mask: refused by name,
    # in the layout trace, before any collective.
    falcon = _build("falcon", alibi=True)
    for sp in (False, True):
        with pytest.raises(ValueError, match=r"'alibi' has shape \(1, 4, 1, 4\), not \(batch \* 4 heads, "
                                             r"1, length\).*data or fully sharded parallelism"):
            check_plan(falcon, plait.plan_for(falcon), tp=2, sequence_parallel=sp, numeric=False)
    pools[2].run(_tp2, [("bloom", False), ("bloom", True)])


def test_tp2_with_and_without_sp_matches_single_process_in_yet_more_families(pools):
    families = ("stablelm", "granite", "starcoder2", "phi", "smollm3")
    pools[2].run(_tp2, [(f, sp) for f in families for sp in (False, True)])


def test_tp2_replicates_the_kv_head_of_a_fused_multi_query_projection(pools):
    # Falcon's query_key_value and GPT-BigCode's c_attn hold [q of 4 heads | k | v] of one KV head:
    # each rank computes its 2 query heads and the KV head, the layer's gradient summed over tp.
    # Cohere (parallel attention and MLP, bias-free LayerNorm, logit scale) planned as it was.
    pools[2].run(_tp2, [(f, sp) for f in ("falcon", "bigcode", "cohere") for sp in (False, True)])


def test_falcons_grouped_fused_projection_is_refused_by_name():
    import plait

    # new_decoder_architecture: query_key_value holds [q of its heads, k, v] per KV head.
    model = _build("falcon-grouped")
    with pytest.raises(ValueError, match="plan_for: cannot place") as err:
        plait.plan_for(model)
    why = ("'transformer.h.0.self_attention' (FalconAttention): its fused 'query_key_value' serves 4 heads "
           "with 2 KV heads (Falcon's grouped layout")
    assert why in str(err.value) and "data or fully sharded parallelism" in str(err.value), str(err.value)


def test_tp2_splits_experts_stacked_in_3d_tensors(pools):
    # Mixtral's and Qwen2-MoE's experts (gate_up_proj (4, 2 * inner, 32), down_proj (4, 32, inner))
    # are split by each expert's hidden units, Qwen2-MoE's shared expert too; the routers stay
    # whole, their gradient summed over tp. Before: refused.
    pools[2].run(_tp2, [("mixtral", False), ("mixtral", True), ("qwen2-moe", False), ("qwen2-moe", True)])


def test_tp2_without_a_kv_cache_is_checked_and_matches_single_process(pools):
    # use_cache=False, as in training: transformers' causal mask then asks whether the position ids
    # hold packed sequences, a branch on values that the plan check's layout trace once failed on.
    pools[2].run(_tp2, [("llama-nocache", True), ("gpt2-nocache", False)])


def _fsdp_tp(families: list[tuple[str, bool]]) -> dict:
    return {f: _train(f, sp, "fsdp") for f, sp in families}


def test_fsdp2_tp2_matches_single_process(pools):
    # Llama (GQA) and GPT-2 (Conv1D, fused, tied) with SP; Phi-3 (fused) and the replicated KV head without.
    pools[4].run(_fsdp_tp, [("llama", True), ("gpt2", True), ("phi3", False), ("llama-mqa", False)])


def test_fsdp2_tp2_matches_single_process_in_every_other_planned_family(pools):
    # FSDP gathers each unit's shards into plain tensors for the forward: a tp module that reads its
    # own weight (OLMo2's norm across heads) must take the gathered tensor, not only a Parameter.
    # With SP wherever the family's plan allows it (OPT's decoder layer refuses SP by name).
    families = ["neox", "qwen2", "mistral", "gemma", "gemma2", "codegen", "qwen3", "gemma3", "stablelm",
                "granite", "starcoder2", "phi", "smollm3", "falcon", "bigcode", "cohere", "olmo2",
                "olmo2-mqa", "bloom", "mixtral", "qwen2-moe"]
    pools[4].run(_fsdp_tp, [(f, True) for f in families] + [("opt", False)])


def _vocab_parallel_step(family: str) -> None:
    """One step with the logits left split by vocabulary and `plait.loss_fn_for`'s loss.

    Compared at ``rtol=1e-5``, ``atol=1e-7``: the bounds set when that loss (`plait.tp.loss`)
    computed in float32, where rounding of the softmax (~6e-8 of the largest logit's
    probability) was all there was near zero; it now keeps float64 logits in float64."""
    import plait
    from plait.testing import cached_mesh

    torch.manual_seed(0)
    oracle = _build(family)
    model = copy.deepcopy(oracle)
    plait.tensor_parallel(model, cached_mesh(tp=2), plait.plan_for(model, loss_parallel=True),
                          sequence_parallel=True)
    ids, tgt = _batch(0)
    loss64(oracle(ids).logits, tgt).backward()
    loss = plait.loss_fn_for(model)(model(ids).logits, tgt)
    loss.backward()
    torch.testing.assert_close(loss.double(), loss64(oracle(ids).logits, tgt), rtol=1e-6, atol=0)
    from plait.state.placement import tp_info
    from plait.state.placement.state import checkpoint_entry, restore_entry

    info = tp_info(model)
    tol = {"rtol": 1e-5, "atol": 1e-7}
    compare_with_oracle(model, oracle, "gradient of", lambda p: p.grad, tol, info.specs)
    ref = dict(oracle.named_parameters(remove_duplicate=False))
    for name, p in model.named_parameters(remove_duplicate=False):
        spec = info.specs.get(name)
        if spec is not None and not spec.contiguous:  # fused c_attn: checkpointed whole, restored in parts
            entry = checkpoint_entry(p, spec, info, name)
            assert torch.equal(entry, ref[name].detach())
            back = torch.zeros_like(p)
            restore_entry(back, entry, spec)
            assert torch.equal(back, p.detach())


def test_vocab_parallel_loss_and_fused_checkpoint_entries(pools):
    pools[2].run(_vocab_parallel_step, "gpt2")  # tied embedding and lm_head, both split by vocabulary


# ------------------------------------------------------------------ what sequence parallelism costs
def _sp_comm() -> dict:
    import plait
    from plait import comm
    from plait.testing import cached_mesh

    torch.manual_seed(0)
    model = _build("llama")
    plait.tensor_parallel(model, cached_mesh(tp=2), plait.plan_for(model), sequence_parallel=True)
    ids, tgt = _batch(0)
    with comm.counting() as fwd:
        loss = loss64(model(ids).logits, tgt)
    with comm.counting() as bwd:
        loss.backward()
    return {k: {op: (int(v["calls"]), int(v["bytes"])) for op, v in s.as_dict().items()}
            for k, s in (("fwd", fwd), ("bwd", bwd))}


def test_sequence_parallel_communication_equals_theory(pools):
    """Megatron-SP per layer (2 all-gathers + 2 reduce-scatters of b*s*h each way), plus what
    starting at the first layer and ending before the final norm costs here: the embedding's
    all-reduce and, in backward, the lm_head's input all-reduce and the scatter's all-gather.
    Against plait's GPT plan (which reduce-scatters at the embedding and runs the final norm on
    shards) that is one reduce-scatter's worth of b*s*h more per direction, per step."""
    out = pools[2].run(_sp_comm)[0]
    layers, b, s, h, v, f8 = 2, BATCH, SEQ, HIDDEN, VOCAB, 8
    act = b * s * h * f8
    fwd, bwd = out["fwd"], out["bwd"]
    # Forward: embedding all-reduce; 2 per layer each way; the final gather; the logits' gather.
    assert fwd["all_reduce@tp"] == (1, act)
    assert fwd["all_gather@tp"] == (2 * layers + 2, (2 * layers + 1) * act + b * s * v * f8)
    assert fwd["reduce_scatter@tp"] == (2 * layers, 2 * layers * act)
    # Backward: lm_head input (all-reduce) and the norms' weights (h each, summed over the
    # sequence shards); 2 per layer each way; the scatter at layer 0 (all-gather).
    assert bwd["all_reduce@tp"] == (1 + 2 * layers, act + 2 * layers * h * f8)
    assert bwd["all_gather@tp"] == (2 * layers + 1, (2 * layers + 1) * act)
    assert bwd["reduce_scatter@tp"] == (2 * layers, 2 * layers * act)


# ------------------------------------------------------------------ plans refused, no spawning
def test_every_family_is_planned_and_checked_without_spawning():
    import plait
    from plait.tp import AttentionParallel, ColwiseParallel, SplitRMSNorm, check_plan

    for family in FAMILIES:
        model = _build(family)
        plan = plait.plan_for(model)
        for sp in (False, True) if family != "opt" else (False,):  # OPT under SP: refused (tested above)
            check_plan(model, plan, tp=2, sequence_parallel=sp)
        if family == "gpt2":  # Conv1D c_attn: q, k and v split each on their own
            assert plan["transformer.h.*.attn.c_attn"].parts == (HIDDEN,) * 3
        if family == "llama-mqa":
            assert plan["model.layers.*.self_attn.k_proj"].replicate
            assert isinstance(plan["model.layers.*.self_attn"], AttentionParallel)
        if family == "phi3":
            assert isinstance(plan["model.layers.*.mlp.gate_up_proj"], ColwiseParallel)
        if family == "mixtral":
            dims = (("gate_up_proj", 1, (64, 64)), ("down_proj", 2, ()))
            assert plan["model.layers.*.mlp.experts"].dims == dims
        if family == "bloom":
            assert plan["transformer.h.*.self_attention"].head_inputs == ("alibi",)
        if family == "olmo2":  # over 4 heads and 2 KV heads of 8 features
            assert plan["model.layers.*.self_attn.q_norm"] == SplitRMSNorm(width=32, unit=8)
            assert plan["model.layers.*.self_attn.k_norm"] == SplitRMSNorm(width=16, unit=8)
        if family == "codegen":  # 4 groups of [q v k], 2 heads of 4 features each
            assert plan["transformer.h.*.attn.qkv_proj"].parts == (8,) * 12
            assert plan["transformer.h.*.attn.out_proj"].parts == (8,) * 4
    for family in ("llama-mqa", "olmo2-mqa", "olmo2"):  # 1 or 2 KV heads over tp=4: replicated
        mqa = _build(family)
        check_plan(mqa, plait.plan_for(mqa), tp=4, sequence_parallel=True)
    assert plait.plan_for(model, loss_parallel=True)["lm_head"].gather_output is False


def _refused(case: str) -> tuple[torch.nn.Module, dict, dict]:
    """(model, plan, check_plan options) of a plan that must be refused."""
    import plait
    from plait.tp import (
        ColwiseParallel,
        GatherSequence,
        ParallelRegion,
        RowwiseParallel,
        ScatterSequence,
        SequenceParallel,
        VocabParallelEmbedding,
        VocabParallelOutput,
    )

    llama = _build("llama")
    mlp = {"model.layers.*.mlp": ParallelRegion(),
           "model.layers.*.mlp.gate_proj": ColwiseParallel(input_comm=False),
           "model.layers.*.mlp.up_proj": ColwiseParallel(input_comm=False),
           "model.layers.*.mlp.down_proj": RowwiseParallel()}
    sp = {"tp": 2, "sequence_parallel": True}
    if case == "mlp-only-sp":  # the MLP-only plan: the replicated attention would see shards
        return llama, {**mlp, "model.layers.*.input_layernorm": SequenceParallel(),
                       "model.layers.*.post_attention_layernorm": SequenceParallel(),
                       "model.layers.0": ScatterSequence(), "model.norm": GatherSequence()}, sp
    if case == "mlp-only-sp-bare":
        return llama, mlp, sp
    if case == "region-around-layer":  # the region spans the norms and the residual additions
        whole = {k.replace(".mlp", "", 1) if k == "model.layers.*.mlp" else k: s for k, s in mlp.items()}
        return llama, whole, {"tp": 2}
    plan = plait.plan_for(llama)
    if case == "embedding-own-lookup":  # F.embedding on the table, which holds this rank's rows only

        class OwnLookup(torch.nn.Embedding):
            def forward(self, ids: torch.Tensor) -> torch.Tensor:
                return F.embedding(ids, self.weight) * 2.0

        llama.model.embed_tokens = OwnLookup(VOCAB, HIDDEN, dtype=torch.float64)
        return llama, plan, {"tp": 2}
    if case == "embedding-shards-sequence":  # positions would come from a shard's length
        return llama, {**plan, "model.embed_tokens": VocabParallelEmbedding()}, sp
    if case == "norm-without-style":
        return llama, {k: s for k, s in plan.items() if not k.endswith("input_layernorm")}, sp
    if case == "no-scatter":
        return llama, {k: s for k, s in plan.items() if k != "model.layers.0"}, sp
    if case == "labels-on-sharded-logits":  # the model's own loss over a vocabulary shard
        ids = torch.zeros(1, 4, dtype=torch.long)
        return llama, plait.plan_for(llama, loss_parallel=True), {"tp": 2, "example_inputs": {
            "input_ids": ids, "labels": ids}}
    if case == "hidden-states-out":
        return llama, plan, {**sp, "example_inputs": {"input_ids": torch.zeros(1, 4, dtype=torch.long),
                                                      "output_hidden_states": True}}
    gpt2 = _build("gpt2")
    plan = plait.plan_for(gpt2)
    if case == "gpt2-final-norm-on-shards":  # GPT-2 reshapes ln_f's output to the full length
        return gpt2, {**plan, "transformer.ln_f": SequenceParallel(),
                      "lm_head": VocabParallelOutput(gather_output=True)}, sp
    if case == "gpt2-unfused-split":  # c_attn split as one block: rank 0 would hold q and half of k
        return gpt2, {**plan, "transformer.h.*.attn.c_attn": ColwiseParallel(input_comm=False, unit=8)}, sp
    neox = _build("neox", hidden_dropout=0.1).train()
    plan = plait.plan_for(neox)
    if case == "dropout-on-shards-same-mask":
        return neox, {k: s for k, s in plan.items() if not k.endswith("post_attention_dropout")}, sp
    raise ValueError(case)


REFUSED = {
    "mlp-only-sp": "'model.layers.0.self_attn' (LlamaAttention): reads the shape",
    "mlp-only-sp-bare": "'model.layers.0.mlp' (LlamaMLP): ParallelRegion(fork_rng=True, entry='') expects "
                        "this rank's sequence shard",
    "region-around-layer": "'model.layers.0.input_layernorm' (LlamaRMSNorm): pow reads the input of its "
                           "ParallelRegion directly",
    "embedding-own-lookup": "'model.embed_tokens' (OwnLookup): TypeError: model.embed_tokens: "
                            "OwnLookup.forward does not look its table up through nn.Embedding.forward",
    "embedding-shards-sequence": "module 'model' (LlamaModel): reads the shape (shape) of a sequence-split",
    "norm-without-style": "'model.layers.0.input_layernorm' (LlamaRMSNorm): mul applies a replicated tensor "
                          "that needs a gradient",
    "no-scatter": "'model.layers.0.input_layernorm' (LlamaRMSNorm): mul applies a parameter whose gradient "
                  "is summed",
    "labels-on-sharded-logits": "on vocabulary-split logits",
    "hidden-states-out": "the model returns a sequence-split tensor",
    "gpt2-final-norm-on-shards": "'transformer' (GPT2Model): view on a sequence-split activation is not "
                                 "position-wise",
    "gpt2-unfused-split": "'transformer.h.0.attn.c_attn' is named like a fused projection",
    "dropout-on-shards-same-mask": "'gpt_neox.layers.0.post_attention_dropout' (Dropout): drops out a "
                                   "sequence-split activation on the synchronized random stream",
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_plans_that_would_train_wrong_are_refused_without_spawning(case):
    from plait.tp import check_plan

    model, plan, options = _refused(case)
    with pytest.raises(ValueError, match="plan") as err:
        check_plan(model, plan, **options)
    assert REFUSED[case] in str(err.value), str(err.value)


def _refused_before_any_collective() -> str:
    import plait
    from plait import comm
    from plait.testing import cached_mesh

    model, plan, _ = _refused("mlp-only-sp")
    with comm.counting() as counts:
        try:
            plait.tensor_parallel(model, cached_mesh(tp=2), plan, sequence_parallel=True)
        finally:
            assert counts.calls() == 0, "a collective ran before the refusal"
    return "no error"


def test_tensor_parallel_refuses_before_any_collective(pools):
    errors = pools[2].errors(_refused_before_any_collective)
    assert all(REFUSED["mlp-only-sp"] in e for e in errors.values()), errors[0]


def test_codegen_refuses_tp_degrees_that_split_a_group_of_heads():
    import plait
    from plait.tp import check_plan

    model = _build("codegen")  # 8 heads in 4 groups: tp=4 would give a rank half a group's head
    with pytest.raises(ValueError, match=r"'transformer.h.0.attn' cannot split 8 attention heads \(4 groups "
                                         r"of 2, each split on its own\) evenly across tp=4; tp degrees that "
                                         r"work: 1, 2$"):
        check_plan(model, plait.plan_for(model), tp=4)


def test_plan_for_names_the_module_it_cannot_place():
    import plait

    # Qwen3's per-head q_norm and OLMo2's across heads, once refused here, are planned now; what is
    # still refused: test_falcons_grouped_fused_projection_is_refused_by_name.
    with pytest.raises(ValueError, match="no nn.ModuleList of decoder layers"):
        plait.plan_for(torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8)))
