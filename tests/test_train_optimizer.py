"""``tapas train --optimizer``: a Keras optimizer name or a JSON config file, the zoo model's
compiled optimizer by default, verified against Keras's own training step; a bad value is
refused with its cause before any work."""

from __future__ import annotations

import json

import keras
import pytest

from command import run_tapas_each   # tests/command.py


# batch 16: at the default 4, batch norm over a handful of values makes the model's own
# gradients sensitive beyond verify's float32 tolerance (docs/running.md)
TRAIN = ("train", "--model=resnet-tiny", "--devices=2", "--steps=2", "--batch_size=16",
         "--strategy=random:1", "--verify")


def test_default_named_and_config_file_optimizers_verify(tmp_path):
    """The compiled optimizer by default, one by name and one from a JSON config, each
    verified against Keras (one process runs the three: command.run_tapas_each)."""
    config = tmp_path / "opt.json"
    config.write_text(json.dumps(keras.optimizers.serialize(
        keras.optimizers.RMSprop(0.002, momentum=0.5, clipnorm=0.3))))
    runs = run_tapas_each(list(TRAIN), [*TRAIN, "--optimizer=adamw"],
                          [*TRAIN, f"--optimizer={config}"], timeout=900)
    for proc in runs:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "verify: PASSED" in proc.stdout, proc.stdout[-3000:]
    default, adamw, rmsprop = (proc.stdout for proc in runs)
    assert "optimizer: SGD(learning_rate=0.01" in default
    assert "(the model's compiled optimizer)" in default
    assert "optimizer: AdamW(learning_rate=0.001, weight_decay=0.004)" in adamw
    assert "optimizer: RMSprop(learning_rate=0.002, clipnorm=0.3)" in rmsprop


def test_bad_optimizers_are_refused_with_their_cause(tmp_path):
    broken = tmp_path / "bad.json"
    broken.write_text('{"class_name": "Adam", "config": ')
    # refused before any step: one process runs them all (command.run_tapas_each)
    nosuch, bad_json, adafactor = run_tapas_each(
        [*TRAIN, "--optimizer=nosuch"], [*TRAIN, f"--optimizer={broken}"],
        [*TRAIN, "--optimizer=adafactor"], timeout=400)
    assert nosuch.returncode != 0
    assert "optimizer 'nosuch' is not a Keras optimizer" in nosuch.stdout + nosuch.stderr
    assert bad_json.returncode != 0
    assert f"--optimizer={broken}: not valid JSON" in bad_json.stdout + bad_json.stderr
    assert adafactor.returncode != 0
    assert "Adafactor cannot run on weight shards" in adafactor.stdout + adafactor.stderr


def test_the_search_counts_the_compiled_optimizers_slots():
    """The memory estimate of the plan parallelize searches counts the optimizer the model
    trains with: no state for plain SGD, one copy for momentum, three for AMSGrad Adam
    (``CostOptions.optimizer_slots``, counted by ``keras_optimizer.slot_count``)."""
    import tensorflow as tf
    from tapas import capturing
    from tapas.execution.api import parallel
    from tapas.planning.cost import CostOptions, weight_memory

    inp = keras.Input((8,))
    model = keras.Model(inp, keras.layers.Dense(4)(keras.layers.Dense(16)(inp)))
    graph = capturing.capture(model, tf.TensorSpec([4, 8]), training=True)
    for optimizer, slots in ((keras.optimizers.SGD(0.1), 0),
                             (keras.optimizers.SGD(0.1, momentum=0.9), 1),
                             (keras.optimizers.Adam(amsgrad=True), 3)):
        strategy = parallel._search(graph, 2, None, None, 1, [None], optimizer)
        # the optimizer state is ``slots`` copies of the weights as the plan holds them
        assert strategy.memory.optimizer == slots * strategy.memory.weights, strategy.memory
    assert weight_memory(100, True, CostOptions(optimizer_slots=3)).optimizer == 300
    with pytest.raises(ValueError, match="optimizer_slots=-1"):
        CostOptions(optimizer_slots=-1)
