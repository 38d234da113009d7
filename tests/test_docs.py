"""The docs hold: their Python examples run as written, and the pages and sections they
name exist.

A page's examples run in order in one namespace, as a reader would type them. A reference
``docs/NAME.md`` (in README.md, docs/*.md or a tapas/ docstring) names an existing page, and
``docs/NAME.md, "Section"`` a heading of that page (the quoted text inside the heading). A
result file a page names, ``benchmarks/results/NAME`` (``{a,b}`` alternatives and ``*``
allowed), exists.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


@pytest.mark.parametrize("path", [p for p in DOCS if BLOCK.search(p.read_text())],
                         ids=lambda p: p.name)
def test_doc_examples_run(path):
    namespace = {"__name__": "__doc_example__"}
    for k, code in enumerate(BLOCK.findall(path.read_text())):
        exec(compile(code, f"{path.name} example {k}", "exec"), namespace)


SOURCES = [*DOCS, *sorted((ROOT / "tapas").rglob("*.py")), *sorted((ROOT / "models").glob("*.py"))]
PAGE = re.compile(r"docs/([\w-]+\.md)")
SECTION = re.compile(r'docs/([\w-]+\.md)`{0,2},\s*"([^"]+)"')


def _headings(page: pathlib.Path) -> list[str]:
    return [" ".join(line.lstrip("#").split()).lower()
            for line in page.read_text().splitlines() if line.startswith("#")]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_pages_and_sections_exist(path):
    text = path.read_text()
    missing = sorted({m.group(1) for m in PAGE.finditer(text)
                      if not (ROOT / "docs" / m.group(1)).exists()})
    assert not missing, f"{path.name} names pages that do not exist: {missing}"
    stale = []
    for m in SECTION.finditer(text):
        section = " ".join(m.group(2).split()).lower()
        if not any(section in h for h in _headings(ROOT / "docs" / m.group(1))):
            stale.append(f"docs/{m.group(1)}, {m.group(2)!r}")
    assert not stale, f"{path.name} names sections that do not exist: {stale}"


RESULT = re.compile(r"benchmarks/results/([\w.{},*-]+\.(?:json|png|log|\{json,log\}))")


def _alternatives(name: str) -> list[str]:
    """``a{,_b}.png`` -> ``a.png``, ``a_b.png`` (shell brace expansion)."""
    m = re.search(r"\{([^{}]*)\}", name)
    if m is None:
        return [name]
    return [full for alt in m.group(1).split(",")
            for full in _alternatives(name[:m.start()] + alt + name[m.end():])]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_named_result_files_exist(path):
    results = ROOT / "benchmarks" / "results"
    missing = sorted({name for m in RESULT.finditer(path.read_text())
                      for name in _alternatives(m.group(1)) if not list(results.glob(name))})
    assert not missing, f"{path.name} names result files that do not exist: {missing}"
