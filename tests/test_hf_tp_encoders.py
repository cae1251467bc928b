"""Tensor and sequence parallelism on unmodified `transformers` encoders, through `plait.plan_for`.

Tiny configs built from config objects (hidden 32, 2 layers, 4 heads, nothing downloaded), float64,
every dropout 0. At tp=2, with and without sequence parallelism, each family trains 5 AdamW steps
against one process on the same global batch, with tests/test_hf_tp.py's engine
(`train_against_one_process`): the logits and every parameter's gradient at the first step, and
every parameter after the last, within ``rtol=1e-9, atol=1e-12`` (test_hf_tp's bound: sharding only
reorders sums).

Families: BERT with its masked-LM head (the decoder tied to the word embedding, its bias registered
twice) and with a sequence-classification head (pooler, 3 labels), RoBERTa's masked LM (positions
counted from the padding id), ViT's image classification (patch embedding, class token, 3 labels:
9 patches and the class token, 10 positions, so the sequence splits over tp=2). What must be
refused is checked without spawning: `plait.tp.check_plan` needs no process group.
"""

from __future__ import annotations

import pytest
import torch
from test_hf_tp import BATCH, HIDDEN, TOL, VOCAB, _batch, train_against_one_process

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
    return {"input_ids": ids}, labels if family.endswith("-cls") else tgt


def _train(family: str, sp: bool) -> float:
    return train_against_one_process(family, lambda: build_encoder(family), lambda s: encoder_batch(family, s),
                                     sp, "none", TOL, TOL, grads=True)


def _tp2(runs: list[tuple[str, bool]]) -> dict:
    return {(family, sp): _train(family, sp) for family, sp in runs}


def test_bert_and_roberta_at_tp2_with_and_without_sp_match_single_process(pools):
    # BERT's attention computes its heads in `self` and projects them back in `output`, beside the
    # residual and the norm; its MLP is `intermediate` then `output`: each a region entered at its
    # first child. Before: plan_for refused them ("no nn.ModuleList of decoder layers").
    runs = [(f, sp) for f in ("bert-mlm", "bert-cls", "roberta-mlm") for sp in (False, True)]
    out = pools[2].run(_tp2, runs)
    assert out[0] == out[1]  # the gathered parameters are the same on every rank


def test_vit_at_tp2_with_and_without_sp_matches_single_process(pools):
    # ViT's layers are planned as a decoder's; the patches, class token and classifier run
    # replicated. Before: refused, its 3 labels taken for a vocabulary.
    pools[2].run(_tp2, [("vit", False), ("vit", True)])
