"""Faults injected on 2 Gloo ranks: a frozen rank, skipped, swapped or mismatched collectives.

The pool's ranks are initialised the way a user's are (`plait.init(timeout_s=TIMEOUT_S)`), and
the groups under test are the ones plait makes (mesh axes, pipeline directions, weight ties):
nothing here builds its own group with a timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from plait import comm
from plait.testing import RankFailure, RankPool, cached_mesh

TIMEOUT_S = 4.0
# A failed rank waits up to comm's arrival grace (3 s) for its peers' reports, then writes its
# flight record; 4 s more leaves room for a loaded machine.
BOUND_S = TIMEOUT_S + 7.0


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = RankPool(2, timeout_s=TIMEOUT_S, run_dir=str(tmp_path_factory.mktemp("run")))
    yield p
    p.close()


# ------------------------------------------------------------------ frozen ranks
def _freeze_rank1_then(fn_name: str, pids: list[int]) -> tuple[float, str]:
    """Rank 1 stops (SIGSTOP) at step 50; rank 0 runs ``fn_name`` and reports how it ended."""
    work = globals()[fn_name]
    setup = work(None)  # both ranks build the groups (collective), then rank 1 freezes
    comm.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        return 0.0, "resumed"  # never reached: rank 0 kills this process
    time.sleep(0.2)  # rank 1 is stopped by now
    t0 = time.monotonic()
    try:
        with comm.scope("step 50"):
            work(setup)
        message = "no error"
    except comm.CollectiveError as e:
        message = str(e)
    elapsed = time.monotonic() - t0
    os.kill(pids[1], signal.SIGKILL)
    return elapsed, message


def _mesh_all_reduce(setup):
    group = cached_mesh(dp=2).group("dp")
    if setup is not None:
        comm.all_reduce(torch.ones(3), group)
    return group


def _pipeline_step(setup):
    from oracle import tiny_gpt

    from plait.models.gpt import lm_loss
    from plait.pipeline import pipeline

    batch = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    if setup is None:  # build, and run one step so that shapes are known and messages flow
        with torch.device("meta"):
            model = tiny_gpt(tie_embeddings=True)
        setup = pipeline(model, cached_mesh(pp=2), schedule="1f1b", microbatches=2, loss_fn=lm_loss,
                         p2p="directed")
    setup.step(batch[:, :-1], batch[:, 1:])
    return setup


def _tie_all_reduce(setup):
    pipe = _pipeline_step(None) if setup is None else setup
    if setup is not None:  # the step's backward left rank 0 at the tie's all-reduce; now rank 1 is gone
        tied, = pipe._tied  # the tied embedding / LM head copy and the group of its copies
        comm.all_reduce(torch.ones(2), tied.group)
    return pipe


def _frozen(pool: RankPool, fn_name: str) -> tuple[float, str]:
    with pytest.raises(RankFailure) as info:
        pool.run(_freeze_rank1_then, fn_name, pool.pids())
    assert info.value.errors == {1: "died"}, info.value.errors
    return info.value.results[0]


def _skip_last() -> str:
    group = cached_mesh(dp=2).group("dp")
    if dist.get_rank() == 1:
        return "skipped"
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(3), group)
    except comm.CollectiveError as e:
        return f"{time.monotonic() - t0:.1f} s: {e}"
    return "no error"


def _skipped(pool: RankPool, _: str) -> tuple[str, str]:
    return tuple(pool.run(_skip_last))  # type: ignore[return-value]


STALLS = {"_mesh_all_reduce": _frozen, "_pipeline_step": _frozen, "_tie_all_reduce": _frozen,
          "_skip_last": _skipped}


@pytest.fixture(scope="module")
def stalled(tmp_path_factory) -> dict[str, tuple[Any, str]]:
    """Each stall (a frozen rank 1 in three places, a collective rank 1 skips) on a pool of its
    own, all at the same time: each spends its seconds waiting out the timeout, so together they
    take about as long as one. Returns each one's (outcome, flight record folder)."""
    dirs = {name: str(tmp_path_factory.mktemp(name.strip("_"))) for name in STALLS}

    def one(name: str) -> tuple[Any, str]:
        run_dir = dirs[name]
        p = RankPool(2, timeout_s=TIMEOUT_S, run_dir=run_dir)
        try:
            return STALLS[name](p, name), run_dir
        finally:
            p.close()

    with ThreadPoolExecutor(len(STALLS)) as ex:
        return dict(zip(STALLS, ex.map(one, STALLS)))


