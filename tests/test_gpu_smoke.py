"""bench/gpu_smoke.py runs its checks on CPU + Gloo (`--cpu`), so the script is exercised here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_smoke.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_every_check_passes_on_cpu():
    res = _run("--cpu")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [line for line in res.stdout.splitlines() if line[:4] in ("PASS", "FAIL", "SKIP")]
    assert len(lines) == 12 and all(line.startswith("PASS") for line in lines), res.stdout
    assert "| check | result | seconds | detail |" in res.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_everything_is_skipped_and_the_exit_code_says_so(capsys):
    # In this process: without a device the script starts nothing (no process group, no ranks).
    if str(SCRIPT.parents[1]) not in sys.path:  # bench/ is a package beside src/, not installed
        sys.path.insert(0, str(SCRIPT.parents[1]))
    from bench.gpu_smoke import main

    assert main(["--only", "ddp,fsdp-zero3"]) == 2
    out = capsys.readouterr().out
    first = [line.split()[:2] for line in out.splitlines()[:2]]
    assert first == [["SKIP", "ddp"], ["SKIP", "fsdp-zero3"]]
