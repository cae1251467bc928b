"""`plait.full_state_dict` in every layout equals the single-process model's ``state_dict()``.

Each layout trains a tiny float64 GPT for two default AdamW steps on the same global batches as
an unsplit oracle (every rank runs the oracle too, so each comparison is local); then the full
state dict, gathered on every rank, must hold the oracle's keys (tied weights under both names)
and values. Tolerance: ``rtol=1e-9, atol=1e-12`` (summation order only; measured 1e-15 apart at
most), and with tensor parallelism ``rtol=1e-5, atol=1e-6``, the bounds set when its
vocab-parallel loss computed in float32 (then within 0.12 of them; it now stays float64). Then
`plait.load_full_state_dict` puts the oracle's *initial* state back and the full state dict must
return it exactly.

The vocabulary is 63 wherever tensor parallelism splits it over 2 ranks: shards of 32 rows,
the last one padded, whose padding must not appear in the full tensors.
"""

from __future__ import annotations

import pytest
import torch
from oracle import assert_params_close, loss64

from plait.testing import cached_mesh

TOL = {"rtol": 1e-5, "atol": 1e-6}  # with tensor parallelism
TOL64 = {"rtol": 1e-9, "atol": 1e-12}
TINY = {"seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64}
STEPS = 2


def _batch(step: int, vocab: int, b: int = 8, s: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    w = torch.randint(0, vocab, (b, s + 1), generator=g)
    return w[:, :-1], w[:, 1:]


def _build(layout: str, cfg, mesh, data_parallel: str, zero_stage: int):
    """(the model in ``layout``, a step function (inputs, targets) -> None that runs backward)."""
    import plait
    from plait.models.gpt import GPT

    if layout == "dataparallel":  # one process, two CPU threads
        model = plait.init_weights(GPT(cfg).to(torch.float64), seed=3)
        net = plait.DataParallel(model, devices=["cpu", "cpu"])
        return net, lambda x, y: loss64(net(x), y).backward()
    if layout == "compiled":  # one process; its keys carry torch.compile's _orig_mod. prefix
        net = torch.compile(plait.init_weights(GPT(cfg).to(torch.float64), seed=3), backend="eager")
        return net, lambda x, y: loss64(net(x), y).backward()
    with torch.device("meta"):  # no rank ever materializes the full model
        model = GPT(cfg).to(torch.float64)
    if layout == "pipeline-compiled":  # a block compiled in a wrapper (layers.0._orig_mod.*), one in place
        model.layers[0] = torch.compile(model.layers[0], backend="eager")
        model.layers[1].compile(backend="eager")
    tp_plan = plait.gpt_plan(cfg) if mesh.size("tp") > 1 else None
    if mesh.size("pp") > 1:
        pipe = plait.parallelize(model, mesh, plait.ParallelPlan(
            tp=tp_plan, data="none", pp_schedule="1f1b", pp_microbatches=2, seed=3,
            loss_fn=None if tp_plan else loss64))
        return pipe, pipe.step
    plan = plait.ParallelPlan(tp=tp_plan, data=data_parallel, seed=3,
                              **({"zero_stage": zero_stage} if data_parallel == "fsdp" else {}))
    net = plait.parallelize(model, mesh, plan)
    loss_fn = plait.loss_fn_for(net) if tp_plan else loss64
    data_rank, data_size = mesh.rank(("dp", "fsdp")), mesh.size(("dp", "fsdp"))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        mine = slice(data_rank * len(x) // data_size, (data_rank + 1) * len(x) // data_size)
        loss_fn(net(x[mine]), y[mine]).backward()

    return net, step


def _full_state_matches(layout: str, mesh_axes: dict, cfg_kw: dict, data_parallel: str = "ddp",
                        zero_stage: int = 3) -> list[str]:
    import plait
    from plait.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(**{**TINY, **cfg_kw})
    mesh = cached_mesh(**mesh_axes) if mesh_axes else None  # DataParallel runs without a process group
    oracle = plait.init_weights(GPT(cfg).to(torch.float64), seed=3)
    initial = {k: v.clone() for k, v in oracle.state_dict().items()}
    net, step = _build(layout, cfg, mesh, data_parallel, zero_stage)
    opt = torch.optim.AdamW(net.parameters())
    opt_ref = torch.optim.AdamW(oracle.parameters())
    for i in range(STEPS):
        x, y = _batch(i, cfg.vocab_size)
        step(x, y)
        loss64(oracle(x), y).backward()
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
    full = plait.full_state_dict(net)
    plait.load_full_state_dict(net, initial)
    reloaded = plait.full_state_dict(net)  # the last collective: the checks below are local
    want = oracle.state_dict()
    tol = TOL if mesh_axes.get("tp", 1) > 1 else TOL64
    assert all(value.device.type == "cpu" for value in full.values()), {n: v.device for n, v in full.items()}
    assert_params_close(full, want, **tol, what=layout)
    assert_params_close(reloaded, initial, rtol=0, atol=0, what=f"{layout} reloaded")
    return sorted(full)


TIED = {"vocab_size": 64, "tie_embeddings": True}
UNEVEN = {"vocab_size": 63}

LAYOUTS = [  # (world, layout, mesh axes, GPT config, data strategy, zero stage)
    (2, "ddp", {"dp": 2}, UNEVEN, "ddp", 3),
    (2, "zero1", {"fsdp": 2}, TIED, "fsdp", 1),
    (2, "zero2", {"fsdp": 2}, UNEVEN, "fsdp", 2),
    (2, "zero3", {"fsdp": 2}, TIED, "fsdp", 3),
    (4, "hsdp", {"dp": 2, "fsdp": 2}, UNEVEN, "fsdp", 3),
    (2, "tp", {"tp": 2}, {**UNEVEN, "tie_embeddings": True}, "ddp", 3),
    (4, "ddp-tp", {"dp": 2, "tp": 2}, UNEVEN, "ddp", 3),
    (4, "fsdp-tp", {"fsdp": 2, "tp": 2}, {**UNEVEN, "tie_embeddings": True}, "fsdp", 3),
    (2, "pipeline", {"pp": 2}, TIED, "ddp", 3),  # tok_emb on rank 0 tied to lm_head on rank 1
    (2, "pipeline-compiled", {"pp": 2}, TIED, "ddp", 3),  # torch.compile'd blocks
    (4, "pipeline-tp", {"pp": 2, "tp": 2}, {**UNEVEN, "tie_embeddings": True}, "ddp", 3),  # padded shards
]


@pytest.mark.parametrize("world,layout,axes,cfg_kw,data,zero", LAYOUTS, ids=[row[1] for row in LAYOUTS])
def test_full_state_dict_matches_single_process(pools, world, layout, axes, cfg_kw, data, zero):
    names = pools[world].run(_full_state_matches, layout, axes, cfg_kw, data, zero)
    assert all(n == names[0] for n in names)  # every rank holds the whole model
    if cfg_kw.get("tie_embeddings"):
        assert {"tok_emb.weight", "lm_head.weight"} <= set(names[0])


@pytest.mark.parametrize("layout", ["plain", "dataparallel", "compiled"])
def test_full_state_dict_in_one_process(layout):
    if layout == "plain":
        import plait
        from plait.models.gpt import GPT, GPTConfig

        model = plait.init_weights(GPT(GPTConfig(**TINY, **TIED)), seed=3)
        full = plait.full_state_dict(model)
        assert full.keys() == model.state_dict().keys()
        assert all(torch.equal(full[k], v) for k, v in model.state_dict().items())
        with torch.no_grad():
            model.norm.weight.add_(1)  # a copy, not a view of the live parameters
        assert not torch.equal(full["norm.weight"], model.norm.weight)
        return
    _full_state_matches(layout, {}, TIED)  # a compiled model's under the uncompiled model's names
