"""The corpus over models built by other libraries (issue 10): every keras.applications
and kimm family, keras-hub's backbones, Hugging Face's and the Model Garden's TensorFlow
models capture, mine and search on 2, 4 and 8
devices without an exception. The slow entries, and those left out of the CI slice
(``CorpusEntry.ci``), run in ``scripts/corpus.py`` only."""

import gc

import keras
import pytest

from tapas.models import corpus

FAST = [e for e in corpus.entries() if not e.slow and e.ci]


def test_keras_hub_is_installed_for_the_corpus():
    # scripts/_venv.sh installs requirements-corpus.txt; without it the hub-* entries vanish
    assert corpus.keras_hub_available(), "install requirements-corpus.txt (pip --no-deps -r ...)"
    assert any(e.library == "keras-hub" for e in corpus.entries())


def test_every_keras_applications_family_is_in_the_corpus():
    families = {e.name for e in corpus.entries("keras.applications")}
    for family in ("convnext", "densenet", "efficientnet", "efficientnetv2", "inception-v3",
                   "inception-resnet-v2", "mobilenet", "mobilenet-v2", "mobilenet-v3", "nasnet",
                   "resnet", "resnet-v2", "vgg", "xception"):
        assert f"keras-{family}" in families


@pytest.mark.parametrize("entry", FAST, ids=lambda e: e.name)
def test_corpus_model_plans_on_2_4_8_devices(entry):
    try:
        row = corpus.run(entry, (2, 4, 8))
    finally:
        keras.backend.clear_session()
        gc.collect()
    assert row["graph_nodes"] > 0
    for n in (2, 4, 8):
        assert row["searches"][n]["cost_s"] > 0


def test_every_kimm_family_is_in_the_corpus_with_a_10_class_head():
    """kimm (Keras Image Models) takes ``classes=`` (a ``num_classes=`` would be swallowed by
    its keyword arguments and leave the 1000-class ImageNet head): each family's smallest
    variant ends in the corpus's 10 classes, trained on class ids like keras.applications."""
    assert corpus.kimm_available(), "install requirements-corpus.txt (pip --no-deps -r ...)"
    found = corpus.entries("kimm")
    assert {e.name for e in found} == {f"kimm-{f}" for f in corpus._kimm_models()}
    assert len(found) == 26
    entry = corpus.get("kimm-resnet")
    model, specs = entry.build()
    assert tuple(model.output.shape) == (None, 10)
    assert specs[0].shape.as_list() == [corpus.BATCH, corpus.IMAGE, corpus.IMAGE, 3]
    _, y = entry.synthetic_batch(model, specs)
    assert y.shape == (corpus.BATCH,) and y.max() < 10
    assert isinstance(entry.loss(), keras.losses.SparseCategoricalCrossentropy)
    keras.backend.clear_session()


def test_unknown_corpus_model_names_the_choices():
    with pytest.raises(ValueError, match="no corpus model 'keras-nope'.*keras-resnet"):
        corpus.get("keras-nope")


def test_inputs_of_their_own_length_and_targets_shaped_like_the_real_output():
    """Moonshine takes raw audio (4096 samples, not the token length) and PaliGemma prepends
    its image tokens to the text, which its symbolic output shape does not show: the specs
    take the entry's own input shapes and the training targets the output's real shape."""
    moonshine = corpus.get("hub-moonshine")
    _, specs = moonshine.build()
    assert specs["encoder_input_values"].shape.as_list() == [corpus.BATCH, 4096, 1]
    assert specs["decoder_token_ids"].shape.as_list() == [corpus.BATCH, corpus.SEQ]
    paligemma = corpus.get("hub-paligemma")
    model, specs = paligemma.build()
    _, y = paligemma.synthetic_batch(model, specs)
    image_tokens = (corpus.IMAGE // 8) ** 2
    assert y.shape == (corpus.BATCH, image_tokens + corpus.SEQ, 64)
    keras.backend.clear_session()


def test_transformers_is_installed_for_the_corpus():
    # Hugging Face's TensorFlow models (transformers 4.57, from requirements-corpus.txt)
    assert corpus.transformers_available(), "install requirements-corpus.txt"
    assert len(corpus.entries("transformers")) >= 40


def test_hugging_face_mobilevit_with_lengths_unknown_to_the_trace_plans_and_rebuilds():
    """Hugging Face MobileViT resizes its feature maps inside a tf.cond, so the traced graph
    leaves their height and width unknown ((batch, -1, -1, channels)). A plan that split
    such a tensor, or sliced it for a split consumer (its gradient then gathered), failed
    at reconstruction ("cannot cut dimension 1 of size None"): those placements are not
    offered, and a random plan on 2 simulated shards equals one device."""
    from tapas import capturing
    from tapas.execution.api import parallel
    from tapas.execution.checking import checker, verify
    model, specs = corpus.get("hf-mobilevit").build()
    trace = capturing.trace(model, specs)
    graph = capturing.to_ir(trace)
    assert any(d < 0 for n in graph.nodes for t in n.outputs for d in (t.shape or ()))
    inputs = checker.synthetic_inputs(graph)
    plan = parallel.random_plan(graph, 2, 0)
    cmp = verify.compare_with_single_device(trace, graph, plan, inputs)
    assert cmp.ok(), cmp.worst
    assert sum(1 for p in plan.patterns.values() if p.name != "replicate") > 0


def test_model_garden_sparse_mixer_runs_the_collectives_its_plans_predict():
    """The Model Garden's SparseMixer routes with TopKV2 of its router probabilities and
    uses only the (integer) indices: no gradient flows back through that read, so a
    resharding of the probabilities for it runs no backward collective. The audit's
    prediction had one (a reader counted as passing a gradient through any output):
    random plans on 2 simulated shards equal one device and run what they predict."""
    from tapas import capturing
    from tapas.execution.api import parallel
    from tapas.execution.program import reconstruct
    from tapas.execution.checking import audit, checker, verify
    model, specs = corpus.get("tfm-sparse-mixer").build()
    trace = capturing.trace(model, specs)
    graph = capturing.to_ir(trace)
    inputs = checker.synthetic_inputs(graph)
    for seed in range(2):
        plan = parallel.random_plan(graph, 2, seed)
        cmp = verify.compare_with_single_device(trace, graph, plan, inputs)
        assert cmp.ok(), cmp.worst
        assert not audit.compare_audit(cmp.audit, audit.program_comms(
            reconstruct.Program(trace, graph, plan), input_gradients=True))
