"""The before/after check of refactors (``scripts/identical_outputs.py``) can be trusted.

Its dump of one zoo preset (the captured graph, the gp and es Strategy JSON, every
``explain()`` message) is the same when made twice in one process, so a difference
between two trees' dumps is the trees', not noise; and its diff reports a changed
pattern, a missing model and a changed message by path.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import identical_outputs  # noqa: E402


def test_a_dump_is_reproducible_and_complete():
    first = identical_outputs.dump_one("resnet-tiny", 2, ("gp", "es"))
    second = identical_outputs.dump_one("resnet-tiny", 2, ("gp", "es"))
    assert identical_outputs.differences(first, second) == []
    names = [f"{n[0]}:{n[1]}" for n in first["nodes"]]
    assert sorted(first["explain"]) == sorted(names)
    for strategy in first["strategies"].values():
        assert len(strategy["patterns"]) == len(names) and "timings" not in strategy
    for messages in first["explain"].values():
        assert "has no pattern named" in messages[0] and len(messages) >= 2


def test_the_diff_names_each_difference():
    before = {"models": {"m": {"strategies": {"gp": {"patterns": ["replicate", "column"]}},
                               "explain": {"n": ["a", "b"]}}, "gone": {}}}
    after = {"models": {"m": {"strategies": {"gp": {"patterns": ["replicate", "row"]}},
                              "explain": {"n": ["a", "c"]}}}}
    found = identical_outputs.differences(before, after)
    assert found == ['/models/gone: only in before',
                     '/models/m/explain/n[1]: "b" != "c"',
                     '/models/m/strategies/gp/patterns[1]: "column" != "row"']
