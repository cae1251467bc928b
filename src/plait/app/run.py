"""`plait run`: launch a script on one or many machines (a thin wrapper of torchrun).

Every flag of ``torch.distributed.run`` may come before the script (``--nproc-per-node``,
``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``, ``--rdzv-backend``, ``--max-restarts``,
...), spelled in full; everything after the script (or after ``-m module``) goes to the script
untouched, so a script that calls ``plait.init()`` runs the same way on a laptop and on a
cluster::

    plait run --nproc-per-node 4 train.py --my-flag           # one machine, 4 ranks
    plait run --nproc-per-node 2 -m plait train --nproc 2  # a module, its own flags
    plait run --nnodes 2 --node-rank 0 --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint head:29500 train.py  # on each of 2 machines
"""

from __future__ import annotations

import argparse
import os
import sys


class LaunchError(ValueError):
    """The launcher's own part of the command line is wrong (before the script)."""


def split_argv(argv: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], str, list[str]]:
    """Split ``argv`` into the launcher's options, the script (or module) and the script's args.

    torchrun's own parser sees the whole line and lets argparse abbreviate, so a script flag
    such as ``--nproc`` is taken for an ambiguous ``--nproc-per-node`` and the launch fails.
    Here only the options before the script are parsed; the script's arguments never reach
    the launcher's parser. ``--`` may end the launcher's options explicitly.
    """
    # The option strings and whether each takes a value, from torchrun's own parser.
    takes_value = {opt: action.nargs != 0 for action in parser._actions for opt in action.option_strings}
    own: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-") or arg == "-":
            break
        name = arg.split("=", 1)[0]
        if name not in takes_value:
            raise LaunchError(f"plait run: unknown launcher option {arg!r} before the script (options of "
                              "torch.distributed.run, spelled in full, go before the script; the script's "
                              "own go after it)")
        width = 2 if takes_value[name] and "=" not in arg else 1
        own += argv[i:i + width]
        i += width
    if i >= len(argv):
        raise LaunchError("plait run: no script given (expected e.g. `plait run --nproc-per-node 2 train.py` "
                          "or `plait run --nproc-per-node 2 -m package.module`)")
    return own, argv[i], argv[i + 1:]


# How long the launchers wait for every node to (re)join, when --rdzv-conf does not say: longer than
# plait train's step timeout (3 x --timeout, 900 s by default), so a node still waiting out its own
# timeouts after a failure is not left behind (torchrun's own default is 600 s). docs/failures.md.
RENDEZVOUS_TIMEOUT_S = 1200


def with_rendezvous_timeout(conf: str, backend: str) -> str:
    """``--rdzv-conf`` with the rendezvous timeout set, unless the user set it."""
    key = "timeout" if backend == "static" else "join_timeout"  # the static backend's name for it
    given = {item.split("=", 1)[0].strip() for item in conf.split(",") if item.strip()}
    if key in given:
        return conf
    return ",".join(filter(None, [conf, f"{key}={RENDEZVOUS_TIMEOUT_S}"]))


# torch's c10d (dynamic) rendezvous shares its own TCPStore with the ranks by default, and then
# builds the round's bootstrap information (MASTER_ADDR, MASTER_PORT) only on a launcher's first
# round: a launcher that survived a node's death enters the next round with it cached and never
# writes ``torch.rendezvous.<id>.<round>/MASTER_ADDR``, which the node started again waits for,
# while the survivor waits for that node's ``torchelastic/role_info/<rank>`` (torch 2.13,
# dynamic_rendezvous.next_rendezvous). Without sharing, every launcher builds it every round and
# the ranks meet through a store of the round's own (on a fresh port), so only the dead node
# needs starting again. The static rendezvous ignores the variable. docs/launch.md.
NO_SHARED_STORE = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def cli_main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.run import get_args_parser, run

    parser = get_args_parser()
    parser.prog = "plait run"
    parser.allow_abbrev = False  # the launcher's options are spelled in full, as split_argv reads them
    try:
        own, script, script_args = split_argv(argv, parser)
    except LaunchError as e:
        print(e, file=sys.stderr)
        return 2
    args = parser.parse_args([*own, script])
    args.rdzv_conf = with_rendezvous_timeout(args.rdzv_conf, args.rdzv_backend)
    args.training_script_args = script_args  # exactly as given, never parsed here
    os.environ.setdefault(*NO_SHARED_STORE)  # read by this process's rendezvous handler; set to 0 to share
    try:
        record(run)(args)  # torchrun's error files, as its own entry point writes them
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr)
        return 1
    return 0
