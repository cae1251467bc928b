"""Straggler blame through `plait train`: a rank made slow on purpose (a sleep in its model's
forward) is named, with its axis, within 20 steps; an even run raises no alarm, even on a busy
host."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.runtime.straggler import Blame

SLEEP_S = 0.06  # per forward on the slow rank: far above a tiny model's step on two ranks


def _train_with_a_slow_rank(tmp: str, slow: int | None) -> list[dict]:
    """20 steps of plait train at dp=2 with reports every 10; ``slow``'s forwards sleep. Returns
    the steps' "stragglers" records (rank 0 writes the metrics)."""
    import time

    import torch.distributed as dist
    from oracle import TRAIN_BASE

    from plait import comm
    from plait.app.train import TrainConfig, train
    from plait.models.gpt import GPT

    original = GPT.forward

    def sleepy(self, *args, **kwargs):
        time.sleep(SLEEP_S)
        return original(self, *args, **kwargs)

    if dist.get_rank() == slow:
        GPT.forward = sleepy  # type: ignore[method-assign]
    try:  # blame reads the waits of the desync check, plait train's default (the pools run without it)
        with comm.desync_check("fast"):
            train(TrainConfig.from_flags(**{**TRAIN_BASE, "run_dir": tmp, "name": "r", "strategy": "ddp",
                                            "nproc": 2, "steps": 20, "straggler_every": 10}))
    finally:
        GPT.forward = original  # type: ignore[method-assign]
    if dist.get_rank() != 0:
        return []
    rows = [json.loads(line) for line in (Path(tmp) / "r" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "stragglers" in r]


@pytest.mark.parametrize("slow", [1, 0])
def test_a_slow_rank_is_named_within_20_steps(pools, tmp_path, slow):
    reports = pools[2].run(_train_with_a_slow_rank, str(tmp_path), slow)[0]
    assert [r["step"] for r in reports] == [10, 20]
    assert reports[0]["stragglers"] == []  # a first window alone names no one
    blamed = [Blame(**b) for r in reports for b in r["stragglers"]]
    assert blamed, "no straggler named by step 20"
    assert {b.rank for b in blamed} == {slow} and {b.axis for b in blamed} == {"dp"}, blamed
    # Over the window of 10 steps the peer waited about 10 x SLEEP_S for it.
    assert all(b.waited_s > 5 * SLEEP_S for b in blamed), blamed


def test_an_even_run_raises_no_alarm(pools, tmp_path):
    reports = pools[2].run(_train_with_a_slow_rank, str(tmp_path), None)[0]
    assert [r["step"] for r in reports] == [10, 20]
    assert all(r["stragglers"] == [] for r in reports), reports


def test_blame_with_the_desync_check_off_is_refused_by_name():
    # It measures the check's waits: with the check off it would name no one, ever.
    from plait import comm
    from plait.runtime.straggler import StragglerTracker

    with comm.desync_check("off"), pytest.raises(ValueError, match="desync check, which is off"):
        StragglerTracker()
    StragglerTracker()  # the default check is on


def _train_with_the_check_off(tmp: str) -> tuple[list[str], list[dict]]:
    """plait train inside a process whose plait.init turned the desync check off (the suite's
    pools do): what rank 0 logged and the steps' records."""
    import logging

    import torch.distributed as dist
    from oracle import TRAIN_BASE

    from plait import comm
    from plait.app.train import TrainConfig, train

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    keep = Keep()
    logging.getLogger("plait.train").addHandler(keep)
    try:
        with comm.desync_check("off"):
            train(TrainConfig.from_flags(**{**TRAIN_BASE, "run_dir": tmp, "name": "r", "strategy": "ddp",
                                            "nproc": 2, "steps": 2, "straggler_every": 1}))
    finally:
        logging.getLogger("plait.train").removeHandler(keep)
    if dist.get_rank() != 0:
        return said, []
    rows = [json.loads(line) for line in (Path(tmp) / "r" / "metrics.jsonl").read_text().splitlines()]
    return said, [r for r in rows if "step" in r]


def test_plait_train_with_the_desync_check_off_says_blame_is_off(pools, tmp_path):
    said, steps = pools[2].run(_train_with_the_check_off, str(tmp_path))[0]
    assert any("straggler blame is off" in s for s in said), said
    assert len(steps) == 2 and not any("stragglers" in r for r in steps), steps
