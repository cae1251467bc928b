"""Every code block of README.md and docs/*.md runs as written, imports included.

Each ```python block runs on its own, in a fresh namespace as ``__main__``, in an empty folder,
with the RNGs seeded as `plait.init` seeds them. The HTML comment just before a block says how:

* none: one process (a rank pool of one: what ``python block.py`` does);
* ``<!-- run: N ranks -->``: on every rank of an N-rank Gloo job, as ``plait run
  --nproc-per-node N block.py`` runs it;
* ``<!-- run: python NAME.py -->``: written as ``NAME.py`` and run as that command in a fresh
  process (for blocks that spawn processes themselves, which the pool's daemon ranks cannot);
* ``<!-- not run: REASON -->``: shown, not run; few are allowed, and each says why.

Every ``plait train``/``plait plan``/``plait check`` command line of the pages (in shell blocks
and in inline code) must parse, and every ```toml block must be a `plait train --config` file.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_NOT_RUN = 4
TIMEOUT_S = 60

FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
DIRECTIVE = re.compile(r"^\s*<!--\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # 1-based line of the block's first code line
    lang: str
    code: str
    directive: str  # the HTML comment just before the fence, "" if none

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def code_blocks() -> list[Block]:
    found = []
    for path in PAGES:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            opening = FENCE.match(lines[i])
            if not opening:
                i += 1
                continue
            indent, lang = opening.group(1), opening.group(2)
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            body = [line.removeprefix(indent) if line.startswith(indent) else line.lstrip()
                    for line in lines[i + 1:end]]
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            directive = DIRECTIVE.match(before)
            found.append(Block(str(path.relative_to(ROOT)), i + 2, lang, "\n".join(body) + "\n",
                               directive.group(1) if directive else ""))
            i = end + 1
    return found


BLOCKS = code_blocks()
PYTHON = [b for b in BLOCKS if b.lang == "python"]


def _how(block: Block) -> tuple[str, str | int]:
    """("pool", world size), ("python", file name) or ("skip", reason)."""
    d = block.directive
    if not re.match(r"(not )?run\b", d):  # no comment, or one about something else
        return "pool", 1
    if d.startswith("not run:"):
        return "skip", d.removeprefix("not run:").strip()
    if m := re.fullmatch(r"run: (\d+) ranks", d):
        return "pool", int(m.group(1))
    if m := re.fullmatch(r"run: python (\w+\.py)", d):
        return "python", m.group(1)
    raise AssertionError(f"{block.id}: unknown directive <!-- {d} -->")


def _exec_block(code: str, page: str, line: int, folder: str) -> None:
    """Run ``code`` as a fresh ``__main__`` would: RNGs seeded as `plait.init` seeds them, in
    ``folder`` (shared by the job's ranks, as a shared filesystem is). Tracebacks name the page's
    own lines."""
    import torch

    from plait.runtime.env import seed_everything

    seed_everything(0)
    here = os.getcwd()
    os.chdir(folder)
    try:
        exec(compile("\n" * (line - 1) + code, str(ROOT / page), "exec"), {"__name__": "__main__"})
    finally:
        os.chdir(here)
        torch.set_default_dtype(torch.float32)


def test_the_pages_hold_code_and_every_python_block_says_how_it_runs():
    assert len(PYTHON) >= 20
    for block in PYTHON:
        _how(block)  # raises on a directive this test does not know
    skipped = [(b.id, _how(b)[1]) for b in PYTHON if _how(b)[0] == "skip"]
    assert len(skipped) <= MAX_NOT_RUN, f"too many blocks not run: {skipped}"
    assert all(len(str(why)) > 10 for _, why in skipped), skipped


@pytest.mark.parametrize("block", [b for b in PYTHON if _how(b)[0] == "pool"], ids=lambda b: b.id)
def test_python_block_runs(pools, tmp_path, block):
    _, world = _how(block)
    pools[world].run(_exec_block, block.code, block.page, block.line, str(tmp_path))


@pytest.mark.parametrize("block", [b for b in PYTHON if _how(b)[0] == "python"], ids=lambda b: b.id)
def test_python_script_block_runs(tmp_path, block):
    _, name = _how(block)
    (tmp_path / str(name)).write_text(block.code)
    paths = [str(ROOT / "src"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run([sys.executable, str(name)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, (f"{block.id}: python {name} exited {done.returncode}\n"
                                  f"{done.stdout}\n{done.stderr}")


# --- command lines --------------------------------------------------------------------------

def _command_lines(program: str) -> list[tuple[str, str]]:
    """(where, arguments) of every ``plait PROGRAM ...`` the pages show: lines of shell blocks
    and inline code spans. Usage synopses (with ``[...]`` or ``a|b``) are not commands, nor is
    prose naming one flag (``plait train --resume``)."""
    found = []
    for block in BLOCKS:
        if block.lang in ("bash", "console"):
            for k, line in enumerate(block.code.splitlines()):
                if block.lang == "console" and not line.startswith("$ "):
                    continue  # output
                for part in re.split(r"&&|;", line.removeprefix("$ ")):
                    found.append((f"{block.page}:{block.line + k}", part.strip()))
    for path in PAGES:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for span in re.findall(r"`([^`]+)`", line):
                if len(span.split()) > 3 or not span.split()[-1].startswith("--"):
                    found.append((f"{path.relative_to(ROOT)}:{n}", span))
    out = []
    for where, text in found:
        m = re.match(rf"plait {program} (.*)$", text)  # the bare name is a mention, not a command
        if not m or "[" in text or "|" in text or "..." in text:
            continue
        if re.search(r"--(hf-config|init-from|config|data|eval-data) |--model \S+:", text):
            continue  # they name files (or a module) that an earlier block of the page makes
        args = re.split(r"\s[>|]\s", m.group(1))[0]  # drop a redirection
        out.append((where, args))
    return out


def test_every_plait_train_command_line_parses(tmp_path, monkeypatch):
    from plait.app.config import parse_args

    monkeypatch.chdir(tmp_path)  # --save-dir and --run-dir are checked for being writable here
    commands = _command_lines("train")
    assert len(commands) >= 30
    for where, args in commands:
        try:
            parse_args(shlex.split(args, comments=True))
        except SystemExit as e:  # 0: --print-config printed the configuration
            if e.code:
                raise AssertionError(f"{where}: plait train {args} is refused") from e


def test_every_plait_plan_and_check_command_line_parses():
    from plait.app.check import parse_args as check_args
    from plait.app.plan.cli import parse_args as plan_args

    plans, checks = _command_lines("plan"), _command_lines("check")
    assert len(plans) >= 3 and len(checks) >= 1
    for parse, program, commands in ((plan_args, "plan", plans), (check_args, "check", checks)):
        for where, args in commands:
            try:
                parse(shlex.split(args, comments=True))
            except SystemExit as e:
                raise AssertionError(f"{where}: plait {program} {args} is refused") from e


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "toml"], ids=lambda b: b.id)
def test_toml_block_is_a_train_config(tmp_path, block):
    from plait.app.config import parse_args

    run = tmp_path / "run.toml"
    run.write_text(block.code)
    parse_args(["--config", str(run)])


def test_the_readme_test_command_is_the_one_ci_runs():
    readme = (ROOT / "README.md").read_text()
    setup = "python3 -m venv .venv && . .venv/bin/activate && pip install -r requirements-dev.txt -e ."
    assert f"{setup} && python -m pytest tests\n" in readme
    assert f"{setup} && plait train " in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\npython -m pytest tests\n" in ci and "python3 -m venv .venv" in ci


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)  # no headings in code
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_links_between_pages_resolve():
    for path in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", path.read_text()):
            if "://" in target:
                continue
            where = path.parent / target if target else path
            assert where.exists(), f"{path.relative_to(ROOT)} links to missing {target}"
            if anchor:
                assert anchor in _anchors(where), (f"{path.relative_to(ROOT)} links to {target}#{anchor}: "
                                                   "no such heading")