def test_frozen_rank_ends_its_peer_on_a_mesh_group_within_the_timeout(stalled):
    (elapsed, message), run_dir = stalled["_mesh_all_reduce"]
    assert TIMEOUT_S - 0.5 < elapsed < BOUND_S, (elapsed, message)
    assert "all_reduce of a (3,) torch.float32 tensor on axis 'dp'" in message, message
    assert "ranks [1] did not arrive" in message and "step 50" in message, message
    assert "test_failures.py" in message  # the user's call site
    flight = Path(run_dir) / "flight" / "rank0.jsonl"
    assert str(flight) in message
    lines = [json.loads(x) for x in flight.read_text().splitlines()]
    assert lines[-1]["op"] == "all_reduce" and lines[-1]["label"] == "step 50", lines[-1]


def test_frozen_rank_ends_its_peer_in_a_pipeline_step(stalled):
    (elapsed, message), _ = stalled["_pipeline_step"]
    assert TIMEOUT_S - 0.5 < elapsed < BOUND_S, (elapsed, message)
    # Stage 0 waits for stage 1's gradient on the group of that direction.
    assert "recv of a" in message and "from rank 1 on axis 'pp'" in message, message
    assert "rank 1 never completed its side" in message and "flight" in message, message


def test_frozen_rank_ends_its_peer_on_a_tie_group(stalled):
    (elapsed, message), _ = stalled["_tie_all_reduce"]
    assert TIMEOUT_S - 0.5 < elapsed < BOUND_S, (elapsed, message)
    assert "axis 'pp_tied'" in message and "ranks [1] did not arrive" in message, message


def test_a_collective_skipped_at_the_end_times_out_naming_the_missing_rank(stalled):
    (message, skipped), _ = stalled["_skip_last"]
    assert skipped == "skipped"
    assert "ranks [1] did not arrive" in message, message
    assert float(message.split(" s:")[0]) < BOUND_S


