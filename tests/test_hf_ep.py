"""Expert parallelism on transformers' MoE models, whose experts are stacked in 3-D tensors.

Mixtral and Qwen2-MoE (tiny configs, float64, `tests/test_hf_tp.py` builds them) at ep=2 over 2
ranks, each rank holding half of every layer's experts (rows of ``gate_up_proj`` and
``down_proj``), under DDP and under FSDP, against one process on the same global batch: the
logits of the first step, and every parameter after 5 AdamW steps, gathered by
`plait.full_state_dict` under the model's names and full shapes. The routers compute in float32
(see test_hf_tp's note on float32 routers).
"""

from __future__ import annotations

import pytest
import torch
from oracle import loss64, train_against_one_process

from plait.testing import cached_mesh

transformers = pytest.importorskip("transformers")

BATCH, STEPS = 4, 5


def _train(family: str, data: str) -> dict:
    """5 AdamW steps at ep=2 under ``data`` (``-tp``: and tp=2) next to one process, compared on
    every rank by `oracle.train_against_one_process`; each rank's share of the experts."""
    from test_hf_tp import TOL, TOL_FLOAT32_NORMS, _token_batch, build_family

    import plait

    tp = 2 if data.endswith("-tp") else 1
    data = data.removesuffix("-tp")
    axis = "dp" if data == "ddp" else "fsdp"
    mesh = cached_mesh(**{axis: 2}, ep=2, tp=tp)

    def plan(model: torch.nn.Module) -> plait.ParallelPlan:
        return plait.ParallelPlan(data=data, tp=plait.plan_for(model) if tp > 1 else None)

    trained = train_against_one_process(lambda: build_family(family, use_cache=False), _token_batch, mesh,
                                        plan, TOL_FLOAT32_NORMS, TOL, steps=STEPS, every_rank=True,
                                        label=f"{family} {data}")
    held = {n.removeprefix("module."): tuple(p.shape) for n, p in trained.net.named_parameters()
            if n.endswith("experts.gate_up_proj")}
    return {"held": held, "rank": mesh.rank(axis)}


def _runs(cases: list[tuple[str, str]]) -> list[dict]:
    return [_train(family, data) for family, data in cases]


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_stacked_experts_split_over_ep_train_like_one_process(pools, family):
    for runs in pools[2].run(_runs, [(family, "ddp"), (family, "fsdp")]):
        for run in runs:  # each rank holds 2 of the 4 experts of every layer
            assert run["held"] and all(shape[0] == 2 for shape in run["held"].values()), run


def _saved_and_loaded(folder: str, data: str) -> dict:
    """Mixtral at ep=2 (``-tp``: and tp=2) after one AdamW step: `plait.checkpoint` saved and
    loaded into a fresh model of the same layout (which then steps as the original does) and into
    one without ep (whole experts); torch's DCP saving ``model.state_dict()`` (each rank's rows, as
    a DTensor over ep) and loading into a plain model."""
    import torch.distributed.checkpoint as dcp
    from test_hf_tp import _batch, build_family

    import plait

    tp = 2 if data.endswith("-tp") else 1
    data = data.removesuffix("-tp")
    axis = "dp" if data == "ddp" else "fsdp"
    mesh = cached_mesh(**{axis: 2}, ep=2, tp=tp)
    rank = mesh.rank(axis)
    mine = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)

    def built(seed: int, where) -> tuple:
        torch.manual_seed(seed)
        model = build_family("mixtral", use_cache=False)
        plan = plait.ParallelPlan(data=data, tp=plait.plan_for(model) if tp > 1 else None)
        net = plait.parallelize(model, where, plan)
        return net, torch.optim.AdamW(net.parameters())

    def step(net, opt, n: int) -> None:
        ids, tgt = _batch(n)
        loss64(net(input_ids=ids[mine]).logits, tgt[mine]).backward()
        opt.step()
        opt.zero_grad()

    net, opt = built(0, mesh)
    step(net, opt, 0)
    saved = plait.full_state_dict(net)
    plait.checkpoint.save(f"{folder}/plait", net, opt, {"step": 1})
    again, opt2 = built(1, mesh)  # other values everywhere until loaded
    plait.checkpoint.load(f"{folder}/plait", again, opt2)
    same_model = all(torch.equal(v, saved[k]) for k, v in plait.full_state_dict(again).items())
    step(net, opt, 1)
    step(again, opt2, 1)  # the optimizer state came back too: the next step agrees
    after = plait.full_state_dict(net)
    same_step = all(torch.equal(v, after[k]) for k, v in plait.full_state_dict(again).items())
    whole, opt3 = built(2, cached_mesh(**{axis: 2}, tp=tp))  # every expert on every rank
    plait.checkpoint.load(f"{folder}/plait", whole, opt3)
    other_layout = all(torch.equal(v, saved[k]) for k, v in plait.full_state_dict(whole).items())
    # FSDP's state_dict() refuses experts, by name (test_fsdp_dtensor); a tp model's holds its
    # tp shards (torch's DCP is exact on it under FSDP only: the README says so).
    if data == "ddp" and tp == 1:
        dcp.save(net.state_dict(), checkpoint_id=f"{folder}/dcp")
        plain = build_family("mixtral", use_cache=False)
        state = {f"module.{k}": v for k, v in plain.state_dict().items()}
        dcp.load(state, checkpoint_id=f"{folder}/dcp")
        dcp_ok = all(torch.equal(state[f"module.{k}"], v) for k, v in after.items())
    else:
        dcp_ok = True
    return {"model": same_model, "step": same_step, "other layout": other_layout, "dcp": dcp_ok}


