"""Activation checkpointing: the same gradients with every policy, in every layout, for less memory.

Each layout is built by `plait.parallelize` from a float64 GPT on the meta device, once without
checkpointing and once per policy (full, full every 2nd block, selective), with the same seed, and
trains two SGD steps on the same batches. Checkpointing only changes when activations are computed,
not what is computed: its gradients must equal the same layout's without it *bitwise* (the same
kernels run on the same values in the same order; with dropout, the recomputation draws the same
masks, tensor parallelism's per-rank ones included). Without dropout every layout is also checked
against a single-process oracle (no checkpointing) at rtol=1e-9, atol=1e-12 (float64; only the
order of sums differs; measured at most 6.1e-16 apart, tp2-sp, and 1.1e-16 elsewhere).

A probe counts the bytes of tensors made in a block's forward that are still alive when it returns
(what backward will read): none > selective > full, exactly the matmul (and fused attention)
outputs for selective and nothing for full, so a policy that changed nothing would fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import assert_params_close, layout_pieces, local_of, piece_of, train_losses
from torch import nn

import plait
from plait.compose.activation_checkpointing import activation_checkpointing, checkpointed, select_blocks
from plait.models.gpt import GPT, GPTConfig
from plait.testing import cached_mesh

CFG = dict(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)
POLICIES = [("full", 1), ("full", 2), ("selective", 1)]
EXACT = dict(rtol=0.0, atol=0.0)
TOL64 = dict(rtol=1e-9, atol=1e-12)
LAYOUTS = {
    "ddp2": (dict(dp=2), dict(data="ddp")),
    "zero3-fsdp2": (dict(fsdp=2), dict(data="fsdp", zero_stage=3)),
    "zero3-fsdp2-keep-gathered": (dict(fsdp=2), dict(data="fsdp", zero_stage=3, reshard_after_forward=False)),
    "tp2-sp": (dict(tp=2), dict(sequence_parallel=True)),
    "pp2-zb-h1": (dict(pp=2), dict(pp_schedule="zb-h1", pp_microbatches=4)),
    "pp2-tp2-zb-h1": (dict(pp=2, tp=2), dict(pp_schedule="zb-h1", pp_microbatches=4)),
}


def _loss64(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def _batch(step: int, b: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    w = torch.randint(0, CFG["vocab_size"], (b, CFG["seq_len"] + 1), generator=g)
    return w[:, :-1], w[:, 1:]


def _train(mesh, plan_kw: dict, dropout: float, ac: str | None, every: int, steps: int = 2) -> dict:
    """This rank's gradient pieces at each step (two SGD steps), keyed by original name."""
    from plait.state.placement import tp_info
    from plait.tp.apply import loss_fn_for

    cfg = GPTConfig(dropout=dropout, **CFG)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.float64)
    tp = plait.gpt_plan(cfg) if mesh.size("tp") > 1 else None
    pp = mesh.size("pp") > 1
    torch.manual_seed(7)  # the same dropout masks for every policy (tensor parallelism syncs it over tp)
    plan = plait.ParallelPlan(tp=tp, seed=3, ac=ac, ac_every=every,
                              loss_fn=_loss64 if pp and not tp else None, **plan_kw)
    net = plait.parallelize(model, mesh, plan)
    specs = (net.tp_info if pp else tp_info(net)).specs if tp else {}
    loss_fn = loss_fn_for(net) if tp and not pp else _loss64
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    r, n = mesh.rank(("dp", "fsdp")), mesh.size(("dp", "fsdp"))
    grads = []
    for step in range(steps):
        x, y = _batch(step)
        xs, ys = x.chunk(n)[r], y.chunk(n)[r]  # this data-parallel rank's slice
        if pp:
            net.step(xs, ys)
        else:
            loss_fn(net(xs), ys).backward()
        grads.append({name: local_of(t.grad).reshape(-1)[mine or slice(None)].clone()
                      for name, t, mine, _ in layout_pieces(net)})
        opt.step()
        opt.zero_grad()
    theirs = {name: sl or slice(None) for name, _, _, sl in layout_pieces(net)}
    return {"grads": grads, "theirs": theirs, "specs": specs, "full": plait.full_state_dict(net),
            "fill_w": net.exec.fill_w if pp else None}


