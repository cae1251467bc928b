"""A job whose ranks all finished exits with code 0 on every rank, launch after launch.

Each rank's Gloo groups run on C++ threads; a process that ends right after its last
collective used to abort now and then at interpreter exit ("terminate called without an
active exception"). `plait.init` registers a teardown (barriers, then every group destroyed in
order, then plait's threads joined) that must make every launch end cleanly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from plait.env import free_port

LAUNCHES = 10
AT_ONCE = 2  # launches running side by side (each is 2 processes)

# Ends right after its last collective: the moment the abort used to strike.
JOB = textwrap.dedent("""
    import torch
    from torch import nn

    import plait
    from plait import comm

    plait.init()
    mesh = plait.Mesh(dp=2)
    t = torch.ones(8)
    comm.all_reduce(t, mesh.group("dp"))
    assert t[0].item() == 2.0
    model = plait.DDP(nn.Linear(4, 2), mesh)
    model(torch.randn(3, 4)).sum().backward()
""")


def _start(script: Path) -> list[subprocess.Popen]:
    """Two ranks with the variables torchrun would set (a launcher process adds nothing here)."""
    env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for r in range(2)]


def test_every_rank_of_every_launch_exits_cleanly(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    failures = []
    for first in range(0, LAUNCHES, AT_ONCE):
        running = [(first + i, _start(script)) for i in range(AT_ONCE)]
        for launch, ranks in running:
            for rank, proc in enumerate(ranks):
                _, err = proc.communicate(timeout=180)
                if proc.returncode != 0 or "terminate called" in err:
                    failures.append(f"launch {launch} rank {rank}: exit {proc.returncode}\n{err[-2000:]}")
    assert not failures, f"{len(failures)} of {2 * LAUNCHES} ranks failed:\n" + "\n".join(failures)
