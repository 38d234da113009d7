"""tapas.sharding.placements: placements, the resharding table, Comm and SRC expressions."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tapas.sharding.placements import Collective
from tapas.sharding.expressions import Apply, Coll, Leaf, parse
from tapas.sharding.placements import Comm, Partial, Replica, Split, parse_placement, reshard


def test_placement_short_forms_round_trip() -> None:
    for p in (Split(0), Split(3), Split(12), Replica(), Partial()):
        assert parse_placement(str(p)) == p
    assert str(Split(1)) == "S1" and str(Replica()) == "R" and str(Partial()) == "P"


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


def test_megatron_row_expression() -> None:
    e = parse("C_AR(MatMul(S1(X), S0(W)))")
    assert e == Coll(Collective.ALL_REDUCE, (), Apply("MatMul", (Leaf(Split(1), "X"),
                                                                Leaf(Split(0), "W"))))
    assert str(e) == "C_AR(MatMul(S1(X), S0(W)))"
    assert parse(" C_AG1( MatMul( R(X) ,S1(W) ) ) ") == parse("C_AG1(MatMul(R(X), S1(W)))")
    a2a = parse("C_A2A12(R(x))")
    assert isinstance(a2a, Coll) and a2a.axes == (1, 2)
    assert parse(str(Coll("A2A", (1, 12), Leaf(Replica(), "x")))).axes == (1, 12)


@pytest.mark.parametrize("bad,msg", [
    ("MatMul(X)", "expected '\\('"), ("R(X", "expected '\\)'"), ("C_XX(R(X))", "unknown"),
    ("R(X) R(Y)", "trailing"), ("R((X))", "must wrap a tensor name"), ("R(C_AR(X))", "expected"),
    ("Op(R(X)) $", "unexpected character")])
def test_parse_errors(bad: str, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        parse(bad)


_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_./:\-]{0,8}", fullmatch=True).filter(
    lambda s: not (s in ("R", "P") or s.startswith("C_") or (s[0] == "S" and s[1:].isdigit())))
_placements = st.one_of(st.builds(Split, st.integers(0, 11)), st.just(Replica()),
                        st.just(Partial()))
_leaves = st.builds(Leaf, _placements, _names)


def _colls(child: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.builds(lambda e: Coll(Collective.ALL_REDUCE, (), e), child),
        st.builds(lambda a, e: Coll(Collective.ALL_GATHER, (a,), e), st.integers(0, 11), child),
        st.builds(lambda a, e: Coll(Collective.REDUCE_SCATTER, (a,), e), st.integers(0, 11),
                  child),
        st.builds(lambda a, b, e: Coll(Collective.ALL_TO_ALL, (a, b), e), st.integers(0, 11),
                  st.integers(0, 11), child))


_exprs = st.recursive(_leaves, lambda child: st.one_of(
    st.builds(lambda op, args: Apply(op, tuple(args)), _names, st.lists(child, min_size=1,
                                                                         max_size=3)),
    _colls(child)), max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(_exprs)
def test_parse_round_trips_str(e) -> None:
    assert parse(str(e)) == e


def test_pure_modules_import_no_tensorflow() -> None:
    code = ("import sys, tapas.capturing.grouping, tapas.mining, tapas.sharding.patterns, "
            "tapas.sharding.expressions, tapas.planning.search, tapas.planning.explore; "
            "bad = [m for m in sys.modules if m == 'tensorflow' or m.startswith('tensorflow.')"
            " or m == 'keras' or m.startswith('keras.')]; print(bad); assert not bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
