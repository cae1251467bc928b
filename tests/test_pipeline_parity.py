"""Pipeline parallelism against a single-process oracle on 2 and 4 Gloo ranks.

Each case builds the GPT on the meta device, pipelines it (every rank materializes only its own
stages) and trains default AdamW steps next to an unsplit oracle with the same seed and batches,
in float64: 5 at pp=2, 2 at pp=4 (every step runs the same schedule; the second reuses the first's
buffers and state). The pipeline averages microbatch mean losses, the oracle takes one mean over the batch:
equal in exact arithmetic, different in summation order (and microbatch matmul shapes), hence
rtol=1e-9 with atol=1e-12 for entries that are ~0 (measured: 2e-15 apart at most after 5 steps).
The loss a pipeline returns is float32 whatever the model's dtype: rtol=1e-6 (measured 5e-8).
"""

from __future__ import annotations

import pytest
import torch
from oracle import compare_with_oracle, loss64

from plait.testing import cached_mesh

CFG = dict(vocab_size=64, seq_len=16, d_model=32, n_heads=2)
TOL64 = dict(rtol=1e-9, atol=1e-12)


def _batch(step: int, batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, CFG["vocab_size"], (batch, CFG["seq_len"] + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _parity(pp: int, schedule: str, m: int, chunks: int, n_layers: int, split="auto", steps: int = 5,
            tie: bool = False, p2p: str = "auto") -> dict:
    import plait
    from plait.models.gpt import GPT, GPTConfig
    from plait.pipeline import pipeline

    mesh = cached_mesh(pp=pp)
    cfg = GPTConfig(n_layers=n_layers, tie_embeddings=tie, **CFG)
    oracle = plait.init_weights(GPT(cfg).to(torch.float64), seed=3)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.float64)
    pipe = pipeline(model, mesh, split=split, schedule=schedule, microbatches=m, loss_fn=loss64,
                    chunks=chunks, seed=3, p2p=p2p)
    mine = dict(pipe.named_parameters())
    assert all(not p.is_meta for p in mine.values())
    # No rank holds the full model: the other ranks' stages stay on the meta device here.
    assert all(p.is_meta for n, p in model.named_parameters() if n not in mine)
    opt = torch.optim.AdamW(list(mine.values()))
    oopt = torch.optim.AdamW(oracle.parameters())
    x, y = _batch(99)
    out = pipe.eval_step(x)  # forward only: the last stage's rank gets the logits
    if out is not None:
        torch.testing.assert_close(out, oracle(x).detach(), **TOL64)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        loss = pipe.step(x, y)
        ref_loss = loss64(oracle(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL64)
        if step == 0:  # same parameters on both sides; later steps compare at drifted points
            compare_with_oracle(pipe, oracle, "gradient of", lambda p: p.grad, TOL64)
        opt.step()
        oopt.step()
        opt.zero_grad()
        oopt.zero_grad()
        losses.append(float(loss))
    compare_with_oracle(pipe, oracle, f"after {steps} AdamW steps,", lambda p: p.detach(), TOL64)
    torch.testing.assert_close(pipe.eval_step(x, y), loss64(oracle(x), y).detach(), **TOL64)
    return {"names": sorted(mine), "losses": losses, "bubble": pipe.bubble_fraction,
            "links": sorted(pipe.exec.links or {})}


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]
# At pp=4, m = p and m = 2p (warm-up, steady state and cool-down each take another shape); at pp=2,
# m = 2p, the steady state that larger m only lengthens.
CASES = [(s, c, m) for s, c in SCHEDULES for m in (4, 8)]
CASES_PP2 = [(s, c, 4) for s, c in SCHEDULES]


@pytest.mark.parametrize("schedule,chunks,m", CASES_PP2)
def test_parity_pp2(pools, schedule, chunks, m):
    out = pools[2].run(_parity, 2, schedule, m, chunks, 3)
    # Every parameter lives on exactly one rank: nothing dropped, nothing duplicated.
    names = [n for o in out for n in o["names"]]
    assert len(names) == len(set(names)) == 3 + 9 * 3 - 3 + 3  # emb, 3 blocks x 9, norm, head


@pytest.mark.parametrize("schedule,chunks,m", CASES)
def test_parity_pp4(pools, schedule, chunks, m):
    pools[4].run(_parity, 4, schedule, m, chunks, 5 if chunks == 1 else 4, steps=2)


# V-shape schedules hold two stages per rank (chunks=2): rank r holds stages r and 2p - 1 - r.
V_CASES = [("zbv", 4), ("zbv", 8), ("dualpipev", 4)]  # m = 2p and 4p; DualPipeV's pp=4 case: m = 2p


@pytest.mark.parametrize("schedule,m", V_CASES)
def test_v_schedules_parity_pp2(pools, schedule, m):
    out = pools[2].run(_parity, 2, schedule, m, 2, 3)
    names = [n for o in out for n in o["names"]]
    assert len(names) == len(set(names)) == 3 + 9 * 3 - 3 + 3
    # The V: rank 0 holds the first stage and the last (the embedding and the LM head).
    assert "tok_emb.weight" in out[0]["names"] and "lm_head.weight" in out[0]["names"]


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_parity_pp4(pools, schedule):
    pools[4].run(_parity, 4, schedule, 8, 2, 4, steps=2)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_tied_embedding_and_one_group_per_direction(pools, schedule):
    # The tied embedding and LM head meet on rank 0: one weight, no tie group. With one group per
    # direction (NCCL's matching by order) each rank posts its receives in the order the peer sends
    # them; under ZB-V rank 1 waits for them in another order.
    from plait.pipeline import make_schedule

    s = make_schedule(schedule, 2, 8)
    listed = [a for a in s.actions[1] if a.kind.name.startswith("RECV")]
    assert (listed != s.receive_order(1)) == (schedule == "zbv")
    out = pools[2].run(_parity, 2, schedule, 8, 2, 3, tie=True, p2p="directed")
    assert "tok_emb.weight" in out[0]["names"] and "lm_head.weight" not in out[0]["names"]
    assert out[0]["links"] == [(0, 1), (1, 0)]
