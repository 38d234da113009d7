"""Tests of the model zoo (``tapas.models``): registry, presets and the three families.

Only the tiny presets (and, with ``fast_init``, t5-small and resnet50-1k) are
built here; the large presets are checked analytically.
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tapas import models  # noqa: E402
from tapas.models import moe, resnet, t5  # noqa: E402

TINY = ["t5-tiny", "moe-tiny", "resnet-tiny", "t5-tiny-masked", "bert-tiny", "llama-tiny",
        "llama-tiny-fused"]
INPUT_NAMES = {
    "t5": ("encoder_input_ids", "decoder_input_ids"),
    "moe": ("input_ids",),
    "resnet": ("images",),
    "bert": ("token_ids", "segment_ids", "padding_mask"),
    "llama": ("token_ids", "padding_mask"),
}
MASKED_T5_INPUTS = INPUT_NAMES["t5"] + ("encoder_padding_mask", "decoder_padding_mask")


def _input_names(entry: models.ModelEntry) -> tuple[str, ...]:
    if entry.family == "t5" and entry.config.padding_mask:
        return MASKED_T5_INPUTS
    return INPUT_NAMES[entry.family]


@pytest.fixture(scope="module")
def tiny_models() -> dict[str, keras.Model]:
    return {name: models.get(name).build(seed=0) for name in TINY}


def _expected_logits_shape(entry: models.ModelEntry, batch: int) -> tuple[int, ...]:
    c = entry.config
    if entry.family == "t5":
        return (batch, c.decoder_seq_len, c.vocab_size)
    if entry.family in ("moe", "bert", "llama"):
        return (batch, c.seq_len, c.vocab_size)
    return (batch, c.num_classes)


def _trace(model: keras.Model, specs: tuple[tf.TensorSpec, ...]) -> tf.Graph:
    """Trace the model exactly as the capture stage does and return the graph."""
    fn = tf.function(lambda *a: model(list(a), training=False))
    return fn.get_concrete_function(*specs).graph


# --------------------------------------------------------------------------- #
# Registry and presets (no building)
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("name", models.names())
def test_every_preset_is_well_formed(name: str) -> None:
    entry = models.get(name)
    assert entry.name == name
    assert entry.family in models.FAMILIES
    assert entry.description.strip() and "\n" not in entry.description
    assert entry.loss == models.LOSS == "sparse_categorical_crossentropy_from_logits"
    count = entry.param_count()
    assert isinstance(count, int) and count > 0
    for batch in (None, 1 if entry.family != "moe" else entry.default_batch_size):
        specs = entry.input_spec(batch)
        assert tuple(s.name for s in specs) == _input_names(entry)
        for spec in specs:
            assert spec.shape.is_fully_defined(), spec
            assert spec.shape[0] == (batch or entry.default_batch_size)


def test_preset_families_and_sizes() -> None:
    assert models.DEFAULT_MODEL in models.names()
    assert models.names("t5")[:4] == ["t5-tiny", "t5-small", "t5-base", "t5-large"]
    assert {f"t5-large-depth{d}" for d in (6, 12, 24, 48)} <= set(models.names("t5"))
    assert models.names("moe") == ["moe-tiny", "moe-380m", "moe-1.3b", "moe-2.4b",
                                   "moe-tiny-tapas", "moe-1.3b-tapas"]
    resnets = models.names("resnet")
    assert len(resnets) == 1 + 3 * 5 and resnets[0] == "resnet-tiny"
    assert models.get("resnet152-400k").config.num_classes == 409600
    assert models.get("resnet50-1k").config.num_classes == 1024
    # Published sizes: T5 (60M / 220M / 770M) and Alpa's GShard MoE (within 5%).
    assert models.get("t5-small").param_count() == 60_506_624
    assert models.get("t5-base").param_count() == 222_903_552
    assert models.get("t5-large").param_count() == 737_668_096
    for name, nominal in (("moe-380m", 380e6), ("moe-1.3b", 1.3e9), ("moe-2.4b", 2.4e9)):
        assert abs(models.get(name).param_count() / nominal - 1) < 0.05, name
    # Depth scaling grows the model.
    depth = [models.get(f"t5-large-depth{d}").param_count() for d in (6, 12, 24, 48)]
    assert depth == sorted(depth) and depth[2] == models.get("t5-large").param_count()


def test_unknown_name_lists_close_matches() -> None:
    with pytest.raises(ValueError) as info:
        models.get("t5-lage")
    message = str(info.value)
    assert "'t5-large'" in message and "Did you mean" in message
    assert "resnet152-400k" in message  # all names are listed


def test_register_rejects_duplicates_and_bad_entries() -> None:
    entry = models.get("t5-tiny")
    with pytest.raises(ValueError, match="already registered"):
        models.register(entry)
    with pytest.raises(TypeError):
        models.register("t5-tiny")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a MoEConfig"):
        models.ModelEntry(
            name="bad", family="moe", description="x", config=entry.config, default_batch_size=1
        )
    with pytest.raises(ValueError, match="unknown family"):
        models.names("cnn")


def test_config_errors_name_the_bad_value() -> None:
    with pytest.raises(ValueError, match="'swish'"):
        t5.T5Config(
            num_layers=1, num_decoder_layers=1, d_model=8, d_ff=8, num_heads=1, d_kv=8, vocab_size=8,
            feed_forward="swish",  # type: ignore[arg-type]
        )
    with pytest.raises(ValueError, match="34"):
        resnet.ResNetConfig(depth=34, num_classes=10)
    with pytest.raises(ValueError, match="num_heads=3"):
        moe.MoEConfig(num_layers=2, d_model=32, d_ff=8, num_heads=3, num_experts=2, vocab_size=8, seq_len=4)
    grouped = moe.MoEConfig(
        num_layers=2, d_model=8, d_ff=8, num_heads=1, num_experts=2, vocab_size=8, seq_len=4, group_size=8
    )
    with pytest.raises(ValueError, match="batch_size=3"):
        grouped.check_batch_size(3)
    with pytest.raises(ValueError, match="batch_size"):
        models.get("t5-tiny").input_spec(0)


# --------------------------------------------------------------------------- #
# Tiny presets: build, run, train, trace
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("name", TINY)
def test_tiny_forward_and_param_count(name: str, tiny_models: dict[str, keras.Model]) -> None:
    entry, model = models.get(name), tiny_models[name]
    assert entry.param_count() == model.count_params()
    assert tuple(t.name for t in model.inputs) == _input_names(entry)
    inputs, targets = entry.synthetic_batch()
    for array, spec in zip(inputs, entry.input_spec()):
        assert array.shape == tuple(spec.shape) and array.dtype == spec.dtype.as_numpy_dtype
    assert np.issubdtype(targets.dtype, np.integer)
    logits = np.asarray(model(list(inputs), training=False))
    assert logits.shape == _expected_logits_shape(entry, entry.default_batch_size)
    assert targets.shape == logits.shape[:-1]
    assert np.isfinite(logits).all()


@pytest.mark.parametrize("name", TINY)
def test_tiny_synthetic_batch_is_deterministic(name: str) -> None:
    entry = models.get(name)
    (a, ya), (b, yb), (c, yc) = (entry.synthetic_batch(3 if name != "moe-tiny" else 2, seed=s) for s in (5, 5, 6))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(ya, yb)
    assert any(not np.array_equal(x, z) for x, z in zip(a, c))


@pytest.mark.parametrize("name", TINY)
def test_tiny_training_lowers_loss(name: str) -> None:
    entry = models.get(name)
    model = entry.build(seed=1)
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    inputs, targets = entry.synthetic_batch(seed=1)
    history = model.fit(inputs, targets, epochs=5, batch_size=len(targets), verbose=0).history["loss"]
    assert all(np.isfinite(history))
    assert history[-1] < history[0], history


@pytest.mark.parametrize("name", TINY)
def test_tiny_traces_with_static_shapes(name: str, tiny_models: dict[str, keras.Model]) -> None:
    entry = models.get(name)
    graph = _trace(tiny_models[name], entry.input_spec())
    undefined = [
        (op.name, out.shape)
        for op in graph.get_operations()
        for out in op.outputs
        if not out.shape.is_fully_defined()
    ]
    assert not undefined, undefined[:5]


def test_fast_init_zeroes_every_weight_and_seed_is_reproducible() -> None:
    entry = models.get("moe-tiny")
    zero = entry.build(fast_init=True)
    assert all(not np.any(np.asarray(w)) for w in zero.weights)
    a, b, c = (entry.build(seed=s) for s in (3, 3, 4))
    for wa, wb in zip(a.weights, b.weights):
        np.testing.assert_array_equal(np.asarray(wa), np.asarray(wb))
    assert any(not np.array_equal(np.asarray(wa), np.asarray(wc)) for wa, wc in zip(a.weights, c.weights))
    # Same-shaped weights get distinct random values.
    attention = a.get_layer("block_0").attention
    assert not np.array_equal(np.asarray(attention.q.kernel), np.asarray(attention.k.kernel))


@pytest.mark.parametrize("name", ["t5-small", "resnet50-1k"])
def test_param_count_matches_build_for_real_presets(name: str) -> None:
    entry = models.get(name)
    model = entry.build(fast_init=True)
    assert model.count_params() == entry.param_count()
    keras.backend.clear_session()


@pytest.mark.parametrize(
    "overrides", [dict(feed_forward="gated-gelu"), dict(tie_embeddings=False), dict(dropout_rate=0.1)]
)
def test_t5_variants_param_count(overrides: dict) -> None:
    config = t5.T5Config(
        num_layers=2, num_decoder_layers=3, d_model=16, d_ff=24, num_heads=2, d_kv=4, vocab_size=40,
        encoder_seq_len=6, decoder_seq_len=5, **overrides,
    )
    model = t5.build_model(config)
    assert model.count_params() == t5.param_count(config)
    out = model([np.zeros((2, 6), np.int32), np.zeros((2, 5), np.int32)], training=True)
    assert out.shape == (2, 5, 40)


# --------------------------------------------------------------------------- #
# T5 specifics
# --------------------------------------------------------------------------- #


def test_t5_only_block_0_owns_the_relative_bias(tiny_models: dict[str, keras.Model]) -> None:
    model, config = tiny_models["t5-tiny"], models.get("t5-tiny").config
    owners = {w.path: tuple(w.shape) for w in model.weights if "relative_attention_bias" in w.path}
    expected_shape = (config.relative_attention_num_buckets, config.num_heads)
    assert owners == {
        "encoder_block_0/self_attention/relative_attention_bias": expected_shape,
        "decoder_block_0/self_attention/relative_attention_bias": expected_shape,
    }
    for layer in model.layers:
        if isinstance(layer, t5.T5Block):
            assert layer.has_relative_attention_bias == layer.name.endswith("_block_0")


def test_t5_decoder_is_causal(tiny_models: dict[str, keras.Model]) -> None:
    entry, model = models.get("t5-tiny"), tiny_models["t5-tiny"]
    (encoder_ids, decoder_ids), _ = entry.synthetic_batch(2)
    t = 9
    changed = decoder_ids.copy()
    changed[:, t] = (changed[:, t] + 1) % entry.config.vocab_size
    before = np.asarray(model([encoder_ids, decoder_ids]))
    after = np.asarray(model([encoder_ids, changed]))
    np.testing.assert_allclose(before[:, :t], after[:, :t], rtol=1e-5, atol=1e-5)
    assert not np.allclose(before[:, t:], after[:, t:])
    # ... while the encoder is bidirectional: changing its last token changes every position.
    enc_changed = encoder_ids.copy()
    enc_changed[:, -1] = (enc_changed[:, -1] + 1) % entry.config.vocab_size
    after_enc = np.asarray(model([enc_changed, decoder_ids]))
    assert not np.allclose(before[:, 0], after_enc[:, 0])


def test_t5_later_blocks_run_identical_ops() -> None:
    config = t5.T5Config(
        num_layers=3, num_decoder_layers=3, d_model=16, d_ff=32, num_heads=2, d_kv=8, vocab_size=32,
        encoder_seq_len=8, decoder_seq_len=8,
    )
    model = t5.build_model(config, fast_init=True)
    graph = _trace(model, t5.input_spec(config, 2))
    ops_by_block: dict[tuple[str, int], list[str]] = {}
    for op in graph.get_operations():
        match = re.search(r"(encoder|decoder)_block_(\d+)(?:_\d+)?/(.*)$", op.name)
        if match:
            ops_by_block.setdefault((match[1], int(match[2])), []).append(op.type)
    for stack in ("encoder", "decoder"):
        assert ops_by_block[(stack, 1)] == ops_by_block[(stack, 2)]
        # Block 0 additionally gathers the bias table.
        assert len(ops_by_block[(stack, 0)]) > len(ops_by_block[(stack, 1)])


def test_relative_position_buckets() -> None:
    enc = t5.relative_position_buckets(300, 300, bidirectional=True, num_buckets=32, max_distance=128)
    dec = t5.relative_position_buckets(300, 300, bidirectional=False, num_buckets=32, max_distance=128)
    assert enc.shape == dec.shape == (300, 300)
    assert enc[5, 5] == 0 and enc[5, 4] == 1 and enc[4, 5] == 17  # keys after the query use the upper half
    assert enc[299, 0] == 15 and enc[0, 299] == 31  # far distances share the last bucket of each half
    assert dec[5, 5] == 0 and dec[5, 4] == 1 and dec[4, 5] == 0  # the future all maps to bucket 0
    assert dec[299, 0] == 31 and dec.max() == 31 and dec.min() == 0
    # Buckets never decrease with distance.
    assert np.all(np.diff(dec[299, ::-1]) >= 0)


# --------------------------------------------------------------------------- #
# MoE specifics
# --------------------------------------------------------------------------- #


def test_moe_expert_weights_are_stacked(tiny_models: dict[str, keras.Model]) -> None:
    config, model = models.get("moe-tiny").config, tiny_models["moe-tiny"]
    shapes = {w.path: tuple(w.shape) for w in model.weights}
    e, m, f = config.num_experts, config.d_model, config.d_ff
    assert shapes["block_1/moe/wi"] == (e, m, f)
    assert shapes["block_1/moe/wo"] == (e, f, m)
    assert shapes["block_1/moe/router/kernel"] == (m, e)
    assert not any(path.startswith("block_0/moe") for path in shapes)  # block 0 is dense
    assert shapes["block_0/ffn/wi/kernel"] == (m, f)
    assert [config.is_moe_block(i) for i in range(config.num_layers)] == [False, True]


def _random_router_probs(groups: int, tokens: int, experts: int, seed: int) -> np.ndarray:
    logits = np.random.default_rng(seed).normal(size=(groups, tokens, experts)).astype(np.float32)
    return np.asarray(tf.nn.softmax(logits, axis=-1))


def test_top2_gating_routes_every_token_to_two_experts() -> None:
    probs = _random_router_probs(3, 10, 4, seed=0)
    dispatch, combine, aux = (np.asarray(t) for t in moe.top2_gating(probs, capacity=10))
    assert dispatch.shape == combine.shape == (3, 10, 4, 10)
    per_expert = dispatch.sum(axis=3)  # [G, S, E]
    assert np.all(per_expert.sum(axis=2) == 2)  # exactly two assignments per token ...
    assert np.all(per_expert <= 1)  # ... to two different experts
    top2 = np.argsort(-probs, axis=-1)[..., :2]
    chosen = np.sort(np.argwhere(per_expert > 0)[:, 2].reshape(3, 10, 2), axis=-1)
    np.testing.assert_array_equal(chosen, np.sort(top2, axis=-1))
    np.testing.assert_allclose(combine.sum(axis=(2, 3)), 1.0, rtol=1e-5)  # renormalised top-2 gates
    assert np.all(dispatch.sum(axis=1) <= 1)  # each expert slot holds at most one token
    assert np.isfinite(aux) and aux > 0


def test_top2_gating_respects_capacity() -> None:
    probs = _random_router_probs(2, 16, 4, seed=1)
    dispatch, combine, _ = (np.asarray(t) for t in moe.top2_gating(probs, capacity=3))
    assert dispatch.shape[-1] == 3
    assert np.all(dispatch.sum(axis=(1, 3)) <= 3)  # no expert over capacity
    assert np.all(dispatch.sum(axis=1) <= 1)
    assert np.all(dispatch.sum(axis=(2, 3)) <= 2)
    assert dispatch.sum() < 2 * 2 * 16  # something was dropped
    assert np.all((combine > 0) == (dispatch > 0))


def test_moe_aux_loss_only_in_training(tiny_models: dict[str, keras.Model]) -> None:
    entry, model = models.get("moe-tiny"), tiny_models["moe-tiny"]
    inputs, _ = entry.synthetic_batch()
    model(list(inputs), training=True)
    assert len(model.losses) == 1 and float(model.losses[0]) > 0
    model(list(inputs), training=False)
    assert len(model.losses) == 0


def test_moe_group_size_must_divide_tokens() -> None:
    config = moe.MoEConfig(
        num_layers=2, d_model=8, d_ff=8, num_heads=1, num_experts=2, vocab_size=8, seq_len=4, group_size=8
    )
    assert config.capacity == 8  # ceil(2.0 * 8 / 2), capped at the group size
    config.check_batch_size(2)
    with pytest.raises(ValueError, match="multiple of 2"):
        config.check_batch_size(3)
    model = moe.build_model(config)
    logits = model([np.zeros((4, 4), np.int32)])
    assert logits.shape == (4, 4, 8)


def test_new_family_configs_refuse_bad_values_with_the_fix() -> None:
    import dataclasses

    from tapas.models import bert, llama
    with pytest.raises(ValueError, match="hidden_size=100 is not divisible by num_heads=12"):
        bert.BertConfig(num_layers=1, hidden_size=100, num_heads=12, intermediate_size=8,
                        vocab_size=8)
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        llama.LlamaConfig(num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=3,
                          intermediate_size=8, vocab_size=8)
    with pytest.raises(ValueError, match="even size"):
        llama.LlamaConfig(num_layers=1, hidden_size=12, num_heads=4, num_kv_heads=2,
                          intermediate_size=8, vocab_size=8)
    with pytest.raises(ValueError, match="padding_mask=True needs layer_impl='keras'"):
        dataclasses.replace(models.get("t5-tiny-masked").config, layer_impl="tapas")


def test_masked_t5_ignores_padded_tokens() -> None:
    entry = models.get("t5-tiny-masked")
    model = entry.build(seed=0)
    (enc, dec, enc_mask, dec_mask), _ = entry.synthetic_batch(4)
    assert enc_mask[1, -1] == 0 and enc_mask[0, -1] == 1
    before = model([enc, dec, enc_mask, dec_mask]).numpy()
    changed = enc.copy()
    changed[1, -1] = (changed[1, -1] + 1) % entry.config.vocab_size     # a padded token
    after = model([changed, dec, enc_mask, dec_mask]).numpy()
    np.testing.assert_allclose(after[1], before[1], rtol=0, atol=1e-6)
    changed[0, -1] = (changed[0, -1] + 1) % entry.config.vocab_size     # a real token
    assert np.abs(model([changed, dec, enc_mask, dec_mask]).numpy()[0] - before[0]).max() > 0
