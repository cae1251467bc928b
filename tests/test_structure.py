"""The layout keeps its promises: folders by role at the top with a few modules beside them, layers
that import only downward, no import cycles, no private names across modules, names that import
(no package attribute hides its own submodule, every name the README shows resolves), a public
face that docs/api.md lists whole (only public modules define `__all__`), and one parity engine:
the tests that compare a layout with one process do it through tests/oracle.py."""

from __future__ import annotations

import ast
import functools
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import plait
import plait.pipeline.split
from plait.runtime.callable_module import CallableModule

ROOT = Path(plait.__file__).resolve().parent
README = ROOT.parent.parent / "README.md"
BENCH = ROOT.parent.parent / "bench"


def _module_name(path: Path, top: Path) -> str:
    parts = path.relative_to(top.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache  # parsed once for the module's tests (read only: no test changes it)
def _modules() -> dict[str, tuple[ast.Module, bool]]:
    """module name -> (its syntax tree, whether it is a package), for plait and bench."""
    return {_module_name(p, top): (ast.parse(p.read_text()), p.name == "__init__.py")
            for top in (ROOT, BENCH) for p in sorted(top.rglob("*.py"))}


@functools.cache
def _library_imports() -> dict[str, set[tuple[str, str]]]:
    """`_imports` of plait and bench, found once for the module's tests."""
    return _imports(_modules())


def _imports(mods: dict[str, tuple[ast.Module, bool]]) -> dict[str, set[tuple[str, str]]]:
    """module -> {(imported plait or bench module, imported name or '')}: every import statement,
    at the top, under ``if TYPE_CHECKING:`` and inside functions. ``from a import b`` is an edge to
    the submodule ``a.b`` when there is one, else to ``a``; relative imports are resolved."""
    out: dict[str, set[tuple[str, str]]] = {}
    for name, (tree, is_package) in mods.items():
        package = name.split(".") if is_package else name.split(".")[:-1]
        found: set[tuple[str, str]] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:  # from . import x, from ..y import z
                    base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).rstrip(".")
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in mods:
                        found.add((sub, ""))
                    elif base in mods:
                        found.add((base, alias.name))
            elif isinstance(node, ast.Import):
                found.update((a.name, "") for a in node.names if a.name in mods)
        out[name] = found
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle for each edge that closes one in a depth-first walk (none: the graph is acyclic)."""
    cycles: list[list[str]] = []
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(node)

    for m in sorted(graph):
        if m not in done:
            visit(m, [m])
    return cycles


def test_the_cycle_finder_sees_lazy_and_type_checking_imports():
    mods = {"plait.a": (ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                  "    from plait.b import B\n"), False),
            "plait.b": (ast.parse("def f():\n    from . import a\n"), False)}
    graph = {m: {t for t, _ in deps} for m, deps in _imports(mods).items()}
    assert graph == {"plait.a": {"plait.b"}, "plait.b": {"plait.a"}}
    assert _cycles(graph) == [["plait.a", "plait.b", "plait.a"]]


def test_no_import_cycles():
    """No module imports, at any depth and by any route (an import at the top, inside a function,
    or only for type checkers), a module that imports it back. A package's ``__init__`` running
    before its submodules is not an edge (re-exports there are by design); the facade
    ``plait/__init__`` is a node like any other, so no module it imports may import ``plait`` back."""
    graph = {m: {t for t, _ in deps if t != m} for m, deps in _library_imports().items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_private_names_imported_across_modules():
    bad = [f"{m} imports {t}.{n}" for m, deps in _library_imports().items() for t, n in deps
           if n.startswith("_") and not n.startswith("__") and t != m]
    assert not bad, bad


def test_the_library_never_imports_the_application():
    """`plait.app` (train, data, cli, run, launch) is built on the library, not the reverse."""
    bad = sorted(f"{m} imports {t}" for m, deps in _library_imports().items() for t, _ in deps
                 if m.startswith("plait") and not m.startswith("plait.app") and m != "plait.__main__"
                 and t.startswith("plait.app"))
    assert not bad, bad


# The top of the package: the folders by role (DESIGN.md, "Layout") and the few modules that belong
# to no one of them, each with its reason. Everything else lives in a folder.
TOP_MODULES = {
    "__init__": "the public names (`plait.Mesh`, `plait.comm`, ...)",
    "__main__": "`python -m plait`, the command",
    "_torch_compat": "the one place for private torch and CPython APIs",
    "data_parallel": "DataParallel: a strategy of one file",
    "losses": "public (`plait.losses.lm_loss`): the loss the reference models and tensor parallelism "
              "both compute, which neither may import from the other",
    "testing": "public (`plait.testing`): the rank pools tests run on, built on the facade",
}
TOP_FOLDERS = {
    "runtime": "the process layer: env, mesh, comm, desync, straggler, faults, healing",
    "state": "materialization, state dicts, checkpoints, the placement record and its readers, the "
             "mixed-precision policy",
    "ddp": "a strategy", "fsdp": "a strategy", "tp": "a strategy", "cp": "a strategy", "ep": "a strategy",
    "pipeline": "a strategy: splits and schedules",
    "compose": "ParallelPlan, the rules, parallelize, activation checkpointing",
    "plans": "tensor-parallel plans for model families",
    "check": "parity against one process, the fuzzer, error budgets",
    "models": "the reference GPT and MoE, with no parallel code",
    "app": "the `plait` command",
}
ROLE_FOLDERS = ("runtime", "state", "compose")


def test_the_top_level_holds_the_folders_by_role_and_a_few_modules():
    modules = {p.stem for p in ROOT.glob("*.py")}
    folders = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert modules <= set(TOP_MODULES), f"{sorted(modules - set(TOP_MODULES))}: move each into a folder"
    assert folders <= set(TOP_FOLDERS), f"{sorted(folders - set(TOP_FOLDERS))}: not in DESIGN.md's layout"
    gone = sorted((set(TOP_MODULES) - modules) | (set(TOP_FOLDERS) - folders))
    assert not gone, f"no longer at the top, drop from TOP_MODULES / TOP_FOLDERS: {gone}"


def test_the_role_folders_import_nothing_when_entered():
    """`runtime/`, `state/` and `compose/` are folders, not faces: their ``__init__`` holds a
    docstring only, so importing one module of a folder loads no other."""
    for folder in ROLE_FOLDERS:
        body = ast.parse((ROOT / folder / "__init__.py").read_text()).body
        assert [type(node) for node in body] == [ast.Expr], folder
        assert isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), folder


# The strategies: each places parameters or runs the model its own way, and none imports another.
STRATEGIES = ("plait.ddp", "plait.fsdp", "plait.tp", "plait.ep", "plait.cp", "plait.pipeline",
              "plait.data_parallel", "plait.compose.activation_checkpointing")
# What learns how a parameter is placed from `plait.state.placement` alone (never from the strategy
# that placed it): DDP, FSDP, activation checkpointing, and the whole of `plait.state` (the record
# itself, materialization, state dicts, checkpoints, clipping).
PLACEMENT_READERS = ("plait.ddp", "plait.fsdp", "plait.compose.activation_checkpointing", "plait.state")


def _owner(module: str, owners: tuple[str, ...]) -> str | None:
    return next((o for o in owners if module == o or module.startswith(o + ".")), None)


def _cross_edges(imports: dict[str, set[tuple[str, str]]]) -> set[tuple[str, str]]:
    """(importer, imported) for every import from one strategy (or placement reader) into another
    strategy, by package, at any depth (top, function body, type checking)."""
    found: set[tuple[str, str]] = set()
    for m, deps in imports.items():
        for importer in {_owner(m, STRATEGIES), _owner(m, PLACEMENT_READERS)} - {None}:
            for t, _ in deps:
                imported = _owner(t, STRATEGIES)
                if imported is not None and imported != importer:
                    found.add((str(importer), imported))
    return found


def test_the_strategy_edge_finder_sees_a_reader_importing_a_strategy():
    mods = {"plait.state.clip": (ast.parse("def f():\n    from plait.tp.apply import tp_info\n"), False),
            "plait.tp.apply": (ast.parse("from plait.runtime.rng import RNGFork\n"), False),
            "plait.runtime.rng": (ast.parse(""), False)}
    assert _cross_edges(_imports(mods)) == {("plait.state", "plait.tp")}


def test_no_strategy_imports_another_and_readers_read_only_the_placement_record():
    """DDP, FSDP, clipping, state dicts and checkpoints learn how each parameter is placed from
    `plait.state.placement`, which tensor and expert parallelism write; no strategy imports another at
    all (`plait.parallelize` is the composition and may): the pipeline only splits and schedules,
    and a block's checkpointing record lives in `plait.state.blocks`."""
    edges = _cross_edges(_library_imports())
    assert not edges, sorted(edges)


