"""The per-parameter placement record: one attribute, one state.

After `plait.parallelize` of a GPT under tp2 x ep2 (experts split over ep and by hidden
units over tp, on plain shards), dp2 x tp2 (dense: DDP over the leaves of tp's DTensors) and fsdp2 x tp2
with sequence parallelism, and after one backward, no parameter, plain leaf or gradient carries
any ``_plait_*`` attribute but the record (`plait.state.placement.placement_of`), and the records say
what each strategy did: experts their `ExpertPlacement` and tp shards their piece, the leaves DDP
reduces `ParamState.GRAD_PUBLISHED`, the sequence-sharded weights under FSDP the gradient hooks tp
handed over.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.testing import cached_mesh

CFG = {"vocab_size": 64, "seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 32,
       "n_experts": 4, "top_k": 2}
RECORD = "_plait_placement"


def _marks(t: torch.Tensor) -> set[str]:
    return {a for a in vars(t) if a.startswith("_plait_")}


def _records_after_a_backward(layout: str) -> dict:
    import plait
    from plait.models.gpt import GPT, GPTConfig
    from plait.plans import gpt_plan
    from plait.state.placement import ParamState, placement_of
    from plait.state.placement.records import plain_leaf

    dense = layout == "dp-tp"  # experts are plain shards: ep makes tp's DTensors plain
    model = plait.init_weights(GPT(GPTConfig(**{**CFG, "n_experts": 0} if dense else CFG)), seed=3)
    if layout == "tp-ep":
        mesh, data, sp, experts = cached_mesh(dp=2, ep=2, tp=2), "ddp", False, "split"
    elif layout == "dp-tp":
        mesh, data, sp, experts = cached_mesh(dp=2, tp=2), "ddp", False, "replicate"
    else:
        mesh, data, sp, experts = cached_mesh(fsdp=2, tp=2), "fsdp", True, "replicate"
    plan = plait.ParallelPlan(data=data, tp=gpt_plan(model.cfg, loss_parallel=False, experts=experts),
                              sequence_parallel=sp)
    net = plait.parallelize(model, mesh, plan)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    net(idx).float().sum().backward()
    tensors: list[torch.Tensor] = []
    for m in net.modules():
        for p in [*m._parameters.values(), *vars(m).values()]:
            if isinstance(p, nn.Parameter):
                tensors += [p, plain_leaf(p)] + [g for g in (p.grad, plain_leaf(p).grad) if g is not None]
    stray = sorted({a for t in tensors for a in _marks(t) - {RECORD}})
    recs = [r for p in net.parameters() if (r := placement_of(plain_leaf(p))) is not None]
    return {"stray": stray,
            "experts": sum(r.expert is not None for r in recs),
            "pieces": sum(r.piece is not None and r.piece.split for r in recs),
            "published": sum(r.state is ParamState.GRAD_PUBLISHED for r in recs),
            "hooks": sum(bool(r.grad_hooks) for r in recs)}


@pytest.mark.parametrize("layout", ["tp-ep", "dp-tp", "fsdp-tp"])
def test_a_parameter_carries_one_record_and_no_other_mark(pools, layout):
    out = pools[4].run(_records_after_a_backward, layout)
    for o in out:
        assert o["stray"] == [], o
    if layout == "tp-ep":
        assert all(o["experts"] > 0 and o["pieces"] > 0 for o in out), out
    elif layout == "dp-tp":
        assert all(o["published"] > 0 for o in out), out
    else:
        assert all(o["hooks"] > 0 for o in out), out


# Attributes the library may set: records on modules (not parameters), the one parameter record,
# and where a tensor was made under the device-less check (on any tensor, in tests only).
MODULE_RECORDS = {"_plait_tp", "_plait_ep", "_plait_cp", "_plait_layout", "_plait_mixed_precision",
                  "_plait_checkpointed"}
ALLOWED = MODULE_RECORDS | {RECORD, "_plait_made_without_device"}


def test_the_library_names_no_other_plait_attribute():
    import re
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / "plait"
    written = re.compile(r"""["'](_plait_\w+)["']|\.(_plait_\w+)\s*=""")  # a name, or an assignment
    named = {a or b for f in src.rglob("*.py") for a, b in written.findall(f.read_text())}
    assert named <= ALLOWED, sorted(named - ALLOWED)
