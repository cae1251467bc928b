"""torch's own tools in a user's loop on plait's layouts: right, or refused by name.

`clip_grad_norm_`:

Where plait's parameters are whole tensors (DDP's replicas) or DTensors (TP's and DDP x TP's over
tp; FSDP's and FSDP x TP's shards: `test_fsdp_dtensor`) torch's clip takes the global norm. Where a
rank holds a piece of the model in plain tensors (experts over ep, pipeline stages, a fused q/k/v
split) torch's norm would be the piece's alone: it raises `TorchToolRefused` before scaling
anything, and `plait.clip_grad_norm_`, which the error names, gives one process's norm. Each
layout trains the tiny GPT in float64 beside its one-process oracle.

`state_dict()` and torch.distributed.checkpoint on tensor parallelism without FSDP: each shard is
a DTensor of the full tensor, so DCP saves every rank's rows and loads them into one process or
another tp layout; `load_state_dict` takes one process's full tensors too. (FSDP's and FSDP x
TP's: `test_fsdp_dtensor`.)
"""

from __future__ import annotations

import math

import pytest
import torch
from oracle import assert_params_close, dtensor_clip_tol, loss64

from plait.testing import cached_mesh

TOL64 = {"rtol": 1e-9, "atol": 1e-12}
CFG = {"vocab_size": 64, "seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 32}
MOE = {"n_experts": 4, "top_k": 2}


def _batch(step: int, b: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randint(0, 64, (b, 17), generator=torch.Generator().manual_seed(200 + step))
    return w[:, :-1], w[:, 1:]


def _torch_clip_on(layout: dict, steps: int = 2) -> list[str]:
    """Train ``layout`` ({mesh axes..., "moe": bool, "data": "ddp" | "fsdp"}) beside one process,
    AdamW with param groups by shape; at each step, call torch's clip on its parameters. Returns what
    torch's clip did each step: "refused" (and nothing was scaled, and plait's clip then matched one
    process's norm) or "right" (its norm was one process's). The whole state must match one
    process's after the steps."""
    import plait
    from plait.models.gpt import GPT, GPTConfig
    from plait.state.dtensors import local_of
    from plait.state.placement.pieces import TorchToolRefused

    axes = {k: v for k, v in layout.items() if k in ("dp", "fsdp", "tp", "ep", "pp")}
    mesh = cached_mesh(**axes)
    cfg = GPTConfig(**CFG, **(MOE if layout.get("moe") else {}))
    oracle = plait.init_weights(GPT(cfg).to(torch.float64), seed=3)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.float64)
    pp = mesh.size("pp")
    pipe = {"pp_microbatches": 2, "loss_fn": loss64} if pp > 1 else {}
    plan = plait.ParallelPlan(tp=plait.gpt_plan(cfg, loss_parallel=False) if mesh.size("tp") > 1 else None,
                              data=layout.get("data", "ddp"), seed=3, **pipe)
    net = plait.parallelize(model, mesh, plan)
    opt, opt_ref = _by_shape(net.named_parameters()), _by_shape(oracle.named_parameters())
    rank, size = mesh.rank(("dp", "fsdp")), mesh.size(("dp", "fsdp"))
    outcome, tol = [], TOL64
    for step in range(steps):
        x, y = _batch(step)
        loss64(oracle(x), y).backward()
        xs, ys = x.chunk(size)[rank], y.chunk(size)[rank]
        if pp > 1:
            net.step(xs, ys)
        else:
            loss64(net(xs), ys).backward()
        want = torch.nn.utils.clip_grad_norm_(oracle.parameters(), 0.5)
        # (Each rank's own values: DTensor's torch.equal would compare over the mesh.)
        before = [local_of(p.grad).clone() for p in net.parameters() if p.grad is not None]
        try:
            got = torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        except TorchToolRefused as e:
            assert "plait.clip_grad_norm_(model, max_norm)" in str(e), e
            if layout.get("moe") and "ep" not in layout:  # whole experts: not pieces, another reason
                assert "the whole expert 'layers." in str(e) and "FSDP keeps the experts whole" in str(e), e
            after = [local_of(p.grad) for p in net.parameters() if p.grad is not None]
            assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), "scaled, then refused"
            got = plait.clip_grad_norm_(net, 0.5)
            outcome.append("refused")
        else:
            outcome.append("right")
            if hasattr(got, "full_tensor"):  # torch scaled DTensor gradients: its older coefficient
                tol = dtensor_clip_tol(TOL64)
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        torch.testing.assert_close(got.double(), want, **TOL64, msg=lambda m, s=step: f"step {s}: {m}")
        assert float(want) > 0.5  # clipping scaled what the optimizers step on
        opt.step()
        opt_ref.step()
        opt.zero_grad()  # to None: the next backward's gradients are new tensors
        opt_ref.zero_grad()
    assert_params_close(plait.full_state_dict(net), oracle.state_dict(), **tol, what=f"after {steps} steps,")
    return outcome


