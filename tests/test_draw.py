"""Drawing a strategy (tapas.planning.draw, `tapas search --draw`): the rows per template
and outside it, reference plans beside the strategy, errors."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from tapas.planning.draw import draw_strategy, strategy_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def t5() -> Any:
    import tapas
    from tapas import models
    from tapas.planning.cluster import Cluster
    entry = models.get("t5-tiny")
    graph = tapas.capture(entry.build(fast_init=True), list(entry.input_spec(8)))
    return graph, tapas.search(graph, cluster=Cluster.v100_ethernet(1, 2))


def test_rows_cover_one_instance_of_each_template_and_the_weighted_rest(t5: Any) -> None:
    graph, s = t5
    rows = strategy_rows(s, graph)
    heads = [r for r in rows if "template" in r]
    nodes = [r for r in rows if "template" not in r]
    assert [h["template"] for h in heads[:len(s.templates)]] == [t[0] for t in s.templates]
    first = {v for _, _, insts in s.templates for v in insts[0]}
    assert first <= {r["id"] for r in nodes}
    for r in nodes:
        assert r["pattern"] == s.patterns[r["id"]] and r["family"]
        node = graph.nodes[r["id"]]
        if r["id"] not in first:   # outside the templates: only weights or collectives
            assert node.weights or r["collectives"]
    split = {w.path for w in graph.weights} & set(s.weight_placements)
    drawn = " ".join(w for r in nodes for w in r["weights"])
    assert all("/".join(p.split("/")[-2:]) in drawn for p in split)
    assert all("/2" in w for r in nodes for w in r["weights"])   # axis and device count


def test_draw_with_references_and_a_reference_that_does_not_apply(t5: Any,
                                                                   tmp_path: Any) -> None:
    graph, s = t5
    path = draw_strategy(s, graph, str(tmp_path / "s.png"),
                         references=["megatron", "expert"])
    assert os.path.getsize(path) > 0
    mega = next(a for a in s.references if a.name == "megatron")
    pats = [mega.changes.get(v, p) for v, p in enumerate(s.patterns)]
    assert {r["pattern"] for r in strategy_rows(s, graph, pats) if "pattern" in r} >= {"heads"}
    with pytest.raises(ValueError, match="no pattern 'nonsense'"):
        strategy_rows(s, graph, ["nonsense"] * len(graph.nodes))


def test_cli_search_draw(tmp_path: Any) -> None:
    png = tmp_path / "t5.png"
    proc = subprocess.run(
        [sys.executable, "-m", "tapas.cli", "search", "--model=t5-tiny", "--batch_size=8",
         "--devices_per_node=2", f"--draw={png}"], capture_output=True, text=True,
        timeout=300, cwd=ROOT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert png.stat().st_size > 0 and "strategy drawn to" in proc.stdout
    assert "beside megatron" in proc.stdout
