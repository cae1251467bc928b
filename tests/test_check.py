"""`plait check` / `plait.check`: a correct layout passes, a rank-dependent module is named.

The factories live here so the spawned processes can import them (``tests.test_check:...`` from
the repository root, ``test_check:...`` inside pytest's rank pool). Tiny models, 2 ranks, 3 steps,
float64.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait.models.gpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)


def tiny_gpt() -> nn.Module:
    return GPT(TINY)


def tiny_moe_gpt() -> nn.Module:
    """The tiny GPT with 4 experts per layer (top-2) and 24 positions (which split over 2, 3 and 4 cp
    ranks), for expert-parallel layouts. No balancing loss: with it the schedules that run a
    backward before the step's last forward are refused (test_moe covers the balancing)."""
    return GPT(dataclasses.replace(TINY, seq_len=24, n_experts=4, top_k=2))


class RankSkew(nn.Module):
    """Wraps a block and scales its output by 1 + 1e-3 * rank: right on rank 0, slightly off elsewhere,
    invisible to a single process."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * (1 + 1e-3 * dist.get_rank())


def skewed_gpt() -> nn.Module:
    model = GPT(TINY)
    model.layers[1] = RankSkew(model.layers[1])
    return model


def _check_in_job(mesh: dict[str, int], ac: str | None = None):
    import plait
    from plait.testing import cached_mesh

    plan = plait.ParallelPlan(ac=ac) if ac else None
    return plait.check(tiny_gpt, plan, mesh=cached_mesh(**mesh), steps=3, batch_size=4)


def _longer_than_context() -> str:
    import plait
    from plait.check import CheckInputError
    from plait.testing import cached_mesh

    with pytest.raises(CheckInputError) as info:
        plait.check(tiny_gpt, mesh=cached_mesh(dp=2), steps=1, batch_size=4, seq=32)
    return str(info.value)


def test_sequences_longer_than_the_models_positions_are_bad_input(pools):
    # Were a shape error inside the model's rotary embedding, from the one-process run.
    for said in pools[2].run(_longer_than_context):
        assert "--seq 32 (check(seq=...)) is longer than GPT's seq_len = 16" in said, said


@pytest.mark.parametrize("mesh,ac", [({"dp": 2}, None), ({"tp": 2}, None), ({"dp": 2}, "full")],
                         ids=["ddp", "tp", "ddp-ac"])
def test_a_correct_layout_passes(pools, mesh, ac):
    # Inside a running job (the pool's ranks): every rank gets the same report. With activation
    # checkpointing each block runs again in backward: those calls are not compared twice.
    reports = pools[2].run(_check_in_job, mesh, ac)
    report = reports[0]
    assert report.ok, report.format()
    assert reports[1].format() == report.format()
    assert len(report.steps) == 3 and all(s.compared > 0 for s in report.steps)
    assert report.first is None
    # float64: a correct layout is at rounding level, many orders below the tolerance.
    assert max(d.rel for s in report.steps for d in s.grads.values()) < 1e-11
    assert max(s.loss_rel for s in report.steps) < 1e-12
    text = report.format()
    assert "against one process" in text and text.rstrip().endswith("within 1e-09")


def test_a_rank_dependent_module_is_named_by_the_cli():
    cmd = [sys.executable, "-m", "plait", "check", "tests.test_check:skewed_gpt", "--nproc", "2",
           "--steps", "3", "--batch-size", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "first divergence: step 1, module layers.1," in done.stdout, done.stdout
    assert "on rank 1" in done.stdout and "FAILED" in done.stdout


def _descendants(pid: int) -> dict[int, str]:
    """Every live process below ``pid``: its command line."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z":  # a zombie has ended; only its parent's wait remains
                children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            with contextlib.suppress(OSError):
                out[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            todo.append(child)
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_ends_the_check_with_its_ranks_and_one_process_run():
    cmd = [sys.executable, "-m", "plait", "check", "tests.test_check:tiny_gpt", "--nproc", "2",
           "--steps", "500", "--batch-size", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    kids: dict[int, str] = {}
    while not (sum("spawn_main" in c for c in kids.values()) >= 2  # the ranks, not a resource tracker
               and any("plait.check.oracle" in c for c in kids.values())):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.2)
        kids = _descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM, proc.stderr.read() if proc.stderr else ""
    gone_by = time.monotonic() + 10
    while (alive := {p: c for p, c in kids.items() if Path(f"/proc/{p}").exists()
                     and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"}):
        assert time.monotonic() < gone_by, f"outlived plait check: {alive}"
        time.sleep(0.2)


@pytest.mark.parametrize("factory, says", [
    ("no_colon", "must name a function as 'package.module:function'"),
    ("no_such_module_xyz:build", "cannot import module 'no_such_module_xyz'"),
    ("test_check:missing", "has no attribute 'missing'"),
    ("test_check:TINY", "not a function"),
])
def test_a_bad_factory_is_a_clear_error(factory, says):
    import plait
    from plait.check import CheckInputError

    with pytest.raises(CheckInputError, match="FACTORY") as info:
        plait.check(factory)
    assert says in str(info.value)


def _exit_code(argv: list[str]) -> int:
    from plait.app.check import cli_main

    try:
        return cli_main(argv)
    except SystemExit as e:  # the flag parser exits by itself
        return int(e.code or 0)


def test_bad_input_exits_2_before_anything_starts(capsys):
    assert _exit_code(["no_such_module_xyz:build"]) == 2
    assert "cannot import module 'no_such_module_xyz'" in capsys.readouterr().err
    assert _exit_code(["test_check:tiny_gpt", "--zero-stage", "2"]) == 2
    assert "--zero-stage 2 applies to --strategy fsdp only" in capsys.readouterr().err
    assert _exit_code(["test_check:tiny_gpt", "--strategy", "dp"]) == 2
    assert "compares processes" in capsys.readouterr().err
    assert _exit_code(["test_check:tiny_gpt", "--nproc", "3", "--tp", "2"]) == 2
    assert "--nproc 3 is not divisible" in capsys.readouterr().err
    # Flags plait train reads but the comparison does not build are refused, not dropped.
    for flags, says in ((["--ac-every", "2"], "--ac none would ignore it"),
                        (["--offload"], "--offload applies to --strategy fsdp only"),
                        (["--chunks", "2"], "--chunks 2 is a pipeline option, read only when"),
                        (["--cp-algorithm", "ulysses"], "--cp 1 would ignore it"),
                        (["--cp", "2", "--strategy", "none"], "--cp 2 ranks hold the same parameters"),
                        (["--cp", "2", "--seq", "6"], "--seq 6 does not divide by 4"),
                        (["--ep", "2", "--nproc", "3"],
                         "--ep 2: expert parallelism folds its groups out of the data axes, dp x fsdp = 3")):
        assert _exit_code(["test_check:tiny_gpt", *flags]) == 2
        assert says in capsys.readouterr().err, flags


def test_a_process_alone_in_its_group_checks_as_one_outside_a_job(capsys):
    # plait.init() in a notebook (or a one-process plait train earlier in the same process) made
    # a group of one: asked for 2 ranks, the check spawns them, so its flags are judged as there.
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        assert _exit_code(["test_check:tiny_gpt", "--cp", "2", "--strategy", "none"]) == 2
        assert "--cp 2 ranks hold the same parameters" in capsys.readouterr().err
    finally:
        if made:
            dist.destroy_process_group()


# ---------------------------------------------------------------------------- the layout fuzzer


def _fuzz_in_job(k: int, seed: int):
    from plait.app.check import layout_from_flags
    from plait.check.fuzz import layouts, run_layouts, sample

    todo = sample([c for c in layouts(2) if c.nproc == 2], k, seed)
    return run_layouts(tiny_gpt, todo, layout_from_flags, steps=2, batch_size=8)


def test_a_seeded_sample_of_layouts_matches_one_process(pools):
    # Two layouts of two ranks drawn by a fixed seed; the whole enumeration runs in bench/RESULTS.md.
    outcomes = pools[2].run(_fuzz_in_job, 2, 7)[0]
    from plait.check.fuzz import format_table

    table = format_table(outcomes)
    ran = [o for o in outcomes if o.verdict != "skipped"]
    assert ran and not any(o.failed for o in outcomes), table
    for o in ran:  # float64: at rounding level, far under the tolerance
        assert o.rel < 1e-11 and o.report is not None and o.report.ok, table
    assert f"{len(ran)} layouts run, 0 failed" in table


def test_the_fuzzer_enumerates_and_skips_by_plait_checks_own_reasons():
    from plait.app.check import layout_from_flags
    from plait.check.fuzz import layouts, run_layouts

    every = layouts(4)
    labels = {c.label for c in every}
    assert "--strategy fsdp --zero-stage 2 --dp 2 --nproc 4" in labels  # hybrid sharding
    assert "--strategy ddp --nproc 2 --tp 2 --sequence-parallel" in labels
    assert "--strategy ddp --nproc 4 --tp 2 --pp 2 --schedule interleaved --chunks 2" in labels
    assert "--strategy none --nproc 2 --pp 2 --schedule dualpipev" in labels
    assert len(labels) == len(every)
    # Features on top: checkpointing and mixed precision alone and with the other axes.
    assert "--strategy fsdp --nproc 4 --tp 2 --mixed-precision bf16" in labels
    assert "--strategy ddp --nproc 4 --pp 2 --schedule 1f1b --cp 2" in labels
    refused = [c for c in every if c.nproc == 3 and ("cp", 3) in c.fields]  # 16 tokens in 6 chunks

    def never(*a, **k):  # a skipped layout never reaches the check
        raise AssertionError("ran")

    out = run_layouts("test_check:tiny_gpt", refused, layout_from_flags, runner=never)
    assert refused and [o.verdict for o in out] == ["skipped"] * len(refused)
    assert all("--seq 16 does not divide by 6" in o.detail for o in out)


def test_fuzz_flags_refuse_layout_flags(capsys):
    assert _exit_code(["test_check:tiny_gpt", "--all-layouts", "--tp", "2"]) == 2
    assert "--tp with --all-layouts/--sample: the fuzzer chooses the layouts" in capsys.readouterr().err
    assert _exit_code(["test_check:tiny_gpt", "--all-layouts", "--mixed-precision", "bf16"]) == 2
    assert "--mixed-precision with --all-layouts/--sample" in capsys.readouterr().err


def test_a_failed_check_ends_every_rank_before_removing_its_folder():
    # A rank that fails makes torch signal its peers, which may still write their errors into
    # the check's folder: they are killed and waited for before the folder goes.
    import multiprocessing

    from plait.check.run import _end

    ctx = multiprocessing.get_context("fork")
    ranks = [ctx.Process(target=time.sleep, args=(60,)) for _ in range(2)]
    for p in ranks:
        p.start()
    _end(ranks)
    assert all(not p.is_alive() and p.exitcode is not None for p in ranks)


def test_expert_outputs_are_compared_only_where_a_rank_sees_every_token():
    # An expert's rows are the tokens routed to it: where a rank sees part of the tokens (cp, data
    # ranks, sequence parallelism, microbatches) they are not a slice of one process's. The fuzzer's
    # cp4 and dp2 x ep2 x tp2-SP layouts of an MoE GPT failed on one when its row count happened to
    # equal one process's (losses, gradients and parameters exact).
    from plait.check.layout import compared_modules

    model = GPT(dataclasses.replace(TINY, n_experts=4, top_k=2))
    whole = {n for n, _ in compared_modules(model, pipelined=False, tokens_split=False)}
    split = {n for n, _ in compared_modules(model, pipelined=False, tokens_split=True)}
    assert "layers.0.mlp.experts.2.gate_proj" in whole
    assert whole - split == {n for n in whole if ".mlp.experts" in n}


def test_a_killed_reference_writes_nothing_into_the_folder_being_removed(tmp_path):
    # Its watcher used to record "exited with code -9" after the kill, while the folder was being
    # removed: the removal failed (OSError) and ended the fuzzer.
    import threading

    from plait.check.run import _Reference

    ref = _Reference()
    ref.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.PIPE)
    ref.folder = str(tmp_path)
    watcher = threading.Thread(target=ref._watch, args=(ref.proc,))
    watcher.start()
    ref.kill()
    watcher.join(timeout=10)
    assert not watcher.is_alive() and list(tmp_path.iterdir()) == []
