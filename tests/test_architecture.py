"""The package's shape: imports follow the pipeline, no import cycle, sizes within limits.

In:  the source of every ``tapas/**/*.py`` and ``models/*.py``, parsed with ``ast`` (nothing
     is imported, so this runs in a second).
Out: failures naming the module, the import or the oversized definition and the fix.

The layer order (docs/architecture.md) is ``ir``/``progress`` < ``capturing`` < ``mining`` <
``sharding`` < ``planning`` < ``layers`` < ``execution`` (``program`` < ``training`` <
``runtime`` < the rest) < ``models`` (the zoo) < ``cli``.
A module imports only modules of its own layer or a lower one, at module level, inside a
function, under ``TYPE_CHECKING`` or through ``importlib.import_module("...")`` alike (a
module named at run time is refused: it cannot be checked); ``tapas/__init__.py`` is the
public facade, counted in the zoo's layer since it re-exports ``tapas.models``. Module-level
imports between tapas modules form no cycle (an edge per imported module, not per package
``__init__`` it passes through).

Size limits, for ``tapas/`` (the zoo is checked for imports only): a module at most 600
lines, a class 300, a function 80 (docstrings included).
The definitions over a limit today are listed in ``SIZE_EXCEPTIONS`` with their size now:
one may shrink but not grow, and leaves the list once it fits (the test says so), so the
list only shrinks.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Lowest first. A module's layer is the longest prefix of its dotted name found here.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("tapas.ir", "tapas.progress"),
    ("tapas.capturing",),
    ("tapas.mining",),
    ("tapas.sharding",),
    ("tapas.planning",),
    ("tapas.layers",),
    # the execution floor, one package per concern (docs/architecture.md): the per-replica
    # program, the model's training pieces on the shards, the tf.distribute runtime, then
    # the user API and jobs, checking and calibration, which use one another
    ("tapas.execution.program",),
    ("tapas.execution.training",),
    ("tapas.execution.runtime",),
    ("tapas.execution", "tapas.execution.api", "tapas.execution.checking",
     "tapas.execution.calibration"),
    ("tapas.models",),
    ("tapas.export",),
    ("tapas.cli",),
)
FACADE = "tapas"   # tapas/__init__.py: re-exports the public entry points of every layer

# Imports against the layer order that stay until the importing module moves, with why.
LAYER_EXCEPTIONS: dict[tuple[str, str], str] = {}

MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 600, 300, 80

# "path" (module lines), "path::Class" or "path::func" / "path::Class.method" (lines) -> size
# today. Shrink an entry when its definition shrinks; delete it when it fits the limit.
SIZE_EXCEPTIONS: dict[str, int] = {}


def _modules() -> dict[str, pathlib.Path]:
    """``{dotted name: path}`` of every tapas module (models/ is ``tapas.models``)."""
    found = {}
    for base, package in ((ROOT / "tapas", "tapas"), (ROOT / "models", "tapas.models")):
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The tapas module an imported dotted name lands in (``tapas.ir.Graph`` -> ``tapas.ir``)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


DYNAMIC = "<a module named at run time>"


def _callee(call: ast.Call) -> str | None:
    """The called name: ``f`` of ``f(...)`` and of ``x.f(...)``."""
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)


def _imports(module: str, tree: ast.Module) -> list[tuple[str, int, bool]]:
    """``(imported tapas module, line, at module level)`` for every import in ``tree``:
    ``import``, ``from ... import`` (relative too), ``importlib.import_module("...")`` and
    ``__import__("...")``; an import whose module is not a string constant is ``DYNAMIC``."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, int, bool]] = []

    def add(name: str, line: int, top: bool) -> None:
        target = _resolve(name)
        if target is not None and target != module:
            found.append((target, line, top))

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno, top)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                add(full if full in MODULES else base, node.lineno, top)
        elif isinstance(node, ast.Call) and _callee(node) in ("import_module", "__import__"):
            name = node.args[0] if node.args else None
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                add(name.value, node.lineno, top)
            else:
                found.append((DYNAMIC, node.lineno, top))
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.Lambda))
            if isinstance(node, ast.If) and _is_type_checking(node):
                inner = False   # not run: no cycle, but still bound by the layer order
            visit(child, inner)

    visit(tree, True)
    return found


TREES = {m: ast.parse(p.read_text(), filename=str(p)) for m, p in MODULES.items()}
IMPORTS = {m: _imports(m, tree) for m, tree in TREES.items()}


def _layer(module: str) -> int | None:
    """The index in LAYERS of the layer ``module`` sits in; the facade counts as the zoo's
    layer (it re-exports ``tapas.models``), so only the zoo and the CLI may import it."""
    if module == FACADE:
        module = "tapas.models"
    best, rank = -1, None
    for k, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), k
    return rank


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(ROOT)}:{line}"


def layer_violations() -> list[str]:
    """Every import of a higher layer by a lower one, not in ``LAYER_EXCEPTIONS``."""
    bad = []
    for module, imports in IMPORTS.items():
        if module == FACADE:
            continue
        own = _layer(module)
        assert own is not None, f"{module} belongs to no layer: add it to LAYERS"
        for target, line, _ in imports:
            if target == DYNAMIC:
                bad.append(f"{_where(module, line)}: {module} imports {target}: name the "
                           "module as a string constant, so this check can see its layer")
                continue
            other = _layer(target)
            if other is not None and other > own:
                if (module, target) in LAYER_EXCEPTIONS:
                    continue
                if (module, _top(target)) in LAYER_EXCEPTIONS:
                    continue
                bad.append(f"{_where(module, line)}: {module} imports {target}, a higher layer "
                           "(docs/architecture.md): move the shared code down, or pass it in")
    return bad


