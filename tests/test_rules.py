"""`plait.compose.rules.check_layout`: whether a layout can run, decided in one process from a meta model,
the mesh's degrees and the plan, with no process group, in well under a second; refusals name
their fields and the nearest degrees that fit. `plait.parallelize`, `plait train`, `plait check`
and `plait plan` all run it (their own tests meet its refusals through them)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import plait
from plait.app.config import TrainConfig
from plait.compose.rules import LayoutError, MeshShape, check_layout
from plait.models.gpt import GPT, GPTConfig


def _meta_gpt(**kw) -> tuple[GPTConfig, torch.nn.Module]:
    cfg = GPTConfig(**kw)
    with torch.device("meta"):
        return cfg, GPT(cfg)


def test_a_large_model_is_decided_on_meta_in_well_under_a_second(monkeypatch):
    def no_group(*args, **kwargs):
        raise AssertionError("check_layout asked for a process group")

    for name in ("new_group", "get_rank", "get_world_size", "barrier", "all_reduce"):
        monkeypatch.setattr(dist, name, no_group)
    cfg, model = _meta_gpt(n_layers=32, d_model=4096, n_heads=32, vocab_size=128256, seq_len=64)
    plan = plait.ParallelPlan(tp=plait.gpt_plan(cfg), sequence_parallel=True, data="fsdp",
                              pp_schedule="interleaved", pp_chunks=2, pp_microbatches=8)
    start = time.perf_counter()
    check_layout(model, MeshShape(pp=4, fsdp=16, tp=8), plan)
    took = time.perf_counter() - start
    assert took < 0.5, took  # about 0.04 s here
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing allocated or moved


def test_a_degree_that_does_not_fit_is_refused_with_the_nearest_that_do():
    cfg, model = _meta_gpt(n_heads=4)
    plan = plait.ParallelPlan(tp=plait.gpt_plan(cfg), data="fsdp")
    with pytest.raises(LayoutError) as e:
        check_layout(model, MeshShape(fsdp=2, tp=3), plan)
    assert e.value.fields == ("tp",) and e.value.axis == "tp"
    # Same 6 ranks, the data axis taking up the difference; the degrees the heads allow listed too.
    assert e.value.nearest == [{"tp": 2, "fsdp": 3}, {"tp": 1, "fsdp": 6}]
    assert "cannot split 4 attention heads" in str(e.value) and "one of [1, 2, 4]" in str(e.value)
    assert "nearest valid: tp=2 fsdp=3, tp=1 fsdp=6" in str(e.value)
    for shape in e.value.nearest:  # each suggestion passes the same rules
        check_layout(model, shape, plan)


@pytest.mark.parametrize("shape,plan_kw,fields,says", [
    (dict(tp=2), dict(), ("tp",), "has tp=2 but the plan has no tp styles"),
    (dict(dp=2), dict(sequence_parallel=True, tp={}), ("sequence_parallel", "tp"), "needs tp >= 2"),
    (dict(fsdp=2), dict(data="ddp"), ("data", "fsdp"), "data='ddp' uses the dp axis"),
    (dict(dp=2, cp=2), dict(data="none", cp="ring"), ("cp", "data"), "data='none' would leave"),
    (dict(dp=2, ep=2), dict(), ("ep",), "ep=2"),
    (dict(dp=2), dict(pp_microbatches=8), ("pp_microbatches",), "read only when the mesh has pp > 1"),
    (dict(pp=2, fsdp=2), dict(data="fsdp", pp_schedule="zbv"), ("pp_schedule", "zero_stage"),
     "with zero_stage=3"),
    (dict(pp=8), dict(), ("pp", "pp_chunks"), "8 pipeline stages, but GPT has only 6 segments"),
    (dict(pp=2), dict(pp_schedule="dualpipev", pp_microbatches=2), ("pp_schedule", "pp_microbatches",
                                                                      "pp_chunks"), "needs at least"),
])
def test_each_rule_names_its_fields(shape, plan_kw, fields, says):
    _, model = _meta_gpt()
    with pytest.raises(LayoutError, match=says) as e:
        check_layout(model, shape, plait.ParallelPlan(**plan_kw))
    assert e.value.fields == fields


@pytest.mark.parametrize("plan_kw,fields,says", [
    (dict(data="zero"), ("data",), r"data=\.\.\.\) must be one of"),
    (dict(data="ddp", zero_stage=2), ("zero_stage", "data"), "applies to data='fsdp' only"),
    (dict(data="none", offload=True, backward_prefetch=False), ("offload", "backward_prefetch", "data"),
     "apply to data='fsdp' only"),
    (dict(data="ddp", reshard_after_forward=False, fsdp_units=["blocks.*"]),
     ("reshard_after_forward", "fsdp_units", "data"), "data='ddp' would ignore them"),
    (dict(data="fsdp", ddp_options={"bucket_cap_mb": 1}), ("ddp_options", "data"), "applies to data='ddp'"),
    (dict(cp="rings"), ("cp",), r"cp=\.\.\.\) must be one of"),
    (dict(mixed_precision="int8"), ("mixed_precision",), "'int8'"),
    (dict(mixed_precision=plait.MixedPrecision(reduce_dtype=torch.float64)), ("mixed_precision", "data"),
     "DDP reduces the fp32 master gradients"),
    (dict(mixed_precision="bf16", ddp_options={"gradient_compression": "fp16"}),
     ("ddp_options", "mixed_precision"), "disagrees with"),
    (dict(pp_microbatches=0), ("pp_microbatches",), "must be an integer >= 1"),
    (dict(pp_chunks=True), ("pp_chunks",), "must be an integer >= 1"),
    (dict(p2p="carrier pigeon"), ("p2p",), r"p2p=\.\.\.\) must be one of"),
    (dict(pp_split="layers.4"), ("pp_split",), "'auto' or a list of segment names"),
    (dict(pp_schedule="zb"), ("pp_schedule",), r"pp_schedule=\.\.\.\) must be one of"),
    (dict(ac="most"), ("ac",), "policy must be one of"),
    (dict(ac="full", ac_every=0), ("ac_every",), "every must be an integer >= 1"),
    (dict(ac_every=2), ("ac_every", "ac"), r"ParallelPlan\(ac_every=2\) chooses the blocks"),
    (dict(ac_blocks=["blocks.*"]), ("ac_blocks", "ac"), "ac=None would ignore it"),
])
def test_each_plan_refusal_names_its_fields(plan_kw, fields, says):
    """`ParallelPlan`'s own refusals are `LayoutError`s as `check_layout`'s are: the fields they name
    are the ones a CLI says as its flags."""
    with pytest.raises(LayoutError, match=says) as e:
        plait.ParallelPlan(**plan_kw)
    assert e.value.fields == fields
    plan = plait.ParallelPlan()  # the same refusal when fields change after construction
    for name, value in plan_kw.items():
        setattr(plan, name, value)
    with pytest.raises(LayoutError) as again:
        plan.validate()
    assert again.value.fields == fields


@pytest.mark.parametrize("plan_kw,field", [(dict(loss_fn=3), "loss_fn"),
                                           (dict(ac="full", ac_blocks="blocks"), "ac_blocks")])
def test_a_value_of_the_wrong_type_is_a_type_error_naming_its_field(plan_kw, field):
    with pytest.raises(TypeError, match=field) as e:
        plait.ParallelPlan(**plan_kw)
    assert isinstance(e.value, LayoutError) and e.value.fields == (field,)


def test_experts_under_fsdp_refuse_what_fsdp_would_not_cast_or_offload():
    _, model = _meta_gpt(n_experts=4, top_k=2)
    with pytest.raises(LayoutError, match=r"experts \('layers\.0\.mlp'\) with data='fsdp' and "
                       r"ParallelPlan\(mixed_precision='bf16'\): the experts stay whole") as e:
        check_layout(model, dict(fsdp=2), plait.ParallelPlan(data="fsdp", mixed_precision="bf16"))
    assert e.value.fields == ("data", "mixed_precision")
    with pytest.raises(LayoutError) as e:
        check_layout(model, dict(fsdp=2, ep=2), plait.ParallelPlan(data="fsdp", offload=True))
    assert e.value.fields == ("data", "offload")
    check_layout(model, dict(dp=2), plait.ParallelPlan(mixed_precision="bf16"))  # DDP casts them
    check_layout(model, dict(fsdp=2), plait.ParallelPlan(data="fsdp", mixed_precision="fp32"))  # no cast


def test_train_config_refuses_in_its_flags_what_parallelize_refuses_in_fields():
    """The same rule (ep against the experts) through both: the library's words, and the CLI's."""
    cfg = GPTConfig(n_experts=6, top_k=2)
    with torch.device("meta"):
        model = GPT(cfg)
    with pytest.raises(LayoutError, match=r"ep=4 splits the 6 experts evenly.*nearest valid: ep=2, ep=1"):
        check_layout(model, MeshShape(dp=4, ep=4), plait.ParallelPlan())
    flags = r"--ep 4 splits the 6 experts evenly.*nearest valid: --ep 2, --ep 1"
    with pytest.raises(ValueError, match=flags):
        TrainConfig.from_flags(experts=6, ep=4, nproc=4)
