"""The Python examples in README.md and docs/*.md run as written.

A page's examples run in order in one namespace, as a reader would type them.
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
