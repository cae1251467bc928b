"""Two nodes on one machine: two `plait run` launchers (``--nnodes 2 --node-rank N``) meeting at one
rendezvous endpoint, as on two hosts. Layouts launched this way reproduce one process, the groups
that must stay inside a node (FSDP's shards under HSDP, tensor parallelism) do, and a node that
dies is named by the other within the collective timeout and, started again alone, rejoins the job,
which resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from oracle import TRAIN_ARGV
from test_exit import descendants

from plait.runtime.env import DEFAULT_TIMEOUT_S, free_port


def _node(node: int, endpoint: str, args: list[str], per_node: int, restarts: int = 0) -> subprocess.Popen:
    """Start node ``node``'s launcher of the job meeting at ``endpoint``: ``args`` is what follows the
    launcher's options (a script or ``-m module`` and its flags)."""
    return subprocess.Popen([sys.executable, "-m", "plait", "run", "--nnodes", "2", "--node-rank", str(node),
                             "--nproc-per-node", str(per_node), "--max-restarts", str(restarts),
                             "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "job",
                             # node 0 hosts the rendezvous (both are "localhost": either might)
                             "--rdzv-conf", f"is_host={int(node == 0)}", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _nodes(args: list[str], per_node: int, restarts: int = 0) -> tuple[str, list[subprocess.Popen]]:
    """Start two launchers, nodes 0 and 1, of one job; the rendezvous endpoint and the launchers."""
    endpoint = f"localhost:{free_port()}"
    return endpoint, [_node(node, endpoint, args, per_node, restarts) for node in (0, 1)]


def _finish(launchers: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    outputs = [p.communicate(timeout=300) for p in launchers]
    return [(p.returncode, out, err) for p, (out, err) in zip(launchers, outputs, strict=True)]


# `plait train` as a script under the launcher (HSDP: replicas across the nodes, shards within),
# then, in the same job, where the mesh's groups lie.
TRAIN_THEN_PLACES = textwrap.dedent("""
    import json, os, sys, torch.distributed as dist
    import plait
    from plait.app.cli import main
    assert main(["train", *sys.argv[2:]]) == 0
    out = {"rank": dist.get_rank(), "node": int(os.environ["GROUP_RANK"])}
    hsdp, dp_tp = plait.Mesh(dp=2, fsdp=2), plait.Mesh(dp=2, tp=2)
    out["hsdp"] = dist.get_process_group_ranks(hsdp.group("fsdp"))
    out["tp"] = dist.get_process_group_ranks(dp_tp.group("tp"))
    # A file per rank: one launcher's ranks share its stdout, and their lines may interleave.
    with open(os.path.join(sys.argv[1], f"rank{out['rank']}.json"), "w") as f:
        json.dump(out, f)
""")


def test_hsdp_on_two_nodes_reproduces_one_process_with_shard_and_tp_groups_inside_a_node(tmp_path, oracle):
    """HSDP 2x2 launched as two nodes (DDP replicas across them, FSDP shards within each) gives one
    process's losses; the mesh keeps FSDP's shard groups and tensor-parallel groups inside a node."""
    script = tmp_path / "job.py"
    script.write_text(TRAIN_THEN_PLACES)
    flags = [*TRAIN_ARGV, "--strategy", "fsdp", "--nproc", "4", "--dp", "2", "--run-dir", str(tmp_path),
             "--name", "two"]
    results = _finish(_nodes([str(script), str(tmp_path), *flags], per_node=2)[1])
    assert all(code == 0 for code, _, _ in results), [err[-2000:] for _, _, err in results]
    rows = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["summary"]["world"] == 4
    assert [r["loss"] for r in rows if "step" in r] == pytest.approx(oracle, rel=1e-4)
    places = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    node_of = {p["rank"]: p["node"] for p in places}
    assert sorted(node_of) == [0, 1, 2, 3] and sorted(node_of.values()) == [0, 0, 1, 1]
    for p in places:
        for axis in ("hsdp", "tp"):
            assert len(p[axis]) == 2 and {node_of[r] for r in p[axis]} == {p["node"]}, (axis, p)


def _samples(metrics: Path) -> dict[int, tuple[float, list[int]]]:
    """Each step's loss and global batch (sample ids); a step run again after a restart counts as its
    last run."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"]: (r["loss"], r["samples"]) for r in rows if "step" in r}


def test_a_killed_node_started_again_alone_rejoins_and_the_job_resumes_exactly(tmp_path):
    """``kill -9`` of node 1's launcher and its ranks mid-training, both launchers under
    ``--max-restarts 1``: node 0's rank sees its peer gone and ends within the collective timeout plus
    5 s (a dead peer's closed connections end the wait at once: seconds, measured here), naming the
    collective and the ranks that did not arrive. Only node 1 is started again, with the same command:
    node 0's launcher, still up, restarts its rank into the new rendezvous round with it, and the job
    resumes from the newest checkpoint: every step's loss and sample ids equal those of a run that
    was never interrupted (needs the launchers' unshared rendezvous store: plait/app/run.py)."""
    steps, every = 16, 6
    flags = [*TRAIN_ARGV, "--steps", str(steps), "--strategy", "ddp", "--nproc", "2", "--log-samples",
             "--save-every", str(every), "--resume", "auto", "--run-dir", str(tmp_path)]
    job = ["-m", "plait", "train", *flags, "--name", "k"]
    endpoint, launchers = _nodes(job, per_node=1, restarts=1)
    # The uninterrupted run it is held against, beside it (launches wait on process starts more
    # than on the CPUs; the runs share nothing but the machine).
    clean = subprocess.Popen([sys.executable, "-m", "plait", "train", *flags, "--name", "clean"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "k" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= every + 2):
        assert all(p.poll() is None for p in launchers) and time.monotonic() < deadline, _finish(launchers)
        time.sleep(0.05)
    survivors = descendants(launchers[0].pid)  # node 0's rank
    # torchrun starts its ranks in sessions of their own: the launcher's process group is not the node.
    node = [launchers[1].pid, *descendants(launchers[1].pid)]
    killed = time.monotonic()
    for pid in node:  # the node: its launcher and every rank it started
        os.kill(pid, signal.SIGKILL)
    while any(Path(f"/proc/{pid}").exists() for pid in survivors):
        assert time.monotonic() - killed < DEFAULT_TIMEOUT_S + 60 and launchers[0].poll() is None
        time.sleep(0.05)
    took = time.monotonic() - killed
    print(f"node 0's rank ended {took:.1f} s after node 1 was killed")
    launchers[1].wait()
    assert took < DEFAULT_TIMEOUT_S + 5, took

    again = _node(1, endpoint, job, per_node=1, restarts=1)  # the same command, on node 1 alone
    results = _finish([launchers[0], again])
    assert all(code == 0 for code, _, _ in results), [r[2][-2000:] for r in results]
    err = results[0][2]
    assert "rank 0: CollectiveError" in err and "ranks [1] did not arrive" in err, err[-3000:]
    resumed = [line for _, _, e in results for line in e.splitlines() if "resumed from" in line]
    assert len(resumed) == 1 and f"step_{every:06d}" in resumed[0], err[-3000:]
    _, clean_err = clean.communicate(timeout=300)
    assert clean.returncode == 0, clean_err[-3000:]
    got, want = _samples(metrics), _samples(tmp_path / "clean" / "metrics.jsonl")
    assert sorted(got) == list(range(1, steps + 1)) == sorted(want)
    assert got == want  # the same batches, and bit for bit the same losses
