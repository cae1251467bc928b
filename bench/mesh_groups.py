"""What building a `plait.Mesh` costs each rank at 1,024 and 4,096 ranks, read from a dry run.

One process stands in for one rank of the world (`plait.runtime.env.dry_run`: torch's fake process group,
so no peer is needed) and builds the mesh. Counted on that rank:

* ``new_group`` calls: every call to `torch.distributed.new_group` while the mesh is built, the
  ones this rank makes as a non-member of a world-collective group included;
* groups held: the calls that returned a group this rank belongs to;
* TCP peers: the sum over the Gloo groups this rank holds of (size - 1), the connections Gloo
  opens to them. On CPUs every group is a Gloo group; on GPUs only the desync check's companions
  are (the data groups are NCCL's), so they are also given apart;
* construction seconds: the wall time of ``Mesh(...)``. A dry run leaves out the rendezvous of a
  real start-up (each group's members meeting through the store), which grows with the number
  of groups held; what it measures is the work of deciding and making them.

A dry run makes no desync-check companions (its fake groups carry nothing to compare), so here
the mesh is built with the CPU device set in `plait.comm`, as a Gloo run makes it, and every
Gloo group asked for is made as a fake one that stands for it. Each layout runs in a fresh
process (a dry run refuses to start where a process group exists), at rank 0: every rank of these
layouts holds the same number of groups of each size.

Run: ``plait bench mesh_groups`` (or ``python -m bench.mesh_groups``); ``--baseline REV`` measures
the library as of a git revision too, from its ``src/`` (extracted with ``git archive``), beside
the working tree's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import BENCH_DIR, markdown_table, write_section

LAYOUTS: list[dict[str, int]] = [
    {"pp": 8, "fsdp": 16, "tp": 8},
    {"pp": 4, "dp": 2, "fsdp": 16, "cp": 2, "tp": 4, "ep": 4},
    {"pp": 8, "fsdp": 64, "tp": 8},
    {"pp": 8, "dp": 4, "fsdp": 16, "cp": 2, "tp": 4, "ep": 8},
]
ROOT = BENCH_DIR.parent


def measure(degrees: dict[str, int], rank: int = 0) -> dict[str, Any]:
    """Build ``Mesh(**degrees)`` in a dry run as ``rank``; the counts above. Needs a fresh process."""
    import math
    import time

    import torch
    import torch.distributed as dist

    from plait import comm
    from plait.runtime.env import dry_run
    from plait.runtime.mesh import Mesh

    world = math.prod(d for a, d in degrees.items() if a != "ep")
    made: list[dict[str, Any]] = []
    real_new_group = dist.new_group

    def counting_new_group(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        gloo = kwargs.get("backend") == "gloo"
        if gloo:  # the fake backend stands for Gloo: a real Gloo group would wait for its peers
            kwargs["backend"] = "fake"
        pg = real_new_group(ranks, *args, **kwargs)
        member = pg is not None and pg is not dist.GroupMember.NON_GROUP_MEMBER
        size = world if ranks is None else len(ranks)
        made.append({"gloo": gloo, "member": member, "size": size})
        return pg

    dist.new_group = counting_new_group
    try:
        with dry_run(world, rank):
            comm.configure(device=torch.device("cpu"))  # companions as a CPU run makes them
            t0 = time.perf_counter()
            Mesh(**degrees)
            seconds = time.perf_counter() - t0
    finally:
        dist.new_group = real_new_group
    held = [g for g in made if g["member"]]
    return {"world": world, "calls": len(made), "held": len(held),
            "one_rank": sum(g["size"] == 1 for g in held),
            "peers": sum(g["size"] - 1 for g in held),
            "companion_peers": sum(g["size"] - 1 for g in held if g["gloo"]),
            "seconds": seconds}


def _measure_in_fresh_process(degrees: dict[str, int], src: Path) -> dict[str, Any]:
    code = ("import json, sys; from bench.mesh_groups import measure; "
            f"print(json.dumps(measure({degrees!r})))")
    env = {"PYTHONPATH": f"{src}:{ROOT}", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         check=False, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"measuring {degrees} with {src} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _baseline_src(rev: str, into: Path) -> Path:
    """``src/`` of the library as of ``rev``, extracted into ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "src"


def _name(degrees: dict[str, int]) -> str:
    return " x ".join(f"{a}{d}" for a, d in degrees.items())


def _rows(results: dict[str, list[dict[str, Any]]]) -> list[list[object]]:
    rows: list[list[object]] = []
    for i, degrees in enumerate(LAYOUTS):
        for version, per_layout in results.items():
            r = per_layout[i]
            rows.append([r["world"], _name(degrees), version, r["calls"], r["held"], r["one_rank"],
                         r["peers"], r["companion_peers"], round(r["seconds"], 4)])
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="plait bench mesh_groups", description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="also measure the library as of this git revision")
    args = parser.parse_args(argv)
    versions = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            versions[f"before ({args.baseline})"] = _baseline_src(args.baseline, Path(tmp))
        versions["this tree" if not args.baseline else "after"] = ROOT / "src"
        results = {v: [_measure_in_fresh_process(d, src) for d in LAYOUTS] for v, src in versions.items()}
    header = ["world", "layout", "code", "new_group calls", "groups held", "one-rank groups",
              "TCP peers (all Gloo)", "of which companions", "construction (s)"]
    table = markdown_table(header, _rows(results))
    print(table)
    body = (f"Per rank (rank 0), building the mesh in a dry run (`plait.runtime.env.dry_run`, torch's "
            f"fake process group standing for every group). TCP peers: the sum over this rank's groups of "
            f"(size - 1) when every group is Gloo (a CPU run); on GPUs only the desync check's Gloo "
            f"companions open TCP connections (last but one column). Construction time leaves out each "
            f"group's rendezvous.\n\n"
            f"{table}\n")
    command = "plait bench mesh_groups" + (f" --baseline {args.baseline}" if args.baseline else "")
    write_section("mesh_groups", "Mesh construction: process groups per rank at 1,024 and 4,096 ranks", body,
                  command)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
