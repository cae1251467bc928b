"""`plait train` refuses every flag it would ignore or that cannot work, before any process starts."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import get_args

import pytest

import plait
from plait.app.config import TrainConfig, parse_args, sections
from plait.models.gpt import PRESETS
from plait.pipeline import SCHEDULES

BAD = [
    # FSDP-only options under other strategies: they would change nothing.
    (dict(strategy="ddp", offload=True), "--offload applies to --strategy fsdp"),
    (dict(strategy="dp", nproc=2, offload=True), "--strategy dp would ignore it"),
    (dict(strategy="none", nproc=1, offload=True), "--strategy none would ignore it"),
    # Mixed precision runs in every layout but DataParallel's threads.
    (dict(strategy="dp", nproc=2, mixed_precision="bf16"), "--mixed-precision bf16 with --strategy dp"),
    (dict(strategy="ddp", zero_stage=1), "--zero-stage 1 applies to --strategy fsdp"),
    (dict(strategy="ddp", reshard_after_forward=False), "--no-reshard-after-forward applies"),
    (dict(strategy="ddp", backward_prefetch=False), "--no-backward-prefetch applies"),
    # Numbers out of range.
    (dict(grad_clip=-1.0), r"--grad-clip -1.0: must be a finite number >= 0 \(0: no clipping\)"),
    (dict(grad_clip=float("nan")), "--grad-clip nan"),
    (dict(lr=float("inf")), "--lr inf: must be a finite number > 0"),
    (dict(lr=0.0), "--lr 0.0"),
    (dict(lr=-1e-3), "--lr -0.001"),
    (dict(min_lr_ratio=1.5), r"--min-lr-ratio 1.5: must be a number in \[0, 1\]"),
    (dict(min_lr_ratio=float("nan")), "--min-lr-ratio nan"),
    (dict(weight_decay=-0.1), "--weight-decay -0.1"),
    (dict(weight_decay=float("inf")), "--weight-decay inf"),
    (dict(eval_every=-1), "--eval-every -1: must be an integer >= 0"),
    (dict(save_every=-5), "--save-every -5"),
    (dict(seq_len=0), "--seq-len 0: must be an integer >= 1"),
    (dict(seq_len=-8), "--seq-len -8"),
    (dict(max_bytes=0), "--max-bytes 0: must be an integer >= 1024"),
    (dict(seed=-1), r"--seed -1: must be an integer in \[0, 2\*\*32\)"),
    (dict(steps=0), "--steps 0: must be an integer >= 1"),
    (dict(microbatches=0), "--microbatches 0"),
    (dict(keep=0), "--keep must be >= 1"),
    (dict(warmup=-1), "--warmup must be in"),
    # Model against layout.
    (dict(strategy="ddp", nproc=3, tp=3, batch_size=3), r"--tp 3: .*4 attention heads.*one of \[1, 2, 4\]"),
    (dict(model="small", strategy="fsdp", nproc=3, tp=3, batch_size=3), "--tp 3"),
    (dict(strategy="ddp", nproc=2, tp=2, sequence_parallel=True, seq_len=33),
     "sequence length 33 .* must be divisible by it"),
    (dict(strategy="ddp", nproc=8, pp=8, batch_size=32), r"--pp 8 x 1 stages per rank .* = 8 "
     "pipeline stages, but GPT has only 6 segments"),
    (dict(strategy="ddp", nproc=4, pp=4, schedule="zbv", batch_size=16), r"--pp 4 x 2 stages per rank .* = 8 "
     "pipeline stages, but GPT has only 6"),
    (dict(strategy="ddp", nproc=2, pp=2, schedule="dualpipev", microbatches=2, batch_size=8),
     "--schedule dualpipev .* needs at least 2 x pp = 4 microbatches"),
    (dict(strategy="ddp", nproc=2, pp=2, schedule="zbv", chunks=3, batch_size=8),
     "--schedule zbv .* holds two stages per rank in a V"),
    (dict(strategy="fsdp", nproc=4, pp=2, schedule="zbv"), "--schedule zbv with --zero-stage 3"),
    (dict(strategy="ddp", nproc=4, pp=4, chunks=2, schedule="interleaved", batch_size=16),
     "8 pipeline stages, but GPT has only 6"),
    (dict(strategy="ddp", nproc=6, pp=6, batch_size=24), "leaves pipeline rank 1 with only drop"),
    (dict(strategy="ddp", nproc=2, pp=2, schedule="1f1b", chunks=2, batch_size=8),
     "--schedule 1f1b with --pp 2.* runs one stage per rank"),
    (dict(strategy="ddp", nproc=2, pp=2, schedule="interleaved", chunks=2, microbatches=3, batch_size=6),
     "--schedule interleaved .* multiple of pp"),
    (dict(strategy="ddp", nproc=4, pp=4, schedule="interleaved", microbatches=2, batch_size=8),
     "--schedule interleaved .*at least as many microbatches"),
    (dict(schedule="round-robin"), "--schedule must be one of"),
    # The plan's rules (plait.compose.rules, ParallelPlan), said in flags.
    (dict(chunks=2), "--chunks 2 is a pipeline option, read only when the mesh has pp > 1; .* has --pp 1"),
    (dict(strategy="dp", nproc=2, chunks=3), "--chunks 3 is a pipeline option, read only when"),
    (dict(seq_len=10**7), "--seq-len 10000000: .*held-out 5%"),
    (dict(max_bytes=2000, seq_len=200), "--seq-len 200"),
    (dict(timeout=10, step_timeout=5), "--step-timeout 5 must be longer than --timeout 10"),
    (dict(timeout=0), "--timeout 0: must be a finite number of seconds > 0"),
    # Paths.
    (dict(data="/no/such/corpus"), "--data /no/such/corpus: no such file or folder"),
]


@pytest.mark.parametrize("kwargs,match", BAD, ids=[m.split(":")[0][:40] for _, m in BAD])
def test_bad_value_is_refused_with_its_flag(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_flags(**kwargs)


def test_paths_the_run_writes_are_checked(tmp_path):
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(ValueError, match="--save-dir .*is an existing file"):
        TrainConfig.from_flags(save_dir=str(afile))
    with pytest.raises(ValueError, match="--run-dir .*file, so the folders above runs cannot be created"):
        TrainConfig.from_flags(run_dir=str(afile / "sub" / "runs"))
    with pytest.raises(ValueError, match="--run-dir .*is an existing file"):
        TrainConfig.from_flags(run_dir=str(afile))
    (tmp_path / "runs" / "old").mkdir(parents=True)
    (tmp_path / "runs" / "old" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="--name old: .* holds a run already; add --resume"):
        TrainConfig.from_flags(run_dir=str(tmp_path / "runs"), name="old")
    with pytest.raises(ValueError, match="--name '../x': names one folder"):
        TrainConfig.from_flags(name="../x")
    with pytest.raises(ValueError, match="--save-dir .*file, so the folders"):
        TrainConfig.from_flags(save_dir=str(afile / "ckpt"))
    small = tmp_path / "small.txt"
    small.write_text("tiny")
    with pytest.raises(ValueError, match="--data .*holds 5 tokens"):  # 4 bytes and the end of the document
        TrainConfig.from_flags(data=str(small))
    TrainConfig.from_flags(save_dir=str(tmp_path / "new" / "ckpt"), run_dir=str(tmp_path / "new" / "runs"))


@pytest.mark.parametrize("kwargs", [
    dict(grad_clip=0.0),  # no clipping
    dict(strategy="fsdp", nproc=2, mixed_precision="bf16", offload=True, zero_stage=2),
    dict(strategy="ddp", nproc=2, pp=2, schedule="interleaved", chunks=2, microbatches=4, batch_size=8),
    dict(strategy="ddp", nproc=2, pp=2, schedule="zb-h1", batch_size=8),
    dict(strategy="ddp", nproc=2, pp=2, schedule="zbv", batch_size=8),
    dict(strategy="fsdp", zero_stage=2, nproc=4, pp=2, schedule="dualpipev", chunks=2, batch_size=8),
    dict(strategy="ddp", nproc=4, tp=4, sequence_parallel=True),
    dict(model="25m", strategy="fsdp", nproc=8, tp=8, batch_size=8),
    dict(strategy="ddp", nproc=4, tp=2, sequence_parallel=True, mixed_precision="fp16"),
    dict(strategy="none", nproc=1, mixed_precision="bf16"),
    dict(strategy="ddp", nproc=4, pp=2, mixed_precision="bf16", batch_size=8),
])
def test_good_layouts_pass(kwargs):
    TrainConfig.from_flags(**kwargs)


def test_parallel_plan_refuses_fsdp_options_without_fsdp():
    only_fsdp = r"ParallelPlan\(zero_stage=2\) applies to data='fsdp' only.*data='ddp' would ignore it"
    with pytest.raises(ValueError, match=only_fsdp):
        plait.ParallelPlan(data="ddp", zero_stage=2)
    plait.ParallelPlan(data="ddp", mixed_precision="bf16")  # mixed precision: every strategy
    with pytest.raises(ValueError, match="mixed_precision.*'int8'"):
        plait.ParallelPlan(data="ddp", mixed_precision="int8")
    with pytest.raises(ValueError, match="offload=True"):
        plait.ParallelPlan(data="none", offload=True)
    with pytest.raises(ValueError, match="ddp_options"):
        plait.ParallelPlan(data="fsdp", ddp_options={"bucket_cap_mb": 1})
    plan = plait.ParallelPlan(data="fsdp", mixed_precision="bf16", offload=True)
    plan.data = "ddp"  # changed after construction: parallelize checks again, before any collective
    with pytest.raises(ValueError, match=r"ParallelPlan\(offload=True\) applies to data='fsdp' only"):
        plait.parallelize(None, None, plan)  # type: ignore[arg-type]


def test_schedule_choices_on_the_command_line(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--schedule", "round-robin"])
    assert "invalid choice 'round-robin' for argument '--schedule'" in capsys.readouterr().err
    assert parse_args(["--schedule", "zb-h1", "--pp", "2", "--batch-size", "8"]).parallel.schedule == "zb-h1"


def test_command_line_choices_are_the_library_names():
    assert set(get_args(sections.ModelName)) == set(PRESETS)
    assert get_args(sections.ScheduleName) == SCHEDULES


def test_flat_flags_land_in_their_sections():
    cfg = parse_args(["--model", "small", "--tp", "2", "--nproc", "4", "--lr", "1e-3", "--data", __file__,
                      "--save-dir", "runs/x", "--no-progress", "--grad-accum", "2", "--sequence-parallel"])
    assert (cfg.model.name, cfg.parallel.tp, cfg.parallel.nproc, cfg.optimizer.lr) == ("small", 2, 4, 1e-3)
    assert (cfg.data.path, cfg.checkpoint.save_dir, cfg.run.progress) == (__file__, "runs/x", False)
    assert (cfg.run.grad_accum, cfg.parallel.sequence_parallel) == (2, True)
    assert TrainConfig.from_flags(**cfg.flags()) == cfg
    with pytest.raises(TypeError, match=r"unknown options \['tensor_parallel'\]"):
        TrainConfig.from_flags(tensor_parallel=2)


def test_config_file_by_section_and_flags_override_it(tmp_path):
    run = tmp_path / "run.toml"
    run.write_text(textwrap.dedent("""
        [model]
        name = "small"
        [parallel]
        strategy = "fsdp"
        nproc = 4
        tp = 2
        zero_stage = 2
        reshard_after_forward = false
        [optimizer]
        lr = 1e-3
        [run]
        steps = 50
        progress = false
    """))
    cfg = parse_args(["--config", str(run)])
    par = cfg.parallel
    assert (cfg.model.name, par.strategy, par.nproc, par.tp) == ("small", "fsdp", 4, 2)
    assert (cfg.parallel.zero_stage, cfg.parallel.reshard_after_forward) == (2, False)
    assert (cfg.optimizer.lr, cfg.run.steps, cfg.run.progress) == (1e-3, 50, False)
    over = parse_args(["--config", str(run), "--tp", "4", "--reshard-after-forward", "--lr=2e-3"])
    assert (over.parallel.tp, over.parallel.reshard_after_forward, over.optimizer.lr) == (4, True, 2e-3)
    assert over.model.name == "small"  # the rest still from the file


def test_print_config_reads_back_to_the_same_config(tmp_path, capsys):
    argv = ["--strategy", "fsdp", "--nproc", "4", "--dp", "2", "--mixed-precision", "bf16", "--seq-len", "32",
            "--save-dir", str(tmp_path / "ckpt"), "--no-progress"]
    with pytest.raises(SystemExit) as stop:
        parse_args([*argv, "--print-config"])
    assert stop.value.code == 0
    (tmp_path / "run.toml").write_text(capsys.readouterr().out)
    assert parse_args(["--config", str(tmp_path / "run.toml")]) == parse_args(argv)


@pytest.mark.parametrize("text,match", [
    ("[paralel]\ntp = 2\n", r"unknown section \[paralel\]; the sections are \[model\], \[parallel\]"),
    ("[parallel]\ntensor = 2\n",
     r"\[parallel\] has no option 'tensor'; it has ac, ac_every, backward_prefetch, chunks"),
    ("tp = 2\n", "tp must be a \\[tp\\] table|unknown section \\[tp\\]"),
    ("[parallel]\ntp = [2]\n", r"\[parallel\] tp = \[2\]: expected a number, a string or a boolean"),
    ("[parallel\n", "not valid TOML"),
    ("[parallel]\ntp = 3\nnproc = 3\n[data]\nbatch_size = 3\n", "--tp 3: .*cannot split 4 attention heads"),
])
def test_bad_config_file_is_refused_naming_what(tmp_path, capsys, text, match):
    run = tmp_path / "run.toml"
    run.write_text(text)
    with pytest.raises(SystemExit) as stop:
        parse_args(["--config", str(run)])
    assert stop.value.code == 2
    assert re.search(match, capsys.readouterr().err)


def test_missing_config_file(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--config", "/no/such/run.toml"])
    assert "--config /no/such/run.toml: No such file or directory" in capsys.readouterr().err


def _train_page() -> str:
    """docs/train.md: the reference page of `plait train` (its usage and its layout table)."""
    return (Path(__file__).resolve().parents[1] / "docs" / "train.md").read_text()


def test_the_train_page_lists_exactly_the_flags_plait_train_has():
    page = _train_page()
    usage = page[page.index("plait train ["):page.index("```", page.index("plait train ["))]
    in_page = set(re.findall(r"--[a-z][a-z-]*", usage))
    flags = TrainConfig().flags()
    parser = {"--" + flag.replace("_", "-") for flag in flags} | {"--config", "--print-config"}
    booleans = {f"--no-{f.replace('_', '-')}" for f, v in flags.items() if isinstance(v, bool)}
    assert in_page - parser - booleans == set(), "docs/train.md flags plait train does not have"
    negated = {flag for flag in parser if flag.replace("--", "--no-", 1) in in_page}
    assert parser - in_page - negated == set(), "flags missing from docs/train.md's usage"


def test_every_command_in_the_train_page_layout_table_is_accepted():
    commands = re.findall(r"^\| `plait train ([^`]*)` \|", _train_page(), re.M)
    assert len(commands) >= 15
    for command in commands:
        parse_args(shlex.split(command))  # exits 2 on a flag or combination the page should not show


def test_cli_refuses_in_the_parent_before_spawning(tmp_path, monkeypatch, capsys):
    """As a user runs it (a process of its own) for one case; the others through the same entry
    point in this process, with starting ranks made to fail the test."""
    afile = tmp_path / "file"
    afile.write_text("x")
    bad_schedule = tmp_path / "run.toml"
    bad_schedule.write_text('[parallel]\nnproc = 2\npp = 2\nschedule = "interleaved"\nchunks = 2\n'
                            'microbatches = 3\n[data]\nbatch_size = 6\n')
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "plait", "train", "--nproc", "3", "--tp", "3", "--batch-size",
                          "3"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--tp 3" in res.stderr, res.stderr
    assert "[rank" not in res.stderr  # no rank ever started (rank log lines start so)
    assert time.perf_counter() - t0 < 60

    from plait.app import launch, train
    from plait.app.cli import main

    def no_ranks(*args, **kwargs):
        raise AssertionError("plait train started ranks for a run it should have refused")

    monkeypatch.setattr(launch, "spawn", no_ranks)
    monkeypatch.setattr(train, "train", no_ranks)
    cases = [
        (["--strategy", "dp", "--mixed-precision", "bf16"], "--mixed-precision bf16 with --strategy dp"),
        (["--lr", "inf"], "--lr inf: must be a finite number > 0"),
        (["--save-dir", str(afile)], "is an existing file"),
        (["--config", str(bad_schedule)], "--schedule interleaved with --pp 2, --microbatches 3"),
    ]
    for args, message in cases:
        with pytest.raises(SystemExit) as exit_:
            main(["train", *args])
        assert exit_.value.code == 2, args
        assert message in capsys.readouterr().err, args


PLAN_RULES = [  # rules plait.compose.rules and ParallelPlan decide, said in the flags that were typed
    (["--strategy", "ddp", "--nproc", "2", "--zero-stage", "2"],
     "--zero-stage 2 applies to --strategy fsdp only", "zero_stage"),
    (["--strategy", "dp", "--nproc", "2", "--offload", "--no-backward-prefetch"],
     "--offload --no-backward-prefetch apply to --strategy fsdp only (FSDP and HSDP read them); "
     "--strategy dp would ignore them: use --strategy fsdp", "data="),
    (["--strategy", "none", "--nproc", "1", "--no-reshard-after-forward"],
     "--no-reshard-after-forward applies to --strategy fsdp only", "reshard_after_forward"),
    (["--ac-every", "2"], "--ac-every 2 chooses the blocks to checkpoint; --ac none would ignore it: give "
     "--ac full or --ac selective", "ac_every"),
    (["--chunks", "2"], "--chunks 2 is a pipeline option, read only when the mesh has pp > 1", "pp_chunks"),
    (["--nproc", "2", "--ep", "2"], "has --ep 2, but GPT has no plait MoE layers", "ep="),
    (["--nproc", "2", "--strategy", "fsdp", "--experts", "4", "--offload"],
     "with --strategy fsdp and --offload: the experts stay whole outside FSDP's shards", "offload="),
]


@pytest.mark.parametrize("args,message,field", PLAN_RULES,
                         ids=["fsdp-option", "fsdp-options-dp", "fsdp-option-none", "ac-every", "chunks",
                              "ep", "experts-fsdp-offload"])
def test_plan_rules_are_refused_by_flag_before_spawning(monkeypatch, capsys, args, message, field):
    """The rules the CLI no longer restates: the library's refusal, in the flags, before any rank
    starts, and never in the plan's field names."""
    from plait.app import launch, train
    from plait.app.cli import main

    def no_ranks(*args, **kwargs):
        raise AssertionError("plait train started ranks for a run it should have refused")

    monkeypatch.setattr(launch, "spawn", no_ranks)
    monkeypatch.setattr(train, "train", no_ranks)
    with pytest.raises(SystemExit) as exit_:
        main(["train", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err
    assert field not in err and "ParallelPlan" not in err, err


def test_in_flags_says_a_plan_refusal_in_flags():
    from plait.app.config import in_flags
    from plait.compose.rules import LayoutError

    with pytest.raises(LayoutError) as e:
        plait.ParallelPlan(data="ddp", zero_stage=1, reshard_after_forward=False)
    assert e.value.fields == ("zero_stage", "reshard_after_forward", "data")
    said = in_flags(e.value, strategy="ddp", data="ddp")
    assert said.startswith("--zero-stage 1 --no-reshard-after-forward apply to --strategy fsdp only"), said
    assert "--strategy ddp would ignore them" in said
    # A strategy that makes the same data value is said as typed: --strategy none runs one process
    # with data='ddp'; the advice (data='fsdp') stays what it says.
    said = in_flags(e.value, strategy="none", data="ddp")
    assert "--strategy none would ignore them: use --strategy fsdp" in said
    # A field no flag sets stays as the library says it.
    with pytest.raises(LayoutError) as e:
        plait.ParallelPlan(data="ddp", fsdp_units=["blocks.*"])
    assert in_flags(e.value).startswith("ParallelPlan(fsdp_units=['blocks.*']) applies to --strategy fsdp")

