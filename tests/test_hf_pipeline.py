"""Pipelines of models whose forward is not a chain of children, against one process.

Tiny Hugging Face models (LlamaForCausalLM with grouped-query attention and rotary embeddings, tied
and untied embeddings, the untied one with a padding mask; GPT2LMHeadModel) and a small model with
a residual across the cut, keyword arguments between modules and a dict output. Each is split at
module names or balanced, runs every schedule at pp=2 on 2 Gloo ranks (gpipe, 1f1b, interleaved
with 2 chunks, zb-h1) and trains 5 default AdamW steps next to an unsplit copy in float64; the
untied Llama also runs pp=2 x tp=2 on 4 ranks with `plait.plan_for`'s plan (1F1B, ZB-H1, and 1F1B
with sequence parallelism), and so does GPT-2, whose embedding on the first stage is tied to the LM
head on the last (ZB-H1 with sequence parallelism), each rank compared with its slice of the oracle.
Stages run the model's own forward with the other stages' layers stood in for: rotary tables, masks
and position ids are recomputed on every stage, while the embedding's output (the residual) and the
keyword arguments computed from it are sent.

Tolerances: rtol=1e-9, atol=1e-12 on float64 gradients and parameters: the pipeline averages
microbatch losses where the oracle takes one mean over the batch, equal in exact arithmetic, so
only summation order differs (measured: at most 3e-15 apart after 5 steps, `_parity`'s "worst").
Llama's RMSNorm computes in float32 inside the float64 model; both sides feed it the same values up
to float64 rounding, which its float32 rounding absorbs. The loss a pipeline returns is float32
whatever the model's dtype: rtol=1e-6.
"""

from __future__ import annotations

import copy

import pytest
import torch
from oracle import logits_of, loss64, train_pipeline_against_one_process
from torch import nn

from plait.testing import cached_mesh

pytest.importorskip("transformers")

V, SEQ, BATCH, M, STEPS = 96, 16, 8, 4, 5
TOL64 = dict(rtol=1e-9, atol=1e-12)
# (schedule, chunks, split): named split points where the schedule has 2 stages, else balanced.
SCHEDULES = [("gpipe", 1, "named"), ("1f1b", 1, "auto"), ("interleaved", 2, "auto"), ("zb-h1", 1, "named")]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, *, gate: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x))) * gate + bias