@pytest.mark.parametrize("data", ["ddp", "fsdp", "ddp-tp"])
def test_stacked_experts_checkpoint_and_dcp_keep_every_rank_rows(pools, tmp_path, data):
    world = 4 if data.endswith("-tp") else 2
    for out in pools[world].run(_saved_and_loaded, str(tmp_path), data):
        assert all(out.values()), out


def test_stacked_experts_split_over_ep_and_tp_train_like_one_process(pools):
    # dp2 x ep2 x tp2: each rank holds 2 of the 4 experts, each split by hidden units over tp
    # (gate_up_proj: 2 of 4 experts, 64 of 128 rows).
    for runs in pools[4].run(_runs, [("mixtral", "ddp-tp")]):
        for run in runs:
            assert run["held"] and all(shape[:2] == (2, 64) for shape in run["held"].values()), run


def _stacked_dispatch_checked(bug: bool) -> dict:
    """Mixtral at dp=2 x ep=2, one forward; ``bug``: the dispatch returns its rows reversed."""
    from unittest import mock

    from test_hf_tp import _batch, build_family

    import plait
    from plait.ep.stacked import StackedDispatch, stacked_expert_modules

    mesh = cached_mesh(dp=2, ep=2)
    torch.manual_seed(0)
    model = build_family("mixtral", use_cache=False)
    names = [n for n, _ in stacked_expert_modules(model)]
    net = plait.parallelize(model, mesh, plait.ParallelPlan())
    ids = _batch(0)[0].chunk(2)[mesh.rank("dp")]
    compute = StackedDispatch._compute
    reversed_rows = (lambda self, *args: compute(self, *args).flip(0)) if bug else compute
    with mock.patch.object(StackedDispatch, "_compute", reversed_rows):
        net(input_ids=ids)
    return {"names": names, "errors": [m.forward.check_error for _, m in stacked_expert_modules(net)]}


def test_stacked_expert_dispatch_is_verified_by_its_numbers_at_the_first_forward(pools):
    # Rows that come back out of order keep every shape; the first forward refuses them on every
    # ep rank, naming the stacked module and the expert (a correct dispatch passes, checked).
    for error in pools[2].errors(_stacked_dispatch_checked, True).values():
        assert "expert parallelism's numeric check: model.layers.0.mlp.experts expert " in error, error
    for out in pools[2].run(_stacked_dispatch_checked, False):
        assert len(out["errors"]) == len(out["names"]) > 0, out
        assert all(e is not None and e <= 1e-8 for e in out["errors"]), out

