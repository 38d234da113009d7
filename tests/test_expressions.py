"""tapas.sharding.expressions: SRC expressions (``C_AR(MatMul(S1(X), S0(W)))``): parsing,
printing, errors, and the parse/print round trip."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tapas.sharding.expressions import Apply, Coll, Leaf, parse
from tapas.sharding.placements import Collective, Partial, Replica, Split


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