# The layers, lowest first: a module imports from its own layer and those below it, never above
# (`plait._torch_compat`, `plait.losses` and the facade's `__version__` are beside every layer).
LAYERS = (("plait.runtime",), ("plait.state",),
          ("plait.ddp", "plait.fsdp", "plait.tp", "plait.ep", "plait.cp", "plait.pipeline",
           "plait.data_parallel"),
          ("plait.compose",))
# Imports that run up a layer, each for a reason; the test fails when one goes (drop it).
UPWARD: set[tuple[str, str]] = set()


def _layer(module: str) -> int | None:
    return next((i for i, owners in enumerate(LAYERS) if _owner(module, owners)), None)


def _upward(imports: dict[str, set[tuple[str, str]]]) -> set[tuple[str, str]]:
    """(importer, imported) for every import, at any depth, from a layer into a higher one."""
    return {(m, t) for m, deps in imports.items() for t, _ in deps
            if (low := _layer(m)) is not None and (high := _layer(t)) is not None and high > low}


def test_the_layer_finder_sees_an_import_that_runs_up():
    mods = {"plait.runtime.mesh": (ast.parse("def f():\n    from plait.state.names import matches\n"), False),
            "plait.state.names": (ast.parse("from plait.runtime.mesh import Mesh\n"), False),
            "plait.tp.apply": (ast.parse("from plait.state.names import matches\n"), False)}
    assert _upward(_imports(mods)) == {("plait.runtime.mesh", "plait.state.names")}


