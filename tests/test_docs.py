"""The Python examples in README.md and docs/*.md run as written."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _examples():
    for path in DOCS:
        for k, code in enumerate(BLOCK.findall(path.read_text())):
            yield pytest.param(code, id=f"{path.name}#{k}")


@pytest.mark.parametrize("code", list(_examples()))
def test_doc_example_runs(code):
    exec(compile(code, "<doc example>", "exec"), {"__name__": "__doc_example__"})
