"""`plait check FACTORY`: a model in a layout against the same model in one process.

    plait check mymodels:build --strategy fsdp --nproc 2
    plait check mymodels:build --tp 2 --nproc 2 --steps 3 --dtype float32

The layout flags are `plait train`'s (`ParallelSection`, the same names and choices), checked
here before any process starts; the rest say what to compare (`CheckSection`) and, for a factory
that returns a model alone, which random token batches to feed it (`BatchSection`). The report is
printed either way; the exit code is 0 within the tolerance, 1 past it, 2 on bad input (flags, a
factory that cannot be imported or built, a layout that refuses the model) and 3 when a process
failed while training. Under torchrun or `plait run` the job's ranks are the layout's.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import tyro

from plait.app.config import STRATEGIES, ParallelSection, given_flags, in_flags
from plait.compose.parallel_plan import ParallelPlan
from plait.compose.rules import LayoutError


@dataclass
class CheckSection:
    """What both runs do and how closely they must agree."""

    steps: int = 5
    """training steps of both runs (plain SGD)"""
    dtype: Literal["float64", "float32", "bfloat16", "float16"] = "float64"
    """float64 separates layout bugs from rounding; the others are checked against their error budget"""
    tolerance: float | None = None
    """largest relative difference per tensor; None: 1e-9 in float64, the error budget in the others"""
    lr: float = 0.1
    """the SGD learning rate"""
    seed: int = 0
    """initial values and batches"""
    activations: bool = True
    """compare every module's output too, which names the module where a difference starts"""
    all_layouts: bool = False
    """check every layout up to --nproc ranks instead of the one the flags give (`plait.check.fuzz`)"""
    sample: int | None = None
    """check this many of those layouts, drawn by --seed"""


@dataclass
class BatchSection:
    """Batches for a factory that returns a model alone: random token ids, next-token loss."""

    vocab: int | None = None
    """token ids are drawn below this; None: the model's vocabulary"""
    seq: int = 16
    """tokens per sequence"""
    batch_size: int = 8
    """the global batch, in sequences"""


@dataclass
class CheckConfig:
    factory: str
    parallel: ParallelSection = field(default_factory=ParallelSection)
    check: CheckSection = field(default_factory=CheckSection)
    batch: BatchSection = field(default_factory=BatchSection)


def _command(factory: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="FACTORY")],
             parallel: ParallelSection, check: CheckSection, batch: BatchSection) -> CheckConfig:
    """Train a model in a layout and in one process from the same initial values on the same data,
    and report where they part.

    Args:
        factory: package.module:function returning a model, or (model, make_batch, loss_fn)
    """
    cfg = CheckConfig(factory, parallel, check, batch)
    layout_of(cfg)  # a bad combination fails here, as one line naming the flag
    return cfg


