"""Pipelines with data parallelism per stage, built by `plait.parallelize`, against one process.

torchtitan's layout: the model is split into stages and each stage is its own FSDP module over
the fsdp axis (ZeRO-2 or ZeRO-3; hybrid with dp), or its own DDP module over dp. Gradients
accumulate over the microbatches and each stage's last backward of the step reduces them.

Every rank also runs the single-process oracle on the whole global batch (each pipeline replica
gets its slice), so each comparison is local: the piece of each parameter this rank's FSDP shard
(or DDP replica) holds against the same piece of the oracle's. Losses, clipped gradients at the
first step and parameters after a few default AdamW steps are compared.

Tolerances: float64 with default AdamW, so only summation order differs: rtol=1e-9, atol=1e-12,
with tensor parallelism too (its vocab-parallel cross-entropy stays float64 for float64 logits) and
for the clipping norm (summed in float64), so every case clips and compares clipped gradients.
Measured, as worst |diff| / (atol + rtol * |want|) after 3 steps: 2.0e-5 for pp2 x fsdp2 and
pp2 x dp2 (the same figure for every schedule, ZeRO stage and offload), 1.9e-5 accumulating
under no_sync, 2.8e-5 hybrid, 2.8e-4 with tp2; the norms below 1.1e-6. The loss a pipeline
returns (float64) is compared at rtol=1e-6, as when it was reported in float32 (then measured
1.1e-7 apart at most, accumulating; 5.5e-8 otherwise). bf16 mixed precision is compared with the
fp32 oracle at bf16's resolution (losses only).
"""

from __future__ import annotations

import pytest
import torch
from oracle import assert_params_close, compare_with_oracle, local_of, loss64

from plait.testing import cached_mesh

