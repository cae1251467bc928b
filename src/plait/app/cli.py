"""The `plait` command: train, run, bench, check, export, plan."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path

BENCHES = ("ddp", "fsdp", "deepspeed", "tp", "pp", "cp", "moe", "compile", "checkpoint", "memory", "plan",
           "mesh_groups", "heal")


def _bench_package_root() -> Path:
    # bench/ lives at the repository root, beside src/ (benchmarks are not shipped in wheels).
    root = Path(__file__).resolve().parents[3]
    if not (root / "bench" / "common.py").exists():
        raise SystemExit("plait bench needs a source checkout: bench/ was not found beside src/")
    return root


def cmd_bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="plait bench", description="plait vs PyTorch, one run, ratios")
    parser.add_argument("name", choices=BENCHES)
    # A bench's own options (and its --help) come after its name: parse only up to it.
    head = argv[:1] if argv and argv[0] in BENCHES else argv
    args = parser.parse_args(head)
    rest = argv[1:] if head is not argv else []
    root = _bench_package_root()
    sys.path.insert(0, str(root))
    module = importlib.import_module(f"bench.{args.name}")
    return int(module.main(rest) or 0)


# What `pip install plait[cli]` adds for the command (the library needs torch only).
CLI_EXTRAS = ("tyro", "tqdm", "safetensors", "tomli", "numpy")
# Each command's module, imported only when it runs: `plait --help` and `plait --version` answer
# without importing torch.
COMMANDS = {"train": "plait.app.train", "run": "plait.app.run", "check": "plait.app.check",
            "export": "plait.app.export", "plan": "plait.app.plan.cli"}
USAGE = ("usage: plait [--version] {train,run,bench,check,export,plan} ...\n"
         "  train  train a model (built-in, a transformers config or your own) on text or tokens\n"
         "  run    launch a script on one or many machines (wraps torch.distributed.run)\n"
         "  bench  plait vs PyTorch side by side: " + ", ".join(BENCHES) + "\n"
         "  check  a model in a layout against one process, step by step (FACTORY = module:function)\n"
         "  export a checkpoint as safetensors weights, under the model's own names\n"
         "  plan   memory and step time of a layout on a cluster before renting it; --search ranks them")


def _command(name: str) -> Callable[[list[str]], int | None]:
    if name == "bench":
        return cmd_bench
    return importlib.import_module(COMMANDS[name]).cli_main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--version":
        from plait import __version__

        print(f"plait {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or (argv[0] not in COMMANDS and argv[0] != "bench"):
        print(USAGE)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        command = _command(argv[0])
    except ModuleNotFoundError as e:
        if e.name not in CLI_EXTRAS:
            raise
        print(f"plait: the command needs {e.name!r}, one of the command's extras: pip install 'plait[cli]'",
              file=sys.stderr)
        return 2
    return int(command(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
