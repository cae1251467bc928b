"""Replicas that heal without a restart (``plait train --heal``): a replica killed with ``kill -9``
is dropped, the survivors redo the step over the live replicas with the same global batch, and a
replacement joins at a step boundary with a peer's state, every process of the run kept alive."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from plait.runtime.heal import Epoch, Quorum, split

# A tiny byte-level run whose learning rate is constant after the first step (--min-lr-ratio 1), so
# its first K steps are the same whatever --steps says: the healed run is stopped by a signal once
# the replacement trained in step and K steps are done, and compared with a one-process run of K
# steps, which trains meanwhile.
RUN = ["--model", "tiny", "--batch-size", "8", "--max-bytes", "200000", "--eval-every", "0", "--warmup", "1",
       "--min-lr-ratio", "1", "--no-progress", "--log-samples"]
COMPARED = 24  # steps compared with the one-process run
LOSS_RTOL = 1e-5  # float32: the same sums over other shares of the batch (measured: 3e-7 over 150 steps)
STEPS_AFTER_JOIN = 10


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _steps(metrics: Path) -> dict[int, dict]:
    """Each step's record; a step recorded twice (its leader died after writing it) counts as its last."""
    return {r["step"]: r for r in _rows(metrics) if "step" in r}


def _wait(what: str, ready, job: subprocess.Popen, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not (found := ready()):
        if job.poll() is not None:
            raise AssertionError(f"the run ended before {what}: {job.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return found


def _train(tmp_path: Path, name: str, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "plait", "train", *flags, "--run-dir", str(tmp_path), "--name", name, *RUN]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


class _OneProcess:
    """The one-process run of COMPARED steps that every healed run is held against (the same flags:
    the same samples and losses), started once for the module beside the first healed run."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.job = _train(folder, "one", "--strategy", "none", "--nproc", "1", "--steps", str(COMPARED))
        self._steps: dict[int, dict] | None = None

    def steps(self) -> dict[int, dict]:
        if self._steps is None:
            _, err = self.job.communicate(timeout=300)
            assert self.job.returncode == 0, err[-3000:]
            self._steps = _steps(self.folder / "one" / "metrics.jsonl")
            assert sorted(self._steps) == list(range(1, COMPARED + 1))
        return self._steps


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    one = _OneProcess(tmp_path_factory.mktemp("heal_reference"))
    yield one
    if one.job.poll() is None:
        os.killpg(one.job.pid, signal.SIGKILL)


# (flags, the killed process as (replica uid, process index), the standby's uid, the members after
# its join, the processes per replica)
LAYOUTS = {
    "ddp": (["--nproc", "4"], (2, 0), 4, [0, 1, 3, 4], 1),
    # HSDP 2 x 2: two replicas, each sharding the model over 2 processes; one process killed takes
    # its replica down, a standby replica of 2 processes replaces it.
    "hsdp": (["--strategy", "fsdp", "--dp", "2", "--nproc", "4"], (1, 1), 2, [0, 2], 2),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_killed_replica_is_healed_around_and_its_replacement_trains_in_step(tmp_path, layout, one_process):
    """``kill -9`` of one process after step 5 (dp 4: a replica; HSDP 2x2: a process of a replica,
    which ends its replica). The other replicas finish that step over themselves, the supervisor
    wakes its standby replica, which joins at a step boundary with a peer's state; a SIGTERM then
    stops every replica after the same step. Against one process on the same global batch: every
    step read exactly the same samples (none skipped or read twice) and has the same loss up to
    float32 rounding; every replica ends with bit-equal parameters (shard by shard under HSDP)."""
    flags, (killed_uid, killed_index), standby, members, per = LAYOUTS[layout]
    heal, metrics = tmp_path / "healed" / "heal", tmp_path / "healed" / "metrics.jsonl"

    def events(uid: int, index: int = 0) -> list[dict]:
        return _rows(heal / (f"uid{uid}.{index}.jsonl" if per > 1 else f"uid{uid}.jsonl"))

    job = _train(tmp_path, "healed", "--heal", *flags, "--steps", "100000", "--heal-timeout", "5")
    try:
        _wait("step 5", lambda: max(_steps(metrics), default=0) >= 5, job)
        starts = [e for e in _rows(heal / "supervisor.jsonl") if e["event"] == "start"]
        os.kill(next(e["pid"] for e in starts if (e["uid"], e["index"]) == (killed_uid, killed_index)),
                signal.SIGKILL)
        killed = time.time()
        at_kill = max(_steps(metrics))  # the step in flight is at most the one after the next
        join = _wait("the replacement to join",
                     lambda: next((e for e in events(standby) if e["event"] == "epoch"), None), job)
        enough = max(join["step"] + STEPS_AFTER_JOIN, COMPARED)
        _wait(f"step {enough}", lambda: max(_steps(metrics), default=0) >= enough, job)
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 128 + signal.SIGTERM, err[-3000:]  # stopped as asked, as plait train reports it

    got = _steps(metrics)
    last, full = max(got), len(members)
    assert sorted(got) == list(range(1, last + 1))
    lost = [s for s, r in got.items() if r["replicas"] == full - 1]
    assert lost and min(lost) <= at_kill + 2 and all(got[s]["replicas"] == full for s in range(1, min(lost)))
    assert got[last]["replicas"] == full
    recovered = got[min(lost)]["time"] - killed
    assert recovered < 5, f"{recovered:.2f} s from the kill to the next completed step"

    # The replacement received the state, and every replica ended at the same step, bit for bit.
    assert join["received_state"] and join["members"] == members
    assert join["time"] - killed < 5  # the standby, loaded ahead, joins at the next step boundary
    for index in range(per):
        finished = [e for uid in members for e in events(uid, index) if e["event"] == "finished"]
        assert len(finished) == full, finished
        assert len({(e["step"], e["params_sha256"]) for e in finished}) == 1, finished
        assert finished[0]["step"] == last

    want = one_process.steps()
    assert all(got[s]["samples"] == want[s]["samples"] for s in want)  # no sample skipped or read twice
    for s in want:
        assert abs(got[s]["loss"] - want[s]["loss"]) <= LOSS_RTOL * abs(want[s]["loss"]), s


def test_a_hung_replica_is_dropped_within_the_bound_and_rejoins_when_it_wakes(tmp_path, one_process):
    """dp 2 under ``--heal --heal-timeout 2``: one replica stopped with SIGSTOP (it hangs, its sockets
    stay open, the supervisor sees nothing die). The other's collective times out, it waits the
    quorum's bound for an answer and goes on alone: its next step completes within 3 x the timeout
    (plus a step). Continued with SIGCONT, the stopped replica finds itself dropped, asks to join
    and takes its peer's state at a step boundary. Every step read the same samples as one process,
    with the same loss; both replicas end bit-equal."""
    timeout = 2.0
    heal, metrics = tmp_path / "healed" / "heal", tmp_path / "healed" / "metrics.jsonl"
    job = _train(tmp_path, "healed", "--heal", "--nproc", "2", "--no-heal-replace", "--steps", "100000",
                 "--heal-timeout", str(timeout))
    hung = None
    try:
        _wait("step 3", lambda: max(_steps(metrics), default=0) >= 3, job)
        starts = [e for e in _rows(heal / "supervisor.jsonl") if e["event"] == "start"]
        hung = next(e["pid"] for e in starts if e["uid"] == 1)
        os.kill(hung, signal.SIGSTOP)
        stopped = time.time()
        alone = _wait("a step without the hung replica",
                      lambda: next((r for r in _steps(metrics).values() if r["replicas"] == 1), None), job)
        os.kill(hung, signal.SIGCONT)
        back = _wait("the hung replica to rejoin",
                     lambda: next((e for e in _rows(heal / "uid1.jsonl")
                                   if e["event"] == "epoch" and e["time"] > stopped), None), job)
        enough = max(back["step"] + 5, COMPARED)
        _wait(f"step {enough}", lambda: max(_steps(metrics), default=0) >= enough, job)
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=60)
    finally:
        if hung is not None:  # a stopped replica would not act on its parent's death
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGCONT)
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert alone["time"] - stopped < 3 * timeout + 2, f"{alone['time'] - stopped:.2f} s to go on alone"
    assert back["received_state"] and back["members"] == [0, 1]

    got, want = _steps(metrics), one_process.steps()
    last = max(got)
    assert sorted(got) == list(range(1, last + 1)) and got[last]["replicas"] == 2
    assert all(got[s]["samples"] == want[s]["samples"] for s in want)  # none skipped or read twice
    for s in want:
        assert abs(got[s]["loss"] - want[s]["loss"]) <= LOSS_RTOL * abs(want[s]["loss"]), s
    finished = [e for uid in (0, 1) for e in _rows(heal / f"uid{uid}.jsonl") if e["event"] == "finished"]
    assert len(finished) == 2 and len({(e["step"], e["params_sha256"]) for e in finished}) == 1, finished


def test_split_shares_every_sample_once():
    for total in (8, 9, 13):
        for parts in range(1, 6):
            shares = [split(total, parts, i) for i in range(parts)]
            assert shares[0][0] == 0 and shares[-1][1] == total
            assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
            assert max(h - lo for lo, h in shares) - min(h - lo for lo, h in shares) <= 1


def test_the_survivors_agree_without_the_dead_and_admit_a_joiner():
    """The store protocol on its own: a member the supervisor marked dead is not waited for, a
    proposal written first is the one every member reads, and joiners come in request order."""
    store = dist.HashStore()
    epoch = Epoch(0, (0, 1, 2, 3), 0, me=0)
    store.set("heal/dead/2", "-9")
    for uid in (1, 3):
        store.set(f"heal/alive/0/{uid}", "1")
    start = time.monotonic()
    survivors = Quorum(store, 0, bound_s=30).recover(epoch)
    assert time.monotonic() - start < 5  # not the 30 s bound: every member answered or is dead
    assert survivors.members == (0, 1, 3) and survivors.number == 1 and survivors.leader
    late = Quorum(store, 3, bound_s=30).recover(Epoch(0, (0, 1, 2, 3), 0, me=3))
    assert late.members == (0, 1, 3)  # the first proposal stands

    Quorum(store, 7, bound_s=1).request_join()
    Quorum(store, 5, bound_s=1).request_join()
    quorum = Quorum(store, 0, bound_s=1)
    assert quorum.pending_joins() == 2
    admitted = quorum.admit(survivors, quorum.pending_joins())
    assert admitted.members == (0, 1, 3, 7, 5) and admitted.joins == 2
    assert Quorum(store, 5, bound_s=1).wait_admission().members == admitted.members


def test_a_silent_member_is_dropped_after_the_bound():
    store = dist.HashStore()
    store.set("heal/alive/0/1", "1")
    start = time.monotonic()
    epoch = Quorum(store, 0, bound_s=0.3).recover(Epoch(0, (0, 1, 2), 0, me=0))
    assert epoch.members == (0, 1) and 0.3 <= time.monotonic() - start < 3


@pytest.mark.parametrize("flags, message", [
    ({"strategy": "fsdp", "nproc": 4}, "needs --dp 2 or more"),
    ({"strategy": "dp", "nproc": 4}, "got --strategy dp"),
    ({"nproc": 4, "tp": 2}, "--tp 2 splits the model"),
    ({"save_every": 10}, "--save-every with --heal"),
])
def test_heal_refuses_what_it_does_not_heal(flags, message):
    from plait.app.config import TrainConfig

    with pytest.raises(ValueError, match=message):
        TrainConfig.from_flags(heal=True, max_bytes=200000, **flags)


def test_heal_flags_need_heal():
    from plait.app.config import TrainConfig

    with pytest.raises(ValueError, match="--heal-timeout applies to --heal only"):
        TrainConfig.from_flags(heal_timeout=3.0, max_bytes=200000)


def test_a_state_transfer_waits_for_every_member_through_the_store_and_not_for_the_dead():
    store = dist.HashStore()
    epoch = Epoch(3, (0, 1), 0, me=0)
    store.add("heal/settled/3", 1)  # member 1 is done
    Quorum(store, 0, bound_s=1).settle(epoch, bound_s=5)
    store.set("heal/dead/1", "-9")
    with pytest.raises(RuntimeError, match=r"replicas \[1\] died"):
        Quorum(store, 0, bound_s=1).settle(Epoch(4, (0, 1), 0, me=0), bound_s=5)


def test_heal_refuses_a_machine_with_cuda_instead_of_leaving_its_gpus_idle(monkeypatch, capsys, tmp_path):
    import torch

    from plait.app import healing
    from plait.app.config import TrainConfig

    cfg = TrainConfig.from_flags(heal=True, max_bytes=200000, nproc=2, run_dir=str(tmp_path), name="gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert healing.cli_main(cfg) == 2
    err = capsys.readouterr().err
    assert "NCCL groups are not healed yet" in err and "CUDA_VISIBLE_DEVICES=" in err
    assert not (tmp_path / "gpu").exists()  # refused before any replica started
