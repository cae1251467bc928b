"""The numeric plan check (`plait.tp.numeric`): each distinct unit of a tensor-parallel plan run
whole and split (threads of this process, float64, no process group), outputs and gradients
compared (bound: 1e-8 of each tensor's largest entry; sharding moves float64 results by ~1e-16
relative per operation, a wrong layout by O(1)).

Each known silent-wrong mistake is re-introduced through a deliberately wrong plan: the layout trace
on shapes lets it through (asserted, so the test shows what only the numbers catch), the
numeric check refuses it naming the module and the tensor. Correct plans pass, with and without
sequence parallelism. Tiny configs (hidden 32, 2 layers), nothing downloaded.
"""

from __future__ import annotations

import dataclasses
import logging
import types

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import plait  # noqa: E402
from plait.tp import check_plan  # noqa: E402
from plait.tp.layout_trace import PlanError  # noqa: E402
from plait.tp.styles import ColwiseParallel, RowwiseParallel, VocabParallelEmbedding  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=64, bos_token_id=0, eos_token_id=0)


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    transformers.logging.set_verbosity_error()


def _llama(**extra) -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, num_key_value_heads=2, **extra))


def _gemma() -> nn.Module:
    config = transformers.GemmaConfig(**COMMON, num_key_value_heads=2, head_dim=8)
    return transformers.GemmaForCausalLM(config)


def _codegen() -> nn.Module:  # qkv_proj: mp_num=4 groups of [q v k]
    return transformers.CodeGenForCausalLM(transformers.CodeGenConfig(
        vocab_size=96, n_embd=32, n_layer=2, n_head=8, rotary_dim=2, n_positions=64, n_inner=64,
        bos_token_id=0, eos_token_id=0))


@pytest.mark.parametrize(("build", "sp"), [(_gemma, False), (_codegen, True)], ids=["gemma", "codegen-sp"])
def test_correct_plans_pass_the_numeric_check(build, sp):  # Llama with sp: the last test
    model = build()
    check_plan(model, plait.plan_for(model), tp=2, sequence_parallel=sp)


def test_a_fused_qkv_read_as_q_k_v_is_refused_naming_the_attention():
    # CodeGen's qkv_proj read as one [q|k|v] block (the plan plait had before it knew the groups).
    model = _codegen()
    plan = plait.plan_for(model)
    plan["transformer.h.*.attn.qkv_proj"] = ColwiseParallel(input_comm=False, unit=4, parts=(32, 32, 32))
    plan["transformer.h.*.attn.out_proj"] = RowwiseParallel(unit=4)
    check_plan(model, plan, tp=2, numeric=False)  # the shapes fit: the layout trace cannot see it
    with pytest.raises(PlanError, match=r"module 'transformer\.h\.0\.attn' \(CodeGenAttention\).*output 0"):
        check_plan(model, plan, tp=2)


@dataclasses.dataclass(frozen=True)
class _LookupOnly(VocabParallelEmbedding):
    """A deliberately wrong style: the split lookup replaces the embedding's whole forward (what
    plait did before it kept a subclass's forward), dropping Gemma's sqrt(hidden) scaling."""

    def install(self, mod: nn.Module, name: str, ctx) -> None:
        super().install(mod, name, ctx)
        lookup = next(c for c in type(mod).__mro__ if c.__name__ == "Lookup")
        mod.forward = types.MethodType(lookup.forward, mod)


@pytest.mark.parametrize("sp", [False, True])
def test_a_scaling_the_style_drops_is_refused_naming_the_embedding(sp):
    model = _gemma()
    plan = plait.plan_for(model)
    plan["model.embed_tokens"] = _LookupOnly(shard_sequence=False)
    check_plan(model, plan, tp=2, sequence_parallel=sp, numeric=False)
    with pytest.raises(PlanError, match=r"module 'model\.embed_tokens' \(GemmaTextScaledWordEmbedding\).*"
                                        r"output 0 on rank 0 differs"):
        check_plan(model, plan, tp=2, sequence_parallel=sp)


class _Swapped(nn.Module):
    """An attention whose fused projection holds [v | k | q]: split as one block, rank 0 would hold
    all of v and half of k (the shapes fit: no rule of shapes can tell)."""

    def __init__(self, d: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v, k, q = self.qkv(x).chunk(3, dim=-1)
        b, s, w = q.shape
        split = [t.view(b, s, -1, 4).transpose(1, 2) for t in (q, k, v)]
        y = nn.functional.scaled_dot_product_attention(*split, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.attn, self.head = nn.Embedding(32, 16), _Swapped(), nn.Linear(16, 32)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx) + self.attn(self.emb(idx)))


def test_a_model_plait_never_saw_is_checked_by_its_numbers_too():
    # A plan that declares the fused layer not fused (parts=(48,), as the layout trace's own advice
    # allows for a layer that is not) computes wrong attention on every rank.
    model = _Net()
    attn = {"attn": plait.ParallelRegion(), "attn.out": RowwiseParallel(unit=4)}
    right = {**attn, "attn.qkv": ColwiseParallel(input_comm=False, unit=4, parts=(16, 16, 16))}
    check_plan(model, right, tp=2)
    wrong = {**attn, "attn.qkv": ColwiseParallel(input_comm=False, unit=4, parts=(48,))}  # as one block
    check_plan(model, wrong, tp=2, numeric=False)
    with pytest.raises(PlanError, match=r"module 'attn' \(_Swapped\)"):
        check_plan(model, wrong, tp=2)


def test_the_check_is_on_by_default_logs_its_cost_and_can_be_switched_off(caplog):
    model = _llama()
    plan = plait.plan_for(model)
    with caplog.at_level(logging.INFO, logger="plait.tp.numeric"):
        check_plan(model, plan, tp=2, sequence_parallel=True)
    # embedding, layer 0 (it starts the sequence split), layer 1's attention, MLP and two norms
    # (alike: checked once), final norm, lm_head
    assert any("7 distinct of 8 units at tp=2 with sp" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="check= must be True"):
        plait.tensor_parallel(model, plait.Mesh.__new__(plait.Mesh), plan, check="numbers")


def test_a_unit_too_large_to_check_is_named_in_a_warning(caplog, monkeypatch):
    monkeypatch.setattr("plait.tp.numeric.MAX_UNIT_BYTES", 8 * 96 * 32 - 1)  # just under the embedding
    model = _llama()
    with caplog.at_level(logging.INFO, logger="plait.tp.numeric"):
        check_plan(model, plait.plan_for(model), tp=2)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'model.embed_tokens' (Embedding) not checked" in w for w in warned), warned


def test_a_unit_that_passed_is_not_run_again_in_the_process(monkeypatch):
    model = _llama()
    check_plan(model, plait.plan_for(model), tp=2)  # checked (or already, by an earlier test)

    def never(*_a, **_k):
        raise AssertionError("a unit that passed was run again")

    monkeypatch.setattr("plait.tp.numeric._mismatch", never)
    check_plan(_llama(), plait.plan_for(model), tp=2)  # a second model of the same kinds of unit
    with pytest.raises(PlanError, match="run again"):  # another tp degree is another check
        check_plan(_llama(), plait.plan_for(model), tp=4)