def _oracle(steps: int = 2) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    oracle = plait.init_weights(GPT(GPTConfig(**CFG)).to(torch.float64), seed=3)
    opt = torch.optim.SGD(oracle.parameters(), lr=0.5)
    grads = []
    for step in range(steps):
        x, y = _batch(step)
        _loss64(oracle(x), y).backward()
        grads.append({n: p.grad.clone() for n, p in oracle.named_parameters()})
        opt.step()
        opt.zero_grad()
    return grads, oracle.state_dict()


def _layout_parity(layout: str, dropout: float, policies: list) -> dict[str, float]:
    """Every policy against the same layout without checkpointing (bitwise) and, without dropout,
    that layout against one process; returns the largest difference to the oracle."""
    mesh_kw, plan_kw = LAYOUTS[layout]
    mesh = cached_mesh(**mesh_kw)
    base = _train(mesh, plan_kw, dropout, None, 1)
    for ac, every in policies:
        got = _train(mesh, plan_kw, dropout, ac, every)
        for step, (g, want) in enumerate(zip(got["grads"], base["grads"])):
            assert_params_close(g, want, **EXACT, what=f"{ac} every {every}, step {step},")
        # The model's names, everywhere: the full state of a checkpointed layout is the model's.
        assert got["full"].keys() == base["full"].keys()
        # A pipeline pulls W's into waits unless a W may recompute a tensor-parallel block (the
        # first stage's W runs its whole backward), whose collectives would then come at times
        # that differ between the tp ranks.
        assert got["fill_w"] == (None if base["fill_w"] is None else base["fill_w"] and "tp" not in mesh_kw)
    worst = 0.0
    if dropout == 0.0:
        ref, state = _oracle()
        assert base["full"].keys() == state.keys()
        for step, grads in enumerate(base["grads"]):
            want = {n: piece_of(ref[step][n], base["specs"].get(n), base["theirs"][n]) for n in grads}
            assert_params_close(grads, want, **TOL64, what=f"oracle, step {step},")
            worst = max(worst, *(float((g - want[n]).abs().max()) for n, g in grads.items()))
    return {"worst": worst}


@pytest.mark.parametrize("layout", ["ddp2", "zero3-fsdp2", "tp2-sp", "pp2-zb-h1"])
def test_every_policy_matches_the_layout_without_it_and_one_process(pools, layout):
    out = pools[2].run(_layout_parity, layout, 0.0, POLICIES)
    assert max(o["worst"] for o in out) < 1e-12


@pytest.mark.parametrize("layout", ["tp2-sp", "pp2-zb-h1", "zero3-fsdp2"])
def test_dropout_masks_are_drawn_again_in_the_recomputation(pools, layout):
    # tp2-sp: masks inside the attention and MLP regions and on sequence shards come from each tp
    # rank's own stream; pp2-zb-h1: the first stage recomputes in W, pulled into waits at times
    # that vary, without moving the random stream of the forwards around it.
    pools[2].run(_layout_parity, layout, 0.1, POLICIES)


def test_fsdp_keeping_gathered_parameters(pools):
    pools[2].run(_layout_parity, "zero3-fsdp2-keep-gathered", 0.0, [("full", 1)])


def test_pipeline_of_tensor_parallel_stages_with_dropout(pools):
    pools[4].run(_layout_parity, "pp2-tp2-zb-h1", 0.1, [("full", 1), ("selective", 1)])


