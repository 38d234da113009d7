"""BUILD (Bazel) must name every Python file of the project, and only existing ones.

Bazel cannot fetch its rules on the project's machines, so this test is what keeps the
BUILD file true: add a module or a test and forget BUILD, and this fails.
"""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DIRS = ("tapas", "models", "tests", "scripts", "benchmarks")


def _glob(patterns):
    """Bazel's ``glob`` for the patterns BUILD uses (``dir/*.py``, ``dir/**/*.py``)."""
    files = []
    for pattern in patterns:
        files += sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob(pattern)
                        if "__pycache__" not in p.parts)
    return files


def _value(node):
    """A BUILD argument: a literal, or ``glob([...])`` expanded against the tree."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "glob":
        return _glob(ast.literal_eval(node.args[0]))
    return ast.literal_eval(node)


def _build_calls():
    """Parse BUILD (Starlark is Python-syntax for this subset) into (rule, kwargs)."""
    tree = ast.parse((ROOT / "BUILD").read_text(), filename="BUILD")
    calls = []
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            call = node.value
            kwargs = {k.arg: _value(k.value) for k in call.keywords
                      if isinstance(k.value, (ast.Constant, ast.List, ast.Call))}
            calls.append((call.func.id, kwargs))
    return calls


def test_glob_patterns_match_files():
    for rule, kw in _build_calls():
        if rule == "py_library":
            assert kw.get("srcs"), f"py_library {kw['name']} names no source file"


def _py_files():
    files = set()
    for d in DIRS:
        for p in (ROOT / d).rglob("*.py"):
            if "__pycache__" not in p.parts:
                files.add(p.relative_to(ROOT).as_posix())
    return files


def _named_files(calls):
    named = set()
    for _, kw in calls:
        for key in ("srcs", "data"):
            named.update(f for f in kw.get(key, []) if f.endswith(".py"))
    return named


def test_build_names_every_python_file():
    missing = sorted(_py_files() - _named_files(_build_calls()))
    assert not missing, f"add these files to BUILD: {missing}"


def test_build_names_no_missing_file():
    stale = sorted(f for f in _named_files(_build_calls()) if not (ROOT / f).exists())
    assert not stale, f"BUILD names files that do not exist: {stale}"


def test_every_test_file_has_a_py_test():
    tests = {kw["srcs"][0] for rule, kw in _build_calls() if rule == "py_test"}
    on_disk = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py")}
    assert on_disk == tests, f"py_test targets differ from tests/: {sorted(on_disk ^ tests)}"


def test_rules_are_known_and_named():
    for rule, kw in _build_calls():
        assert rule in {"py_library", "py_test", "py_binary", "load", "package",
                        "exports_files"}, rule
        if rule.startswith("py_"):
            assert re.fullmatch(r"[a-z0-9_]+", kw["name"]), kw["name"]