def _by_shape(named) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only, as nanoGPT groups them: the model's own names and
    shapes (a DTensor's ndim is its full tensor's) in every layout."""
    params = dict(named)
    return torch.optim.AdamW([
        {"params": [p for p in params.values() if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0}])


def _refusal_messages() -> dict[str, str]:
    """What torch's clip and torch's Muon raise on tp shards that stay plain (a fused q/k/v weight
    split part by part, which no DTensor describes), for the test to read."""
    from torch import nn

    import plait
    from plait.state.placement.pieces import TorchToolRefused
    from plait.tp.styles import ColwiseParallel

    net = plait.tensor_parallel(nn.Sequential(nn.Linear(8, 24)).double(), cached_mesh(tp=2),
                                {"0": ColwiseParallel(parts=(8, 8, 8))}, check=False)
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    net(x).square().sum().backward()
    out = {}
    with pytest.raises(TorchToolRefused) as e:
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    out["clip"] = str(e.value)
    if hasattr(torch.optim, "Muon"):  # torch >= 2.9
        matrices = [p for p in net.parameters() if p.ndim == 2]
        before = [p.detach().clone() for p in matrices]
        with pytest.raises(TorchToolRefused) as e:
            torch.optim.Muon(matrices).step()
        assert all(torch.equal(p, b) for p, b in zip(matrices, before, strict=True)), "stepped, then refused"
        out["muon"] = str(e.value)
    torch.nn.utils.clip_grad_value_(net.parameters(), 1e-3)  # elementwise: right on shards, not refused
    assert max(float(p.grad.abs().max()) for p in net.parameters()) <= 1e-3
    for p in net.parameters():  # a gradient's own norm, outside torch's clipping, is the user's to take
        assert math.isfinite(float(p.grad.norm()))
    return out


TWO_RANKS = {
    "tp2": {"tp": 2},  # DTensor parameters: torch's clip is right
    "dp2 x ep2": {"dp": 2, "ep": 2, "moe": True},  # each rank's experts
    "fsdp2 x ep2": {"fsdp": 2, "ep": 2, "moe": True, "data": "fsdp"},  # plain experts beside DTensor shards
    # Whole experts (no ep) beside DTensor shards: torch's clip failed inside DTensor on the mix.
    "fsdp2, whole experts": {"fsdp": 2, "moe": True, "data": "fsdp"},
    "pp2": {"pp": 2},  # each rank's stage
    "dp2": {"dp": 2},  # replicas: torch's clip is right
}
FOUR_RANKS = {
    "dp2 x tp2": {"dp": 2, "tp": 2},  # DDP's bucket views, the tp DTensors' gradients
    "pp2 x fsdp2": {"pp": 2, "fsdp": 2, "data": "fsdp"},  # a stage's DTensor shards
}
EXPECTED = {"dp2": "right", "tp2": "right", "dp2 x tp2": "right"}


def _all(layouts: dict[str, dict]) -> dict[str, list[str]]:
    return {name: _torch_clip_on(layout) for name, layout in layouts.items()}


def test_torch_clip_is_refused_on_pieces_and_right_elsewhere_on_two_ranks(pools):
    for got in pools[2].run(_all, TWO_RANKS):
        for name, outcome in got.items():
            assert outcome == [EXPECTED.get(name, "refused")] * 2, (name, outcome)


def test_torch_clip_is_right_on_ddp_over_tp_and_refused_on_fsdp_stages(pools):
    for got in pools[4].run(_all, FOUR_RANKS):
        for name, outcome in got.items():
            assert outcome == [EXPECTED.get(name, "refused")] * 2, (name, outcome)


def test_the_refusals_name_the_piece_and_what_to_use(pools):
    got = pools[2].run(_refusal_messages)[0]
    assert "tp rank 0's shard of" in got["clip"] and "(tp=2)" in got["clip"], got
    assert "plait.clip_grad_norm_(model, max_norm)" in got["clip"], got
    assert "Nothing was scaled" in got["clip"], got
    if hasattr(torch.optim, "Muon"):
        assert "torch.optim.Muon" in got["muon"] and "tp rank 0's shard of" in got["muon"], got
        assert "AdamW" in got["muon"] and "FSDP" in got["muon"], got


# ------------------------------------------------------------------ state_dict() and DCP under TP
def _tp_net(seed: int, vocab: int = 64):
    import plait
    from plait.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(**{**CFG, "vocab_size": vocab})
    with torch.device("meta"):
        model = GPT(cfg).to(torch.float64)
    return plait.parallelize(model, cached_mesh(tp=2), plait.ParallelPlan(tp=plait.gpt_plan(cfg), seed=seed))


def _tp_dcp(path: str, vocab: int) -> dict:
    """Save a tp2 model's ``state_dict()`` with DCP; load it into another tp2 model (other initial
    values) the way DCP's docs show, and one process's full state into a third. Returns each
    rank's full state of each, and the saved entries' types."""
    import torch.distributed.checkpoint as dcp

    import plait
    from plait.models.gpt import GPT, GPTConfig

    saved = _tp_net(3, vocab)
    sd = saved.state_dict()
    dcp.save(sd, checkpoint_id=path)
    into = _tp_net(4, vocab)
    target = into.state_dict()
    dcp.load(target, checkpoint_id=path)
    into.load_state_dict(target)
    from_full = _tp_net(5, vocab)
    oracle = plait.init_weights(GPT(GPTConfig(**{**CFG, "vocab_size": vocab})).to(torch.float64), seed=3)
    from_full.load_state_dict(oracle.state_dict())  # one process's full tensors: each rank keeps its shard
    return {"saved": plait.full_state_dict(saved), "loaded": plait.full_state_dict(into),
            "from_full": plait.full_state_dict(from_full),
            "types": sorted({type(v).__name__ for v in sd.values()})}


def _one_process_from(path: str, vocab: int) -> dict:
    from plait._torch_compat import dcp_load_in_this_process
    from plait.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(**{**CFG, "vocab_size": vocab})).to(torch.float64)
    sd = model.state_dict()
    dcp_load_in_this_process(sd, checkpoint_id=path)
    return {k: v.clone() for k, v in sd.items()}


@pytest.mark.parametrize("vocab", [64, 63])  # 63: the vocabulary split pads rank 1's rows
def test_dcp_of_a_tp_state_dict_loads_into_one_process_and_another_tp_model(pools, tmp_path, vocab):
    from plait.models.gpt import GPT, GPTConfig
    from plait.state.materialize import init_weights

    path = str(tmp_path / "ck")
    got = pools[2].run(_tp_dcp, path, vocab)
    want = init_weights(GPT(GPTConfig(**{**CFG, "vocab_size": vocab})).to(torch.float64), seed=3).state_dict()
    for r in got:
        assert r["types"] == ["DTensor", "Tensor"], r["types"]  # shards DTensors, replicated tensors plain
        for which in ("saved", "loaded", "from_full"):
            assert set(r[which]) == set(want)
            for k, v in want.items():
                assert torch.equal(r[which][k], v), (which, k)
    one = _one_process_from(path, vocab)
    for k, v in want.items():
        assert torch.equal(one[k], v), k


def _fused_state_dict() -> str:
    from torch import nn

    import plait
    from plait.tp.styles import ColwiseParallel

    net = plait.tensor_parallel(nn.Sequential(nn.Linear(8, 24)), cached_mesh(tp=2),
                                {"0": ColwiseParallel(parts=(8, 8, 8))}, check=False)
    assert net.state_dict(keep_vars=True)["0.weight"].shape == (12, 8)  # what plait reads: the shard
    with pytest.raises(ValueError, match="fused") as e:
        net.state_dict()
    return str(e.value)


def test_state_dict_refuses_a_fused_tp_split_by_name(pools):
    for message in pools[2].run(_fused_state_dict):
        assert "'0.weight'" in message and "plait.full_state_dict(model)" in message, message


# ------------------------------------------------------------------ torch.autocast
def _autocast_grads(layout: dict) -> dict[str, float]:
    """One forward and backward under ``torch.autocast('cpu', bfloat16)`` in ``layout`` beside one
    process (float32 models, as autocast expects), that process once under the same autocast and
    once without: the largest relative difference of a whole gradient from each."""
    import plait
    from plait.models.gpt import GPT, GPTConfig
    from plait.state.placement import tp_info

    mesh = cached_mesh(**{k: v for k, v in layout.items() if k != "data"})
    cfg = GPTConfig(**CFG)
    with torch.device("meta"):
        model = GPT(cfg)
    tp = mesh.size("tp") > 1
    net = plait.parallelize(model, mesh, plait.ParallelPlan(
        tp=plait.gpt_plan(cfg, loss_parallel=False) if tp else None, data=layout.get("data", "ddp"), seed=3))
    rank, size = mesh.rank(("dp", "fsdp")), mesh.size(("dp", "fsdp"))
    x, y = _batch(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = net(x.chunk(size)[rank])
        loss64(logits, y.chunk(size)[rank]).backward()
    specs = tp_info(net).specs if tp else {}
    got = {n.removeprefix("module."): p.grad for n, p in net.named_parameters()}
    whole = {n for n, g in got.items() if hasattr(g, "full_tensor")}  # DTensors: the full gradient
    got = {n: g.full_tensor() if n in whole else g for n, g in got.items()}
    out = {"bf16 logits": float(logits.dtype == torch.bfloat16)}
    for cast in (True, False):
        oracle = plait.init_weights(GPT(cfg), seed=3)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast):
            loss64(oracle(x), y).backward()
        ref = {n: specs[n].take(o.grad) if n in specs and n not in whole else o.grad
               for n, o in oracle.named_parameters()}
        out["autocast" if cast else "float32"] = max(
            float((g - ref[n]).norm() / ref[n].norm()) for n, g in got.items())
    return out


AUTOCAST = {"dp2": {"dp": 2}, "fsdp2": {"fsdp": 2, "data": "fsdp"}, "tp2": {"tp": 2}}


def _autocast_all() -> dict[str, dict[str, float]]:
    return {name: _autocast_grads(layout) for name, layout in AUTOCAST.items()}


# Eight bfloat16 unit roundoffs. Measured: 0.0024 at dp2 and fsdp2 (0.020 from the float32 run);
# 0.013 at tp2, where each rank's partial product is rounded to bfloat16 before the all-reduce sums
# it (as in Megatron-LM), against 0.015 from the float32 run.
BF16_BUDGET = 8 * 2.0**-8


def test_autocast_in_the_users_loop_computes_as_one_process_does(pools):
    for got in pools[2].run(_autocast_all):
        for name, d in got.items():
            assert d["bf16 logits"] == 1.0, name  # autocast reached the layout's matmuls
            assert d["autocast"] < BF16_BUDGET, (name, d)
            if name != "tp2":  # one process's sums: far nearer its autocast run than its float32 one
                assert d["autocast"] < d["float32"] / 4, (name, d)


# ------------------------------------------------------------------ optimizer state under TP, with DCP
def _tp_optimizer_dcp(path: str) -> dict:
    """Two AdamW steps at tp2; save model and optimizer with torch's get_state_dict and DCP; load
    both into a fresh tp2 model and optimizer with set_state_dict; one more step on each. Returns
    the full states after that step, and the saved optimizer state's types."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import plait

    def step(net, opt, i: int) -> None:
        x, y = _batch(i)
        plait.loss_fn_for(net)(net(x), y).backward()  # the vocabulary-parallel loss gpt_plan's head needs
        opt.step()
        opt.zero_grad()

    net = _tp_net(3)
    opt = torch.optim.AdamW(net.parameters())
    for i in range(2):
        step(net, opt, i)
    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    types = sorted({type(v).__name__ for st in optim_sd["state"].values() for v in st.values()})
    again = _tp_net(4)
    opt2 = torch.optim.AdamW(again.parameters())
    model_sd2, optim_sd2 = get_state_dict(again, opt2)
    loaded = {"model": model_sd2, "optim": optim_sd2}
    dcp.load(loaded, checkpoint_id=path)
    set_state_dict(again, opt2, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    step(net, opt, 2)
    step(again, opt2, 2)
    return {"types": types, "original": plait.full_state_dict(net), "restored": plait.full_state_dict(again)}


def test_dcp_of_torchs_optimizer_state_dict_under_tp_resumes_exactly(pools, tmp_path):
    """torch's get_state_dict / set_state_dict with DCP, as torchtitan checkpoints: the optimizer's
    state of each tp shard is a DTensor of the full state, so every rank's rows are saved (plain
    shards under one name would keep one rank's for all), and the run continues exactly."""
    for got in pools[2].run(_tp_optimizer_dcp, str(tmp_path / "ck")):
        for k, v in got["original"].items():
            assert torch.equal(got["restored"][k], v), k
        assert "DTensor" in got["types"], got["types"]


# ------------------------------------------------------------------ tp parameters are DTensors
def _tp_parameters(vocab: int) -> dict[str, str]:
    """A tp2 GPT's parameters as torch's tools see them, against one process's initial model: the
    same names, full shapes and full values; returns each one's placement."""
    from torch.distributed.tensor import DTensor

    import plait
    from plait.models.gpt import GPT, GPTConfig

    net = _tp_net(3, vocab)
    want = dict(plait.init_weights(GPT(GPTConfig(**{**CFG, "vocab_size": vocab})).to(torch.float64),
                                   seed=3).named_parameters())
    got = dict(net.named_parameters())
    assert list(got) == list(want), (list(got), list(want))
    for name, p in got.items():
        assert isinstance(p, DTensor) and p.shape == want[name].shape, (name, type(p), p.shape)
        assert torch.equal(p.full_tensor(), want[name].detach()), name
    return {name: str(p.placements[0]) for name, p in got.items()}


@pytest.mark.parametrize("vocab", [64, 63])  # 63: the vocabulary split pads rank 1's rows
def test_tp_parameters_are_dtensors_of_the_models_own(pools, vocab):
    for placed in pools[2].run(_tp_parameters, vocab):
        assert placed["tok_emb.weight"] == "S(0)" and placed["layers.0.attn.q_proj.weight"] == "S(0)"
        assert placed["layers.0.attn.o_proj.weight"] == "S(1)" == placed["layers.0.mlp.down_proj.weight"]
        assert placed["layers.0.attn_norm.weight"] == "R" and placed["norm.weight"] == "R", placed


def _muon_and_adamw(named) -> tuple[torch.optim.Optimizer, ...]:
    named = list(named)
    # Muon orthogonalizes each matrix update; embeddings and vectors take AdamW, as Muon advises.
    mats = [p for n, p in named if p.ndim == 2 and "emb" not in n and "head" not in n]
    rest = [p for n, p in named if not (p.ndim == 2 and "emb" not in n and "head" not in n)]
    return torch.optim.Muon(mats, lr=2e-2), torch.optim.AdamW(rest, lr=1e-2)


def _muon_under_tp(steps: int = 2) -> dict[str, float]:
    """Per parameter: |tp2 - one process| / |one process's own change| after ``steps`` steps."""
    import plait
    from plait.models.gpt import GPT, GPTConfig

    net = _tp_net(3)
    oracle = plait.init_weights(GPT(GPTConfig(**CFG)).to(torch.float64), seed=3)
    start = {k: v.clone() for k, v in oracle.state_dict().items()}
    opts, ref_opts = _muon_and_adamw(net.named_parameters()), _muon_and_adamw(oracle.named_parameters())
    for step in range(steps):
        x, y = _batch(step)
        plait.loss_fn_for(net)(net(x), y).backward()
        loss64(oracle(x), y).backward()
        for o in (*opts, *ref_opts):
            o.step()
            o.zero_grad()
    full = plait.full_state_dict(net)
    return {k: float((full[k] - want).norm() / (want - start[k]).norm())
            for k, want in oracle.state_dict().items()}


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon came with torch 2.9")
def test_muon_on_the_matrices_trains_as_one_process_under_tp(pools):
    """As under ZeRO-3 (`test_fsdp_dtensor`): Muon orthogonalizes in bfloat16 and DTensor sums a split
    matrix's products in another order, so entries round otherwise (a few percent of a matrix's
    change); orthogonalizing each rank's rows on their own would be off by the change itself."""
    for errors in pools[2].run(_muon_under_tp):
        assert max(errors.values()) < 0.15, errors


def _converted_after_tp(steps: int = 2) -> bool:
    """A float32 tp2 model converted with ``.double()`` after `tensor_parallel`, its AdamW made
    before the conversion, trains as one process in float64."""
    import plait
    from plait.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(**CFG)
    with torch.device("meta"):
        model = GPT(cfg)
    net = plait.parallelize(model, cached_mesh(tp=2), plait.ParallelPlan(tp=plait.gpt_plan(cfg), seed=3))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net.double()
    oracle = plait.init_weights(GPT(cfg), seed=3).double()
    ref = torch.optim.AdamW(oracle.parameters(), lr=1e-2)
    assert all(p.dtype == torch.float64 for p in net.parameters())
    for step in range(steps):
        x, y = _batch(step)
        logits = net(x)
        assert logits.dtype == torch.float64
        plait.loss_fn_for(net)(logits, y).backward()
        loss64(oracle(x), y).backward()
        for o in (opt, ref):
            o.step()
            o.zero_grad()
    assert_params_close(plait.full_state_dict(net), oracle.state_dict(), **TOL64)
    return True


def test_a_tp_model_converted_after_tensor_parallel_trains_as_one_process(pools):
    assert all(pools[2].run(_converted_after_tp))
