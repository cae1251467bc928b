"""The layout keeps its promises: no import cycles, no private names across modules."""

from __future__ import annotations

import ast
from pathlib import Path

import plait

ROOT = Path(plait.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text()) for p in ROOT.rglob("*.py")}


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of imports inside ``if TYPE_CHECKING:`` blocks (never run)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            lines.update(n.lineno for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return lines


def _imports(mods: dict[str, ast.Module]) -> dict[str, set[tuple[str, str]]]:
    """module -> {(imported plait module, imported name or '')}, lazy imports included."""
    out: dict[str, set[tuple[str, str]]] = {}
    for name, tree in mods.items():
        skip = _type_checking_only(tree)
        found: set[tuple[str, str]] = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("plait"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add((sub, "") if sub in mods else (node.module, alias.name))
            elif isinstance(node, ast.Import):
                found.update((a.name, "") for a in node.names if a.name.startswith("plait"))
        out[name] = found
    return out


def test_no_import_cycles():
    mods = _modules()
    # The package facade (plait/__init__) imports everything by design; it is not a node.
    graph = {m: {t for t, _ in deps if t in mods and t != "plait" and t != m}
             for m, deps in _imports(mods).items() if m != "plait"}
    cycles = []

    def visit(node: str, path: list[str], on_path: set[str], done: set[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, path + [nxt], on_path | {nxt}, done)
        done.add(node)

    done: set[str] = set()
    for m in sorted(graph):
        if m not in done:
            visit(m, [m], {m}, done)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_private_names_imported_across_modules():
    bad = [f"{m} imports {t}.{n}" for m, deps in _imports(_modules()).items() for t, n in deps
           if n.startswith("_") and not n.startswith("__") and t != m]
    assert not bad, bad


def test_the_library_never_imports_the_application():
    """`plait.app` (train, data, cli, run, launch) is built on the library, not the reverse."""
    bad = sorted(f"{m} imports {t}" for m, deps in _imports(_modules()).items() for t, _ in deps
                 if not m.startswith("plait.app") and m != "plait.__main__" and t.startswith("plait.app"))
    assert not bad, bad


def test_the_library_never_imports_transformers():
    """`transformers` is the optional extra plait[hf]: importing plait (and building a layout's
    pieces) must not need it; models are recognised by their structure."""
    import subprocess
    import sys

    code = ("import sys, plait, plait.models.plans, plait.pipeline, plait.check, plait.tp; "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
