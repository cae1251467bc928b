"""Meta-device materialization of a torchtitan-style model: tensors plait cannot reproduce.

The model keeps its blocks in an ``nn.ModuleDict`` named ``layers`` and computes its complex
rotary table ``freqs_cis`` in the root ``__init__`` (a non-persistent buffer of a module with no
``reset_parameters``); its root ``init_weights()`` recomputes the table and initialises every
weight, as torchtitan's Llama 3 does. The oracle is the model built on the CPU and initialised by
`plait.init_weights` (each module's ``reset_parameters`` under its name's seed, ``freqs_cis`` as
constructed); a layout built on the meta device must start from exactly those values and train as
they do.

Tolerance: float64 with default AdamW, so only the order of sums differs between layouts
(``rtol=1e-9``, ``atol=1e-12`` as in `test_tensor_parallel.py`). Measured after 3 steps, as worst
|diff| / (atol + rtol * |want|): ZeRO-3 0.0055, tp2 0.0012, pp2 0.0055
(``layers.1.attention.wk.weight``); the initial values, ``freqs_cis`` included, are equal. When
``freqs_cis`` started at zeros, the worst parameter was 19% off (relative norm of the difference)
and the losses 4e-4.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from oracle import assert_params_close
from torch import nn

from plait.testing import cached_mesh

DIM, HEADS, LAYERS, VOCAB, SEQ = 32, 4, 2, 64, 16
BATCH, STEPS, LR = 8, 3, 1e-2
TOL = {"rtol": 1e-9, "atol": 1e-12}
F64 = {"dtype": torch.float64}


# ------------------------------------------------------------------ a torchtitan-style Llama
def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, **F64) / dim)
    angles = torch.outer(torch.arange(end, **F64), freqs)
    return torch.polar(torch.ones_like(angles), angles)  # complex128, (end, dim / 2)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (batch, seq, heads, head_dim) by position, pairs of features as complex numbers."""
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis[: x.shape[1], None, :]).flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, **F64))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False, **F64) for _ in range(4))

    def init_weights(self, std: float) -> None:
        for lin in (self.wq, self.wk, self.wv, self.wo):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # heads from the shapes (-1): a tensor-parallel rank holds some of them
        q, k, v = (w(x).view(b, s, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = (nn.Linear(a, b, bias=False, **F64)
                                     for a, b in ((DIM, 2 * DIM), (2 * DIM, DIM), (DIM, 2 * DIM)))

    def init_weights(self, std: float) -> None:
        for lin in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(DIM), Attention()
        self.ffn_norm, self.feed_forward = RMSNorm(DIM), FeedForward()

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(0.02)
        self.feed_forward.init_weights(0.02)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """torchtitan's Llama 3 in miniature: blocks in a ModuleDict, the rotary table in the root."""

    freqs_cis: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM, **F64)
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(LAYERS)})
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False, **F64)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)

    def _precompute_freqs_cis(self) -> torch.Tensor:
        return precompute_freqs_cis(DIM // HEADS, 2 * SEQ)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        buffer_device = buffer_device or self.freqs_cis.device
        with torch.device(buffer_device):
            self.freqs_cis = self._precompute_freqs_cis()
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        cutoff = 3 / math.sqrt(DIM)
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=1 / math.sqrt(DIM), a=-cutoff, b=cutoff)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def llama_plan() -> dict:
    """Megatron's split of the model above: heads, hidden units, the vocabulary."""
    from plait.tp.styles import (
        ColwiseParallel,
        ParallelRegion,
        RowwiseParallel,
        VocabParallelEmbedding,
        VocabParallelOutput,
    )

    heads = {"unit": DIM // HEADS, "what": "attention heads"}
    return {
        "tok_embeddings": VocabParallelEmbedding(),
        "layers.*.attention": ParallelRegion(),
        **{f"layers.*.attention.{w}": ColwiseParallel(input_comm=False, **heads) for w in ("wq", "wk", "wv")},
        "layers.*.attention.wo": RowwiseParallel(**heads),
        "layers.*.feed_forward": ParallelRegion(),
        "layers.*.feed_forward.w1": ColwiseParallel(input_comm=False),
        "layers.*.feed_forward.w3": ColwiseParallel(input_comm=False),
        "layers.*.feed_forward.w2": RowwiseParallel(),
        "output": VocabParallelOutput(gather_output=True),
    }


# ------------------------------------------------------------------ training, on every rank
def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def _loss(model: nn.Module, b: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())


def _train(model: nn.Module, share: int, of: int) -> list[float]:
    """AdamW steps on this rank's ``share`` of ``of`` equal slices of each global batch (a pipeline:
    the whole batch, in two microbatches)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for b in _batches():
        if isinstance(model, nn.Module):
            loss = _loss(model, b.chunk(of)[share])
            loss.backward()
        else:
            loss = model.step(b[:, :-1], b[:, 1:])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _layouts() -> dict:
    """ZeRO-3, tensor parallelism and a pipeline, each over 2 ranks and built on the meta device,
    against the oracle: initial values (``freqs_cis`` included) and parameters after AdamW compared on
    every rank; the losses returned."""
    import plait

    oracle = plait.init_weights(Transformer(), seed=0)
    start = {k: v.clone() for k, v in oracle.state_dict().items()}
    start["freqs_cis"] = oracle.freqs_cis.clone()
    want_losses = _train(oracle, 0, 1)
    want = oracle.state_dict()
    out = {}
    for kind in ("fsdp", "tp", "pp"):
        with torch.device("meta"):
            model = Transformer()
        share, of = 0, 1
        if kind == "fsdp":
            net = plait.FSDP(model, cached_mesh(fsdp=2), zero_stage=3, seed=0)
            out["units"] = [u.name for u in net.units]
            share, of = cached_mesh(fsdp=2).rank("fsdp"), 2
        elif kind == "tp":
            net = plait.tensor_parallel(model, cached_mesh(tp=2), llama_plan(), seed=0)
        else:  # the root's freqs_cis on both stages
            net = plait.pipeline(model, cached_mesh(pp=2), split=["layers.1"], microbatches=2, seed=0,
                                 loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
        first = {**plait.full_state_dict(net), "freqs_cis": model.freqs_cis.cpu()}
        assert_params_close(first, start, **TOL, what=f"{kind}, initial value of")
        losses = _train(net, share, of)
        assert_params_close(plait.full_state_dict(net), want, **TOL, what=f"{kind}, after AdamW steps,")
        out[kind] = {"losses": losses}
    return out | {"want_losses": want_losses}


def test_torchtitan_llama_on_meta_trains_as_one_process_fsdp_tp_and_pp(pools):
    ranks = pools[2].run(_layouts)
    out, want = ranks[0], torch.tensor(ranks[0]["want_losses"], **F64)
    # ZeRO-3's ranks see half the batch each: their mean loss is the whole batch's.
    fsdp = torch.tensor([r["fsdp"]["losses"] for r in ranks], **F64).mean(0)
    torch.testing.assert_close(fsdp, want, **TOL)
    for kind in ("tp", "pp"):
        torch.testing.assert_close(torch.tensor(out[kind]["losses"], **F64), want, **TOL)
    assert out["units"] == ["", "layers.0", "layers.1"]  # the ModuleDict's blocks, not one unit


# ------------------------------------------------------------------ one process
def _on_meta(make: type[nn.Module]) -> nn.Module:
    import plait

    plait.init()  # one process
    with torch.device("meta"):
        model = make()
    return plait.parallelize(model, plait.Mesh(dp=1), plait.ParallelPlan(data="none"))


def test_meta_build_takes_only_the_missing_table_from_init_weights():
    import plait

    model, want = _on_meta(Transformer), plait.init_weights(Transformer(), seed=0)
    # reset_parameters' values, not init_weights' (whose embedding would be N(0, 1)): only the table
    # comes from init_weights, exactly as the root's __init__ computed it.
    torch.testing.assert_close(model.state_dict(), want.state_dict(), rtol=0, atol=0)
    assert torch.equal(model.freqs_cis, want.freqs_cis) and model.freqs_cis.dtype == torch.complex128


class Table(nn.Module):
    """A buffer computed in ``__init__``, and nothing that could compute it again."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(8.0).exp())


class PartialReset(nn.Module):
    """A ``reset_parameters`` that leaves the buffer built in ``__init__`` unset."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3))
        self.register_buffer("scale", torch.full((3,), 0.5))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))


def test_what_nothing_can_recompute_is_refused_by_name():
    with pytest.raises(ValueError, match=r"buffer 'table' of module '' \(Table\) is computed in __init__.*"
                                         r"it has no reset_parameters\(\).*Build the model on a real device"):
        _on_meta(Table)
    with pytest.raises(ValueError, match=r"buffer 'scale' of module '' \(PartialReset\).*its reset_parameters"
                                         r"\(\) leaves it unset"):
        _on_meta(PartialReset)
    with pytest.raises(TypeError, match=r"parameter 'weight' of module '' \(NoReset\): it has no "
                                        r"reset_parameters\(\)"):
        _on_meta(NoReset)
    import plait  # built on the CPU, the buffers are what __init__ computed

    assert torch.equal(plait.init_weights(PartialReset(), 0).scale, torch.full((3,), 0.5))


def test_transformers_llama_on_meta_takes_its_norms_and_rotary_table_from_its_init_weights():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    model, built = _on_meta(lambda: transformers.LlamaForCausalLM(cfg)), transformers.LlamaForCausalLM(cfg)
    assert not any(t.is_meta or t.isnan().any() for t in [*model.parameters(), *model.buffers()])
    for name, t in [*built.named_buffers(), *((n, p) for n, p in built.named_parameters() if "norm" in n)]:
        assert torch.equal(model.get_parameter(name) if "norm" in name else model.get_buffer(name), t), name


def test_blocks_of_a_module_dict_are_units_and_checkpointed_and_one_unit_is_announced(caplog):
    import plait
    from plait.compose.activation_checkpointing import select_blocks
    from plait.state.blocks import blocks

    assert blocks(Transformer()) == select_blocks(Transformer()) == ["layers.0", "layers.1"]
    assert blocks(nn.Sequential(TransformerBlock(), TransformerBlock())) == ["0", "1"]
    assert blocks(nn.Sequential(nn.Linear(2, 2), nn.GELU(), nn.Linear(2, 2))) == []  # not blocks
    plait.init()  # one process
    logger = logging.getLogger("plait")
    logger.addHandler(caplog.handler)
    try:
        net = plait.FSDP(Table(), plait.Mesh(fsdp=1), zero_stage=3)
    finally:
        logger.removeHandler(caplog.handler)
    assert [u.name for u in net.units] == [""]
    assert "Table holds no nn.ModuleList of blocks (nor an nn.ModuleDict" in caplog.text
    assert "name the units with units=[...]" in caplog.text


def test_pipeline_segments_keep_a_recomputed_root_buffer_and_refuse_saved_root_state():
    from plait.pipeline.split import above, segments

    model = Transformer()
    assert [n for n, _ in segments(model)] == ["tok_embeddings", "layers.0", "layers.1", "norm", "output"]
    assert above(model) == [("", model)]  # its freqs_cis goes to every stage
    saved = Transformer()
    saved.register_buffer("freqs_cis", saved.freqs_cis)  # persistent now: no stage would save it
    with pytest.raises(ValueError, match=r"the root module Transformer owns persistent buffer 'freqs_cis' "
                                         r"but is cut into segments.*persistent=False"):
        segments(saved)
    saved.freqs_cis, saved.scale = None, nn.Parameter(torch.ones(1))
    with pytest.raises(ValueError, match=r"owns parameter 'scale' but.*must live in a child module"):
        segments(saved)


def test_every_planned_transformers_family_built_on_meta_is_the_model_a_real_build_makes():
    """Every family `plan_for` plans (tests/test_hf_tp.py's tiny configs), built on meta and
    materialized by plait through the model's own init protocol: nothing left on meta or NaN, and
    every buffer (rotary tables, ALiBi slopes, masks, scales) and every norm weight as the same
    model built on the CPU has them."""
    pytest.importorskip("transformers")
    from test_hf_tp import FAMILIES, build_family

    for family in FAMILIES:
        model, built = _on_meta(lambda family=family: build_family(family)), build_family(family)
        assert not any(t.is_meta or t.isnan().any() for t in [*model.parameters(), *model.buffers()]), family
        for name, t in built.named_buffers():
            # Gemma's embedding scale, sqrt(hidden): the real build rounds it through float32
            # (torch.tensor of a Python float), transformers' init writes it in the model's float64.
            tol = dict(rtol=2e-7, atol=0) if name.endswith("embed_scale") else dict(rtol=0, atol=0)
            where = f"{family} {name}"
            torch.testing.assert_close(model.get_buffer(name), t, **tol, msg=lambda m, w=where: f"{w}: {m}")
        for name, p in built.named_parameters():
            if "norm" in name or ".ln" in name:
                assert torch.equal(model.get_parameter(name), p), f"{family} {name}"