CFG = dict(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)
TOL64 = dict(rtol=1e-9, atol=1e-12)
LOSS32 = dict(rtol=1e-6, atol=0)  # the pipeline's loss
MAX_NORM = 0.5  # below the oracle's gradient norm (asserted): clipping scales what is compared
BATCH = 16  # global batch: 4 microbatches per pipeline replica on 2 replicas


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, CFG["vocab_size"], (BATCH, CFG["seq_len"] + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _parity(mesh_kw: dict, plan_kw: dict, steps: int = 3, accumulate: bool = False,
            tie: bool = False) -> dict:
    """Train the float64 pipeline next to the oracle; ``accumulate``: two half-batch steps per
    optimizer step, the first inside ``no_sync``; ``tie``: the embedding and LM head share a weight."""
    import plait
    from plait import comm
    from plait.models.gpt import GPT, GPTConfig
    from plait.state.materialize import init_weights

    mesh = cached_mesh(**mesh_kw)
    dtype = torch.float64
    cfg = GPTConfig(**CFG, tie_embeddings=tie)
    oracle = init_weights(GPT(cfg).to(dtype), seed=3)
    with torch.device("meta"):  # no rank ever materializes the full model
        model = GPT(cfg).to(dtype)
    tp = plait.gpt_plan(cfg) if mesh.size("tp") > 1 else None
    plan = plait.ParallelPlan(tp=tp, seed=3, pp_microbatches=4 // (1 + accumulate),
                              loss_fn=None if tp else loss64, **plan_kw)
    pipe = plait.parallelize(model, mesh, plan)
    specs = pipe.tp_info.specs if tp else {}

    def check(what: str, get) -> None:
        compare_with_oracle(pipe, oracle, what, get, TOL64, specs)

    check("initial value of", lambda p: p.detach())
    opt = torch.optim.AdamW(pipe.parameters())
    oopt = torch.optim.AdamW(oracle.parameters())
    r, n = mesh.rank(("dp", "fsdp")), mesh.size(("dp", "fsdp"))
    losses, reductions = [], []
    for step in range(steps):
        x, y = _batch(step)
        xs, ys = x.chunk(n)[r], y.chunk(n)[r]  # this pipeline replica's slice
        with comm.counting() as counts:
            if accumulate:
                with pipe.no_sync():
                    first = pipe.step(xs.chunk(2)[0], ys.chunk(2)[0])
                loss = (first + pipe.step(xs.chunk(2)[1], ys.chunk(2)[1])) / 2
                for p in pipe.parameters():
                    p.grad.div_(2)  # two mean-loss backwards
            else:
                loss = pipe.step(xs, ys)
        reductions.append({k: v["calls"] for k, v in counts.as_dict().items()
                           if k.split("@")[0] in ("reduce_scatter", "all_reduce")})
        loss64(oracle(x), y).backward()
        with torch.no_grad():
            torch.testing.assert_close(loss.to(dtype), loss64(oracle(xs), ys), **LOSS32)
        norm = plait.clip_grad_norm_(pipe, MAX_NORM)
        ref_norm = torch.nn.utils.clip_grad_norm_(oracle.parameters(), MAX_NORM)
        assert float(ref_norm) > MAX_NORM
        torch.testing.assert_close(norm, ref_norm, **TOL64)
        if step == 0:
            check("clipped gradient of", lambda p: p.grad)
        opt.step()
        oopt.step()
        opt.zero_grad()
        oopt.zero_grad()
        losses.append(float(loss))
    # The collectives first, so a failed check below cannot leave the other ranks waiting.
    full = plait.full_state_dict(pipe)  # every stage, gathered over fsdp, tp and pp
    with torch.no_grad():
        torch.testing.assert_close(pipe.eval_step(xs, ys).to(dtype), loss64(oracle(xs), ys),
                                   **LOSS32)
    check(f"after {steps} AdamW steps,", lambda p: p.detach())
    assert_params_close(full, oracle.state_dict(), **TOL64, what="full state")
    return {"losses": losses, "reductions": reductions, "coords": mesh.coords,
            "local": sum(local_of(p).numel() for p in pipe.parameters()), "full": oracle.num_parameters()}


FSDP_CASES = {
    "zero2-1f1b": dict(zero_stage=2),
    "zero3-1f1b": dict(zero_stage=3),
    "zero2-zb-h1": dict(zero_stage=2, pp_schedule="zb-h1"),  # reduce-scatters in the last W
    "zero3-interleaved": dict(zero_stage=3, pp_schedule="interleaved", pp_chunks=2),
    "zero3-offload-no-reshard": dict(zero_stage=3, offload=True, reshard_after_forward=False),
}


@pytest.mark.parametrize("name", list(FSDP_CASES))
def test_pp2_fsdp2_matches_single_process(pools, name):
    out = pools[4].run(_parity, dict(pp=2, fsdp=2), dict(data="fsdp", **FSDP_CASES[name]))
    assert all(o["local"] < o["full"] / 2 for o in out)  # a stage's shard: about a quarter
    for o in out:  # one reduce-scatter per flat group and step, not one per microbatch
        per_step = [c.get("reduce_scatter@fsdp", 0) for c in o["reductions"]]
        chunks = FSDP_CASES[name].get("pp_chunks", 1)
        assert per_step[0] == per_step[-1] and 0 < per_step[0] <= 2 * 3 * chunks, per_step


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zbv", "dualpipev"])
def test_pp2_dp2_ddp_matches_single_process(pools, schedule):
    out = pools[4].run(_parity, dict(pp=2, dp=2), dict(data="ddp", pp_schedule=schedule))
    stages = 2 if schedule in ("zbv", "dualpipev") else 1  # per rank
    for o in out:  # one bucket all-reduce per stage and step (25 MB buckets hold a tiny stage)
        assert all(c.get("all_reduce@dp") == stages for c in o["reductions"]), o["reductions"]


def test_pp2_dp2_ddp_accumulates_steps_under_no_sync(pools):
    out = pools[4].run(_parity, dict(pp=2, dp=2), dict(data="ddp"), 2, True)
    assert all(c.get("all_reduce@dp") == 1 for o in out for c in o["reductions"])  # the second step only


def test_pp2_dp2_ddp_accumulates_a_weight_tied_across_stages(pools):
    # The tied copies' sum over pp runs after every step, the replicas' mean in the second only:
    # the first step's sum must be carried into the second once, by one copy.
    out = pools[4].run(_parity, dict(pp=2, dp=2), dict(data="ddp"), 2, True, True)
    for c in (c for o in out for c in o["reductions"]):  # the copies' sum in each step, the mean once
        assert c.get("all_reduce@pp_tied") == 2 and c.get("all_reduce@dp") == 1, c


@pytest.mark.parametrize("plan_kw", [
    dict(zero_stage=3),
    dict(zero_stage=2, sequence_parallel=True, pp_schedule="zb-h1"),  # tp sums norm grads inside W
], ids=["zero3", "zero2-sp-zb-h1"])
def test_pp2_fsdp2_tp2_matches_single_process(pools, plan_kw):
    # torchtitan's 3-D layout: stages split first, each tensor-parallel, then FSDP over fsdp.
    pools[8].run(_parity, dict(pp=2, fsdp=2, tp=2), dict(data="fsdp", **plan_kw))


def test_pp4_tp2_v_schedule_matches_single_process(pools):
    # Here for the module's 8-rank pool: a V schedule at pp=4 with tensor and sequence parallelism
    # (DualPipeV shares ZB-V's stage placement: at pp=4 in test_pipeline_parity, with tp in
    # test_pipeline_tp).
    from test_pipeline_tp import _pp_tp_parity

    out = pools[8].run(_pp_tp_parity, "zbv", 2, True, "auto", False, 4)
    assert all(o["losses"] == out[0]["losses"] for o in out)


def test_pp2_hsdp_dp2_fsdp2_matches_single_process(pools):
    # Hybrid sharding per stage: reduce-scatter over fsdp, then all-reduce over dp, once per step.
    out = pools[8].run(_parity, dict(pp=2, dp=2, fsdp=2), dict(data="fsdp", zero_stage=3))
    for o in out:
        assert all(c.get("all_reduce@dp") == c.get("reduce_scatter@fsdp") > 0 for c in o["reductions"])


def _mixed(mp: str) -> list[float]:
    import plait
    from plait.models.gpt import GPT, GPTConfig, lm_loss
    from plait.state.materialize import init_weights

    mesh = cached_mesh(pp=2, fsdp=2)
    cfg = GPTConfig(**CFG)
    oracle = init_weights(GPT(cfg), seed=3)
    with torch.device("meta"):
        model = GPT(cfg)
    pipe = plait.parallelize(model, mesh, plait.ParallelPlan(data="fsdp", zero_stage=3, mixed_precision=mp,
                                                             seed=3, loss_fn=lm_loss))
    assert all(p.dtype == torch.float32 for p in pipe.parameters())  # fp32 master shards
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    oopt = torch.optim.AdamW(oracle.parameters(), lr=1e-3)
    r = mesh.rank("fsdp")
    gaps = []
    for step in range(3):
        x, y = _batch(step)
        loss = pipe.step(x.chunk(2)[r], y.chunk(2)[r])
        ref = lm_loss(oracle(x.chunk(2)[r]), y.chunk(2)[r])
        lm_loss(oracle(x), y).backward()
        # bf16 keeps 8 bits of mantissa: a relative 2**-8 per rounding, a few roundings deep.
        torch.testing.assert_close(loss, ref.detach().double(), rtol=2e-2, atol=0)
        gaps.append(abs(float(loss) - float(ref)))
        opt.step()
        oopt.step()
        opt.zero_grad()
        oopt.zero_grad()
    return gaps


def test_pp2_fsdp2_bf16_tracks_single_process(pools):
    gaps = pools[4].run(_mixed, "bf16")
    assert max(max(g) for g in gaps) > 1e-5  # the stages did compute in bf16


def test_pipeline_fsdp_checkpoint_resumes_in_one_process(pools, oracle, tmp_path):
    # plait train's pp2 x ZeRO-3 run saves at step 3 (each FSDP stage writes its DTensor shards
    # under the original names); one process resumes it and continues the same loss curve.
    import shutil

    from oracle import train_losses

    losses = pools[4].run(train_losses, str(tmp_path), save_dir=str(tmp_path / "all"), save_every=3,
                          strategy="fsdp", nproc=4, pp=2, zero_stage=3)[0]
    assert losses == pytest.approx(oracle, rel=1e-4)
    shutil.copytree(tmp_path / "all" / "step_000003", tmp_path / "only3" / "step_000003")
    resumed = train_losses(str(tmp_path), save_dir=str(tmp_path / "only3"), resume=True, strategy="none",
                           nproc=1)
    assert resumed == pytest.approx(oracle[3:], rel=1e-4)


REFUSED = {  # case: (mesh, plan, what the error says)
    "zero3 zb-h1": (dict(pp=2, fsdp=2), dict(data="fsdp", pp_schedule="zb-h1"),
                    "splits backward into B and W; ZeRO-3 frees"),
    "tied": (dict(pp=2, fsdp=2), dict(data="fsdp"), "cannot be FSDP-sharded per stage"),
    "zero3 zbv": (dict(pp=2, fsdp=2), dict(data="fsdp", pp_schedule="zbv"), "splits backward into B and W"),
    "tied V": (dict(pp=2, dp=2), dict(data="ddp", pp_schedule="dualpipev"),
               "stages 0 and 3 of pp rank 0 share a parameter (e.g. a tied embedding and LM head, which a V"),
    "pp options without pp": (dict(fsdp=4), dict(data="fsdp", pp_microbatches=8),
                              "is a pipeline option, read only when the mesh has pp > 1"),
    "unused": (dict(pp=2, dp=2), dict(data="ddp", ddp_options={"find_unused_parameters": True}),
               "find_unused_parameters"),
}


def _refused(case: str) -> None:
    import plait
    from plait.models.gpt import GPT, GPTConfig, lm_loss

    mesh_kw, plan_kw, _ = REFUSED[case]
    with torch.device("meta"):
        model = GPT(GPTConfig(**CFG, tie_embeddings=case.startswith("tied")))
    loss = lm_loss if "pp" in mesh_kw else None
    plait.parallelize(model, cached_mesh(**mesh_kw), plait.ParallelPlan(loss_fn=loss, **plan_kw))


def test_impossible_layouts_fail_before_any_collective(pools):
    for case, (_, _, text) in REFUSED.items():
        errors = pools[4].errors(_refused, case)
        assert len(errors) == 4 and all(text in e for e in errors.values()), (case, errors)


@pytest.mark.parametrize("field,value,text", [
    ("pp_microbatches", 0, "pp_microbatches"), ("pp_chunks", 1.5, "pp_chunks"), ("p2p", "x", "p2p"),
    ("pp_schedule", "zb", "pp_schedule"), ("pp_split", "layers.1", "pp_split"), ("loss_fn", 3, "loss_fn"),
])
def test_plan_names_the_bad_pipeline_field(field, value, text):
    import plait

    with pytest.raises((ValueError, TypeError), match=text):
        plait.ParallelPlan(**{field: value})