class SkipNet(nn.Module):
    """The embedding is added back before the head (a residual across every cut), the blocks get a
    gate computed from it and position biases from the inputs as keyword arguments, and the
    forward returns a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, V)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(ids)
        gate = torch.sigmoid(h.mean(-1, keepdim=True))
        pos = (torch.arange(ids.shape[1], device=ids.device) % 4).to(h.dtype)[:, None] / 4
        x = h
        for blk in self.blocks:
            x = blk(x, gate=gate, bias=pos)
        return {"logits": self.head(x + h), "hidden": x}


def _loss(out, y: torch.Tensor) -> torch.Tensor:
    return loss64(logits_of(out), y)


def _model(kind: str) -> tuple[nn.Module, list[str]]:
    """The model in float64 (same seed on every rank) and its named split for 2 stages."""
    torch.manual_seed(0)
    if kind == "skip":
        return SkipNet().double(), ["blocks.1"]
    import transformers as tf

    if kind.startswith("llama"):
        cfg = tf.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                             use_cache=False, tie_word_embeddings=kind == "llama-tied")
        return tf.LlamaForCausalLM(cfg).double(), ["model.layers.2"]
    cfg = tf.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return tf.GPT2LMHeadModel(cfg).double(), ["transformer.h.1"]


def _batch(step: int, mask: bool) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    data = torch.randint(0, V, (BATCH, SEQ + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    if not mask:
        return (x,), y
    am = torch.ones_like(x)
    am[::2, :3] = 0  # left padding on every other row
    return (x, am), y


def _train_five_steps(pipe, oracle: nn.Module, mask: bool, tol: dict = TOL64,
                      specs: dict | None = None) -> float:
    """Five default AdamW steps of ``pipe`` and ``oracle`` on the same batches, compared by
    `oracle.train_pipeline_against_one_process`: the loss at every step, the gradients at the
    first, the parameters at the end (a tp stage's shards by ``specs``). Returns the largest
    difference."""
    return train_pipeline_against_one_process(pipe, oracle, lambda step: _batch(step, mask), _loss, tol,
                                              steps=STEPS, specs=specs)


def _parity(kind: str, mask: bool = False) -> dict:
    from plait.pipeline import pipeline

    mesh = cached_mesh(pp=2)
    base, named = _model(kind)
    worst: dict[str, float] = {}
    stages: dict[str, list[list[str]]] = {}
    for schedule, chunks, how in SCHEDULES:
        oracle, model = copy.deepcopy(base), copy.deepcopy(base)
        pipe = pipeline(model, mesh, split=named if how == "named" else "auto", schedule=schedule,
                        chunks=chunks, microbatches=M, loss_fn=_loss)
        diff = _train_five_steps(pipe, oracle, mask)
        mine = dict(pipe.named_parameters())
        x, _ = _batch(STEPS - 1, mask)
        out = pipe.eval_step(x)  # forward only: the model's outputs (one per microbatch) on the last rank
        if out is not None:
            with torch.no_grad():
                want = logits_of(oracle(*x))
            torch.testing.assert_close(torch.cat([logits_of(o) for o in out]), want, **TOL64)
        worst[schedule], stages[schedule] = diff, pipe.stage_names
    return {"worst": worst, "stages": stages, "names": sorted(mine)}


@pytest.mark.parametrize("kind,mask", [("llama-tied", False), ("llama", True), ("gpt2", False),
                                       ("skip", False)])
def test_every_schedule_matches_one_process(pools, kind, mask):
    out = pools[2].run(_parity, kind, mask)
    if kind == "llama-tied":  # the embedding on the first rank, the head that shares it on the last
        assert "model.embed_tokens.weight" in out[0]["names"] and "lm_head.weight" in out[1]["names"]
    if kind == "skip":  # interleaved: the embedding's output is relayed through stages 1 and 2
        assert out[0]["stages"]["interleaved"][0] == ["embed"] and len(out[0]["stages"]["interleaved"]) == 4


# Every other family `plan_for` plans (tests/test_hf_tp.py builds them), split automatically, 1F1B
# at pp=2. Gemma's, Gemma2's, Gemma3's and Cohere's norms compute in float32 inside the float64
# model: microbatches sum their weight's gradient in another order than one batch does, float32
# rounding (measured: up to 5e-7 of a gradient) far below what a wrong gradient moves.
PIPELINED_FAMILIES = ["llama-mqa", "phi3", "neox", "qwen2", "mistral", "codegen", "qwen3", "stablelm",
                      "granite", "starcoder2", "phi", "smollm3", "falcon", "bigcode", "olmo2", "bloom",
                      "gemma", "gemma2", "gemma3", "cohere"]
FLOAT32_NORMS = ("gemma", "gemma2", "gemma3", "cohere")


def _families_1f1b(families: list[str]) -> dict[str, float]:
    from test_hf_tp import TOL_FLOAT32_NORMS, build_family

    from plait.pipeline import pipeline

    worst = {}
    for family in families:
        torch.manual_seed(0)
        base = build_family(family, use_cache=False)
        oracle, model = copy.deepcopy(base), copy.deepcopy(base)
        pipe = pipeline(model, cached_mesh(pp=2), split="auto", schedule="1f1b", microbatches=M,
                        loss_fn=_loss)
        tol = TOL_FLOAT32_NORMS if family in FLOAT32_NORMS else TOL64
        worst[family] = _train_five_steps(pipe, oracle, False, tol)
    return worst


def test_every_planned_family_matches_one_process_in_a_pipeline(pools):
    out = pools[2].run(_families_1f1b, PIPELINED_FAMILIES)
    assert set(out[0]) == set(PIPELINED_FAMILIES)


def _moe_pipeline() -> str:
    from test_hf_tp import build_family

    from plait.pipeline import pipeline

    pipe = pipeline(build_family("mixtral", use_cache=False), cached_mesh(pp=2), split="auto",
                    schedule="1f1b", microbatches=M, loss_fn=_loss)
    x, y = _batch(0, False)
    with pytest.raises(RuntimeError, match="depends on the values of its data") as refused:
        pipe.step(x, y)
    return str(refused.value)


def test_transformers_moe_in_a_pipeline_is_refused_with_the_layouts_that_train_it(pools):
    # Mixtral's expert dispatch (torch.nonzero) has no meta-device result for the pipeline's dataflow trace;
    # the advice names the layouts that train it (tests/test_hf_tp.py: tp, tp + SP, fsdp x tp).
    for msg in pools[2].run(_moe_pipeline):
        assert "MixtralForCausalLM" in msg and "without a pipeline" in msg, msg


def _pp_tp(kind: str, runs: list[tuple[str, bool]]) -> dict:
    import plait

    mesh = cached_mesh(pp=2, tp=2)
    base, named = _model(kind)
    worst: dict[str, float] = {}
    tied: dict[str, torch.Tensor] = {}
    for schedule, sp in runs:
        oracle, model = copy.deepcopy(base), copy.deepcopy(base)
        pipe = plait.parallelize(model, mesh, plait.ParallelPlan(
            tp=plait.plan_for(model), sequence_parallel=sp, data="none", pp_split=named,
            pp_schedule=schedule, pp_microbatches=M, loss_fn=_loss))
        assert pipe.tp_info is not None
        specs = pipe.tp_info.specs
        mine = dict(pipe.named_parameters())
        ref = dict(oracle.named_parameters(remove_duplicate=False))  # a tied weight under both names
        assert specs and all(p.numel() * 2 == ref[n].numel() for n, p in mine.items() if n in specs)
        diff = _train_five_steps(pipe, oracle, False, specs=specs)
        worst[f"{schedule}{' sp' if sp else ''}"] = diff
        tied.update({f"{schedule} {n}": mine[n].detach() for n in ("transformer.wte.weight", "lm_head.weight")
                     if kind == "gpt2" and n in mine})
    return {"worst": worst, "coords": mesh.coords, "tied": tied}


def _opt_pipeline() -> str:
    import transformers as tf

    from plait.pipeline import pipeline

    torch.manual_seed(0)
    model = tf.OPTForCausalLM(tf.OPTConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
        max_position_embeddings=SEQ, word_embed_proj_dim=32, pad_token_id=1, bos_token_id=0, eos_token_id=0,
        dropout=0.0, use_cache=False)).double()
    pipe = pipeline(model, cached_mesh(pp=2), split=["model.decoder.layers.1"], schedule="1f1b",
                    microbatches=M, loss_fn=_loss)
    with pytest.raises(ValueError) as err:
        pipe.step(*_batch(0, False))
    return str(err.value)


def test_opt_is_refused_naming_its_final_norm_registered_before_the_layers(pools):
    # OPT's decoder registers final_layer_norm before its layers and runs it after them: segments
    # follow the registration order, so every split would put it before the layers it reads.
    for msg in pools[2].run(_opt_pipeline):
        assert "segment 'model.decoder.final_layer_norm' (stage 0) reads the output of" in msg, msg
        assert "is registered before 'model.decoder.layers.1' but runs after it" in msg, msg


def test_pp2_tp2_llama_matches_one_process(pools):
    out = pools[4].run(_pp_tp, "llama", [("1f1b", False), ("zb-h1", False), ("1f1b", True)])
    assert sorted((o["coords"]["pp"], o["coords"]["tp"]) for o in out) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_pp2_tp2_gpt2_embedding_tied_across_pp_ranks_matches_one_process(pools):
    # wte (first stage) is lm_head (last stage), both split by vocabulary over tp: each tp rank's
    # copies are the same rows, their gradients summed between the two pp ranks of its coordinate.
    # ZB-H1 with sequence parallelism: the B/W split and sequence-split activations at once.
    out = pools[4].run(_pp_tp, "gpt2", [("zb-h1", True)])
    by = {(o["coords"]["pp"], o["coords"]["tp"]): o["tied"] for o in out}
    for t in (0, 1):  # the copies stayed identical, bit for bit
        first, last = by[0, t], by[1, t]
        assert list(first) == ["zb-h1 transformer.wte.weight"] and list(last) == ["zb-h1 lm_head.weight"]
        torch.testing.assert_close(first["zb-h1 transformer.wte.weight"], last["zb-h1 lm_head.weight"],
                                   rtol=0, atol=0)


def test_what_crosses_each_cut():
    """No ranks: the dataflow trace's plan. The residual and the gate's source (the embedding's output) are
    relayed through the middle stage; Llama's rotary tables, mask and position ids are not sent."""
    from plait.pipeline.replay import Replay
    from plait.pipeline.split import plan_stages, segments

    ids = torch.zeros(2, SEQ, dtype=torch.long)
    model, _ = _model("skip")
    segs = segments(model)
    assert [n for n, _ in segs] == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    rep = Replay(model, segs, plan_stages(segs, 3, ["blocks.1", "blocks.2"]), torch.device("cpu"))
    rep.prepare((ids,))
    emb, b0, b1 = (0, 0, 0), (1, 0, 0), (2, 0, 0)  # (segment, call, output leaf)
    assert [p.recv for p in rep.plans] == [(), (emb, b0), (emb, b1)]
    assert [p.send for p in rep.plans] == [(emb, b0), (emb, b1), ()]

    llama, named = _model("llama")
    segs = segments(llama)
    rep = Replay(llama, segs, plan_stages(segs, 2, named), torch.device("cpu"))
    rep.prepare((ids, torch.ones_like(ids)))
    last_layer = [n for n, _ in segs].index("model.layers.1")
    assert rep.plans[1].recv == ((last_layer, 0, 0),)
