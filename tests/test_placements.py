"""tapas.sharding.placements: placements (short forms, local shapes and bytes, shard and
unshard), the resharding table and Comm; and the check that the pure stages import no
TensorFlow."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tapas.sharding.placements import (Collective, Comm, Partial, Replica, Split,
                                       is_placement_text, parse_placement, reshard)


def test_placement_short_forms_round_trip() -> None:
    for p in (Split(0), Split(3), Split(12), Replica(), Partial()):
        assert parse_placement(str(p)) == p
    assert str(Split(1)) == "S1" and str(Replica()) == "R" and str(Partial()) == "P"


def test_is_placement_text() -> None:
    assert all(is_placement_text(t) for t in ("S0", "S12", "R", "P"))
    assert not any(is_placement_text(t) for t in ("S", "X", "MatMul", "RS", "s1", ""))


@pytest.mark.parametrize("bad", ["S", "Q", "S-1", "s1", ""])
def test_bad_placement_names_the_forms(bad: str) -> None:
    with pytest.raises(ValueError, match="'R', 'P' or 'S<axis>'"):
        parse_placement(bad)


def test_split_axis_must_be_non_negative() -> None:
    with pytest.raises(ValueError, match="axis must be an int >= 0"):
        Split(-1)


SHAPE = (8, 64)


def _kinds(src: str, dst: str) -> list[tuple[str, str, str, str]]:
    return [(c.phase, c.kind.value, str(c.src), str(c.dst))
            for c in reshard(parse_placement(src), parse_placement(dst), SHAPE, "float32", "t:0")]


def test_placements_are_interned_and_compared_by_value() -> None:
    """One object per placement (the search compares them by identity first); a copy made
    by pickling or deepcopy is a new object that is still equal, with the same hash, so
    identity is only ever a fast path."""
    import copy
    import pickle
    assert Split(1) is Split(1) and Replica() is Replica() and Partial() is Partial()
    assert Split(1) is not Split(2) and Split(1) != Split(2)
    for p in (Split(3), Replica(), Partial()):
        for twin in (pickle.loads(pickle.dumps(p)), copy.deepcopy(p)):
            assert twin == p and hash(twin) == hash(p) and str(twin) == str(p)
    with pytest.raises(ValueError):
        Split(-1)
    with pytest.raises(ValueError):
        Split(True)


def test_an_edge_cost_cached_by_identity_equals_its_cost_by_value() -> None:
    """EdgeCoster caches by the objects' identities: an equal placement that is another
    object (unpickled) gets the same seconds, and equal placements cost nothing."""
    import pickle

    from tapas.ir import TensorInfo
    from tapas.planning.cost import Cluster, CostOptions
    from tapas.planning.table import EdgeCoster
    edges = EdgeCoster(4, Cluster.v100_ethernet(1, 4), CostOptions())
    t = TensorInfo("x:0", (8, 16), "float32")
    first = edges.cost(t, Split(0), Replica())
    assert first is not None and first > 0
    assert edges.cost(t, Split(0), Replica()) == first
    assert edges.cost(t, pickle.loads(pickle.dumps(Split(0))), Replica()) == first
    assert edges.cost(t, Split(1), pickle.loads(pickle.dumps(Split(1)))) == 0.0


def test_reshard_table() -> None:
    assert _kinds("P", "R") == [("fwd", "AR", "P", "R")]
    assert _kinds("S1", "R") == [("fwd", "AG", "S1", "R")]
    assert _kinds("P", "S0") == [("fwd", "RS", "P", "S0"), ("bwd", "AG", "S0", "R")]
    assert _kinds("S0", "S1") == [("fwd", "A2A", "S0", "S1"), ("bwd", "A2A", "S1", "S0")]
    assert _kinds("R", "S1") == [("bwd", "AG", "S1", "R")]
    assert _kinds("R", "R") == [] and _kinds("S1", "S1") == [] and _kinds("P", "P") == []


def test_reshard_axes_and_bytes() -> None:
    (ag,) = reshard(Split(1), Replica(), SHAPE, "float32", "t:0")
    assert ag.axis == 1 and ag.kind is Collective.ALL_GATHER
    assert ag.bytes == 8 * 64 * 4 and ag.shape == SHAPE and ag.tensor == "t:0"
    (ar,) = reshard(Partial(), Replica(), SHAPE, "bfloat16", "t:0")
    assert ar.bytes == 8 * 64 * 2


def test_reshard_rejects_partial_targets_and_bad_axes() -> None:
    with pytest.raises(ValueError, match="no collective produces a partial sum"):
        reshard(Replica(), Partial(), SHAPE, "float32", "t:0")
    with pytest.raises(ValueError, match="has rank 2"):
        reshard(Split(2), Replica(), SHAPE, "float32", "t:0")


def test_comm_validates_phase_and_round_trips_json() -> None:
    c = Comm("AR", "x:0", (4, 4), "float32", Partial(), Replica(), "fwd")
    assert c.kind is Collective.ALL_REDUCE
    assert Comm.from_json(c.to_json()) == c
    with pytest.raises(ValueError, match="use 'fwd' or 'bwd'"):
        Comm("AR", "x:0", (4,), "float32", Partial(), Replica(), "forward")


# ---- local shape and bytes, shard and unshard ---------------------------------------------

def test_local_shape_divides_the_split_axis_only() -> None:
    assert Split(1).local_shape((8, 64), 4) == (8, 16)
    assert Split(0).local_shape([8, 64], 4) == (2, 64)
    assert Replica().local_shape((8, 64), 4) == (8, 64)
    assert Partial().local_shape((8, 64), 4) == (8, 64)
    assert Split(2).local_shape((8, 64), 4) == (8, 64)     # no such axis: nothing to divide


def test_local_bytes() -> None:
    assert Split(0).local_bytes((8, 64), "float32", 4) == 8 * 64 * 4 / 4
    assert Replica().local_bytes((8, 64), "bfloat16", 4) == 8 * 64 * 2
    assert Partial().local_bytes((8, 64), "float32", 2) == 8 * 64 * 4
    assert Replica().local_bytes((8, None), "float32", 2) == 8 * 4       # unknown dim: 1
    assert Replica().local_bytes((8,), "no-such-dtype", 2) == 8 * 4     # unknown dtype: 4
    assert Replica().local_bytes(None, "float32", 2) == 4                  # a scalar


@pytest.mark.parametrize("placement", [Split(0), Split(1), Split(2), Replica()])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_shard_unshard_round_trip(placement, n: int) -> None:
    value = np.arange(4 * 8 * 12, dtype=np.float32).reshape(4, 8, 12)
    parts = [placement.shard(value, n, i) for i in range(n)]
    for part in parts:
        assert part.shape == placement.local_shape(value.shape, n)
    np.testing.assert_array_equal(placement.unshard(parts), value)


def test_split_shards_are_contiguous_blocks() -> None:
    value = np.arange(8).reshape(2, 4)
    assert Split(1).shard(value, 2, 1).tolist() == [[2, 3], [6, 7]]
    assert Split(0).shard(value, 2, 0).tolist() == [[0, 1, 2, 3]]


def test_partial_unshard_sums_the_addends() -> None:
    parts = [np.full((2, 3), float(i)) for i in range(4)]
    np.testing.assert_array_equal(Partial().unshard(parts), np.full((2, 3), 6.0))


def test_split_refuses_a_non_divisible_dimension() -> None:
    with pytest.raises(ValueError, match="cannot split dimension 1 of size 10 into 4 equal "
                                         "shards.*use a device count that divides 10"):
        Split(1).shard(np.zeros((4, 10)), 4, 0)


def test_split_refuses_a_missing_axis() -> None:
    with pytest.raises(ValueError, match="S2 needs a tensor of rank > 2"):
        Split(2).shard(np.zeros((4, 10)), 2, 0)


def test_partial_refuses_to_shard_a_global_value() -> None:
    with pytest.raises(ValueError, match="cannot be sharded as P.*place it R or S"):
        Partial().shard(np.zeros((4,)), 2, 0)


# ---- stage purity ---------------------------------------------------------------------------

def test_pure_modules_import_no_tensorflow() -> None:
    code = ("import sys, tapas.capturing.grouping, tapas.mining, tapas.sharding.patterns, "
            "tapas.sharding.rules, "
            "tapas.sharding.expressions, tapas.planning.search, tapas.planning.explore; "
            "bad = [m for m in sys.modules if m == 'tensorflow' or m.startswith('tensorflow.')"
            " or m == 'keras' or m.startswith('keras.')]; print(bad); assert not bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_collective_is_priced_and_lowered():
    """Adding a Collective member is one edit in tapas/sharding/placements.py; this test names
    the places that must then learn it: its cost and its lowering."""
    from tapas.execution.program.collectives import Collectives
    from tapas.planning import cost
    for kind in Collective:
        assert kind.value in cost.DEFAULT_EPSILON, f"add {kind.value} to DEFAULT_EPSILON"
        assert cost.ring_factor(kind, 4) > 0, f"give {kind.value} a ring factor"
        assert callable(getattr(Collectives, kind.long_name, None)), (
            f"add Collectives.{kind.long_name} in tapas/execution/program/collectives.py")