def test_plait_train_flags(pools, tmp_path):
    from typing import get_args

    from plait.app import config
    from plait.compose.activation_checkpointing import POLICIES as ALL

    assert get_args(config.Checkpointing) == ("none", *ALL)
    cfg = config.parse_args(["--ac", "selective", "--ac-every", "2"])
    assert (cfg.parallel.ac, cfg.parallel.ac_every) == ("selective", 2)
    for flags, match in [(dict(ac_every=2), "--ac-every 2 chooses the blocks.*--ac none would ignore it"),
                         (dict(ac="full", ac_every=0), "--ac-every 0: must be an integer >= 1"),
                         (dict(ac="full", strategy="dp"), "--ac with --strategy dp"),
                         (dict(ac="some"), "--ac must be one of")]:
        with pytest.raises(ValueError, match=match):
            config.TrainConfig.from_flags(**flags)
    # The flag reaches the layout: the same run, the same losses (bitwise), with and without it.
    want = pools[2].run(train_losses, str(tmp_path / "a"), strategy="ddp", nproc=2)
    got = pools[2].run(train_losses, str(tmp_path / "b"), strategy="ddp", nproc=2, ac="selective")
    assert got == want


# ------------------------------------------------------------------ single process


def _tiny(dropout: float = 0.0, **kw) -> GPT:
    return plait.init_weights(GPT(GPTConfig(**{**CFG, "dropout": dropout, **kw})), seed=3).to(torch.float64)


def _two_steps(model: nn.Module) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(11)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    grads = []
    for step in range(2):
        x, y = _batch(step)
        _loss64(model(x), y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return grads


@pytest.mark.parametrize("policy,every", POLICIES)
def test_one_process_with_dropout_and_the_names_kept(policy, every):
    from plait.state.checkpoint.protocol import state_dict

    want = _two_steps(_tiny(0.1, n_layers=3))
    model = activation_checkpointing(_tiny(0.1, n_layers=3), policy, every)
    names = ["layers.0", "layers.1", "layers.2"][every - 1::every]
    assert [n for n, m in model.named_modules() if checkpointed(m)] == names
    assert all(checkpointed(m) == policy for n, m in model.named_modules() if n in names)
    got = _two_steps(model)
    for step, (g, w) in enumerate(zip(got, want)):
        assert_params_close(g, w, **EXACT, what=f"step {step}:")
    plain = _tiny(0.1, n_layers=3)
    assert list(model.state_dict()) == list(plain.state_dict())
    opt = torch.optim.AdamW(model.parameters())
    saved = state_dict(model, opt)  # what plait.checkpoint writes
    assert saved["model"].keys() == plain.state_dict().keys()
    assert plait.full_state_dict(model).keys() == plain.state_dict().keys()


def test_eval_and_no_grad_run_the_plain_forward():
    model = activation_checkpointing(_tiny(), "full")
    x, _ = _batch(0)
    with torch.no_grad():
        torch.testing.assert_close(model(x), _tiny()(x), **EXACT)


def _count_recomputations(monkeypatch) -> list[int]:
    from plait.compose.activation_checkpointing import _Frame

    calls = [0]
    recompute = _Frame.recompute

    def counted(frame) -> None:
        calls[0] += 1
        recompute(frame)

    monkeypatch.setattr(_Frame, "recompute", counted)
    return calls


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_backward_twice_reads_one_recomputation(monkeypatch, policy):
    calls = _count_recomputations(monkeypatch)
    model = activation_checkpointing(_tiny(0.1), policy)
    ref = _tiny(0.1)
    x, y = _batch(0)
    for m in (model, ref):
        torch.manual_seed(1)
        loss = _loss64(m(x), y)
        loss.backward(retain_graph=True)
        loss.backward()
    assert calls[0] == CFG["n_layers"]  # once per block, not once per backward
    assert_params_close({n: p.grad for n, p in model.named_parameters()},
                        {n: p.grad for n, p in ref.named_parameters()}, **EXACT, what="gradient of")


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_split_backward_recomputes_each_block_once(monkeypatch, policy):
    # A zero-bubble stage: B (input gradients, graph kept), then W (weight gradients) later.
    from plait.pipeline.backward_split import backward_input

    calls = _count_recomputations(monkeypatch)
    grads = []
    for m in (_tiny(0.1), activation_checkpointing(_tiny(0.1), policy)):
        torch.manual_seed(2)
        x = torch.randn(4, CFG["seq_len"], CFG["d_model"], dtype=torch.float64, requires_grad=True)
        out = x
        for block in m.layers:
            out = block(out)
        params = [p for block in m.layers for p in block.parameters()]
        (gx,), w = backward_input([out], [torch.ones_like(out)], [x], params)
        w.run()
        grads.append([gx, *(p.grad for p in params)])
    assert calls[0] == CFG["n_layers"]  # in B; W reads what B recomputed
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, **EXACT)


