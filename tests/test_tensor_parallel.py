"""Tensor and sequence parallelism against a single process, on Gloo ranks.

Every rank also runs the single-process oracle (same seed, same batch), so each comparison is
local: a rank's shard against the matching slice of the oracle's tensor.

Tolerance: the GPT runs in float64 with default AdamW, and so does every step of it (the
vocab-parallel cross-entropy, the RMSNorm and `plait.clip_grad_norm_` raise only lower precisions
to float32), so only sharding's other order of sums (a matmul split in two and added, a softmax
normalised with an all-reduced sum) differs: ``rtol=1e-9`` with ``atol=1e-12`` for entries that
are ~0. Measured, as worst |diff| / (atol + rtol * |want|): tp2 0.0011 (tok_emb after 5 steps),
tp2-sp-vocab255-tied 0.00024, tp4-vocab255-gathered 0.00041 (the first logits),
tp4-sp-vocab257-gqa 0.00032, dp2 x tp2 0.00038; losses and gradient norms below 1e-6. The
single-style tests run in float32 (no optimizer): ``rtol=1e-5``, ``atol=1e-6``, a few ulps of the
largest term.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import compare_with_oracle, local_of, loss64
from torch import nn

from plait import comm
from plait.testing import cached_mesh

TOL32 = {"rtol": 1e-5, "atol": 1e-6}  # the single-style tests, in float32
TOL64 = {"rtol": 1e-9, "atol": 1e-12}  # the GPT, in float64
MAX_NORM = 0.5  # below every step's gradient norm (asserted): clipping scales what is compared
TINY = {"seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64}


# ------------------------------------------------------------------ single styles
class Holder(nn.Module):
    """A container so that plans can name the layer under test."""

    def __init__(self, **mods: nn.Module) -> None:
        super().__init__()
        for k, m in mods.items():
            self.add_module(k, m)


class MLPHolder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16, bias=True), nn.GELU(), nn.Linear(16, 8, bias=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def _case(kind: str) -> tuple[nn.Module, dict, torch.Tensor, bool]:
    """(reference module, plan, input, whether the input is token ids)."""
    from plait.tp.styles import (
        ColwiseParallel,
        ParallelRegion,
        RowwiseParallel,
        VocabParallelEmbedding,
        VocabParallelOutput,
    )

    x = torch.randn(2, 8, 8)
    if kind == "colwise":
        return Holder(lin=nn.Linear(8, 12)), {"lin": ColwiseParallel(gather_output=True)}, x, False
    if kind == "rowwise":
        return Holder(lin=nn.Linear(12, 8)), {"lin": RowwiseParallel(input_is_parallel=False)}, \
            torch.randn(2, 8, 12), False
    if kind == "region":
        plan = {"mlp": ParallelRegion(), "mlp.0": ColwiseParallel(input_comm=False),
                "mlp.2": RowwiseParallel()}
        return MLPHolder(), plan, x, False
    if kind == "embedding":  # 10 rows: padded at tp=4
        return Holder(emb=nn.Embedding(10, 8)), {"emb": VocabParallelEmbedding()}, \
            torch.randint(0, 10, (2, 8)), True
    if kind == "head":
        return Holder(head=nn.Linear(8, 10, bias=False)), {"head": VocabParallelOutput()}, x, False
    raise ValueError(kind)


def _style_vs_dense(kind: str, tp: int, sp: bool) -> None:
    import copy

    from plait.state.placement import tp_info
    from plait.tp.apply import loss_fn_for, tensor_parallel

    mesh = cached_mesh(tp=tp)
    r = mesh.rank("tp")
    torch.manual_seed(0)  # same reference module and data on every rank
    ref, plan, x, ids = _case(kind)
    model = tensor_parallel(copy.deepcopy(ref), mesh, plan, sequence_parallel=sp)
    def call(m: nn.Module, a: torch.Tensor) -> torch.Tensor:
        return m(a) if isinstance(m, MLPHolder) else next(iter(m.children()))(a)

    shard_seq = sp and kind in ("region", "embedding")  # these take / give sequence-sharded activations
    x_ref = x if ids else x.clone().requires_grad_()
    y_ref = call(ref, x_ref)
    if kind == "head":
        t = torch.randint(0, 10, (2, 8))
        F.cross_entropy(y_ref.flatten(0, 1), t.flatten()).backward()
        y = call(model, x.clone().requires_grad_() if not ids else x)
        loss = loss_fn_for(model)(y, t)
        torch.testing.assert_close(loss, F.cross_entropy(y_ref.flatten(0, 1), t.flatten()), **TOL32)
        y_ref_cmp = tp_info(model).specs["head.weight"].take(y_ref.detach(), dim=-1)
        torch.testing.assert_close(y, y_ref_cmp, **TOL32)
        loss.backward()
    else:
        w = torch.randn_like(y_ref)  # a fixed, asymmetric upstream gradient
        (y_ref * w).sum().backward()
        x_in = x
        if kind == "region" and sp:
            x_in = x.chunk(tp, dim=1)[r]
        x_in = x_in if ids else x_in.clone().requires_grad_()
        y = call(model, x_in)
        if shard_seq:
            w, y_ref = w.chunk(tp, dim=1)[r], y_ref.chunk(tp, dim=1)[r]
        torch.testing.assert_close(y, y_ref.detach(), **TOL32)
        (y * w).sum().backward()
        if not ids:
            expect = x_ref.grad.chunk(tp, dim=1)[r] if kind == "region" and sp else x_ref.grad
            torch.testing.assert_close(x_in.grad, expect, **TOL32)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    compare_with_oracle(model, ref, "grad of", lambda p: p.grad, TOL32, tp_info(model).specs)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind,sp", [("colwise", False), ("rowwise", False), ("region", False),
                                     ("region", True), ("embedding", False), ("embedding", True),
                                     ("head", False)])
def test_style_matches_dense_layer(pools, tp, kind, sp):
    pools[tp].run(_style_vs_dense, kind, tp, sp)


# ------------------------------------------------------------------ whole GPT training
def _batch(step: int, vocab: int, b: int = 4, s: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    w = torch.randint(0, vocab, (b, s + 1), generator=g)
    return w[:, :-1], w[:, 1:]


def _gpt_parity(tp: int, sp: bool, cfg_kw: dict, loss_parallel: bool, dp: int = 1, steps: int = 5) -> dict:
    from contextlib import nullcontext

    from plait.ddp.wrapper import DDP
    from plait.models.gpt import GPT, GPTConfig
    from plait.plans import gpt_plan
    from plait.state.clip import clip_grad_norm_
    from plait.state.materialize import init_weights
    from plait.state.placement import tp_info
    from plait.state.placement.state import full_state_dict, load_full_state_dict
    from plait.tp.apply import loss_fn_for, tensor_parallel

    mesh = cached_mesh(dp=dp, tp=tp)
    cfg = GPTConfig(**{**TINY, **cfg_kw})
    oracle = init_weights(GPT(cfg).to(torch.float64), seed=3)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.float64)
    tensor_parallel(model, mesh, gpt_plan(cfg, loss_parallel=loss_parallel), sequence_parallel=sp, seed=3)
    # With dp > 1, data parallelism over the other axis wraps the tensor-parallel model.
    net = DDP(model, mesh) if dp > 1 else model
    specs = tp_info(net).specs
    loss_fn = loss_fn_for(net) if loss_parallel else loss64

    def check(what: str, get) -> None:
        compare_with_oracle(model, oracle, what, get, TOL64, specs)

    check("initial value of", lambda p: p.detach())
    opt_ref = torch.optim.AdamW(oracle.parameters())
    opt = torch.optim.AdamW(net.parameters())
    losses = []
    for step in range(steps):
        idx, tgt = _batch(step, cfg.vocab_size)
        logits_ref = oracle(idx)
        loss64(logits_ref, tgt).backward()
        # This dp rank's slice of the global batch, in two micro-batches that accumulate into
        # .grad (the oracle takes the whole batch at once).
        mine = slice(mesh.rank("dp") * len(idx) // dp, (mesh.rank("dp") + 1) * len(idx) // dp)
        loss = torch.zeros((), dtype=torch.float64)
        for k, (x_mb, t_mb) in enumerate(zip(idx[mine].chunk(2), tgt[mine].chunk(2), strict=True)):
            with net.no_sync() if dp > 1 and k == 0 else nullcontext():
                logits = net(x_mb)
                loss_mb = loss_fn(logits, t_mb) / 2
                loss_mb.backward()
            loss += loss_mb.detach()
            if step == 0 and k == 0:
                ref = logits_ref[mine][: len(x_mb)].detach()
                want = specs["lm_head.weight"].take(ref, dim=-1) if loss_parallel else ref
                torch.testing.assert_close(logits, want, **TOL64)
        torch.testing.assert_close(loss, loss64(logits_ref[mine], tgt[mine]).detach(), **TOL64)
        norm_ref = torch.nn.utils.clip_grad_norm_(oracle.parameters(), MAX_NORM)
        assert norm_ref > MAX_NORM  # clipping scales the gradients compared below
        # The whole model's norm, from every shard (plait.state.clip sums it in float64).
        torch.testing.assert_close(clip_grad_norm_(net, MAX_NORM).double(), norm_ref, **TOL64)
        if step == 0:
            check("clipped gradient of", lambda p: p.grad)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        losses.append(loss.item())
    check(f"after {steps} AdamW steps,", lambda p: p.detach())
    # Checkpoints: the gathered state dict is the single-process one, and it loads back in slices.
    full = full_state_dict(model)
    torch.testing.assert_close(full, oracle.state_dict(), **TOL64)
    with torch.device("meta"):
        fresh = GPT(cfg).to(torch.float64)
    tensor_parallel(fresh, mesh, gpt_plan(cfg, loss_parallel=loss_parallel), sequence_parallel=sp, seed=99)
    load_full_state_dict(fresh, oracle.state_dict())
    torch.testing.assert_close(fresh.state_dict(), model.state_dict(), **TOL64)
    local = sum(local_of(p).numel() for p in model.parameters())
    return {"losses": losses, "local_params": local, "full_params": oracle.num_parameters()}


@pytest.mark.parametrize("tp,sp,cfg_kw,loss_parallel", [
    (2, False, {"vocab_size": 256}, True),
    (2, True, {"vocab_size": 255, "tie_embeddings": True}, True),
    (4, False, {"vocab_size": 255}, False),
    (4, True, {"vocab_size": 257, "d_model": 32, "n_heads": 8, "n_kv_heads": 4}, True),
], ids=["tp2", "tp2-sp-vocab255-tied", "tp4-vocab255-gathered", "tp4-sp-vocab257-gqa"])
def test_gpt_training_matches_single_process(pools, tp, sp, cfg_kw, loss_parallel):
    out = pools[tp].run(_gpt_parity, tp, sp, cfg_kw, loss_parallel)
    assert all(o["losses"] == out[0]["losses"] for o in out)  # the loss is replicated bit for bit
    # No rank holds the full model: only norms (and nothing else) are replicated.
    assert out[0]["local_params"] < out[0]["full_params"] / tp * 1.1


# ------------------------------------------------------------------ communication = theory
def _counts(s: comm.CommStats) -> dict[str, tuple[int, int]]:
    return {k: (int(v["calls"]), int(v["bytes"])) for k, v in s.as_dict().items()}


def _block_comm(tp: int, sp: bool) -> dict:
    from plait.models.gpt import GPT, GPTConfig
    from plait.plans import gpt_plan
    from plait.tp.apply import loss_fn_for, tensor_parallel

    cfg = GPTConfig(**TINY)
    with torch.device("meta"):
        model = GPT(cfg)
    tensor_parallel(model, cached_mesh(tp=tp), gpt_plan(cfg), sequence_parallel=sp)
    b, s = 2, cfg.seq_len
    x = torch.randn(b, s // tp if sp else s, cfg.d_model, requires_grad=True)
    with comm.counting() as fwd:
        y = model.layers[0](x)
    with comm.counting() as bwd:
        y.backward(torch.ones_like(y))
    idx = torch.randint(0, cfg.vocab_size, (b, s))
    with comm.counting() as whole_fwd:
        loss = loss_fn_for(model)(model(idx), idx)
    with comm.counting() as whole_bwd:
        loss.backward()
    return {"fwd": _counts(fwd), "bwd": _counts(bwd),
            "whole_fwd": _counts(whole_fwd), "whole_bwd": _counts(whole_bwd)}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_comm_per_block_equals_theory(pools, tp, sp):
    out = pools[tp].run(_block_comm, tp, sp)[0]
    b, s, h, L, d4 = 2, TINY["seq_len"], TINY["d_model"], TINY["n_layers"], 4
    act = b * s * h * d4  # one full (b, s, h) fp32 activation
    if not sp:  # Megatron: 2 all-reduces of b*s*h forward, 2 backward
        assert out["fwd"] == {"all_reduce@tp": (2, 2 * act)}
        assert out["bwd"] == {"all_reduce@tp": (2, 2 * act)}
        # Whole model: + embedding all-reduce and the loss's two per-token all-reduces forward,
        # + the lm_head's input all-reduce backward.
        tokens = b * s * d4
        assert out["whole_fwd"] == {"all_reduce@tp": (2 * L + 3, (2 * L + 1) * act + tokens * 3)}
        assert out["whole_bwd"] == {"all_reduce@tp": (2 * L + 1, (2 * L + 1) * act)}
    else:  # each all-reduce becomes an all-gather + reduce-scatter pair, same logical bytes
        assert out["fwd"] == {"all_gather@tp": (2, 2 * act), "reduce_scatter@tp": (2, 2 * act)}
        # + the two norms' weight gradients (h floats each), summed over the sequence shards
        assert out["bwd"] == {"all_gather@tp": (2, 2 * act), "reduce_scatter@tp": (2, 2 * act),
                              "all_reduce@tp": (2, 2 * h * d4)}
        assert out["whole_fwd"]["all_gather@tp"] == (2 * L + 1, (2 * L + 1) * act)
        assert out["whole_fwd"]["reduce_scatter@tp"] == (2 * L + 1, (2 * L + 1) * act)
        assert out["whole_bwd"]["reduce_scatter@tp"] == (2 * L + 1, (2 * L + 1) * act)
        assert out["whole_bwd"]["all_gather@tp"] == (2 * L + 1, (2 * L + 1) * act)
        assert out["whole_bwd"]["all_reduce@tp"] == (2 * L + 1, (2 * L + 1) * h * d4)


# ------------------------------------------------------------------ randomness
def _dropout_masks(tp: int, sp: bool) -> dict:
    import torch.distributed as dist

    from plait.models.gpt import GPT, GPTConfig
    from plait.plans import gpt_plan
    from plait.tp.apply import tensor_parallel

    torch.manual_seed(100 + dist.get_rank())  # ranks out of step on purpose: tensor_parallel syncs tp
    cfg = GPTConfig(**{**TINY, "dropout": 0.5})
    with torch.device("meta"):
        model = GPT(cfg)
    tensor_parallel(model, cached_mesh(tp=tp), gpt_plan(cfg), sequence_parallel=sp)
    draws: dict[str, list[torch.Tensor]] = {"attn": [], "mlp": [], "drop": []}
    # Pre-hooks registered after tensor_parallel's run inside its regions: they see the stream
    # the region's own dropout sees.
    model.layers[0].attn.register_forward_pre_hook(lambda m, a: draws["attn"].append(torch.rand(4)))
    model.layers[0].mlp.register_forward_pre_hook(lambda m, a: draws["mlp"].append(torch.rand(4)))
    model.layers[0].drop.register_forward_pre_hook(lambda m, a: draws["drop"].append(torch.rand(4)))
    model.train()
    model(torch.randint(0, cfg.vocab_size, (2, cfg.seq_len)))
    return {k: torch.stack(v) for k, v in draws.items()} | {"after": torch.rand(4)}


@pytest.mark.parametrize("sp", [False, True])
def test_dropout_rng_replicated_vs_sharded_regions(pools, sp):
    out = pools[2].run(_dropout_masks, 2, sp)
    same = {k: torch.equal(out[0][k], out[1][k]) for k in out[0]}
    # Attention and MLP bodies act on different heads / hidden units per rank: independent
    # masks. The residual dropout acts on the replicated activation without SP (same mask) and
    # on different sequence shards with it. The default stream stays in step afterwards.
    assert same == {"attn": False, "mlp": False, "drop": not sp, "after": True}


# ------------------------------------------------------------------ bad plans, clear errors
def _bad(case: str) -> None:
    from plait.models.gpt import GPT, GPTConfig
    from plait.plans import gpt_plan
    from plait.tp.apply import tensor_parallel
    from plait.tp.styles import ColwiseParallel, RowwiseParallel

    mesh = cached_mesh(tp=4)
    kw = {"n_heads": 2} if case == "heads" else {"n_heads": 8, "n_kv_heads": 2} if case == "kv" else {}
    cfg = GPTConfig(**{**TINY, **kw})
    with torch.device("meta"):
        model = GPT(cfg)
    plan = gpt_plan(cfg)
    if case == "pattern":
        plan["layers.*.attn.qkv"] = ColwiseParallel()
    elif case == "no_region":
        plan = {"layers.*.mlp.up_proj": ColwiseParallel(input_comm=False)}
    elif case == "type":
        plan = {"norm": RowwiseParallel(input_is_parallel=False)}
    elif case == "seq":
        tensor_parallel(model, mesh, plan, sequence_parallel=True)
        with comm.counting() as counts:
            try:
                model(torch.zeros(1, 10, dtype=torch.long))
            finally:
                assert counts.calls() == 0, "a collective ran before the error"
    tensor_parallel(model, mesh, plan)
    raise AssertionError("no error")


@pytest.mark.parametrize("case,expect", [
    ("heads", "cannot split 2 attention heads (32 features in units of 16) evenly across tp=4"),
    ("kv", "cannot split 2 KV heads (8 features in units of 4) evenly across tp=4"),
    ("pattern", "pattern(s) ['layers.*.attn.qkv'] match no module"),
    ("no_region", "through a ParallelRegion on an enclosing module"),
    ("type", "applies to Linear modules, but 'norm' is a RMSNorm"),
    ("seq", "use a sequence length divisible by 4"),
])
def test_impossible_plan_raises_clear_error(pools, case, expect):
    errors = pools[4].errors(_bad, case)
    assert all(expect in e for e in errors.values()), errors[0]


def test_composes_with_ddp_on_the_dp_axis(pools):
    # world 4 = dp 2 x tp 2: tensor_parallel touches only the tp groups, DDP only the dp groups.
    out = pools[4].run(_gpt_parity, 2, True, {"vocab_size": 255}, True, 2)
    assert out[0]["losses"] == out[1]["losses"] != out[2]["losses"] == out[3]["losses"]