def parse_args(argv: list[str]) -> CheckConfig:
    """The flags as a checked `CheckConfig`; exits 2 on bad input with one line naming the flag."""
    try:
        return tyro.cli(_command, args=argv, prog="plait check", config=(tyro.conf.OmitArgPrefixes,))
    except ValueError as e:
        print(f"plait check: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def layout_of(cfg: CheckConfig) -> tuple[ParallelPlan, dict[str, int]]:
    """The `ParallelPlan` and mesh degrees the layout flags stand for (as `plait train` builds them);
    raises ValueError naming the flag on a combination that cannot run."""
    par, c = cfg.parallel, cfg.check
    if par.strategy not in STRATEGIES or par.strategy == "dp":
        raise ValueError(f"--strategy {par.strategy}: plait check compares processes: use ddp, fsdp or none "
                         "(dp runs threads in one process)")
    for flag, v in (("--nproc", par.nproc), ("--tp", par.tp), ("--pp", par.pp), ("--dp", par.dp),
                    ("--microbatches", par.microbatches), ("--chunks", par.chunks), ("--steps", c.steps),
                    ("--seq", cfg.batch.seq), ("--batch-size", cfg.batch.batch_size)):
        if v < 1:
            raise ValueError(f"{flag} {v}: must be an integer >= 1")
    if par.dp > 1 and par.strategy != "fsdp":  # the mesh's dp: the replicas of HSDP
        raise ValueError(f"--dp {par.dp} applies to --strategy fsdp only; --strategy {par.strategy} "
                         "would ignore it: use --strategy fsdp or drop the flag")
    if par.cp == 1 and par.cp_algorithm != "ring":
        raise ValueError(f"--cp-algorithm {par.cp_algorithm} chooses how --cp splits attention; --cp 1 would "
                         "ignore it: add --cp 2 or more")
    if par.cp > 1 and cfg.batch.seq % (2 * par.cp):
        raise ValueError(f"--cp {par.cp} cuts each sequence into {2 * par.cp} equal chunks (two per rank); "
                         f"--seq {cfg.batch.seq} does not divide by {2 * par.cp}")
    if par.nproc % (par.pp * par.cp * par.tp * par.dp):
        raise ValueError(f"--nproc {par.nproc} is not divisible by --pp {par.pp} x --cp {par.cp} x --tp "
                         f"{par.tp} x --dp {par.dp}")
    if par.strategy == "none" and par.nproc != par.pp * par.cp * par.tp:
        raise ValueError(f"--strategy none has no data-parallel ranks: --nproc must be --pp x --cp x --tp = "
                         f"{par.pp * par.cp * par.tp}, got {par.nproc}")
    # --chunks whatever --pp is: without a pipeline the rules refuse it (in the parent, on the
    # factory's meta model), as they refuse FSDP options under another strategy here.
    pipe: dict[str, Any] = {"pp_chunks": par.chunks}
    if par.pp > 1:
        pipe.update(pp_schedule=par.schedule, pp_microbatches=par.microbatches)
    try:
        plan = ParallelPlan(data={"fsdp": "fsdp", "ddp": "ddp", "none": "none"}[par.strategy],
                            sequence_parallel=par.sequence_parallel,
                            cp=par.cp_algorithm if par.cp > 1 else None,
                            ac=None if par.ac == "none" else par.ac, ac_every=par.ac_every,
                            seed=c.seed, mixed_precision=par.mixed_precision, zero_stage=par.zero_stage,
                            offload=par.offload, reshard_after_forward=par.reshard_after_forward,
                            backward_prefetch=par.backward_prefetch, **pipe)
    except LayoutError as e:
        raise ValueError(in_flags(e)) from None
    mesh = {"pp": par.pp, "tp": par.tp, "cp": par.cp, **({"dp": par.dp} if par.strategy == "fsdp" else {}),
            **({"ep": par.ep} if par.ep > 1 else {})}
    return plan, mesh


def layout_from_flags(fields: dict[str, Any]) -> tuple[ParallelPlan, dict[str, int]]:
    """`layout_of` for parallel flags given as `ParallelSection` fields (the fuzzer's layouts)."""
    return layout_of(CheckConfig("-", ParallelSection(**fields)))


_FUZZ_OWN = {"nproc", "all_layouts", "sample", "steps", "dtype", "tolerance", "lr", "seed", "activations",
             "no_activations", "vocab", "seq", "batch_size"}


def _fuzz(cfg: CheckConfig, argv: list[str]) -> int:
    """--all-layouts / --sample: the fuzzer's table; 1 if any layout failed."""
    from plait.check.fuzz import format_table, layouts, run_layouts, sample

    extra = sorted(given_flags(argv) - _FUZZ_OWN)
    if extra:
        print(f"plait check: error: --{extra[0].replace('_', '-')} with --all-layouts/--sample: the fuzzer "
              "chooses the layouts; drop the flag", file=sys.stderr)
        return 2
    if cfg.check.sample is not None and cfg.check.sample < 1:
        print(f"plait check: error: --sample {cfg.check.sample}: must be an integer >= 1", file=sys.stderr)
        return 2
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    todo = layouts(cfg.parallel.nproc)
    if cfg.check.sample is not None:
        todo = sample(todo, cfg.check.sample, cfg.check.seed)
    c, b = cfg.check, cfg.batch
    outcomes = run_layouts(cfg.factory, todo, layout_from_flags, steps=c.steps, dtype=c.dtype,
                           tolerance=c.tolerance, batch_size=b.batch_size, seq=b.seq, vocab=b.vocab,
                           lr=c.lr, seed=c.seed,
                           activations=c.activations,
                           progress=lambda o: print(f"  {o.verdict:<7} {o.layout.label}", flush=True))
    print(format_table(outcomes), flush=True)
    return 1 if any(o.failed for o in outcomes) else 0


def cli_main(argv: list[str]) -> int:
    import torch.distributed as dist

    from plait.check import check
    from plait.runtime.env import init, launch_from_env

    cfg = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C: the ranks and the one-process run are killed, the exchange
    # folder removed, and the exit code says which signal ended it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if cfg.check.all_layouts or cfg.check.sample is not None:
        return _fuzz(cfg, argv)
    nproc = cfg.parallel.nproc
    launch = launch_from_env()
    if launch.source != "single":  # under a launcher: its ranks are the layout's
        if "nproc" in given_flags(argv) and nproc != launch.world_size:
            print(f"plait check: error: --nproc {nproc}: the launcher started {launch.world_size} ranks",
                  file=sys.stderr)
            return 2
        init(seed=cfg.check.seed)
        nproc = launch.world_size
    if os.getcwd() not in sys.path:  # FACTORY names a module the way `python -m` would find it
        sys.path.insert(0, os.getcwd())
    plan, mesh = layout_of(cfg)
    try:
        c, b = cfg.check, cfg.batch
        report = check(cfg.factory, plan, nproc=nproc, mesh=mesh, steps=c.steps, dtype=c.dtype,
                       tolerance=c.tolerance, batch_size=b.batch_size, seq=b.seq, vocab=b.vocab, lr=c.lr,
                       seed=c.seed, activations=c.activations)
    except (ValueError, TypeError) as e:
        said = f"check: {in_flags(e.__cause__)}" if isinstance(e.__cause__, LayoutError) else str(e)
        print(f"plait check: error: {said}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"plait check: {e}", file=sys.stderr)
        return 3
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(report.format(), flush=True)
    return 0 if report.ok else 1
