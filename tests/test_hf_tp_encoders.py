"""Tensor and sequence parallelism on unmodified `transformers` encoders, through `plait.plan_for`.

Tiny configs built from config objects (hidden 32, 2 layers, 4 heads, nothing downloaded), float64,
every dropout 0. At tp=2, with and without sequence parallelism, each family trains 5 AdamW steps
against one process on the same global batch, with tests/oracle.py's engine
(`train_against_one_process`): the logits and every parameter's gradient at the first step, and
every parameter after the last, within ``rtol=1e-9, atol=1e-12`` (test_hf_tp's bound: sharding only
reorders sums).

Families: BERT with its masked-LM head (the decoder tied to the word embedding, its bias registered
twice) and with a sequence-classification head (pooler, 3 labels), RoBERTa's masked LM (positions
counted from the padding id), ViT's image classification (patch embedding, class token, 3 labels:
9 patches and the class token, 10 positions, so the sequence splits over tp=2), and T5 (relative
position biases made by each stack's first block and reused by the others, the decoder's
cross-attention, its lm_head tied to the shared embedding or its own; 16 encoder and 8 decoder
positions), BERT's and T5's also under fsdp=2 x tp=2 with SP. What must be refused is checked
without spawning: `plait.tp.check_plan` needs no process group.
"""

from __future__ import annotations

import pytest
import torch
from oracle import train_against_one_process
from test_hf_tp import BATCH, HIDDEN, STEPS, TOL, VOCAB, _batch, digest, tp_mesh, tp_plan

transformers = pytest.importorskip("transformers")

LABELS, IMAGE, PATCH = 3, 12, 4


def build_encoder(family: str, **extra) -> torch.nn.Module:
    """A tiny randomly initialised encoder of ``family``, float64, every dropout 0."""
    t = transformers
    t.logging.set_verbosity_error()
    common = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    text = dict(common, vocab_size=VOCAB, max_position_embeddings=64)
    if family == "bert-mlm":
        model = t.BertForMaskedLM(t.BertConfig(**{**text, **extra}))
    elif family == "bert-cls":
        model = t.BertForSequenceClassification(t.BertConfig(**{**text, "num_labels": LABELS, **extra}))
    elif family == "roberta-mlm":
        model = t.RobertaForMaskedLM(t.RobertaConfig(**{**text, **extra}))
    elif family == "vit":
        model = t.ViTForImageClassification(t.ViTConfig(
            **{**common, "image_size": IMAGE, "patch_size": PATCH, "num_labels": LABELS, **extra}))
    elif family in ("t5", "t5-untied", "t5-gated"):  # relative position biases, cross-attention
        model = t.T5ForConditionalGeneration(t.T5Config(
            vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=2, num_heads=4, use_cache=False,
            decoder_start_token_id=0, pad_token_id=0,
            **{"dropout_rate": 0.0, "feed_forward_proj": "gated-gelu" if family == "t5-gated" else "relu",
               **extra}))
        if family == "t5-untied":  # an lm_head of its own (transformers ties it to the embedding)
            model.lm_head.weight = torch.nn.Parameter(model.shared.weight.detach().clone())
    else:
        raise ValueError(family)
    return model.to(torch.float64)


