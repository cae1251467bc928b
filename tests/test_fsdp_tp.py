"""FSDP over tensor parallelism (2-D fsdp x tp, 3-D dp x fsdp x tp) against a single process.

Every rank also runs the single-process oracle on the whole global batch, so each comparison
is local: the piece of each parameter that this rank's flat FSDP shard holds, against the
same piece of the oracle's tp slice of that parameter.

Tolerance: float64 with default AdamW, and no step rounds to float32 (see
`test_tensor_parallel.py`), so only the order of sums differs: ``rtol=1e-9``, ``atol=1e-12`` for
entries near zero. Measured, as worst |diff| / (atol + rtol * |want|) after 5 steps: zero3 5.2e-5,
zero3-sp-vocab255-tied 1.9e-4 (layers.0.attn.v_proj), zero2-sp 7.4e-5; the norms below 1e-6.
"""

from __future__ import annotations

import pytest
import torch
from oracle import assert_params_close, compare_with_oracle, local_of, loss64

from plait.testing import cached_mesh

TOL = {"rtol": 1e-9, "atol": 1e-12}
TINY = {"seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64}
CLIP = 0.5  # below every step's gradient norm here, so clipping scales the gradients


def _batch(step: int, vocab: int, b: int = 8, s: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    w = torch.randint(0, vocab, (b, s + 1), generator=g)
    return w[:, :-1], w[:, 1:]


def _fsdp_tp_parity(dp: int, fsdp: int, tp: int, sp: bool, cfg_kw: dict, zero_stage: int = 3,
                    steps: int = 5) -> dict:
    import plait
    from plait.fsdp.wrapper import FullyShardedDataParallel
    from plait.models.gpt import GPT, GPTConfig
    from plait.plans import gpt_plan
    from plait.state.materialize import init_weights
    from plait.state.placement import tp_info
    from plait.state.placement.state import full_state_dict
    from plait.tp.apply import loss_fn_for

    mesh = cached_mesh(dp=dp, fsdp=fsdp, tp=tp)
    cfg = GPTConfig(**{**TINY, **cfg_kw})
    oracle = init_weights(GPT(cfg).to(torch.float64), seed=3)
    with torch.device("meta"):  # no rank ever materializes the full model
        model = GPT(cfg).to(torch.float64)
    net = plait.parallelize(model, mesh, plait.ParallelPlan(tp=gpt_plan(cfg), sequence_parallel=sp,
                                                            data="fsdp", zero_stage=zero_stage, seed=3))
    assert isinstance(net, FullyShardedDataParallel)
    specs = tp_info(net).specs
    loss_fn = loss_fn_for(net)
    ref = dict(oracle.named_parameters(remove_duplicate=False))

    def check(what: str, get) -> None:
        compare_with_oracle(net, oracle, what, get, TOL, specs)

    check("initial value of", lambda p: p.detach())
    opt_ref = torch.optim.AdamW(oracle.parameters())
    opt = torch.optim.AdamW(net.parameters())
    data_rank, data_size = mesh.rank(("dp", "fsdp")), mesh.size(("dp", "fsdp"))
    losses, norms = [], []
    for step in range(steps):
        idx, tgt = _batch(step, cfg.vocab_size)
        loss64(oracle(idx), tgt).backward()
        mine = slice(data_rank * len(idx) // data_size, (data_rank + 1) * len(idx) // data_size)
        loss = loss_fn(net(idx[mine]), tgt[mine])
        loss.backward()
        if step == 0:  # the max norm needs no weighting: every copy of a value is the same value
            inf_ref = max(p.grad.abs().max() for p in oracle.parameters())
            inf = net.clip_grad_norm_(1e9, norm_type=float("inf"))
            torch.testing.assert_close(inf.double(), inf_ref, **TOL)
        norm_ref = torch.nn.utils.clip_grad_norm_(oracle.parameters(), CLIP)
        norm = plait.clip_grad_norm_(net, CLIP)  # summed in float64, the same on every rank
        torch.testing.assert_close(norm.double(), norm_ref, **TOL)
        assert norm_ref > CLIP  # clipping really scaled the gradients compared below
        if step == 0:
            check("clipped gradient of", lambda p: p.grad)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        losses.append(loss.item())
        norms.append(float(norm))
    check(f"after {steps} AdamW steps,", lambda p: p.detach())
    # The sharded state dict names and shapes the original model's tensors (tp shards as DTensors).
    saved = net.sharded_state_dict(opt)["model"]
    assert {n: tuple(t.shape) for n, t in saved.items() if n in ref} == \
        {n: tuple(ref[n].shape) for n in saved if n in ref}
    assert set(ref) <= set(saved)
    # The full export gathers over fsdp, then tp (an uneven vocabulary split loses its padding).
    full = plait.full_state_dict(net)
    with pytest.raises(ValueError, match="wrapped by FSDP"):
        full_state_dict(net)  # the tp module's own would export buffers only
    assert_params_close(full, oracle.state_dict(), **TOL, what="full")
    local = sum(local_of(p).numel() for p in net.parameters())
    return {"losses": losses, "norms": norms, "local": local, "full": oracle.num_parameters()}


@pytest.mark.parametrize("sp,cfg_kw,zero_stage", [
    (False, {"vocab_size": 256}, 3),
    (True, {"vocab_size": 255, "tie_embeddings": True}, 3),
    (True, {"vocab_size": 256}, 2),
], ids=["zero3", "zero3-sp-vocab255-tied", "zero2-sp"])
def test_fsdp2_tp2_matches_single_process(pools, sp, cfg_kw, zero_stage):
    out = pools[4].run(_fsdp_tp_parity, 1, 2, 2, sp, cfg_kw, zero_stage)
    # Each rank holds about a quarter of the model (padding and the replicated norms aside).
    assert out[0]["local"] < out[0]["full"] / 4 * 1.1
    assert all(o["norms"] == out[0]["norms"] for o in out)  # every rank clips by the same factor


def _hook_carried_over() -> bool:
    """A gradient hook listed in the parameter's placement record runs on FSDP's leaf before
    accumulation."""
    from torch import nn

    from plait.fsdp.wrapper import FullyShardedDataParallel
    from plait.state.placement.records import placement_for

    lin = nn.Linear(4, 4)
    lin.weight.register_hook(lambda g: g * 3)  # lost with the parameter object
    placement_for(lin.weight).grad_hooks.append(lambda g: g * 2)
    ref = nn.Linear(4, 4)
    ref.load_state_dict(lin.state_dict())
    net = FullyShardedDataParallel(lin, cached_mesh(fsdp=2))
    x = torch.ones(2, 4)
    net(x).sum().backward()
    ref(x).sum().backward()
    rank, got = torch.distributed.get_rank(), dict(net.named_parameters())
    rows = slice(2 * rank, 2 * rank + 2)  # this rank's Shard(0) rows
    return (torch.equal(got["weight"].grad.to_local(), (ref.weight.grad * 2)[rows])
            and torch.equal(got["bias"].grad.to_local(), ref.bias.grad[rows]))


def test_fsdp_carries_listed_grad_hooks_to_its_leaves(pools):
    assert all(pools[2].run(_hook_carried_over))
