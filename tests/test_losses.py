"""tapas.execution.training.losses: how the loss of a placed output is computed, and what it moves.

The numbers (loss, gradients, 3 optimizer steps against Keras on 2 and 4 logical devices,
for every method) are checked in tests/test_runtime.py
(test_softmax_and_sigmoid_outputs_train_from_their_logits); these tests pin the choice of
method and the bytes the audit predicts.
"""

from __future__ import annotations

import keras
import pytest

from tapas.execution.training.losses import LossSpec, plan_loss
from tapas.sharding.placements import Replica, Split

LM = (8, 128, 32128)      # t5-small's logits: batch 8 x 128 tokens, vocabulary 32128


def scce(**kw):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, **kw)


def test_replicated_output_is_local():
    plan = plan_loss(scce(), Replica(), LM, "float32", 2, 4)
    assert (plan.method, plan.target_axis, plan.collectives, plan.partial) == \
        ("local", None, (), False)


@pytest.mark.parametrize("axis", [0, 1])
def test_batch_or_sequence_split_keeps_the_axis_per_example(axis):
    plan = plan_loss(scce(), Split(axis), LM, "float32", 2, 4)
    assert (plan.method, plan.target_axis, plan.collectives, plan.partial) == \
        ("local", axis, (), True)


def test_vocab_split_logits_use_vocab_parallel_crossentropy():
    """Issue 11: t5-small on 4 devices all-gathered 131.6 MB of logits for its loss; the
    vocabulary-parallel cross-entropy moves 24 KB (16 KB of row maxima, 8 KB of sums)."""
    plan = plan_loss(scce(), Split(2), LM, "float32", 2, 4)
    assert plan.method == "vocab-parallel" and plan.target_axis is None
    assert plan.collectives == (("AG", 8 * 128 * 4 * 4), ("AR", 8 * 128 * 2 * 4))
    assert sum(b for _, b in plan.collectives) <= 0.01 * 131.6e6
    assert not plan.partial                      # every replica has the full loss
    dense = plan_loss(keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=.1),
                      Split(2), LM, "float32", 3, 4)
    assert dense.method == "vocab-parallel" and dense.target_axis == 2
    assert dense.collectives[1] == ("AR", 8 * 128 * 3 * 4)


@pytest.mark.parametrize("loss, activation", [
    (keras.losses.SparseCategoricalCrossentropy(), "Softmax"),        # probabilities
    (scce(ignore_class=0), None),                                     # masked classes
    (keras.losses.KLDivergence(), None),                              # a sum, not a mean
])
def test_other_losses_of_class_split_outputs_gather_the_output(loss, activation):
    target_ndim = 2 if "Sparse" in type(loss).__name__ else 3
    plan = plan_loss(loss, Split(2), LM, "float32", target_ndim, 4, activation)
    assert plan.method == "gather" and plan.target_axis is None
    assert plan.collectives == (("AG", 8 * 128 * 32128 * 4),)


@pytest.mark.parametrize("loss", [keras.losses.MeanSquaredError(),
                                  keras.losses.BinaryCrossentropy(from_logits=True)])
def test_means_over_the_split_axis_stay_local(loss):
    plan = plan_loss(loss, Split(1), (8, 12), "float32", 2, 4)
    assert (plan.method, plan.target_axis, plan.partial) == ("local", 1, True)
    # targets of another rank cannot be split alike: gather
    assert plan_loss(loss, Split(1), (8, 12), "float32", 1, 4).method == "gather"


# ---- the search prices the loss (tapas.sharding.losses, CostOptions.loss) -------------------

def test_loss_spec_reads_keras_losses_and_refuses_names():
    spec = LossSpec.of(scce())
    assert spec == LossSpec("SparseCategoricalCrossentropy", from_logits=True)
    assert spec.sparse and spec.target_ndim(3) == 2
    assert LossSpec.from_json(spec.to_json()) == spec
    assert LossSpec.of(keras.losses.MeanSquaredError()).target_ndim(3) == 3
    for bad in ("mse", None, keras.losses.mean_squared_error):
        with pytest.raises(TypeError, match="give a keras.losses.Loss object"):
            LossSpec.of(bad)


@pytest.fixture(scope="module")
def t5_graph():
    from tapas import capturing, models
    entry = models.get("t5-tiny")
    return capturing.capture(entry.build(seed=0), list(entry.input_spec(8)))


def test_pattern_table_adds_the_loss_to_the_output_node_only(t5_graph):
    """The LM head split by vocabulary pays the vocabulary-parallel loss (an all-gather of
    row maxima, an all-reduce of row sums: the bytes plan_loss gives the runtime's audit);
    its batch split and replication pay nothing; no other GraphNode changes."""
    from tapas.planning.cluster import Cluster
    from tapas.planning.cost import CostOptions
    from tapas.planning.table import pattern_table
    cluster = Cluster.loopback_cpu(4)
    plain = pattern_table(t5_graph, 4, cluster, CostOptions())
    priced = pattern_table(t5_graph, 4, cluster, CostOptions(loss=scce()))
    out = t5_graph.outputs[0]
    (head,) = [n.id for n in t5_graph.nodes if out.name in {t.name for t in n.outputs}]
    for v in range(len(t5_graph.nodes)):
        for a, b in zip(plain.infos[v], priced.infos[v]):
            extra = [t for t in b.comm_terms if t.label.startswith("loss ")]
            if v != head or not (b.outputs[0] == Split(2)):
                assert not extra and b.comm_time == a.comm_time, (v, b.name)
                continue
            want = plan_loss(scce(), Split(2), out.shape, "float32", 2, 4).collectives
            assert [(t.kind.value, t.nbytes) for t in extra] == list(want) == \
                [("AG", 8 * 16 * 4 * 4), ("AR", 8 * 16 * 2 * 4)]
            assert b.comm_time == pytest.approx(a.comm_time + sum(t.total for t in extra))


def test_search_with_the_loss_prices_the_vocab_parallel_head():
    """tapas.search(loss=...) on t5-small, 8 V100s: the chosen plan (Megatron's, the LM
    head split by vocabulary) and the Megatron reference cost exactly the loss's two
    collectives more; data parallelism (batch-split logits) costs the same."""
    from tapas import capturing, models
    from tapas.planning import cost as cost_lib
    from tapas.planning.cluster import Cluster
    from tapas.planning.search import search
    entry = models.get("t5-small")
    graph = capturing.capture(entry.build(fast_init=True), list(entry.input_spec(8)))
    cluster = Cluster.v100_ethernet(1, 8)
    plain, priced = (search(graph, cluster=cluster, loss=loss) for loss in (None, scce()))
    head = len(graph.nodes) - 1
    assert graph.outputs[0].name in {t.name for t in graph.nodes[head].outputs}
    assert plain.patterns[head] == priced.patterns[head] == "column"
    out = graph.outputs[0]
    extra = sum(cost_lib.collective_cost(cost_lib.Collective.parse(k), b, cluster.axis(8),
                                         cost_lib.CostOptions.for_cluster(cluster)).total
                for k, b in plan_loss(scce(), Split(2), out.shape, "float32", 2, 8).collectives)
    assert extra > 0
    assert priced.total_cost == pytest.approx(plain.total_cost + extra)
    ref = [{a.name: a.cost for a in s.references} for s in (plain, priced)]
    assert ref[1]["megatron"] == pytest.approx(ref[0]["megatron"] + extra)
    assert ref[1]["data-parallel"] == pytest.approx(ref[0]["data-parallel"])