def encoder_batch(family: str, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(keyword inputs, targets of the logits) of the global batch at ``step``."""
    g = torch.Generator().manual_seed(2000 + step)
    labels = torch.randint(0, LABELS, (BATCH,), generator=g)
    if family == "vit":
        return {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g, dtype=torch.float64)}, labels
    ids, tgt = _batch(step)
    if family.startswith("t5"):  # the decoder reads half as many positions as the encoder
        decoder = torch.randint(0, VOCAB, (BATCH, ids.shape[1] // 2 + 1), generator=g)
        return {"input_ids": ids, "decoder_input_ids": decoder[:, :-1]}, decoder[:, 1:]
    return {"input_ids": ids}, labels if family.endswith("-cls") else tgt


def _train(family: str, sp: bool, data: str = "none") -> float:
    """5 AdamW steps at tp=2 (``data='fsdp'``: inside fsdp=2), the logits and (tp alone) every
    gradient at the first step compared, every parameter after the last."""
    trained = train_against_one_process(lambda: build_encoder(family),
                                        lambda step: encoder_batch(family, step), tp_mesh(data),
                                        tp_plan(sp, data), TOL, TOL, grads=data == "none", steps=STEPS,
                                        label=family)
    return digest(trained.full)


def _tp2(runs: list[tuple[str, bool]]) -> dict:
    return {(family, sp): _train(family, sp) for family, sp in runs}


def test_bert_and_roberta_at_tp2_with_and_without_sp_match_single_process(pools):
    # BERT's attention computes its heads in `self` and projects them back in `output`, beside the
    # residual and the norm; its MLP is `intermediate` then `output`: each a region entered at its
    # first child. Before: plan_for refused them ("no nn.ModuleList of decoder layers").
    # The heads and RoBERTa's embeddings sit outside the sequence-parallel span: each with SP only.
    runs = [("bert-mlm", False), ("bert-mlm", True), ("bert-cls", True), ("roberta-mlm", True)]
    out = pools[2].run(_tp2, runs)
    assert out[0] == out[1]  # the gathered parameters are the same on every rank


def test_t5_at_tp2_with_and_without_sp_matches_single_process(pools):
    # Each stack's first block makes a bias per head from relative positions: each rank looks up
    # its heads' columns, and the bias goes whole from block to block; the decoder's cross-attention
    # reads the encoder's output through f. The lm_head tied to the shared embedding (T5's default)
    # and an lm_head of its own (T5 v1.1's gated MLP, wi_0 wi_1 wo, is planned as a gated MLP of a
    # decoder is: checked without spawning below). Before: refused.
    pools[2].run(_tp2, [("t5", False), ("t5", True), ("t5-untied", True)])


def _fsdp_tp(families: list[str]) -> dict:
    return {f: _train(f, True, "fsdp") for f in families}


def test_bert_and_t5_under_fsdp2_x_tp2_with_sp_match_single_process(pools):
    # FSDP gathers each unit's shards into plain tensors for the forward: BERT's tied MLM bias and
    # T5's relative position table (whole over tp, sharded over fsdp) must be read from those.
    pools[4].run(_fsdp_tp, ["bert-mlm", "t5"])


def test_vit_at_tp2_with_and_without_sp_matches_single_process(pools):
    # ViT's layers are planned as a decoder's; the patches, class token and classifier run
    # replicated. Before: refused, its 3 labels taken for a vocabulary.
    pools[2].run(_tp2, [("vit", False), ("vit", True)])


# ------------------------------------------------------------------ plans, checked without spawning
def test_every_encoder_is_planned_and_checked_without_spawning():
    import plait
    from plait.tp import (
        AttentionParallel,
        HeadEmbedding,
        ParallelRegion,
        ScatterSequence,
        VocabParallelOutput,
        check_plan,
    )

    for family in ("bert-mlm", "bert-cls", "roberta-mlm", "vit", "t5", "t5-untied", "t5-gated"):
        # Training with dropout: the layout trace also checks that each dropout draws from the random
        # stream matching what it drops (per rank on split heads or sequence shards).
        rates = {"dropout_rate": 0.1} if family.startswith("t5") else {
            "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}
        model = build_encoder(family, **rates).train()
        plan = plait.plan_for(model)
        inputs = encoder_batch(family, 0)[0]
        for sp in (False, True):  # the numeric check runs in the parity tests
            check_plan(model, plan, tp=2, sequence_parallel=sp, example_inputs=inputs, numeric=False)
        if family == "bert-mlm":  # regions entered at their first child; the tied decoder split by vocabulary
            assert plan["bert.encoder.layer.*.attention"].entry == "self"
            assert isinstance(plan["bert.encoder.layer.*.attention"], AttentionParallel)
            assert plan["bert.encoder.layer.*"] == ParallelRegion(entry="intermediate")
            assert plan["bert.encoder"] == ScatterSequence(gather_output=True)
            assert isinstance(plan["cls.predictions.decoder"], VocabParallelOutput)
            assert plait.plan_for(model, loss_parallel=True)["cls.predictions.decoder"].gather_output is False
        if family == "bert-cls":  # the pooler and the classifier run replicated
            assert not any(k.startswith(("bert.pooler", "classifier")) for k in plan)
        if family == "vit":
            assert "classifier" not in plan and "vit.layers.*.attention.q_proj" in plan
        if family.startswith("t5"):  # the relative position biases split by heads, in block 0 only
            blocks = "decoder.block.{}.layer.0.SelfAttention"
            assert isinstance(plan[blocks.format(0) + ".relative_attention_bias"], HeadEmbedding)
            assert blocks.format(1) + ".relative_attention_bias" not in plan
            cross = plan["decoder.block.1.layer.1.EncDecAttention"]
            assert cross.kv_inputs == ("key_value_states",) and cross.head_bias == "position_bias"
            tied = model.lm_head.weight is model.shared.weight
            assert tied == (family != "t5-untied") and isinstance(plan["lm_head"], VocabParallelOutput)


def _refused(case: str) -> tuple[torch.nn.Module, dict]:
    """(model, check_plan options) of a layout that must be refused by name."""
    if case == "heads-not-divisible":  # 3 heads of 8 features over tp=2
        return build_encoder("bert-mlm", num_attention_heads=3, hidden_size=24), {"tp": 2}
    if case == "vit-odd-sequence":  # 16 patches and the class token: 17 positions over tp=2
        pixels = torch.zeros(1, 3, 16, 16, dtype=torch.float64)
        return build_encoder("vit", image_size=16), {"tp": 2, "sequence_parallel": True,
                                                      "example_inputs": {"pixel_values": pixels}}
    if case == "mlm-labels-on-split-logits":  # the model's own loss over a vocabulary shard
        ids = torch.zeros(1, 4, dtype=torch.long)
        return build_encoder("bert-mlm"), {"tp": 2, "loss_parallel": True,
                                           "example_inputs": {"input_ids": ids, "labels": ids}}
    raise ValueError(case)


REFUSED = {
    "heads-not-divisible": "on 'bert.encoder.layer.0.attention' cannot split 3 attention heads evenly across "
                           "tp=2; tp degrees that work: 1, 3",
    "vit-odd-sequence": "sequence parallelism splits dim 1 (the sequence) across tp=2, but the activation "
                        "has shape (1, 17, 32)",
    "mlm-labels-on-split-logits": "(BertForMaskedLM): view on vocabulary-split logits",
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_layouts_that_cannot_split_are_refused_by_name_without_spawning(case):
    import plait
    from plait.tp import check_plan

    model, options = _refused(case)
    plan = plait.plan_for(model, loss_parallel=options.pop("loss_parallel", False))
    with pytest.raises(ValueError, match="plan") as err:
        check_plan(model, plan, **options)
    assert REFUSED[case] in str(err.value), str(err.value)


@pytest.mark.parametrize("family", ["bert-cls", "vit"])
def test_loss_parallel_without_a_vocabulary_is_refused_by_name(family):
    import plait

    with pytest.raises(ValueError, match=f"plan_for: {family.startswith('vit') and 'ViT' or 'Bert'}"
                                         r"\w+ has no output over a vocabulary to leave split"):
        plait.plan_for(build_encoder(family), loss_parallel=True)


def test_what_plan_for_does_not_split_is_refused_by_name():
    import plait

    # A BERT decoder's cross-attention reads the encoder's states: refused, naming the module.
    decoder = build_encoder("bert-mlm", is_decoder=True, add_cross_attention=True)
    with pytest.raises(ValueError, match=r"cannot place module 'bert.encoder.layer.0.crossattention' "
                                         r"\(BertAttention\): .*data or fully sharded parallelism"):
        plait.plan_for(decoder)
    # BART, an encoder-decoder whose layers hold their MLP inline, not T5's lists of sublayers.
    bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64))
    with pytest.raises(ValueError, match=r"cannot place module 'model.encoder' \(BartEncoder\): .*data or "
                                         "fully sharded parallelism"):
        plait.plan_for(bart)
    # ViT's message named its 3 labels as a vocabulary ("expected one token embedding with 3 rows").
    assert "vit.layers.0" in plait.plan_for(build_encoder("vit"))
