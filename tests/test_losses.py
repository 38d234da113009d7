"""tapas.execution.losses: how the loss of a placed output is computed, and what it moves.

The numbers (loss, gradients, 3 optimizer steps against Keras on 2 and 4 logical devices,
for every method) are checked in tests/test_runtime.py
(test_softmax_and_sigmoid_outputs_train_from_their_logits); these tests pin the choice of
method and the bytes the audit predicts.
"""

from __future__ import annotations

import keras
import pytest

from tapas.execution.losses import plan_loss
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