def test_the_folders_by_role_import_only_downward():
    """runtime/ imports nothing above it; state/ only runtime/; the strategies only state/ and
    runtime/ (and no other strategy); compose/ any of them: a folder can be read, tested and
    replaced with only what lies below it."""
    found = _upward(_library_imports())
    assert not found - UPWARD, sorted(found - UPWARD)
    assert not UPWARD - found, f"no longer imported, drop from UPWARD: {sorted(UPWARD - found)}"


# One interpreter imports torch (most of a fresh interpreter's start) and forks a child per
# question: each child starts with torch and the standard library only, as a new `python -c` would.
FORKER = """
import io, json, os, sys, traceback
import torch

for line in sys.stdin:
    code, args = json.loads(line)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        out, ok = io.StringIO(), True
        sys.argv, sys.stdout = ["-c", *args], out
        try:
            exec(compile(code, "<fresh>", "exec"), {"__name__": "__main__"})
        except BaseException:
            ok = False
            out.write(traceback.format_exc())
        with os.fdopen(w, "w") as f:
            f.write(json.dumps([ok, out.getvalue()]))
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        answer = f.read()
    os.waitpid(pid, 0)
    sys.__stdout__.write(answer + "\\n")
    sys.__stdout__.flush()
"""


@pytest.fixture(scope="module")
def fresh():
    """``fresh(code, *args)`` runs ``code`` in a process where no module that other tests imported is
    loaded (so nothing hides what ``import plait`` alone provides) and returns what it printed."""
    proc = subprocess.Popen([sys.executable, "-c", FORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdin is not None and proc.stdout is not None

    def run(code: str, *args: str) -> str:
        proc.stdin.write(json.dumps([code, list(args)]) + "\n")
        proc.stdin.flush()
        ok, out = json.loads(proc.stdout.readline())
        assert ok, out
        return out

    yield run
    proc.stdin.close()
    proc.wait(timeout=60)


def test_the_library_never_imports_the_reference_gpt():
    """The strategies know no model: losses are the library's (`plait.losses`), positions a
    protocol (`plait.cp.positions.takes_positions`); only models, plans and the application use
    the reference GPT."""
    bad = sorted({f"{m} imports {t}" for m, deps in _library_imports().items() for t, _ in deps
                  if m.startswith("plait") and t.startswith("plait.models.gpt")
                  and not m.startswith(("plait.models", "plait.plans", "plait.app"))})
    assert not bad, bad


def test_the_library_never_imports_transformers(fresh):
    """`transformers` is the optional extra plait[hf]: importing plait (and building a layout's
    pieces) must not need it; models are recognised by their structure."""
    code = ("import sys, plait, plait.plans, plait.pipeline, plait.check, plait.tp; "
            "print('transformers' in sys.modules)")
    assert fresh(code).strip() == "False"


def test_no_plait_module_imports_dynamo(fresh):
    """torch._dynamo costs every process that imports it about a second of start-up (each rank,
    each command): plait's functions that run eagerly under torch.compile are marked without it
    (`plait._torch_compat.eager`), and nothing else imports it before something compiles."""
    code = ("import pkgutil, sys, plait\n"
            "for info in pkgutil.walk_packages(plait.__path__, 'plait.'):\n"
            "    if not info.name.endswith('__main__'):\n"
            "        __import__(info.name)\n"
            "print('torch._dynamo' in sys.modules)")
    assert fresh(code).strip() == "False"


def test_a_fresh_process_has_imported_nothing_of_plait_or_transformers(fresh):
    code = "import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in ('plait', 'transformers')))"
    assert fresh(code).strip() == "[]"


SHADOWS = """
import json, pkgutil, sys, types
import plait

def shadows(package):
    for info in pkgutil.iter_modules(package.__path__):
        full = f"{package.__name__}.{info.name}"
        obj = getattr(package, info.name, None)
        if obj is not None and not (isinstance(obj, types.ModuleType) and obj.__name__ == full):
            yield f"{full} is {obj!r}, not the module {full}"

bad = list(shadows(plait))  # right after `import plait`, before any other plait import
for info in pkgutil.walk_packages(plait.__path__, "plait."):
    if info.ispkg:
        __import__(info.name)
        bad.extend(shadows(sys.modules[info.name]))
print(json.dumps(bad))
"""


def test_no_package_attribute_hides_its_submodule(fresh):
    """A name bound in a package to something other than its submodule of that name hides the
    submodule: after ``import plait``, ``plait.pipeline.zbv`` was looked up on a function."""
    assert json.loads(fresh(SHADOWS)) == []


CALLABLE_MODULES = ("plait.check", "plait.compose.activation_checkpointing", "plait.compose.parallelize",
                    "plait.pipeline")


def _callable_modules() -> list[str]:
    import importlib
    import pkgutil

    for info in pkgutil.walk_packages(plait.__path__, "plait."):
        if not info.name.startswith("plait.app") and info.name != "plait.__main__":
            importlib.import_module(info.name)
    return sorted(n for n, m in sys.modules.items() if isinstance(m, CallableModule))


def test_the_callable_modules_are_modules_and_functions(monkeypatch):
    """`plait.activation_checkpointing`, `plait.check`, `plait.parallelize` and `plait.pipeline` are
    the modules (with every name in them) and, called, their namesake functions, with those
    functions' signatures."""
    assert _callable_modules() == list(CALLABLE_MODULES)
    for name in CALLABLE_MODULES:
        module = sys.modules[name]
        attr = name.rpartition(".")[2]
        assert getattr(plait, attr) is module
        function = getattr(module, attr)
        assert inspect.isfunction(function) and function.__module__.startswith(name)
        assert inspect.signature(module) == inspect.signature(function)
        calls: list[tuple[tuple[object, ...], dict[str, object]]] = []

        def record(*args: object, _calls: list = calls, **kwargs: object) -> str:
            _calls.append((args, kwargs))
            return "result"

        monkeypatch.setattr(module, attr, record)
        assert module(1, key=2) == "result" and calls == [((1,), {"key": 2})]
    assert plait.pipeline.zbv is plait.pipeline.generators.zbv
    assert callable(plait.pipeline.split.segments) and plait.parallelize.ORDER[0] == "pipeline split"
    assert plait.check.oracle.__name__ == "plait.check.oracle"


FILES = {"plait.json"}  # the checkpoint's metadata file, not a Python name


def _readme_names() -> list[str]:
    """Every ``plait.x`` / ``plait.x.y...`` in the Python blocks and inline code of README.md and
    the pages under docs/."""
    text = "\n".join(p.read_text() for p in [README, *sorted((README.parent / "docs").glob("*.md"))])
    blocks = re.findall(r"^ *```python\n(.*?)^ *```", text, flags=re.S | re.M)
    prose = re.sub(r"^ *```.*?^ *```", "", text, flags=re.S | re.M)
    code = blocks + re.findall(r"`([^`\n]+)`", prose)
    names = {n for c in code for n in re.findall(r"(?<![\w.])plait(?:\.[A-Za-z_]\w*)+", c)}
    return sorted(names - FILES)


RESOLVE = """
import importlib, json, sys
from pathlib import Path
import plait

root = Path(plait.__file__).parent.parent
loaded = set(sys.modules)

def is_module(parts):
    path = root.joinpath(*parts)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()

bad = []
for name in sys.argv[1:]:
    parts = name.split(".")
    # A subpackage `import plait` loads must show every name under it with no other import; one it
    # leaves out (the application, test helpers, checkpoints) after `import <its deepest module>`.
    if ".".join(parts[:2]) not in loaded:
        importlib.import_module(".".join(max((parts[:k] for k in range(1, len(parts) + 1)
                                              if is_module(parts[:k])), key=len)))
    obj = plait
    try:
        for part in parts[1:]:
            obj = getattr(obj, part)
    except AttributeError as e:
        bad.append(f"{name}: {e}")
print(json.dumps(bad))
"""


def test_every_name_the_readme_and_docs_show_resolves(fresh):
    names = _readme_names()
    assert {"plait.pipeline.zbv", "plait.pipeline.split.segments", "plait.parallelize.ORDER",
            "plait.parallelize", "plait.pipeline"} <= set(names)
    assert json.loads(fresh(RESOLVE, *names)) == []


@pytest.mark.parametrize("written", ["plait.pipeline.split.segments", "plait.check.oracle"])
def test_names_in_the_package_docs_resolve_after_import_plait(fresh, written):
    """The docstrings name `plait.check.oracle` and `plait.pipeline.split.segments`; the same
    resolution as the README's names."""
    assert json.loads(fresh(RESOLVE, written)) == []


def test_the_readme_lists_the_composition_order_as_parallelize_applies_it():
    """`plait.parallelize.ORDER`, its docstring and the README say the same order."""
    from plait.compose.parallelize import ORDER

    said = re.search(r"in one fixed order — (.*?) —", README.read_text(), flags=re.S)
    assert said, "README: the order sentence is gone"
    steps = [s.strip() for s in re.split(r",|\bthen\b", " ".join(said[1].split())) if s.strip()]
    assert steps == [*ORDER[:-1], "DDP or FSDP"], steps
    doc = plait.parallelize.__doc__ or ""
    at = [doc.lower().find(f"**{step.split(' (')[0]}**") for step in ORDER]  # the numbered headings
    assert -1 not in at and at == sorted(at), dict(zip(ORDER, at))


def test_each_composition_step_is_called_once_for_both_paths():
    """The order is written once: `plait.parallelize` calls each strategy in one place, a step
    the plain path and every pipeline stage share (not one copy per path)."""
    import plait.compose.parallelize as composition

    tree = ast.parse(inspect.getsource(composition))
    called = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    for step in ("context_parallel", "expert_parallel", "checkpoint_blocks", "mixed_precision",
                 "tensor_parallel", "Pipeline"):
        assert called.count(step) == 1, (step, called.count(step))


# ------------------------------------------------------------------ internals behind one door
COMPAT = "plait._torch_compat"
_PRIVATE_TORCH_PATH = re.compile(r"torch(\.\w+)*\._[A-Za-z0-9]\w*")  # "torch.optim._muon", "torch._C"


# Private members of torch's tensors, modules and helpers, read on objects a name alone does not show
# to be torch's: flagged on anything but ``self`` / ``cls`` (plait's own classes reuse a few names).
# nn.Module's ``_parameters``, ``_buffers`` and ``_modules`` dicts are not listed: the library reads and
# writes them in some 70 places, as torch's own parallel wrappers do.
TORCH_INTERNALS = frozenset({
    "_version", "_is_view", "_base", "_local_tensor", "_spec", "_cdata", "_make_wrapper_subclass",
    "_new_with_weak_ptr", "_execution_engine", "_forward_pre_hooks", "_forward_hooks", "_backward_hooks",
    "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks", "_apply", "_compiled_call_impl",
    "_orig_mod", "_replicate_for_data_parallel", "_destroy", "_initializing"})
# What remains outside `plait._torch_compat`, each for a reason; the test fails when one goes (drop it).
PRIVATE_LEFT: set[tuple[str, str]] = set()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _bound_to(tree: ast.Module, top: str) -> set[str]:
    """The names a module binds to what it imports from ``top`` (modules, classes, functions)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names
                         if a.name.split(".")[0] == top)
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == top:
            names.update(a.asname or a.name for a in node.names)
    return names


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _attribute(node: ast.AST) -> tuple[ast.expr, object] | None:
    """(object, name) of ``obj.name`` or of ``getattr(obj, "name", ...)`` (setattr, hasattr)."""
    if isinstance(node, ast.Attribute):
        return node.value, node.attr
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1
            and node.func.id in ("getattr", "setattr", "hasattr") and isinstance(node.args[1], ast.Constant)):
        return node.args[0], node.args[1].value
    return None


def _is_spec(node: ast.expr) -> bool:
    """``x.__spec__`` or ``getattr(x, "__spec__", ...)``: a module's import spec."""
    read = _attribute(node)
    return read is not None and read[1] == "__spec__"


def _private_import(node: ast.stmt) -> list[str]:
    """``import torch._x`` / ``from torch._x import y`` / ``from torch.x import _y``."""
    if isinstance(node, ast.Import):
        return [f"import {a.name}" for a in node.names
                if a.name.split(".")[0] == "torch" and any(map(_private, a.name.split(".")))]
    if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
        parts = (node.module or "").split(".")
        return [f"from {node.module} import {a.name}" for a in node.names
                if any(map(_private, parts)) or _private(a.name)]
    return []


def _private_api_uses(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, what) for each use of a private torch or CPython API in ``tree``: an import of a torch
    module path with a ``_`` component or of a ``_`` name from torch; a ``_`` attribute (read with a
    dot or with ``getattr`` and a literal) on a name bound to torch (a module or anything imported
    from it), on ``sys`` or on a module's ``__spec__``; one of `TORCH_INTERNALS` on anything but
    ``self`` or ``cls``; a string naming a private torch module; and
    an assignment to an object's ``__class__`` (a tensor's or a module's class swapped)."""
    owners = _bound_to(tree, "torch") | _bound_to(tree, "sys")

    def private_on(owner: ast.expr, attr: object) -> bool:
        root = _root(owner)
        own = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
        return isinstance(attr, str) and _private(attr) and (
            (isinstance(root, ast.Name) and root.id in owners) or _is_spec(owner)
            or (attr in TORCH_INTERNALS and not own))

    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found += [(node.lineno, what) for what in _private_import(node)]
        elif (read := _attribute(node)) is not None and private_on(*read):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _PRIVATE_TORCH_PATH.fullmatch(
                node.value):
            found.append((node.lineno, repr(node.value)))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [(node.lineno, f"{ast.unparse(t)} = ...") for t in targets
                      if isinstance(t, ast.Attribute) and t.attr == "__class__"]
    return found


PLANTED = """
import sys
import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.utils._pytree import tree_map
from torch.nn import _reduction
f = sys._getframe(1)
n = torch._foreach_norm
b = nn.modules.batchnorm._BatchNorm
k = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
c = getattr(torch._C, "x")
d = getattr(torch, "_dynamo")
m = "torch.optim._muon"
i = getattr(getattr(mod, "__spec__", None), "_initializing", False)
j = mod.__spec__._initializing
t.__class__ = Sub
v = (t._version, getattr(m, "_compiled_call_impl", None), super()._apply(fn))
ok = torch.__version__, nn.Linear, self._x, obj._parameters, "torch.optim.adam", sys.argv, self._version
"""


def test_the_private_api_finder_sees_each_kind_of_use():
    """Each line of ``PLANTED`` after the plain imports is one use; the last line has none (dunders,
    public torch names, private names of objects that are not torch's, plain strings)."""
    found = _private_api_uses(ast.parse(PLANTED))
    assert sorted({line for line, _ in found}) == [4, *range(6, 19)], found


def test_no_private_torch_or_cpython_api_outside_torch_compat():
    """Every private torch or CPython API plait leans on (`sys._getframe`, `torch._C`, a private torch
    module, a class swapped on a live object, an import's ``__spec__._initializing``) sits in
    `plait._torch_compat`, with the torch versions it is tested on and when it can go: a torch
    release that breaks one breaks it in one file."""
    found = {(name, line, what) for name, (tree, _) in _modules().items()
             if name.startswith("plait") and name != COMPAT for line, what in _private_api_uses(tree)}
    bad = sorted(f"{name}:{line}: {what}" for name, line, what in found if (name, what) not in PRIVATE_LEFT)
    assert not bad, "\n".join(bad)
    gone = PRIVATE_LEFT - {(name, what) for name, _, what in found}
    assert not gone, f"no longer used, drop from PRIVATE_LEFT: {sorted(gone)}"


# What a reader can hold in their head; a module or a function past these is split by responsibility.
MODULE_LINES, FUNCTION_LINES = 600, 80


def test_no_module_over_600_lines_and_no_function_over_80():
    found = set()
    for path in sorted(ROOT.rglob("*.py")):
        name = _module_name(path, ROOT)
        text = path.read_text()
        if text.count("\n") > MODULE_LINES:
            found.add(name)
        tree = ast.parse(text)
        for cls in [tree, *(n for n in tree.body if isinstance(n, ast.ClassDef))]:
            prefix = name if cls is tree else f"{name}.{cls.name}"
            for fn in cls.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.end_lineno is not None \
                        and fn.end_lineno - fn.lineno + 1 > FUNCTION_LINES:
                    found.add(f"{prefix}.{fn.name}")
    assert not found, f"over {MODULE_LINES} lines (modules) or {FUNCTION_LINES} (functions): {sorted(found)}"


# The public face. A module defines `__all__` if and only if it is public, and it is public if and
# only if docs/api.md has a section for it (a ``## `plait.x` `` heading) listing every name of its
# `__all__`; every other module is internal: importable by its full path, advertising nothing.
API_PAGE = README.parent / "docs" / "api.md"
MAX_EXPORTS = 250
# Internal modules that still define `__all__` because their files are being rewritten elsewhere;
# each leaves this list when its `__all__` goes (the test fails on an entry that has none).
PENDING_ALL: frozenset[str] = frozenset()
_SECTION = re.compile(r"^## `(plait[\w.]*)`\s*$")
_ROW_HEAD = re.compile(r"^\|([^|]*)\|")


def _exports() -> dict[str, list[str]]:
    """plait module -> the names of its `__all__`, for every plait module that defines one."""
    out: dict[str, list[str]] = {}
    for name, (tree, _) in _modules().items():
        for node in tree.body if name.startswith("plait") else []:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                assert isinstance(node, ast.Assign), f"{name}: __all__ is written once, as a literal list"
                out[name] = list(ast.literal_eval(node.value))
    return out


def _listed(page: str) -> dict[str, list[str]]:
    """module -> the names docs/api.md lists for it: under a ``## `plait.x` `` heading, the names in
    backticks in the first cell of each table row, as written (``plait.init(seed=0)`` in the
    `plait` section is ``init``; ``plait.SyncBatchNorm.convert_sync_batchnorm`` is ``SyncBatchNorm``;
    ``.step()``, a method, is none)."""
    out: dict[str, list[str]] = {}
    module = None
    for line in page.splitlines():
        if line.startswith("## ") or line.startswith("# "):
            heading = _SECTION.match(line)
            module = heading.group(1) if heading else None
            if module is not None:
                assert module not in out, f"docs/api.md has two sections for `{module}`"
                out[module] = []
        elif module is not None and (row := _ROW_HEAD.match(line)):
            for span in re.findall(r"`([^`]+)`", row.group(1)):
                dotted = re.match(r"[A-Za-z_][\w.]*", span)
                if dotted:
                    name = dotted.group(0).removeprefix(f"{module}.").removeprefix("plait.")
                    out[module].append(name.split(".")[0])
    return out


def test_the_api_page_reader_sees_each_kind_of_row():
    page = """# Title
## `plait`
| name | what it does |
|---|---|
| `plait.init(seed=0)`, `plait.comm` | a, `not_a_name` |
| `plait.SyncBatchNorm.convert_sync_batchnorm(model, mesh)` / `plait.SyncBatchNorm(n)` | |
## `plait.runtime.straggler`
| `StragglerTracker()`, `.step()`, `Blame` | in `plait.runtime.straggler` |
## Building on the meta device
| `not_listed` | |
"""
    assert _listed(page) == {"plait": ["init", "comm", "SyncBatchNorm", "SyncBatchNorm"],
                             "plait.runtime.straggler": ["StragglerTracker", "Blame"]}


def test_internal_modules_define_no_all_and_public_ones_have_a_section_in_the_api_page():
    exports, listed = _exports(), _listed(API_PAGE.read_text())
    unlisted = sorted(set(exports) - set(listed) - PENDING_ALL)
    assert not unlisted, (f"{unlisted} define __all__ but docs/api.md has no section for them: internal "
                          "modules define no __all__ (their names stay importable by their full path); "
                          "a module meant to be public gets a `## `plait.x`` section listing its names")
    assert not set(listed) - set(exports), \
        f"docs/api.md has sections for modules without __all__: {sorted(set(listed) - set(exports))}"
    public_pending = sorted(PENDING_ALL & set(listed))
    assert not public_pending, f"public, drop from PENDING_ALL: {public_pending}"
    gone = sorted(PENDING_ALL - set(exports))
    assert not gone, f"no __all__ any more, drop from PENDING_ALL: {gone}"


def test_the_api_page_lists_every_exported_name_and_no_other():
    exports, listed = _exports(), _listed(API_PAGE.read_text())
    bad = []
    for module in sorted(set(listed) & set(exports)):
        names = exports[module]
        if len(set(names)) != len(names):
            bad.append(f"{module}.__all__ names a name twice")
        if missing := sorted(set(names) - set(listed[module])):
            bad.append(f"{module} exports {missing}, which its section in docs/api.md does not list: add a "
                       "row for each (a line, or a link to its page), or take it out of __all__")
        if extra := sorted(set(listed[module]) - set(names)):
            bad.append(f"docs/api.md lists {extra} under `{module}`, which are not in its __all__")
    assert not bad, "\n".join(bad)


def test_the_public_face_has_at_most_250_names_and_each_resolves():
    import importlib

    public = {m: names for m, names in _exports().items() if m not in PENDING_ALL}
    count = sum(len(names) for names in public.values())
    assert count <= MAX_EXPORTS, f"{count} exported names, over {MAX_EXPORTS}: export what the docs teach"
    missing = [f"{m}.{n}" for m, names in public.items() for n in names
               if not hasattr(importlib.import_module(m), n)]
    assert not missing, f"exported but not there: {missing}"



# ------------------------------------------------------------------ one parity engine
TESTS = Path(__file__).resolve().parent
ORACLE = TESTS / "oracle.py"
# Test modules whose tests run ranks yet take no comparison from tests/oracle.py, each with its
# reason; the test fails when one starts taking one (drop it) or no longer runs ranks.
NO_TENSOR_PARITY = {
    # What they compare with a one-process run is per-step losses as `plait train` logs them
    # (`pytest.approx`), or files.
    "test_layouts": "per-step losses and gradient norms of `plait train` against `oracle.train_losses`",
    "test_hf_train": "per-step losses of `plait train --hf-config` against the same command, one process",
    "test_train_data": "per-step losses of `plait train --model FACTORY` against the same, one process",
    "test_export": "exported files, exactly, against the checkpoint DCP loads in one process; the "
                   "per-step losses of `--init-from` runs",
    # No one-process run at all.
    "test_checkpoint_integrity": "a resumed run's per-step losses against the run it resumes",
    "test_exit": "exit codes and processes left after a job ends or is signalled; a resumed run's losses "
                 "against the same run uninterrupted",
    "test_check": "`plait check`'s verdicts and reports: its reference process is the library's own",
    "test_faults": "each fault switch fails `plait check`, named where it lives",
    "test_failures": "frozen, skipped and mismatched collectives: how ranks fail and what they say",
    "test_straggler": "which rank a slow step is blamed on",
    "test_comm": "the comm layer's accounting: calls and bytes per axis",
    "test_mesh": "mesh construction, rank order and groups",
    "test_placement": "the per-parameter placement record parallelize leaves",
    "test_plan": "`plait plan`'s rehearsal against the same step measured: memory and bytes",
    "test_docs": "the documentation's code blocks run as written",
    "test_train": "`plait train` and `plait run` end to end, and their config's validation",
}
# Loops in modules that run ranks that compare tensors name by name outside tests/oracle.py, by
# (module, function), each with its reason.
OWN_LOOPS = {
    ("test_meta_init",
     "test_every_planned_transformers_family_built_on_meta_is_the_model_a_real_build_makes"):
        "a meta-device build against a CPU build in one process, with a bound of its own for one buffer",
}
_WALKS = re.compile(r"\.(named_parameters|parameters|named_buffers|buffers|state_dict|items|keys)\(")


def _assert_closes(node: ast.AST) -> list[ast.Call]:
    return [c for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
            and c.func.attr == "assert_close"]


def _oracle_comparisons(tree: ast.Module) -> set[str]:
    """The functions and classes of oracle.py that compare: those that assert (an ``assert`` or
    `torch.testing.assert_close`), or call one that does."""
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    called = (lambda node: {c.func.id for c in ast.walk(node)
                            if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)})
    calls = {name: called(node) for name, node in defs.items()}
    found = {name for name, node in defs.items()
             if _assert_closes(node) or any(isinstance(n, ast.Assert) for n in ast.walk(node))}
    while more := {name for name in defs if name not in found and calls[name] & found}:
        found |= more
    return found


def _runs_ranks(tree: ast.Module) -> bool:
    """Whether a test module runs rank pools: a function taking the ``pools`` fixture, or a `RankPool`."""
    return any((isinstance(n, ast.FunctionDef) and any(a.arg == "pools" for a in n.args.args))
               or (isinstance(n, ast.Name) and n.id == "RankPool") for n in ast.walk(tree))


def _from_oracle(tree: ast.Module) -> set[str]:
    return {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "oracle"
            for a in n.names}


def _own_loops(tree: ast.Module) -> list[tuple[str, int]]:
    """(function, line) of each loop that compares tensors one name at a time: a ``for`` whose body
    calls `torch.testing.assert_close` while it walks a model's parameters, buffers or state or a
    dict's items or keys, or walks a dict (``for name in want``) and looks tensors up by the loop's
    variable (``got[name]``). Loops over steps, layouts or literal tuples compare one thing each."""
    found = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        for loop in (n for n in ast.walk(fn) if isinstance(n, ast.For)):
            checks = _assert_closes(loop)
            bound = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
            keyed = any(isinstance(s, ast.Subscript) and isinstance(s.slice, ast.Name) and s.slice.id in bound
                        for c in checks for a in c.args[:2] for s in ast.walk(a))
            over_a_dict = isinstance(loop.iter, (ast.Name, ast.Attribute, ast.Subscript))
            if checks and (_WALKS.search(ast.unparse(loop.iter)) or (over_a_dict and keyed)):
                found.append((fn.name, loop.lineno))
    return found


PLANTED_LOOPS = """
def walks(model, ref):
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    for k in want:
        torch.testing.assert_close(got[k], want[k])
    for k, v in ref.state_dict().items():
        assert_params_close(got, v)
    for step in range(3):
        torch.testing.assert_close(loss[step], ref_loss)
    for kind in ("tp", "pp"):
        torch.testing.assert_close(out[kind], want)
"""


def test_the_loop_finder_sees_name_by_name_comparisons_only():
    """The first two loops of ``PLANTED_LOOPS`` compare name by name; the third goes through the
    engine, the others compare one tensor per step or per layout."""
    assert _own_loops(ast.parse(PLANTED_LOOPS)) == [("walks", 3), ("walks", 5)]


def test_every_module_comparing_a_layout_with_one_process_takes_its_comparison_from_the_oracle():
    """tests/oracle.py is the one parity engine: it compares a layout's outputs, gradients and
    parameters (after optimizer steps) with a one-process run, at an explicit tolerance. Every test
    module whose tests run ranks imports from it at least one function that compares (read from
    oracle.py's own code: it asserts, or calls one that does; a constant, a batch or a loss does not
    count), unless `NO_TENSOR_PARITY` says why it compares no tensors with a one-process run. And
    no module that runs ranks compares tensors name by name in a loop of its own (a loop over a
    model's parameters or a dict of tensors around `torch.testing.assert_close`; `OWN_LOOPS` lists
    the few left, with their reasons): a second copy of the engine drifts, as ours did (one checked
    the values of the names it was given and not that the names were all there)."""
    comparisons = _oracle_comparisons(ast.parse(ORACLE.read_text()))
    assert {"assert_params_close", "compare_with_oracle", "train_against_one_process"} <= comparisons
    missing, listed_but_comparing, loops, running = [], [], [], set()
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        if not _runs_ranks(tree):
            continue
        running.add(path.stem)
        takes = _from_oracle(tree) & comparisons
        if not takes and path.stem not in NO_TENSOR_PARITY:
            missing.append(path.stem)
        if takes and path.stem in NO_TENSOR_PARITY:
            listed_but_comparing.append(f"{path.stem} ({sorted(takes)})")
        loops += [f"{path.stem}.{fn}:{line}" for fn, line in _own_loops(tree)
                  if (path.stem, fn) not in OWN_LOOPS]
    assert not missing, f"run ranks but take no comparison from tests/oracle.py: {missing}"
    assert not listed_but_comparing, f"drop from NO_TENSOR_PARITY, they compare: {listed_but_comparing}"
    assert not loops, f"compare tensors name by name in loops of their own (use tests/oracle.py): {loops}"
    gone = sorted(set(NO_TENSOR_PARITY) - running) + sorted(m for m, _ in OWN_LOOPS if m not in running)
    assert not gone, f"no longer run ranks, drop from NO_TENSOR_PARITY / OWN_LOOPS: {gone}"