def _held_bytes(policy: str | None, dropout: float, b: int = 4) -> int:
    """Bytes of the tensors a block's forward makes that are still alive when it returns (what it
    keeps for backward), its output aside; each storage counted once."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from plait._torch_compat import TorchDispatchMode

    model = _tiny(dropout, n_layers=1)
    if policy is not None:
        activation_checkpointing(model, policy)
    x = torch.randn(b, CFG["seq_len"], CFG["d_model"], dtype=torch.float64, requires_grad=True)
    old = {t.untyped_storage().data_ptr() for t in [x, *model.parameters(), *model.buffers()]}
    made: list = []

    class Made(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in old:
                    st = t.untyped_storage()
                    made.append((st._cdata, StorageWeakRef(st), st.nbytes()))
            return out

    with Made():
        y = model.layers[0](x)
    alive = {k: nbytes for k, ref, nbytes in made if not ref.expired() and k != y.untyped_storage()._cdata}
    y.sum().backward()  # the recomputation, and the block's gradients, still work
    assert model.layers[0].mlp.up_proj.weight.grad is not None
    return sum(alive.values())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_each_policy_changes_what_a_block_keeps(dropout):
    held = {p: _held_bytes(p, dropout) for p in (None, "selective", "full")}
    assert held[None] > held["selective"] > held["full"] == 0
    cfg, b = GPTConfig(**CFG), 4
    assert cfg.d_ff is not None
    tokens, h = b * cfg.seq_len, cfg.d_model
    matmuls = tokens * (5 * h + 2 * cfg.d_ff) * 8  # q, k, v, o, down; gate, up: float64 outputs
    # Without dropout on CPU attention is one fused kernel, kept with its output and logsumexp;
    # with dropout it runs unfused: its batched matmuls, softmax and mask are recomputed.
    fused = (tokens * h + b * cfg.n_heads * cfg.seq_len) * 8 if dropout == 0.0 else 0
    assert held["selective"] == matmuls + fused


# ------------------------------------------------------------------ refusals


def test_refusals_name_what_and_why():
    model = _tiny()
    with pytest.raises(ValueError, match=r"policy must be one of \('full', 'selective'\).*got 'most'"):
        activation_checkpointing(model, "most")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="every must be an integer >= 1"):
            activation_checkpointing(model, "full", bad)
    with pytest.raises(ValueError, match=r"\['layers\.\*\.atn'\] matched no submodule of GPT"):
        activation_checkpointing(model, "full", blocks=["layers.*.attn", "layers.*.atn"])
    with pytest.raises(ValueError, match=r"holds no nn.ModuleList of blocks \(nor .*; name the modules"):
        activation_checkpointing(nn.Sequential(nn.Linear(2, 2)), "full")
    with pytest.raises(ValueError, match=r"'layers\.0\.attn' lies inside 'layers\.0'"):
        activation_checkpointing(model, "full", blocks=["layers.*", "layers.*.attn"])
    with pytest.raises(ValueError, match=r"\(every=2\) chooses the blocks.*policy=None would ignore it"):
        activation_checkpointing(model, None, 2)
    with pytest.raises(ValueError, match=r"every=3 checkpoints no block: GPT has 2 \(layers\.0, layers\.1\)"):
        activation_checkpointing(model, "full", 3)
    # Classes or patterns; every k-th counts the matches in model order (7 linears per block).
    assert select_blocks(model, [nn.Linear], every=7) == ["layers.0.mlp.down_proj", "layers.1.mlp.down_proj"]
    activation_checkpointing(model, "full")
    with pytest.raises(ValueError, match=r"'layers\.0' is checkpointed already \('full'\)"):
        activation_checkpointing(model, "selective")


def _blocks_inside_regions() -> list[str]:
    """Checkpointing a module that runs within a tensor-parallel region, refused at once (a module
    inside the region) or at its forward (the region itself, whose hooks enter it around the call)."""
    mesh = cached_mesh(tp=2)
    with torch.device("meta"):
        model = GPT(GPTConfig(**CFG))
    model = plait.tensor_parallel(model, mesh, plait.gpt_plan(model.cfg), seed=3)
    errors = []
    try:
        activation_checkpointing(model, "full", blocks=["layers.*.attn.o_proj"])
    except ValueError as e:
        errors.append(str(e))
    activation_checkpointing(model, "full", blocks=["layers.*.mlp"])
    try:
        model(_batch(0)[0])
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_a_block_inside_a_tensor_parallel_region_is_refused(pools):
    for errors in pools[2].run(_blocks_inside_regions):
        assert len(errors) == 2
        assert "'layers.0.attn.o_proj' runs inside a tensor-parallel region" in errors[0]
        assert "'layers.0.mlp' runs inside a tensor-parallel region" in errors[1]


def _parallelize_unmatched_blocks(pp: int) -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig(**CFG))
    plan = plait.ParallelPlan(ac="full", ac_blocks=["blocks.*"], **(dict(loss_fn=_loss64) if pp > 1 else {}))
    plait.parallelize(model, cached_mesh(pp=pp, dp=2 // pp), plan)


def test_plan_refusals_come_before_any_collective(pools):
    with pytest.raises(ValueError, match=r"ParallelPlan\(ac=\.\.\.\): policy must be one of"):
        plait.ParallelPlan(ac="everything")
    with pytest.raises(ValueError, match=r"ParallelPlan\(ac_every=\.\.\.\): every must be an integer >= 1"):
        plait.ParallelPlan(ac="full", ac_every=0)
    without_policy = r"ParallelPlan\(ac_every=3\) chooses the blocks to checkpoint; ac=None would ignore it"
    with pytest.raises(ValueError, match=without_policy):
        plait.ParallelPlan(ac_every=3)
    for pp in (1, 2):  # refused on every rank, before anything communicates
        errors = pools[2].errors(_parallelize_unmatched_blocks, pp)
        assert all("['blocks.*'] matched no submodule of GPT" in e for e in errors.values()), errors


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recomputed_activations_are_freed_after_backward(policy):
    # A recomputed graph node holding its own output would be a cycle through autograd's C++ graph,
    # which no collector breaks: each step would leak the block's activations (39-52 MiB per step
    # on the small GPT before this was fixed).
    import gc
    import weakref

    import plait
    from plait.models.gpt import GPT, GPTConfig, lm_loss

    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)
    model = plait.init_weights(GPT(cfg), 0)
    plait.activation_checkpointing(model, policy)
    seen: list[weakref.ref] = []
    inner = [m for m in model.layers[0].modules() if m is not model.layers[0]]  # every module in a block
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.append(weakref.ref(out))) for m in inner]
    x = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        lm_loss(model(x), x).backward()
    for h in hooks:
        h.remove()
    gc.collect()
    # Two steps' forwards, and recomputations (which stop after the last tensor backward needs).
    assert len(seen) > 2 * len(inner)
    assert [r for r in seen if r() is not None] == []
