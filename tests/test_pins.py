"""Pins (tapas.sharding.patterns.pins): a tapas layer's shard= choice is honoured by the search, and
a pin that cannot be honoured is refused naming the layer and the fix."""

import keras
import pytest

import tapas
from tapas.sharding import patterns
from tapas import layers as L
from tapas.planning.cost import Cluster
from tapas.ir import Kind


def _mlp(first_pin, second_pin, hidden=16):
    x = keras.Input((8,), batch_size=4)
    h = L.DenseLayer(hidden, activation="relu", shard=first_pin, name="up")(x)
    return keras.Model(x, L.DenseLayer(8, shard=second_pin, name="down")(h))


def _dense(graph):
    return [n for n in graph.nodes if n.kind == Kind.DENSE]


def test_pinned_layers_keep_their_pin_in_the_searched_strategy():
    # pins against what the cost model would choose alone on this tiny MLP
    model = _mlp("batch", "C_AR(MatMul(S1(X), S0(W)))")
    graph = tapas.capture(model)
    free = tapas.search(tapas.capture(_mlp(None, None)), cluster=Cluster.loopback_cpu(2))
    strategy = tapas.search(graph, cluster=Cluster.loopback_cpu(2))
    up, down = _dense(graph)
    assert strategy.pattern(up.id).name == "batch"
    assert strategy.pattern(down.id).name == "row"
    # the search is free where nothing is pinned, and the pins changed the answer
    assert [free.pattern(n.id).name for n in _dense(tapas.capture(_mlp(None, None)))] != \
        ["batch", "row"]


def test_name_pins_select_exactly_that_pattern():
    graph = tapas.capture(_mlp("column", "row"))
    up, down = _dense(graph)
    assert [p.name for p in patterns.patterns_for(up, graph, 2)] == ["column"]
    assert [p.name for p in patterns.patterns_for(down, graph, 2)] == ["row"]


def test_an_impossible_pin_is_refused_at_search_time_naming_layer_size_and_fix():
    model = _mlp("column", None, hidden=10)      # 10 units cannot split over 4 devices
    graph = tapas.capture(model)
    with pytest.raises(patterns.PinError) as e:
        tapas.search(graph, cluster=Cluster.loopback_cpu(4))
    msg = str(e.value)
    assert "layer 'up'" in msg and "shard='column'" in msg and "4 devices" in msg
    assert "has size 10, not divisible by 4 devices" in msg
    assert "shard=None" in msg and "replicate" in msg
    # the same model is fine on 2 devices
    tapas.search(graph, cluster=Cluster.loopback_cpu(2))


def test_an_expression_matching_nothing_lists_what_is_valid():
    graph = tapas.capture(_mlp("C_AG0(MatMul(S1(X), S0(W)))", None))
    with pytest.raises(patterns.PinError, match=r"no valid pattern has the expression.*"
                                                 r"row: Relu\(AddV2\(C_AR"):
        patterns.patterns_for(_dense(graph)[0], graph, 2)


def test_unpinned_nodes_are_untouched():
    graph = tapas.capture(_mlp(None, None))
    up = _dense(graph)[0]
    assert {"replicate", "batch", "row", "column"} <= {p.name for p in
                                                       patterns.patterns_for(up, graph, 2)}
