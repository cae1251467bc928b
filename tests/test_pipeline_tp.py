"""Pipeline x tensor parallelism (pp2 x tp2 on 4 Gloo ranks) against a single-process oracle.

The GPT is built on the meta device, split into two stages, and each stage is tensor-parallel
with `gpt_plan` (vocab-parallel embedding and lm_head, heads and MLP units split): every rank
materializes only its shards of its own stage. It trains 3 default AdamW steps with gradient
clipping next to an unsplit oracle with the same seed and batches, in float64. Each rank's
parameters and gradients are compared with the oracle's slice (`ShardSpec.take`) at rtol=1e-9,
atol=1e-12: the vocab-parallel loss and the clipping norm stay float64 for a float64 model, so
only the order of sums differs (measured: at most 3e-14 apart after 5 steps; 3 are run). The loss (returned
in float64) and the clipping norm are compared at the same tolerance. The same runs with
the embedding tied to the LM head across the two pp ranks (1F1B and ZB-H1, with and without
sequence parallelism).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from oracle import compare_with_oracle, loss64

from plait.testing import cached_mesh

CFG = dict(vocab_size=64, seq_len=16, d_model=32, n_heads=2)
TOL64 = dict(rtol=1e-9, atol=1e-12)
MAX_NORM = 0.5  # below the oracle's gradient norm on every step (asserted): clipping scales


def _batch(step: int, batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, CFG["vocab_size"], (batch, CFG["seq_len"] + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _pp_tp_parity(schedule: str, steps: int = 3, sp: bool = False, p2p: str = "auto",
                  tied: bool = False, pp: int = 2) -> dict:
    import plait
    from plait.models.gpt import GPT, GPTConfig

    mesh = cached_mesh(pp=pp, tp=2)
    cfg = GPTConfig(n_layers=2 if pp == 2 else 6, tie_embeddings=tied, **CFG)
    oracle = plait.init_weights(GPT(cfg).to(torch.float64), seed=3)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.float64)
    pipe = plait.parallelize(model, mesh, plait.ParallelPlan(
        tp=plait.gpt_plan(cfg), sequence_parallel=sp, data="none", pp_schedule=schedule,
        pp_microbatches=4 if pp == 2 else 8, seed=3, p2p=p2p))
    specs = pipe.tp_info.specs
    mine = dict(pipe.named_parameters())
    ref = dict(oracle.named_parameters(remove_duplicate=False))  # a tied weight under both names

    # Split layers hold half their rows or columns: no rank materialized a full stage.
    assert specs and all(p.numel() * 2 == ref[n].numel() for n, p in mine.items() if n in specs)
    assert all(p.is_meta for n, p in model.named_parameters() if n not in mine)
    compare_with_oracle(pipe, oracle, "initial value of", lambda p: p.detach(), {"rtol": 0, "atol": 0}, specs)
    opt = torch.optim.AdamW(list(mine.values()))
    oopt = torch.optim.AdamW(oracle.parameters())
    losses, norms = [], []
    for step in range(steps):
        x, y = _batch(step)
        loss = pipe.step(x, y)
        ref_loss = loss64(oracle(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL64)
        if step == 0:  # same parameters on both sides; later steps compare at drifted points
            compare_with_oracle(pipe, oracle, "gradient of", lambda p: p.grad, TOL64, specs)
        norm = plait.clip_grad_norm_(pipe, MAX_NORM)
        ref_norm = torch.nn.utils.clip_grad_norm_(oracle.parameters(), MAX_NORM)
        assert float(ref_norm) > MAX_NORM  # clipping actually scales the gradients
        torch.testing.assert_close(norm, ref_norm.detach(), **TOL64)
        opt.step()
        oopt.step()
        opt.zero_grad()
        oopt.zero_grad()
        losses.append(float(loss))
        norms.append(float(norm))
    # The last collective first, so a failed check below cannot leave the other ranks waiting.
    torch.testing.assert_close(pipe.eval_step(x, y), loss64(oracle(x), y).detach(), **TOL64)
    compare_with_oracle(pipe, oracle, f"after {steps} AdamW steps,", lambda p: p.detach(), TOL64, specs)
    tied_copy = next((mine[n].detach() for n in ("tok_emb.weight", "lm_head.weight") if tied and n in mine),
                     None)
    return {"names": sorted(mine), "losses": losses, "norms": norms, "coords": mesh.coords,
            "links": sorted(pipe.exec.links or {}), "tied": tied_copy}


def test_pp2_tp2_1f1b_matches_single_process(pools):
    out = pools[4].run(_pp_tp_parity, "1f1b")
    # Each tp pair of a stage holds the same names; the two stages together hold every parameter.
    by_pp: dict[int, list[str]] = {}
    for o in out:
        assert by_pp.setdefault(o["coords"]["pp"], o["names"]) == o["names"]
    names = [n for ns in by_pp.values() for n in ns]
    assert len(names) == len(set(names)) == 3 + 2 * 9  # emb, 2 blocks x 9, norm, head
    # Every rank returns the same loss and clipped norm (vocab-parallel loss on both tp ranks).
    assert all(o["losses"] == out[0]["losses"] and o["norms"] == out[0]["norms"] for o in out)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_pp2_tp2_sequence_parallel_matches_single_process(pools, schedule):
    # Stages exchange sequence-split activations; norm-weight gradients are summed over tp in W
    # (zb-h1), which then runs where the list puts it on both tp ranks.
    out = pools[4].run(_pp_tp_parity, schedule, 3, True)
    assert all(o["losses"] == out[0]["losses"] and o["norms"] == out[0]["norms"] for o in out)


def test_pp2_tp2_one_group_per_direction_matches_single_process(pools):
    # Each tp coordinate's pipeline gets its own pair of direction groups (NCCL's mode, on Gloo).
    out = pools[4].run(_pp_tp_parity, "1f1b", 3, True, "directed")
    for o in out:  # tp is the innermost axis: global rank = 2 * pp + tp
        t = o["coords"]["tp"]
        assert o["links"] == sorted([(t, 2 + t), (2 + t, t)])
    assert all(o["losses"] == out[0]["losses"] for o in out)


@pytest.mark.parametrize("schedule,sp", [("1f1b", False), ("zb-h1", False), ("1f1b", True), ("zb-h1", True)])
def test_pp2_tp2_embedding_tied_across_pp_ranks_matches_single_process(pools, schedule, sp):
    # tok_emb on the first stage is lm_head on the last; both split by vocabulary, so each tp rank's
    # shard is the same rows at both ends, and the copies' gradients are summed per tp coordinate.
    out = pools[4].run(_pp_tp_parity, schedule, 3, sp, "auto", True)
    assert all(o["losses"] == out[0]["losses"] and o["norms"] == out[0]["norms"] for o in out)
    by = {(o["coords"]["pp"], o["coords"]["tp"]): o for o in out}
    assert "tok_emb.weight" in by[0, 0]["names"] and "lm_head.weight" in by[1, 0]["names"]
    for t in (0, 1):  # the two copies of each shard stayed identical, bit for bit
        torch.testing.assert_close(by[0, t]["tied"], by[1, t]["tied"], rtol=0, atol=0)
    assert not torch.equal(by[0, 0]["tied"], by[0, 1]["tied"])  # and the tp ranks hold other rows


@pytest.mark.parametrize("schedule,sp,tied", [("zbv", True, True), ("dualpipev", True, False),
                                               ("dualpipev", False, True)])
def test_pp2_tp2_v_schedules_match_single_process(pools, schedule, sp, tied):
    # Two stages per rank in a V: pp rank 0 holds the embedding and the LM head, so a tied weight is
    # one tensor there (no tie group), split by vocabulary like both its uses.
    out = pools[4].run(_pp_tp_parity, schedule, 3, sp, "auto", tied)
    assert all(o["losses"] == out[0]["losses"] and o["norms"] == out[0]["norms"] for o in out)
    by = {(o["coords"]["pp"], o["coords"]["tp"]): o for o in out}
    assert "tok_emb.weight" in by[0, 0]["names"] and ("lm_head.weight" in by[0, 0]["names"]) != tied
    assert not any(n.startswith(("tok_emb", "lm_head")) for n in by[1, 0]["names"])


def _bad(case: str) -> None:
    import plait
    from plait.models.gpt import GPT, GPTConfig, lm_loss

    mesh = cached_mesh(pp=2, tp=2)
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layers=2, tie_embeddings=case == "tied head not split", **CFG))
    plan = plait.gpt_plan(model)

    def pipeline(tp_plan: dict | None = None, loss_fn: Any = None) -> None:
        plait.parallelize(model, mesh, plait.ParallelPlan(tp=tp_plan, data="none", loss_fn=loss_fn))

    if case == "plait.pipeline":  # the pipeline package only splits: tp is composed by parallelize
        plait.pipeline(model, mesh, tp_plan=plan)
    elif case == "no plan":
        pipeline(loss_fn=lm_loss)
    elif case == "full-vocab loss":
        pipeline(plan, loss_fn=lm_loss)
    elif case == "typo":
        pipeline({**plan, "layers.*.atn.q_proj": plan["layers.*.attn.q_proj"]})
    else:  # the embedding split by vocabulary, the head tied to it whole: its copies cannot be summed
        pipeline({k: s for k, s in plan.items() if k != "lm_head"}, loss_fn=lm_loss)


def test_bad_pp_tp_arguments_fail_before_any_collective(pools):
    expect = {"plait.pipeline": "plait.parallelize(model, mesh, plait.ParallelPlan(tp=",
              "no plan": "tp=2", "full-vocab loss": "vocab-parallel cross-entropy",
              "typo": "layers.*.atn.q_proj", "tied head not split": "splits them differently"}
    for case, text in expect.items():
        errors = pools[4].errors(_bad, case)
        assert len(errors) == 4 and all(text in e for e in errors.values()), (case, errors)