def _top(module: str) -> str:
    """The layer prefix a module sits under (``tapas.models.t5`` -> ``tapas.models``)."""
    return max((p for ps in LAYERS for p in ps
                if module == p or module.startswith(p + ".")), key=len, default=module)


def import_cycles() -> list[list[str]]:
    """The strongly connected components (more than one module) of the module-level
    import graph, found with Tarjan's algorithm."""
    graph = {m: sorted({t for t, _, top in imps if top and t in IMPORTS})
             for m, imps in IMPORTS.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return cycles


def sizes() -> dict[str, tuple[int, int]]:
    """``{key: (lines, limit)}`` of every module, class and function (see SIZE_EXCEPTIONS)."""
    found = {}
    for module, tree in TREES.items():
        if not module.startswith("tapas.") or module.startswith("tapas.models"):
            continue   # the zoo (models/) is sized by its own rules
        path = MODULES[module].relative_to(ROOT).as_posix()
        found[path] = (len(MODULES[module].read_text().splitlines()), MODULE_LINES)

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{prefix}{child.name}"
                    limit = CLASS_LINES if isinstance(child, ast.ClassDef) else FUNCTION_LINES
                    found[f"{path}::{name}"] = (child.end_lineno - child.lineno + 1, limit)
                    visit(child, name + ".")
                else:
                    visit(child, prefix)

        visit(tree, "")
    return found


SIZES = sizes()


def size_violations() -> list[str]:
    """New oversized definitions, exceptions that grew, and exceptions that now fit."""
    bad = []
    for key, (lines, limit) in sorted(SIZES.items()):
        recorded = SIZE_EXCEPTIONS.get(key)
        if lines > limit and recorded is None:
            bad.append(f"{key} is {lines} lines, over the limit of {limit}: split it")
        elif recorded is not None and lines > recorded:
            bad.append(f"{key} grew to {lines} lines from {recorded} (limit {limit}): an "
                       "exception may only shrink; split it")
        elif recorded is not None and lines <= limit:
            bad.append(f"{key} is {lines} lines, within the limit of {limit}: delete its "
                       "entry from SIZE_EXCEPTIONS")
    for key in sorted(set(SIZE_EXCEPTIONS) - set(SIZES)):
        bad.append(f"{key} in SIZE_EXCEPTIONS no longer exists: delete its entry")
    return bad


def test_every_module_belongs_to_a_layer():
    assert [m for m in MODULES if m != FACADE and _layer(m) is None] == []


def test_lower_layers_never_import_higher_ones():
    assert layer_violations() == []


def test_layer_exceptions_are_still_needed():
    used = {(m, _top(t)) for m, imps in IMPORTS.items() for t, _, _ in imps} | {
        (m, t) for m, imps in IMPORTS.items() for t, _, _ in imps}
    assert [e for e in LAYER_EXCEPTIONS if e not in used] == []


def test_no_import_cycle():
    assert import_cycles() == []


def test_sizes_within_limits_or_recorded_exceptions():
    assert size_violations() == []


@pytest.mark.parametrize("source, expected", [
    ("from tapas.execution.calibration import profiling\n",
     "imports tapas.execution.calibration.profiling"),
    ("def f():\n    from tapas.cli import run\n", "imports tapas.cli"),
    ("def __getattr__(name):\n    import tapas.execution.checking.audit\n", "imports tapas.execution"),
    ("import importlib\nimportlib.import_module('tapas.models')\n", "imports tapas.models"),
    ("def f(name):\n    return __import__(name)\n", "a module named at run time"),
    ("if TYPE_CHECKING:\n    from tapas.layers import DenseLayer\n", "imports tapas.layers"),
])
def test_the_checks_catch_an_injected_violation(source, expected, monkeypatch):
    """A lower layer importing a higher one, however it does it, is reported."""
    module = "tapas.planning.table"
    monkeypatch.setitem(IMPORTS, module, _imports(module, ast.parse(source)))
    assert any(expected in v for v in layer_violations())


def test_the_cycle_check_catches_an_injected_cycle(monkeypatch):
    monkeypatch.setitem(IMPORTS, "tapas.ir", [*IMPORTS["tapas.ir"], ("tapas.progress", 1, True)])
    monkeypatch.setitem(IMPORTS, "tapas.progress", [("tapas.ir", 1, True)])
    assert ["tapas.ir", "tapas.progress"] in import_cycles()


def test_the_size_check_catches_growth_and_stale_entries(monkeypatch):
    monkeypatch.setitem(SIZES, "tapas/new.py", (601, MODULE_LINES))
    monkeypatch.setitem(SIZES, "tapas/new.py::f", (81, FUNCTION_LINES))
    monkeypatch.setitem(SIZES, "tapas/grown.py::C", (320, CLASS_LINES))
    monkeypatch.setitem(SIZE_EXCEPTIONS, "tapas/grown.py::C", 310)
    monkeypatch.setitem(SIZES, "tapas/fits.py", (550, MODULE_LINES))
    monkeypatch.setitem(SIZE_EXCEPTIONS, "tapas/fits.py", 650)
    monkeypatch.setitem(SIZE_EXCEPTIONS, "tapas/gone.py", 700)
    found = "\n".join(size_violations())
    for key in ("tapas/new.py is 601", "tapas/new.py::f is 81", "tapas/grown.py::C grew",
                "tapas/fits.py is 550", "tapas/gone.py in SIZE_EXCEPTIONS"):
        assert key in found
