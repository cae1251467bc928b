"""`plait run`: launch a script on one or many machines (a thin wrapper of torchrun).

Every flag of ``torch.distributed.run`` passes through unchanged (``--nproc-per-node``,
``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``, ``--rdzv-backend``, ``--max-restarts``,
...), so a script that calls ``plait.init()`` runs the same way on a laptop and on a cluster::

    plait run --nproc-per-node 4 train.py --my-flag           # one machine, 4 ranks
    plait run --nnodes 2 --node-rank 0 --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint head:29500 train.py  # on each of 2 machines
"""

from __future__ import annotations

import sys


def cli_main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    from torch.distributed.run import main as torchrun_main

    if not any(not a.startswith("-") and (a.endswith(".py") or a == "-m") for a in argv) and "-m" not in argv:
        print("plait run: no script given (expected e.g. `plait run --nproc-per-node 2 train.py`)",
              file=sys.stderr)
        return 2
    torchrun_main(argv)
    return 0
