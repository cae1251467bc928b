"""Mixed precision outside FSDP (`plait.mixed_precision`) in every layout, and fp16 loss scaling.

The oracle is one process running the same master-weight scheme on the global batch: plait's tiny
GPT given `plait.mixed_precision(model, "bf16")` (fp32 masters, bf16 compute, fp32 gradients), three
AdamW steps. Each layout (DDP over 2 ranks, tp2 with sequence parallelism, pp2, pp2 x dp2) must
reproduce its losses, its step-0 logits and gradients, every step's global gradient norm and the
parameters after the steps, and must really have computed in bf16 (the logits and the tensors the
pipeline sends are bf16; the fp32 oracle is farther from the bf16 one than the gradient-norm
tolerance, so a layout that silently ran in fp32 would fail that check too).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from oracle import TINY, assert_params_close, assert_updates_close

from plait.testing import cached_mesh

STEPS, BATCH, LR = 3, 8, 1e-3
SEED = 5
# Tolerances against the bf16 oracle. bf16 keeps 8 significant bits (u = 2**-8 = 3.9e-3 relative);
# a layout rounds its partial results at other places than one process does (tensor parallelism:
# each rank's partial matmul is rounded to bf16 before the all-reduce; data parallelism and
# pipeline microbatches: each slice's weight gradient is rounded before the fp32 sum), so results
# differ by a few u, growing over the steps. Measured worst cases (tp2-sp is the noisiest; ddp2,
# pp2 and pp2-dp2 are 2-4x closer; ddp2's step-0 logits are bitwise the oracle's):
LOSS_ATOL = 2e-3  # losses ~4.2; measured 8.1e-4
LOGITS_ATOL = 3e-2  # |logits| <= 2.2; measured 1.75e-2 (tp2-sp), 0 (ddp2)
GRAD_RTOL = 2**-5  # of each gradient's largest entry; measured 1.8e-2 (tp2-sp), 5.5e-3 otherwise
NORM_RTOL = 2 * 2**-8  # global gradient norm per step; measured 4.8e-3. The fp32 oracle's is 1.1e-2 off
# AdamW moves every element by about LR whatever its gradient's size, so an element whose gradient
# is near zero flips direction under rounding: compare the whole update instead, as
# |(p - p0) - (p_oracle - p0)| / |p_oracle - p0| per tensor (L2). Measured 7.4e-2 (tp2-sp), <= 3.4e-2
# otherwise; a missing or doubled contribution, a wrong shard or a skipped step makes it O(1).
UPDATE_RTOL = 0.15
LAYOUTS = {  # name -> mesh degrees (the world size is their product)
    "ddp2": dict(dp=2),
    "tp2-sp": dict(tp=2),
    "pp2": dict(pp=2),
    "pp2-dp2": dict(pp=2, dp=2),
}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(STEPS):
        w = torch.randint(0, TINY["vocab_size"], (BATCH, TINY["seq_len"] + 1), generator=g)
        out.append((w[:, :-1], w[:, 1:]))
    return out


def _opt(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def _oracle(mp: str | None) -> dict:
    """One process, the global batch; ``mp``: plait.mixed_precision's policy (None: fp32)."""
    import plait
    from plait.models.gpt import GPT, GPTConfig, lm_loss

    model = plait.init_weights(GPT(GPTConfig(**TINY)), SEED)
    if mp is not None:
        plait.mixed_precision(model, mp)
    opt = _opt(model.parameters())
    out: dict = {"losses": [], "norms": []}
    for step, (x, y) in enumerate(_batches()):
        logits = model(x)
        loss = lm_loss(logits, y)
        loss.backward()
        if step == 0:
            out["logits"] = logits.detach().float()
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)))
        out["losses"].append(loss.item())
        opt.step()
        opt.zero_grad()
    out["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def _local_named(net) -> dict[str, torch.Tensor]:
    """This rank's parameters under the original model's names, whatever the wrapper."""
    inner = getattr(net, "module", net)  # DDP keeps the model as .module
    return dict(inner.named_parameters())


def _run_layout(degrees: dict, mp: str | None) -> dict:
    from torch.distributed.tensor import DTensor

    import plait
    from plait import comm
    from plait.models.gpt import GPT, GPTConfig, lm_loss
    from plait.pipeline import Pipeline
    from plait.state.placement import tp_info

    mesh = cached_mesh(**degrees)
    cfg = GPTConfig(**TINY)
    with torch.device("meta"):
        model = GPT(cfg)
    tp, pp = mesh.size("tp") > 1, mesh.size("pp") > 1
    plan = plait.ParallelPlan(tp=plait.gpt_plan(cfg, loss_parallel=False) if tp else None,
                              sequence_parallel=tp, mixed_precision=mp, seed=SEED,
                              **(dict(pp_microbatches=2, loss_fn=lm_loss) if pp else {}))
    net = plait.parallelize(model, mesh, plan)
    info = None if pp else tp_info(net)  # the tp shards' layout, to slice the oracle's gradients
    opt = _opt(net.parameters())
    dp, r = mesh.size("dp"), mesh.rank("dp")
    out: dict = {"losses": [], "norms": [], "specs": dict(info.specs) if info is not None else {}}
    for step, (x, y) in enumerate(_batches()):
        xs, ys = x.chunk(dp)[r], y.chunk(dp)[r]
        if isinstance(net, Pipeline):
            loss = net.step(xs, ys).float()
        else:
            logits = net(xs)
            loss = lm_loss(logits, ys)
            loss.backward()
            if step == 0:
                out["logits"] = logits.detach().float()
                out["logits_dtype"] = logits.dtype
        total = loss.detach().clone().double()
        comm.all_reduce(total, mesh.group("dp"))
        out["losses"].append(total.item() / dp)
        if step == 0:
            grads = {n: p.grad for n, p in _local_named(net).items() if p.grad is not None}
            out["whole"] = {n for n, g in grads.items() if isinstance(g, DTensor)}  # tp DTensors: in full
            out["grads"] = {n: g.full_tensor() if n in out["whole"] else g.clone() for n, g in grads.items()}
            out["grad_dtypes"] = {str(p.grad.dtype) for p in net.parameters() if p.grad is not None}
        out["norms"].append(float(plait.clip_grad_norm_(net, math.inf)))
        opt.step()
        opt.zero_grad()
    if isinstance(net, Pipeline):  # what crossed the stages: activations' and gradients' dtypes
        out["p2p_dtypes"] = {str(dt) for metas in net.exec.in_meta.values() for meta in metas.values()
                             for _, dt, _ in meta}
        last = net.eval_step(_batches()[0][0].chunk(dp)[r])  # the last stage's output, on its rank
        out["out_dtype"] = last.dtype if last is not None else None
    else:
        out["out_dtype"] = out.pop("logits_dtype")
    out["param_dtypes"] = {str(p.dtype) for p in net.parameters()}
    out["params"] = plait.full_state_dict(net)
    return out


def _init_state() -> dict:
    import plait
    from plait.models.gpt import GPT, GPTConfig

    return plait.init_weights(GPT(GPTConfig(**TINY)), SEED).state_dict()


def _norm_gap(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / b for a, b in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def oracles() -> dict:
    return {"bf16": _oracle("bf16"), "fp32": _oracle(None), "init": _init_state()}


def test_tolerances_tell_bf16_from_fp32(oracles):
    """A layout that silently ran in fp32 would be the fp32 oracle's distance away: past NORM_RTOL."""
    assert _norm_gap(oracles["fp32"]["norms"], oracles["bf16"]["norms"]) > 1.3 * NORM_RTOL


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bf16_layout_matches_single_process(pools, oracles, name):
    degrees = LAYOUTS[name]
    outs = pools[math.prod(degrees.values())].run(_run_layout, degrees, "bf16")
    want = oracles["bf16"]
    dp = degrees.get("dp", 1)
    for rank, o in enumerate(outs):
        # Computed in bf16, with fp32 master weights and gradients.
        assert o["param_dtypes"] == {"torch.float32"} and o["grad_dtypes"] == {"torch.float32"}
        assert o["out_dtype"] in (torch.bfloat16, None), o["out_dtype"]  # None: holds no last stage
        if "p2p_dtypes" in o:  # activations and their gradients crossed the stages in bf16
            assert o["p2p_dtypes"] == {"torch.bfloat16"}, o["p2p_dtypes"]
        torch.testing.assert_close(torch.tensor(o["losses"]), torch.tensor(want["losses"]), rtol=0,
                                   atol=LOSS_ATOL)
        assert _norm_gap(o["norms"], want["norms"]) < NORM_RTOL, (o["norms"], want["norms"])
        if "logits" in o:
            mine = want["logits"].chunk(dp)[(rank // degrees.get("tp", 1)) % dp]
            torch.testing.assert_close(o["logits"], mine, rtol=0, atol=LOGITS_ATOL)
        split = {n: spec for n, spec in o["specs"].items() if n not in o["whole"]}  # DTensors came in full
        assert_params_close(o["grads"], want["grads"], rtol=0, atol=0, atol_of_max=GRAD_RTOL, specs=split,
                            held=True, what="step-0 gradient of")
        assert_updates_close(o["params"], want["params"], oracles["init"], UPDATE_RTOL)
    assert sum(o["out_dtype"] == torch.bfloat16 for o in outs) >= 1  # the model's (last stage's) output
    held = set().union(*(o["grads"] for o in outs))
    assert held == set(want["grads"])  # every parameter's gradient was compared on some rank


# ------------------------------------------------------------------ fp16 and the loss scaler
OVERFLOW_STEP = 1  # the step at which one rank alone finds an inf in its gradients


def _fp16_overflow(degrees: dict) -> dict:
    """fp16 training with `plait.GradScaler`; at OVERFLOW_STEP the last rank alone puts an inf into
    one of its gradients (after the data-parallel reduction, so no other rank sees it)."""
    import torch.distributed as dist

    import plait
    from plait.models.gpt import GPT, GPTConfig, lm_loss
    from plait.pipeline import Pipeline

    mesh = cached_mesh(**degrees)
    with torch.device("meta"):
        model = GPT(GPTConfig(**TINY))
    pp = mesh.size("pp") > 1
    plan = plait.ParallelPlan(mixed_precision="fp16", seed=SEED,
                              **(dict(pp_microbatches=2, loss_fn=lm_loss) if pp else {}))
    net = plait.parallelize(model, mesh, plan)
    opt = _opt(net.parameters())
    # growth_interval=1: every clean step doubles the scale, so the trace shows growth and backoff.
    scaler = plait.GradScaler(mesh, init_scale=2.0**8, growth_interval=1)
    dp, r = mesh.size("dp"), mesh.rank("dp")
    rows = []
    for step, (x, y) in enumerate(_batches()):
        xs, ys = x.chunk(dp)[r], y.chunk(dp)[r]
        before = [p.detach().clone() for p in net.parameters()]
        if isinstance(net, Pipeline):
            net.step(xs, ys, loss_scale=scaler.get_scale())
        else:
            out = net(xs)
            assert out.dtype == torch.float16
            scaler.scale(lm_loss(out, ys)).backward()
        grads = [p.grad for p in net.parameters() if p.grad is not None]
        if step == OVERFLOW_STEP and dist.get_rank() == dist.get_world_size() - 1:
            grads[0].view(-1)[0] = float("inf")
        finite_here = all(bool(torch.isfinite(g).all()) for g in grads)
        scaler.unscale_(opt)
        norm = plait.clip_grad_norm_(net, 1.0)  # after unscaling: the true norm (inf when it overflowed)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        moved = any(not torch.equal(a, p) for a, p in zip(before, net.parameters(), strict=True))
        rows.append(dict(scale=scaler.get_scale(), skipped=scaler.skipped, moved=moved,
                         finite_here=finite_here, norm_finite=bool(torch.isfinite(norm))))
    return {"rows": rows, "local": [p.detach().clone() for p in net.parameters()],
            "state": scaler.state_dict()}


@pytest.mark.parametrize("name", ["ddp2", "pp2"])
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(pools, name):
    outs = pools[2].run(_fp16_overflow, LAYOUTS[name])
    assert outs[0]["rows"][OVERFLOW_STEP]["finite_here"]  # rank 0's own gradients were fine...
    assert not outs[-1]["rows"][OVERFLOW_STEP]["finite_here"]
    assert not outs[-1]["rows"][OVERFLOW_STEP]["norm_finite"]  # clipping after unscale_ saw it too
    for o in outs:
        for step, row in enumerate(o["rows"]):
            bad = step == OVERFLOW_STEP
            assert row["skipped"] is bad and row["moved"] is not bad, (step, row)
        # ...yet it skipped too: 2**8 grew to 2**9, backed off to 2**8, grew to 2**9.
        assert [row["scale"] for row in o["rows"]] == [2.0**9, 2.0**8, 2.0**9]
        assert o["state"]["skipped_steps"] == 1 and o["state"] == outs[0]["state"]
    if name == "ddp2":  # the replicas stayed identical
        for a, b in zip(outs[0]["local"], outs[1]["local"], strict=True):
            assert torch.equal(a, b)


def test_grad_scaler_alone():
    import plait

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = plait.GradScaler(init_scale=4.0, growth_interval=2, backoff_factor=0.25)
    scaler.scale((p * 2).sum()).backward()
    torch.testing.assert_close(p.grad, torch.full((3,), 8.0))  # scaled by 4
    scaler.step(opt)  # unscales first
    scaler.update()
    torch.testing.assert_close(p.detach(), torch.full((3,), -1.0))  # the unscaled gradient, 2
    assert scaler.get_scale() == 4.0 and not scaler.skipped
    p.grad = torch.tensor([1.0, float("nan"), 0.0])
    scaler.step(opt)
    scaler.update()
    assert scaler.skipped and scaler.get_scale() == 1.0
    torch.testing.assert_close(p.detach(), torch.full((3,), -1.0))  # unchanged
    state = scaler.state_dict()
    assert state == {"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.25, "growth_interval": 2,
                     "_growth_tracker": 0, "skipped_steps": 1}
    again = plait.GradScaler()
    again.load_state_dict(json.loads(json.dumps(state)))  # JSON-ready, as checkpoints store it
    assert again.state_dict() == state
    with pytest.raises(RuntimeError, match="no inf check since the last update"):
        again.update()
    off = plait.GradScaler(enabled=False)
    assert off.scale(torch.tensor(3.0)) == 3.0 and off.state_dict() == {} and off.get_scale() == 1.0


def test_refusals():
    import plait
    from plait.models.gpt import GPT, GPTConfig

    model = plait.init_weights(GPT(GPTConfig(**TINY)), SEED)
    with pytest.raises(ValueError, match="'int8'"):
        plait.mixed_precision(model, "int8")
    with pytest.raises(ValueError, match="gradient_compression.*disagrees"):
        plait.ParallelPlan(mixed_precision="bf16", ddp_options={"gradient_compression": "fp16"})
    plait.ParallelPlan(mixed_precision=plait.MixedPrecision(torch.bfloat16, None),
                       ddp_options={"gradient_compression": "bf16"})  # reduce in bf16: agrees
    with pytest.raises(ValueError, match="recurrent layers"):
        plait.mixed_precision(torch.nn.Sequential(torch.nn.LSTM(4, 4)), "bf16")
    plait.mixed_precision(model, "bf16")
    with pytest.raises(ValueError, match="already computes in mixed precision"):
        plait.mixed_precision(model, "bf16")
    with pytest.raises(ValueError, match="DataParallel"):
        plait.DataParallel(model, ["cpu", "cpu"])


def _train_fp16(tmp: str, **extra) -> dict:
    from oracle import TRAIN_BASE

    from plait.app.train import TrainConfig, train

    flags = {**TRAIN_BASE, "steps": 3, "batch_size": 4, "seq_len": 16, "max_bytes": 20_000}
    cfg = TrainConfig.from_flags(**{**flags, "run_dir": tmp, "save_dir": f"{tmp}/ckpt",
                                    "strategy": "ddp", "nproc": 2, "pp": 2, "mixed_precision": "fp16",
                                    **extra})
    return train(cfg)


def _on_fresh_ranks(*args, **kwargs) -> list:
    """`_train_fp16` on two ranks of their own, killed once they answered.

    On torch 2.6 a shared pool's rank was left, in 2 of about 20 runs of this module, inside the
    pool's own barrier after this task (a whole `plait train` run with a checkpoint, inside a rank
    that lives on), so the pool's next task never started; `plait train` itself, launched as users
    launch it, ended cleanly in 10 of 10 runs of the same flags on 2.6, and the pinned torch never
    showed it. Ranks used for one run and killed cannot carry it into another task."""
    from plait.testing import RankPool

    pool = RankPool(2, desync_check="off")
    try:
        return pool.run(_train_fp16, *args, **kwargs)
    finally:
        pool.kill()


def test_train_fp16_saves_and_restores_the_loss_scale(tmp_path):
    """plait train --mixed-precision fp16 (a pipeline: the scale goes into Pipeline.step): the scale is in
    the checkpoint's metadata, and --resume continues from the saved one."""
    tmp = str(tmp_path)
    first = _on_fresh_ranks(tmp, steps=2)[0]
    meta_path = Path(tmp) / "ckpt" / "step_000002" / "plait.json"
    meta = json.loads(meta_path.read_text())
    assert meta["grad_scaler"]["scale"] == first["loss_scale"]
    assert meta["grad_scaler"]["growth_interval"] == 2000
    meta["grad_scaler"].update(scale=512.0, _growth_tracker=1999)  # the next clean step doubles it
    meta_path.write_text(json.dumps(meta))
    resumed = _on_fresh_ranks(tmp, resume=True)
    metrics = Path(resumed[0]["run_dir"]) / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    last = [r for r in rows if r.get("step") == 3][-1]
    assert last["loss_scale"] == (256.0 if last["skipped"] else 1024.0), last  # from 512, not 2**16
    assert resumed[0]["loss_scale"] == resumed[1]["loss_scale"] == last["loss_scale"]


def test_policy_output_dtype_and_input_casts():
    """MixedPrecision's output_dtype casts the root's floating outputs; cast_forward_inputs=False
    leaves its inputs as they come (torch's MixedPrecisionPolicy fields)."""
    import plait
    from plait.state.precision import MixedPrecision

    class Seen(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.seen: list[torch.dtype] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.append(x.dtype)
            return self.lin(x.to(torch.bfloat16))

    m = plait.mixed_precision(Seen(), MixedPrecision(torch.bfloat16, output_dtype=torch.float32,
                                                     cast_forward_inputs=False))
    out = m(torch.randn(2, 4))
    assert m.seen == [torch.float32] and out.dtype == torch.float32
    out.sum().backward()
    assert m.lin.weight.grad.dtype == torch.float32
    with pytest.raises(ValueError, match="output_dtype"):
        MixedPrecision(torch.bfloat16, output_dtype=torch.int32)