# ------------------------------------------------------------------ desynchronised collectives
def _swapped(a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Two same-size all-reduces that the ranks reach in opposite orders."""
    if dist.get_rank() == 0:
        comm.all_reduce(a, group)
        comm.all_reduce(b, group)
    else:
        comm.all_reduce(b, group)
        comm.all_reduce(a, group)


def _two_calls(case: str) -> list[list[float]]:
    """Rank 0 and rank 1 each call one or two collectives on dp; ``case`` says how they differ."""
    group = cached_mesh(dp=2).group("dp")
    a, b = torch.full((4,), 1.0), torch.full((4,), 10.0)
    mine = dist.get_rank()
    if case == "swapped":
        _swapped(a, b, group)
    elif case == "skipped":
        if mine == 0:
            comm.all_reduce(a, group)
        comm.all_reduce(b, group)
    elif case == "transposed":
        c = torch.ones(2, 3) if mine == 0 else torch.ones(3, 2)
        comm.all_reduce(c, group)
    elif case == "dtype":
        comm.all_reduce(a if mine == 0 else a.double(), group)
    elif case == "reduce_op":
        comm.all_reduce(a, group, op=comm.ReduceOp.SUM if mine == 0 else comm.ReduceOp.MAX)
    return [a.tolist(), b.tolist()]


@pytest.mark.parametrize("case,rank0,rank1", [
    ("swapped", "all_reduce of a (4,) float32 tensor (sum) called at test_failures.py",
     "all_reduce of a (4,) float32 tensor (sum) called at test_failures.py"),
    ("skipped", "called at test_failures.py", "called at test_failures.py"),
    ("transposed", "all_reduce of a (2, 3) float32", "all_reduce of a (3, 2) float32"),
    ("dtype", "(4,) float32", "(4,) float64"),
    ("reduce_op", "(sum)", "(max)"),
])
def test_desync_is_caught_by_default_before_any_data_moves(pool, case, rank0, rank1):
    errors = pool.errors(_two_calls, case)
    calls = []
    for r, want in ((0, rank0), (1, rank1)):
        assert "collective desync on axis 'dp'" in errors[r], errors[r]
        assert want in errors[r], errors[r]
        # Each rank names its own collective at the call number where they parted (the group may have
        # run others before, in tests that ran earlier on this pool).
        calls.append(re.findall(rf"rank {r}: #(\d+) ", errors[r]))
    assert calls[0] and calls[0] == calls[1], errors
    if case == "swapped":  # the two sides name different lines of the user's code
        sites = [line.split("called at ")[1] for line in errors[0].splitlines() if "called at" in line]
        assert len(set(sites)) == 2, errors[0]


def _values_after_a_swap() -> list[list[float]]:
    group = cached_mesh(dp=2).group("dp")
    a, b = torch.full((4,), 1.0), torch.full((4,), 10.0)
    with contextlib.suppress(comm.CollectiveError):
        _swapped(a, b, group)
    return [a.tolist(), b.tolist()]


def test_swapped_collectives_leave_the_data_untouched(pool):
    # Unchecked, each rank would hold 1 + 10 = 11 in both tensors (the reported 21 instead of 3).
    assert pool.run(_values_after_a_swap) == [[[1.0] * 4, [10.0] * 4]] * 2


def _matching(mode: str) -> list[float]:
    with comm.desync_check(mode):
        group = cached_mesh(dp=2).group("dp")
        t = torch.arange(4.0) + dist.get_rank()
        comm.all_reduce(t, group)
        out = torch.empty(4)
        comm.all_gather_into(out, torch.ones(2) * dist.get_rank(), group)
        comm.broadcast(t, 0, group)
        return t.tolist() + out.tolist()


@pytest.mark.parametrize("mode", ["off", "fast", "full"])
def test_matching_collectives_pass_every_check_mode(pool, mode):
    assert pool.run(_matching, mode) == [[1.0, 3.0, 5.0, 7.0, 0.0, 0.0, 1.0, 1.0]] * 2


def _history_of(case: str) -> str:
    """``case`` with the per-call check off, then the whole history compared at once."""
    with comm.desync_check("off"):
        values = _two_calls(case)
    try:
        comm.verify_history()
    except comm.CollectiveError as e:
        return f"{values}: {e}"
    return f"{values}: no desync"


def test_the_history_compared_at_once_names_the_first_call_that_differed(pool):
    # Unchecked, the swapped all-reduces ran and mixed the data (11 everywhere); the comparison
    # afterwards names both sides of call #1, as the per-call check would have before it ran.
    for r, out in enumerate(pool.run(_history_of, "swapped")):
        mixed = "[[11.0, 11.0, 11.0, 11.0], [11.0, 11.0, 11.0, 11.0]]"
        assert out.startswith(f"{mixed}: collective desync on axis 'dp'"), out
        assert "found afterwards: the calls ran" in out, out
        # The first of the two calls (the axis's earlier calls, other tasks', matched).
        first = re.search(r"at call #(\d+) ", out)
        assert first is not None, out
        assert f"rank {r}: #{first[1]} all_reduce of a (4,) float32 tensor (sum) called at " in out, out
        sites = [line.split("called at ")[1] for line in out.splitlines() if "called at" in line]
        assert len(set(sites)) == 2, out  # each rank's own line
    out = pool.run(_history_of, "reduce_op")
    assert all("collective desync" in o and "(sum)" in o and "(max)" in o for o in out), out
    # Matching histories (this pool's every earlier task included) pass.
    assert pool.run(_matching, "off") == [[1.0, 3.0, 5.0, 7.0, 0.0, 0.0, 1.0, 1.0]] * 2
    assert pool.run(comm.verify_history) == [None, None]


def test_a_pool_that_skips_the_per_call_check_fails_a_task_whose_collectives_differed():
    # The suite's shared pools run so (conftest): a layout that desyncs still fails its test.
    with contextlib.closing(RankPool(2, desync_check="off")) as off:
        with pytest.raises(RankFailure) as info:
            off.run(_two_calls, "swapped")
        errors = info.value.errors
        assert set(errors) == {0, 1}, errors
        assert all("collective desync on axis 'dp'" in e for e in errors.values()), errors


def _full_mode_desync() -> None:
    with comm.debug():
        _two_calls("transposed")


def test_full_mode_names_both_sides(pool):
    errors = pool.errors(_full_mode_desync)
    assert "(2, 3)" in errors[0] and "(3, 2)" in errors[0], errors[0]


# ------------------------------------------------------------------ devices
def _wrong_device() -> str:
    try:
        comm.all_reduce(torch.ones(2, device="meta"), cached_mesh(dp=2).group("dp"))
    except comm.CollectiveError as e:
        return str(e)
    return "no error"


def test_a_tensor_on_another_device_than_the_groups_is_refused_by_name(pool):
    out = pool.run(_wrong_device)
    assert all("the tensor is on meta, but this axis communicates on cpu" in m for m in out), out


def _bookkeeping_made_without_device() -> str:
    """A tensor made in plait's library without device=, as the loss mean once was."""
    import plait

    fake_file = os.path.join(os.path.dirname(plait.__file__), "somewhere.py")
    code = compile("torch.tensor([1.0])", fake_file, "eval")
    made_in_plait = eval(code, {"torch": torch})
    try:
        comm.all_reduce(made_in_plait, cached_mesh(dp=2).group("dp"))
    except comm.CollectiveError as e:
        return str(e)
    return "no error"


def test_the_pool_audit_catches_a_bookkeeping_tensor_made_without_a_device(pool):
    # On CPU it would pass unnoticed; on NCCL the all-reduce of a CPU tensor fails.
    out = pool.run(_bookkeeping_made_without_device)
    assert all("made without device= at somewhere.py:1" in m for m in out), out


def _async_transposed() -> None:
    """An asynchronous collective (as DDP's buckets are) is verified when it is waited on."""
    c = torch.ones(2, 3) if dist.get_rank() == 0 else torch.ones(3, 2)
    handle = comm.all_reduce(c, cached_mesh(dp=2).group("dp"), async_op=True)
    assert handle is not None
    handle.wait()


def test_an_asynchronous_collective_is_checked_before_its_result_is_used(pool):
    errors = pool.errors(_async_transposed)
    assert all("collective desync" in e and "(2, 3)" in e and "(3, 2)" in e for e in errors.values()), errors


def _unchecked_run_swapped() -> None:
    """Two same-size asynchronous all-reduces in opposite orders, only the second checked (as DDP's
    buckets share the last one's check): the data of both has moved, mixed, when the check runs."""
    group = cached_mesh(dp=2).group("dp")
    a, b = torch.full((4,), 1.0), torch.full((4,), 10.0)
    if dist.get_rank() == 0:
        handles = [comm.all_reduce(a, group, async_op=True, checked=False),
                   comm.all_reduce(b, group, async_op=True)]
    else:
        handles = [comm.all_reduce(b, group, async_op=True, checked=False),
                   comm.all_reduce(a, group, async_op=True)]
    for h in reversed(handles):  # the checked one's verdict first, as DDP reads it
        assert h is not None
        h.wait()


def test_a_run_of_collectives_checked_at_its_last_names_the_first_that_differs(pool):
    # The call number is the group's count of calls so far (earlier tasks on the pool's group count
    # too); the report names the first call of the run on each rank: each branch's first line.
    import inspect
    import re

    lines, start = inspect.getsourcelines(_unchecked_run_swapped)
    first = [start + i for i, line in enumerate(lines) if "handles = [comm.all_reduce(" in line]
    errors = pool.errors(_unchecked_run_swapped)
    for r in (0, 1):
        assert "collective desync on axis 'dp'" in errors[r], errors[r]
        at = re.search(r"at call #(\d+) of that axis", errors[r])
        assert at is not None, errors[r]
        for other, line in zip((0, 1), first, strict=True):
            named = f"rank {other}: #{at[1]} all_reduce of a (4,) float32 tensor (sum)"
            assert f"{named} called at test_failures.py:{line}" in errors[r], (named, line, errors[r])


def _checks_in_a_ddp_backward() -> tuple[int, int]:
    """(buckets, fingerprint comparisons) of one DDP backward."""
    from torch import nn

    import plait
    from plait.runtime.comm import guard

    mesh = cached_mesh(dp=2)
    model = plait.DDP(nn.Sequential(*(nn.Linear(64, 64) for _ in range(4))), mesh, bucket_cap_mb=0.02)
    model(torch.randn(2, 64)).sum()  # a forward and loss without backward first: nothing checked
    real, calls = guard.check, []

    def counting(*args, **kwargs):
        calls.append(args[1].op)
        return real(*args, **kwargs)

    guard.check = counting
    try:
        model(torch.randn(2, 64)).sum().backward()
    finally:
        guard.check = real
    return len(model._buckets), len(calls)


def test_a_ddp_backward_compares_fingerprints_once_whatever_its_buckets(pool):
    buckets, checks = pool.run(_checks_in_a_ddp_backward)[0]
    assert buckets >= 4 and checks == 1, (buckets, checks)


# ------------------------------------------------------------------ the test pool itself
def _sleep_past_the_deadline() -> None:
    time.sleep(30)


def test_a_pool_whose_every_rank_hangs_says_where_and_starts_afresh(tmp_path):
    """A task no rank answers (stuck, not raising) fails with each rank's stacks, and the pool's
    next task runs on new ranks: a pool left as it was would make every later test wait out its
    deadline in turn."""
    p = RankPool(2, timeout_s=1.0, run_dir=str(tmp_path))
    try:
        before = p.run(os.getpid)  # started (the start has the default grace)
        p.answer_grace_s = 1.0
        with pytest.raises(RankFailure) as info:
            p.run(_sleep_past_the_deadline)
        assert sorted(info.value.errors) == [0, 1]
        for text in info.value.errors.values():
            assert text.startswith("no answer (hung)"), text
            assert "_sleep_past_the_deadline" in text, text
        p.answer_grace_s = 30.0  # the new ranks' start
        assert p.run(os.getpid) == p.pids() and set(p.pids()).isdisjoint(before)
    finally:
        p.close()
