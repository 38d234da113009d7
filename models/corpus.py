"""Models written by other people, built small, for testing TAPAS as a new user would.

The zoo (``tapas.models``) holds models written for this project; a model that works only
because it is ours does not count. This module builds models from other libraries, with
random weights (nothing is downloaded) and small inputs, so that the whole pipeline can be
run over them in a test:

* every ``keras.applications`` family, at its smallest variant and a small image size;
* backbones of keras-hub, built from a config: transformers (BERT, RoBERTa, DistilBERT,
  GPT-2, Llama, Mistral, Gemma, Mixtral and Qwen3-MoE, T5 and 31 more: encoder-decoders,
  MoEs, linear attention, a recurrence (RWKV-7), vision transformers), keras-hub's own
  CNNs, and 28 more models (dense-prediction heads on a small encoder, image-text models,
  video, a diffusion transformer, mobile CNNs, more decoders), alone and wrapped with a user's head so that part of the backbone (the BERT pooler)
  is computed but read by nothing; a backbone with a dict of outputs trains on one of them
  (:func:`_one_output`).

* Hugging Face transformers' TensorFlow models (Keras 2, ``tf_keras``; transformers 4.57,
  the last release with them): 40 encoders, decoders, encoder-decoders, vision and speech
  models from small configs, each a functional Keras 2 model of its dict of named inputs
  and its ``last_hidden_state`` (:func:`_hf_models`).

* the TensorFlow Model Garden's NLP networks and models (``tf-models-official``, Keras 2):
  BERT, ALBERT, MobileBERT, FNet (Fourier mixing in complex numbers), Funnel, SparseMixer
  (a sparse MoE), a BERT classifier and the Seq2Seq Transformer (:func:`_tfm_models`).

* kimm (Keras Image Models, Keras 3, timm's image models rewritten for Keras): the smallest
  variant of each of its 26 families, among them ones no other library here has (ConvMixer,
  GhostNet v1-v3, HGNet, InceptionNeXt, LCNet, MobileOne, RepVGG, TinyNet), with
  a 10-class head (:func:`_kimm_models`).

keras-hub, transformers, the Model Garden and kimm are optional (``requirements-corpus.txt``; see README): their
entries are listed only when they import. Every entry builds in a few seconds on 2 cores.

Usage::

    from tapas.models import corpus
    for entry in corpus.entries():
        model, specs = entry.build()
        graph = tapas.capture(model, specs)
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

import keras
import tensorflow as tf

__all__ = ["CorpusEntry", "entries", "get", "keras_hub_available", "transformers_available",
           "model_garden_available", "kimm_available", "run"]

BATCH = 2          # batch size of every corpus input spec
SEQ = 16           # token sequence length of the text backbones
VOCAB = 512        # their vocabulary
IMAGE = 32         # image size of the keras.applications models (or the family's minimum)


@dataclasses.dataclass(frozen=True)
class CorpusEntry:
    """One model from another library: ``build()`` returns ``(model, input_spec)``, where
    ``input_spec`` is what ``tapas.capture`` takes (a list, or a dict keyed by input name)."""

    name: str
    library: str            # "keras.applications", "keras-hub", "transformers",
                            # "tf-models-official" or "kimm"
    description: str
    builder: Callable[[], keras.Model]
    dict_inputs: bool = False
    slow: bool = False      # minutes, not seconds, through the pipeline: left out of the CI slice
    ci: bool = True         # in tests/test_corpus.py's CI slice (else scripts/corpus.py's and
                            # scripts/equivalence.py's matrices only, to keep CI short)
    # inputs whose unknown sizes are not SEQ: input name -> shape without the batch
    input_shapes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def build(self, batch: int = BATCH) -> tuple[keras.Model, Any]:
        """The model and its input specs with ``batch`` examples (default :data:`BATCH`)."""
        keras.utils.set_random_seed(0)
        model = self.builder()
        specs = [tf.TensorSpec([batch, *self.input_shapes.get(
            _input_name(i), [d if d is not None else SEQ for d in i.shape[1:]])],
            i.dtype, name=_input_name(i)) for i in model.inputs]
        if self.dict_inputs:
            return model, {s.name: s for s in specs}
        return model, specs


    def loss(self) -> keras.losses.Loss:
        """The loss a training run of this model uses: the sparse cross-entropy of the
        10-class softmax of a ``keras.applications`` model, mean squared error of the one
        output of any other."""
        if self.library in _CLASSIFIERS:
            return keras.losses.SparseCategoricalCrossentropy()
        return keras.losses.MeanSquaredError()

    def synthetic_batch(self, model: keras.Model, specs: Any, seed: int = 1
                        ) -> tuple[Any, Any]:
        """``(inputs, targets)`` for ``model`` (built by :meth:`build` with ``specs``): inputs
        in the structure of ``specs`` (``tapas.execution.runtime.inputs.synthetic_batch``), targets
        for :meth:`loss`: class ids below 10, or standard normal values shaped like the one
        output (an unknown sequence length taken as :data:`SEQ`)."""
        import numpy as np

        from tapas.execution.runtime import inputs
        rng = np.random.default_rng(seed)
        signature = inputs.InputSignature.of(model, specs)
        xs = inputs.synthetic_inputs(model, signature, seed)
        batch = int(signature.specs[0].shape[0])
        if self.library in _CLASSIFIERS:
            return xs, rng.integers(0, 10, size=(batch,))
        if len(model.outputs) != 1:
            raise ValueError(f"{self.name}: {len(model.outputs)} outputs; training needs one")
        # the output's shape from one call: a symbolic shape may leave out what the
        # backbone prepends (PaliGemma's image tokens) or be the batch (CLIP's logits)
        shape = keras.ops.shape(model(xs, training=False))[1:]
        return xs, rng.standard_normal([batch, *shape]).astype("float32")


# libraries whose corpus models end in a 10-class softmax (trained on class ids)
_CLASSIFIERS = frozenset({"keras.applications", "kimm"})


def _input_name(tensor: Any) -> str:
    return tensor.name.split(":")[0]


# families whose search takes minutes on 2 cores (NASNet: 508 GraphNodes, 11 templates)
_SLOW = frozenset({"nasnet"})
# in scripts/corpus.py's matrix, not the CI slice: a family of the same kind stays there
# (inception-v3, efficientnet, resnet, mobilenet-v2 and -v3)
_APPS_SCRIPT_ONLY = frozenset({"inception-resnet-v2", "efficientnetv2", "resnet-v2",
                               "mobilenet"})


def _applications() -> list[CorpusEntry]:
    apps = keras.applications
    # family -> (constructor, image size): the smallest variant of each family, at the
    # smallest input it accepts (Inception and Xception need 75 and 71 pixels)
    families: dict[str, tuple[Callable[..., keras.Model], int]] = {
        "convnext": (apps.ConvNeXtTiny, IMAGE),
        "densenet": (apps.DenseNet121, IMAGE),
        "efficientnet": (apps.EfficientNetB0, IMAGE),
        "efficientnetv2": (apps.EfficientNetV2B0, IMAGE),
        "inception-resnet-v2": (apps.InceptionResNetV2, 75),
        "inception-v3": (apps.InceptionV3, 75),
        "mobilenet": (lambda **kw: apps.MobileNet(alpha=0.25, **kw), IMAGE),
        "mobilenet-v2": (lambda **kw: apps.MobileNetV2(alpha=0.35, **kw), IMAGE),
        "mobilenet-v3": (lambda **kw: apps.MobileNetV3Small(alpha=0.75, **kw), IMAGE),
        "nasnet": (apps.NASNetMobile, IMAGE),
        "resnet": (apps.ResNet50, IMAGE),
        "resnet-v2": (apps.ResNet50V2, IMAGE),
        "vgg": (apps.VGG16, IMAGE),
        "xception": (apps.Xception, 71),
    }
    out = []
    for family, (ctor, size) in families.items():
        def build(ctor: Callable[..., keras.Model] = ctor, size: int = size) -> keras.Model:
            return ctor(weights=None, input_shape=(size, size, 3), classes=10)
        out.append(CorpusEntry(f"keras-{family}", "keras.applications",
                               f"keras.applications {family} (smallest variant), {size}x{size}, 10 classes",
                               build, slow=family in _SLOW, ci=family not in _APPS_SCRIPT_ONLY))
    return out


def keras_hub_available() -> bool:
    """Whether keras-hub imports here (it is in the ``test`` extra)."""
    try:
        importlib.import_module("keras_hub")
    except ImportError:
        return False
    return True


# keras-hub backbones of the scripts' matrices whose kinds of layers the CI slice
# already has in other backbones (BERT-, GPT- and Llama-style blocks, a shared-expert MoE
# beside Qwen3-MoE, DINOv2 beside ViT): scripts only. DeBERTa-v3 (its relative embeddings
# projected by the attention's own query and key layers) and ViT (image patches) are in
# the CI slice.
_NEW_2026_11_26 = ("bart", "whisper", "xlnet", "esm2", "gemma3", "llama3", "qwen2", "smollm3",
                   "gpt-oss", "qwen3.5", "rwkv7", "deit", "dinov3", "swin", "vitdet", "mit",
                   "resnet", "resnet-v2", "cspnet", "hgnetv2", "densenet", "vgg", "xception")
# the backbones of _hub_backbones_2026_11_26: scripts only too
_HUB_SCRIPT_ONLY = frozenset({"albert", "electra", "falcon", "gpt-neox", "opt", "bloom", "phi3",
                              "qwen3", "fnet", "roformer-v2", "xlm-roberta", "qwen-moe",
                              "dinov2", *_NEW_2026_11_26,
                              # a family of the same kind stays in the slice (bert, llama)
                              "roberta", "distilbert", "mistral"})


# backbones whose one image input is an unnamed keras.Input: Keras itself takes no dict
# for them (its input check wants the InputLayer's name, its dict matching the tensor's)
_HUB_UNNAMED_INPUT = frozenset({"deit", "swin", "mit", "resnet", "resnet-v2", "cspnet",
                                "densenet", "vgg", "xception", "efficientnet", "mobilenet",
                                "mobilenetv5", "basnet", "segformer"})

# inputs whose length is not SEQ: entry -> {input name: shape without the batch}
_HUB_INPUT_SHAPES: dict[str, dict[str, tuple[int, ...]]] = {
    # Moonshine's encoder convolutions (kernel 127 stride 64, then 7/3 and 3/2) take raw
    # audio: 4096 samples make 9 encoder frames
    "moonshine": {"encoder_input_values": (4096, 1), "encoder_padding_mask": (4096,)},
    # SAM: at most one mask prompt per image, 4x the image embedding's grid
    "sam": {"masks": (1, 4 * (IMAGE // 8), 4 * (IMAGE // 8), 1)},
}


def _hub_backbones() -> dict[str, Callable[[], keras.Model]]:
    import keras_hub
    m = keras_hub.models
    text = dict(vocabulary_size=VOCAB, num_layers=2, hidden_dim=64, intermediate_dim=128)
    gqa = dict(text, num_query_heads=4, num_key_value_heads=2)
    return {
        "bert": lambda: m.BertBackbone(num_heads=4, max_sequence_length=SEQ, **text),
        "roberta": lambda: m.RobertaBackbone(num_heads=4, max_sequence_length=SEQ, **text),
        "distilbert": lambda: m.DistilBertBackbone(num_heads=4, max_sequence_length=SEQ, **text),
        "gpt2": lambda: m.GPT2Backbone(num_heads=4, max_sequence_length=SEQ, **text),
        "llama": lambda: m.LlamaBackbone(**gqa),
        "mistral": lambda: m.MistralBackbone(**gqa),
        "gemma": lambda: m.GemmaBackbone(**dict(gqa, num_key_value_heads=1), head_dim=16),
        "mixtral": lambda: m.MixtralBackbone(num_experts=4, top_k=2, **gqa),
        "qwen3-moe": lambda: m.Qwen3MoeBackbone(moe_intermediate_dim=32, num_experts=4, top_k=2,
                                                head_dim=16, **gqa),
        "t5": lambda: m.T5Backbone(vocabulary_size=VOCAB, num_layers=2, num_heads=4, hidden_dim=64,
                                   intermediate_dim=128),
        "albert": lambda: m.AlbertBackbone(num_heads=4, embedding_dim=32, num_groups=1,
                                           num_inner_repetitions=1, max_sequence_length=SEQ,
                                           **text),
        "deberta-v3": lambda: m.DebertaV3Backbone(num_heads=4, max_sequence_length=SEQ,
                                                  bucket_size=8, **text),
        "electra": lambda: m.ElectraBackbone(vocab_size=VOCAB, num_layers=2, num_heads=4,
                                             hidden_dim=64, embedding_dim=32,
                                             intermediate_dim=128, max_sequence_length=SEQ),
        "falcon": lambda: m.FalconBackbone(num_attention_heads=4, **text),
        "gpt-neox": lambda: m.GPTNeoXBackbone(num_heads=4, max_sequence_length=SEQ, **text),
        "opt": lambda: m.OPTBackbone(num_heads=4, max_sequence_length=SEQ, **text),
        "bloom": lambda: m.BloomBackbone(num_heads=4, **text),
        "phi3": lambda: m.Phi3Backbone(max_sequence_length=SEQ, **gqa),
        "qwen3": lambda: m.Qwen3Backbone(head_dim=16, **gqa),
        "fnet": lambda: m.FNetBackbone(max_sequence_length=SEQ, **text),
        "roformer-v2": lambda: m.RoformerV2Backbone(num_heads=4, head_size=16, **text),
        "xlm-roberta": lambda: m.XLMRobertaBackbone(num_heads=4, max_sequence_length=SEQ, **text),
        "qwen-moe": lambda: m.QwenMoeBackbone(moe_intermediate_dim=32,
                                              shared_expert_intermediate_dim=64, num_experts=4,
                                              top_k=2, **gqa),
        "vit": lambda: m.ViTBackbone(image_shape=(IMAGE, IMAGE, 3), patch_size=8, num_layers=2,
                                     num_heads=4, hidden_dim=64, mlp_dim=128),
        "dinov2": _dinov2,
        # encoder-decoders, more decoders, vision transformers and CNNs
        "bart": lambda: _one_output(m.BartBackbone(num_heads=4, max_sequence_length=SEQ, **text),
                                    "decoder_sequence_output"),
        "whisper": lambda: _one_output(m.WhisperBackbone(
            num_heads=4, num_mels=16, max_encoder_sequence_length=2 * SEQ,
            max_decoder_sequence_length=SEQ, **text), "decoder_sequence_output"),
        "xlnet": lambda: m.XLNetBackbone(num_heads=4, **text),
        "esm2": lambda: m.ESM2Backbone(num_heads=4, max_sequence_length=SEQ, **text),
        "gemma3": lambda: m.Gemma3Backbone(image_size=IMAGE, head_dim=16,
                                           **dict(gqa, num_key_value_heads=1)),
        "llama3": lambda: m.Llama3Backbone(**gqa),
        "qwen2": lambda: m.Qwen2Backbone(**gqa),
        "smollm3": lambda: m.SmolLM3Backbone(
            vocabulary_size=VOCAB, hidden_dim=64, intermediate_dim=128, num_layers=2,
            num_attention_heads=4, num_key_value_heads=2, attention_bias=False,
            attention_dropout=0.0, rope_layer_enabled_list=[True, False],
            layer_types=["full_attention", "full_attention"], mlp_bias=False,
            layer_norm_epsilon=1e-6, max_position_embeddings=SEQ, rope_theta=10000.0,
            partial_rotary_factor=1.0),
        "gpt-oss": lambda: m.GptOssBackbone(num_experts=4, top_k=2, head_dim=16, sliding_window=8,
                                            **gqa),
        "qwen3.5": lambda: m.Qwen3_5Backbone(
            head_dim=16, layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, **gqa),
        "rwkv7": lambda: m.RWKV7Backbone(hidden_size=64, head_size=16, num_layers=2,
                                         vocabulary_size=VOCAB, intermediate_dim=128,
                                         gate_lora=16, mv_lora=8, aaa_lora=8, decay_lora=8),
        "deit": lambda: m.DeiTBackbone(image_shape=(IMAGE, IMAGE, 3), patch_size=8, num_layers=2,
                                       num_heads=4, hidden_dim=64, intermediate_dim=128),
        "dinov3": lambda: m.DINOV3Backbone(patch_size=8, num_layers=2, hidden_dim=64,
                                           num_heads=4, intermediate_dim=128,
                                           num_register_tokens=2, image_shape=(IMAGE, IMAGE, 3)),
        "swin": lambda: m.SwinTransformerBackbone(image_shape=(IMAGE, IMAGE, 3), embed_dim=32,
                                                  depths=[2, 2], num_heads=[2, 4], window_size=4,
                                                  patch_size=2, drop_path=0.0),
        "vitdet": lambda: m.ViTDetBackbone(hidden_size=64, num_layers=2, intermediate_dim=128,
                                           num_heads=4, global_attention_layer_indices=[1],
                                           image_shape=(IMAGE, IMAGE, 3), patch_size=8,
                                           num_output_channels=32, window_size=2),
        "mit": _mit,
        "resnet": lambda: m.ResNetBackbone(
            input_conv_filters=[16], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 32],
            stackwise_num_blocks=[2, 2], stackwise_num_strides=[1, 2],
            block_type="bottleneck_block", image_shape=(IMAGE, IMAGE, 3)),
        "resnet-v2": lambda: m.ResNetBackbone(
            input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 64],
            stackwise_num_blocks=[2, 2], stackwise_num_strides=[1, 2], block_type="basic_block",
            use_pre_activation=True, image_shape=(IMAGE, IMAGE, 3)),
        "cspnet": lambda: m.CSPNetBackbone(
            stem_filters=16, stem_kernel_size=3, stem_strides=2, stackwise_depth=[1, 2],
            stackwise_strides=[1, 2], stackwise_num_filters=[32, 64], block_type="dark_block",
            stage_type="csp", bottle_ratio=[0.5], block_ratio=[1.0], expand_ratio=[2.0],
            image_shape=(IMAGE, IMAGE, 3)),
        "hgnetv2": lambda: _one_output(_hgnetv2(), "stage2"),
        "densenet": lambda: m.DenseNetBackbone(stackwise_num_repeats=[2, 2],
                                               image_shape=(IMAGE, IMAGE, 3), growth_rate=8),
        "vgg": lambda: m.VGGBackbone(stackwise_num_repeats=[1, 2], stackwise_num_filters=[16, 32],
                                     image_shape=(IMAGE, IMAGE, 3)),
        "xception": lambda: m.XceptionBackbone(
            stackwise_conv_filters=[[16, 32], [64, 64], [128, 128]],
            stackwise_pooling=[False, True, False], image_shape=(IMAGE, IMAGE, 3)),
    }


def _hub_backbones_2026_11_26() -> dict[str, Callable[[], keras.Model]]:
    """keras-hub backbones of the scripts' matrices (a second set): more decoders and
    encoder-decoders, keras-hub's mobile CNNs, dense-prediction heads on a small encoder
    (DeepLabV3, BASNet, RetinaNet, SegFormer, Depth Anything, D-FINE, SAM), image-text
    models (CLIP, MetaCLIP 2, SigLIP, BLIP-2, PARSeq, PaliGemma), video (VideoPrism) and a
    diffusion transformer (Flux)."""
    import keras_hub
    m = keras_hub.models
    text = dict(vocabulary_size=VOCAB, num_layers=2, hidden_dim=64, intermediate_dim=128)
    gqa = dict(text, num_query_heads=4, num_key_value_heads=2)
    return {
        # ---- text ----
        "qwen": lambda: m.QwenBackbone(**gqa),
        "esm1": lambda: m.ESMBackbone(num_heads=4, max_sequence_length=SEQ,
                                      position_embedding_type="absolute",
                                      use_pre_layer_norm=True, **text),
        "edrec": lambda: _one_output(m.EdRecBackbone(
            vocab_size=VOCAB, num_layers_enc=2, num_layers_dec=2, hidden_dim=64,
            intermediate_dim=128, num_heads=4), "decoder_sequence_output"),
        "moonshine": lambda: _one_output(m.MoonshineBackbone(
            vocabulary_size=VOCAB, filter_dim=32, encoder_num_layers=2, decoder_num_layers=2,
            hidden_dim=32, intermediate_dim=64, encoder_num_heads=2, decoder_num_heads=2,
            max_position_embeddings=64), "decoder_sequence_output"),
        "t5gemma": lambda: _one_output(m.T5GemmaBackbone(**_t5gemma(8)), "decoder_sequence_output"),
        "t5gemma2": lambda: _one_output(m.T5Gemma2Backbone(**_t5gemma(8)),
                                        "decoder_sequence_output"),
        "gemma3n": lambda: m.Gemma3nBackbone(
            text_vocab_size=VOCAB, text_hidden_size=64, num_hidden_layers=2, pad_token_id=0,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=[128, 128], hidden_activation="gelu_approximate",
            layer_types=["sliding_attention", "full_attention"], sliding_window=8,
            rope_theta=10000.0, max_position_embeddings=SEQ, vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8, altup_num_inputs=2, laurel_rank=8),
        "gemma4": lambda: m.Gemma4Backbone(
            image_size=IMAGE, head_dim=16, sliding_window_size=8,
            layer_types=["sliding_attention", "full_attention"], **gqa),
        "qwen3.5-moe": lambda: m.Qwen3_5MoeBackbone(
            head_dim=16, hidden_dim=64, moe_intermediate_dim=32,
            shared_expert_intermediate_size=64, num_experts=4, top_k=2,
            layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, num_key_value_heads=2),
        "paligemma": lambda: m.PaliGemmaBackbone(
            image_size=IMAGE, head_dim=16, vit_patch_size=8, vit_num_heads=4, vit_hidden_dim=64,
            vit_num_layers=2, vit_intermediate_dim=128, **dict(gqa, num_key_value_heads=1)),
        # ---- CNNs ----
        "efficientnet": lambda: m.EfficientNetBackbone(
            stackwise_width_coefficients=[1.0, 1.0], stackwise_depth_coefficients=[1.0, 1.0],
            stackwise_kernel_sizes=[3, 3], stackwise_num_repeats=[1, 2],
            stackwise_input_filters=[16, 16], stackwise_output_filters=[16, 32],
            stackwise_expansion_ratios=[1, 4], stackwise_squeeze_and_excite_ratios=[0.0, 0.25],
            stackwise_strides=[1, 2], stackwise_block_types=["fused", "unfused"],
            num_features=64, input_shape=(IMAGE, IMAGE, 3)),
        "mobilenet": lambda: m.MobileNetBackbone(
            stackwise_expansion=[[32, 48], [64, 96]], stackwise_num_blocks=[2, 2],
            stackwise_num_filters=[[16, 16], [24, 24]], stackwise_kernel_size=[[3, 3], [5, 5]],
            stackwise_num_strides=[[2, 1], [2, 1]], stackwise_se_ratio=[[None, None], [0.25, 0.25]],
            stackwise_activation=[["relu", "relu"], ["hard_swish", "hard_swish"]],
            stackwise_padding=[[1, 1], [2, 2]], output_num_filters=64, depthwise_filters=8,
            depthwise_stride=2, depthwise_residual=False, last_layer_filter=64,
            squeeze_and_excite=0.5, image_shape=(IMAGE, IMAGE, 3)),
        "mobilenetv5": lambda: m.MobileNetV5Backbone(
            **_mnv5_arch([["er_r1_k3_s2_e4_c16"],
                          ["uir_r1_a3_k5_s2_e4_c32", "mqa_r1_h2_v2_d16_s1_c32"]]),
            stem_size=16, num_features=64, msfa_output_resolution=IMAGE // 8,
            image_shape=(IMAGE, IMAGE, 3)),
        # ---- dense prediction heads on a tiny encoder ----
        "deeplabv3": lambda: m.DeepLabV3Backbone(
            image_encoder=_resnet(2), spatial_pyramid_pooling_key="P3", low_level_feature_key="P2",
            upsampling_size=2, dilation_rates=[2, 4], projection_filters=16,
            image_shape=(IMAGE, IMAGE, 3)),
        # BASNet feeds its own projection (projection_filters channels) to the ResNet's
        # first stack, so it must equal input_conv_filters: a bottleneck ResNet (its first
        # block has a conv shortcut) with an 8-filter stem; its decoder is 8x that wide
        "basnet": lambda: _one_output(m.BASNetBackbone(
            image_encoder=m.ResNetBackbone(
                input_conv_filters=[8], input_conv_kernel_sizes=[3],
                stackwise_num_filters=[64, 16, 16, 16], stackwise_num_blocks=[1, 1, 1, 1],
                stackwise_num_strides=[1, 2, 2, 2], block_type="bottleneck_block"),
            num_classes=1, projection_filters=8, image_shape=(IMAGE, IMAGE, 3)), "refine_out"),
        "retinanet": lambda: _one_output(m.RetinaNetBackbone(
            image_encoder=_resnet(3), min_level=3, max_level=4, use_p5=False,
            image_shape=(IMAGE, IMAGE, 3)), "P3"),
        "segformer": lambda: m.SegFormerBackbone(image_encoder=_mit(), projection_filters=32),
        "depth-anything": lambda: m.DepthAnythingBackbone(
            image_encoder=_dinov2(), reassemble_factors=[2, 1], neck_hidden_dims=[16, 32],
            fusion_hidden_dim=32, head_hidden_dim=16, head_in_index=-1,
            feature_keys=["stage1", "stage2"]),
        "d-fine": lambda: _one_output(m.DFineBackbone(
            backbone=_hgnetv2(), decoder_in_channels=[32, 32], encoder_hidden_dim=32,
            num_labels=4, num_denoising=0, learn_initial_query=False, num_queries=8,
            anchor_image_size=(IMAGE, IMAGE), feat_strides=[4, 8], num_feature_levels=2,
            hidden_dim=32, encoder_in_channels=[32, 64], encode_proj_layers=[1],
            num_attention_heads=2, encoder_ffn_dim=64, num_encoder_layers=1,
            hidden_expansion=0.5, depth_multiplier=0.5, eval_idx=-1, num_decoder_layers=2,
            decoder_attention_heads=2, decoder_ffn_dim=64, decoder_n_points=[2, 2],
            lqe_hidden_dim=16, num_lqe_layers=2, out_features=["stage1", "stage2"],
            image_shape=(IMAGE, IMAGE, 3), seed=0), "intermediate_logits"),
        "sam": _sam,
        # ---- image-text ----
        "clip": lambda: _one_output(m.CLIPBackbone(
            vision_encoder=m.CLIPVisionEncoder(**_vit_enc()),
            text_encoder=m.CLIPTextEncoder(**_text_enc()), projection_dim=32), "vision_logits"),
        "metaclip2": lambda: _one_output(m.MetaCLIP2Backbone(
            vision_encoder=m.MetaCLIP2VisionEncoder(**_vit_enc()),
            text_encoder=m.MetaCLIP2TextEncoder(**_text_enc()), projection_dim=32),
            "vision_logits"),
        "siglip": lambda: _one_output(m.SigLIPBackbone(
            vision_encoder=m.SigLIPVisionEncoder(**_vit_enc()),
            text_encoder=m.SigLIPTextEncoder(**_text_enc())), "vision_logits"),
        "blip2": lambda: m.BLIP2Backbone(
            vision_encoder=m.BLIP2VisionEncoder(
                image_size=IMAGE, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64,
                intermediate_dim=128, use_patch_bias=True, use_class_token=True,
                use_mha_bias=True, use_mlp_bias=True, dropout_rate=0.0,
                layer_norm_epsilon=1e-6, initializer_range=0.02),
            qformer=m.BLIP2QFormer(
                num_query_tokens=4, num_layers=2, num_heads=4, hidden_dim=64,
                intermediate_dim=128, vision_dim=64, cross_attention_frequency=1, dropout=0.0,
                layer_norm_epsilon=1e-12),
            language_model=m.BLIP2CustomOPT(
                vocabulary_size=VOCAB, num_layers=2, num_heads=4, hidden_dim=64,
                intermediate_dim=128, num_query_tokens=4, dropout=0.0,
                max_sequence_length=4 * SEQ, qformer_hidden_dim=64)),
        "parseq": lambda: m.PARSeqBackbone(
            image_encoder=m.ViTBackbone(image_shape=(IMAGE, IMAGE, 3), patch_size=8,
                                        num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128,
                                        use_class_token=False),
            vocabulary_size=VOCAB, max_label_length=SEQ - 1, decoder_hidden_dim=64,
            num_decoder_layers=2, num_decoder_heads=4, decoder_mlp_dim=128),
        # ---- video, diffusion ----
        "videoprism": lambda: m.VideoPrismBackbone(
            num_frames=2, patch_size=8, hidden_dim=64, intermediate_dim=128, num_heads=4,
            num_spatial_layers=2, num_temporal_layers=2, num_auxiliary_layers=0,
            image_shape=(IMAGE, IMAGE, 3)),
        "videoprism-lvt": lambda: _one_output(m.VideoPrismBackbone(
            num_frames=2, patch_size=8, hidden_dim=64, intermediate_dim=128, num_heads=4,
            num_spatial_layers=2, num_temporal_layers=2, num_auxiliary_layers=1,
            vocabulary_size=VOCAB, num_text_layers=2, image_shape=(IMAGE, IMAGE, 3)),
            "vision_embeddings"),
        "flux": lambda: m.FluxBackbone(
            input_channels=16, hidden_size=64, mlp_ratio=2.0, num_heads=4, depth=2,
            depth_single_blocks=2, axes_dim=[4, 6, 6], theta=10000, use_bias=True,
            guidance_embed=True, image_shape=(SEQ, 16), text_shape=(SEQ, 32),
            image_ids_shape=(SEQ, 3), text_ids_shape=(SEQ, 3), y_shape=(32,)),
    }




def _t5gemma(window: int) -> dict:
    """Encoder and decoder of 2 layers each (one sliding-window, one full attention)."""
    layers = ["sliding_attention", "full_attention"]
    half = dict(hidden_dim=64, intermediate_dim=128, num_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, layer_types=layers)
    cfg = {f"{side}_{k}": v for side in ("encoder", "decoder") for k, v in half.items()}
    return dict(cfg, vocabulary_size=VOCAB, sliding_window=window)


def _resnet(stacks: int, image_shape=(IMAGE, IMAGE, 3)) -> keras.Model:
    """A ResNet of ``stacks`` stacks of one basic block (pyramid P2..P{stacks+1})."""
    from keras_hub.models import ResNetBackbone
    return ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64, 32, 32, 32][:stacks], stackwise_num_blocks=[1] * stacks,
        stackwise_num_strides=[1, 2, 2, 2][:stacks], block_type="basic_block",
        image_shape=image_shape)


def _mit() -> keras.Model:
    """corpus.py's "mit" (MiT, 2 stages)."""
    from keras_hub.models import MiTBackbone
    return MiTBackbone(layerwise_depths=[1, 1], num_layers=2, layerwise_num_heads=[1, 2],
                       layerwise_sr_ratios=[2, 1], max_drop_path_rate=0.0,
                       layerwise_patch_sizes=[7, 3], layerwise_strides=[4, 2],
                       image_shape=(IMAGE, IMAGE, 3), hidden_dims=[16, 32])


def _dinov2() -> keras.Model:
    """corpus.py's "dinov2"."""
    from keras_hub.models import DINOV2Backbone
    return DINOV2Backbone(patch_size=8, num_layers=2, hidden_dim=64, num_heads=4,
                          intermediate_dim=128, image_shape=(IMAGE, IMAGE, 3),
                          position_embedding_shape=(IMAGE, IMAGE))


def _hgnetv2() -> keras.Model:
    """corpus.py's "hgnetv2" (2 stages, strides 4 and 8), both stages as features."""
    from keras_hub.models import HGNetV2Backbone
    return HGNetV2Backbone(
        depths=[1, 1], embedding_size=16, hidden_sizes=[32, 64], stem_channels=[3, 8, 16],
        hidden_act="relu", use_learnable_affine_block=True,
        stackwise_stage_filters=[[16, 8, 32, 1, 2, 3], [32, 16, 64, 1, 2, 3]],
        apply_downsample=[False, True], use_lightweight_conv_block=[False, True],
        image_shape=(IMAGE, IMAGE, 3), out_features=["stage1", "stage2"])


def _mnv5_arch(arch_def: list[list[str]]) -> dict:
    from keras_hub.src.models.mobilenetv5.mobilenetv5_builder import (
        convert_arch_def_to_stackwise)
    return convert_arch_def_to_stackwise(arch_def)


def _vit_enc() -> dict:
    return dict(patch_size=8, hidden_dim=64, num_layers=2, num_heads=4, intermediate_dim=128,
                image_shape=(IMAGE, IMAGE, 3))


def _text_enc() -> dict:
    return dict(vocabulary_size=VOCAB, embedding_dim=64, hidden_dim=64, num_layers=2,
                num_heads=4, intermediate_dim=128, max_sequence_length=SEQ)


def _sam() -> keras.Model:
    """SAMBackbone (ViTDet image encoder + prompt encoder) with its mask decoder applied,
    as SAMImageSegmenter does: a model of the predicted masks."""
    from keras_hub.layers import SAMMaskDecoder, SAMPromptEncoder
    from keras_hub.models import SAMBackbone, ViTDetBackbone
    grid = IMAGE // 8
    backbone = SAMBackbone(
        image_encoder=ViTDetBackbone(
            hidden_size=64, num_layers=2, intermediate_dim=128, num_heads=4,
            global_attention_layer_indices=[1], image_shape=(IMAGE, IMAGE, 3), patch_size=8,
            num_output_channels=32, window_size=2),
        prompt_encoder=SAMPromptEncoder(hidden_size=32, image_embedding_size=(grid, grid),
                                        input_image_size=(IMAGE, IMAGE), mask_in_channels=16),
        mask_decoder=SAMMaskDecoder(hidden_size=32, num_layers=2, intermediate_dim=64,
                                    num_heads=2, embedding_dim=32, num_multimask_outputs=3,
                                    iou_head_depth=3, iou_head_hidden_dim=32))
    masks = backbone.mask_decoder(**backbone.output)["masks"]
    return keras.Model(backbone.input, masks, name="sam_masks")


def _one_output(backbone: keras.Model, key: str) -> keras.Model:
    """``backbone`` (a keras-hub model with a dict of outputs) as a model of its output
    ``key`` alone, so that it trains with one loss: an encoder-decoder's decoder output
    (the encoder's output still feeds the cross-attention), a CNN's last stage."""
    return keras.Model(backbone.input, backbone.output[key], name=f"{backbone.name}_{key}")


def _bert_with_head() -> keras.Model:
    """A user's classifier on a keras-hub BERT: mean-pooled sequence output -> Dense. The
    backbone's own pooler is computed but its output is read by nothing."""
    backbone = _hub_backbones()["bert"]()
    inputs = {i.name: keras.Input(shape=i.shape[1:], dtype=i.dtype, name=i.name)
              for i in backbone.inputs}
    sequence = backbone(inputs)["sequence_output"]
    logits = keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling1D()(sequence))
    return keras.Model(inputs, logits, name="bert_classifier")


def _keras_hub() -> list[CorpusEntry]:
    if not keras_hub_available():
        return []
    out = [CorpusEntry(f"hub-{name}", "keras-hub", f"keras-hub {name} backbone from a small config",
                       builder, dict_inputs=name not in _HUB_UNNAMED_INPUT,
                       ci=name not in _HUB_SCRIPT_ONLY)
           for name, builder in _hub_backbones().items()]
    out += [CorpusEntry(f"hub-{name}", "keras-hub", f"keras-hub {name} from a small config",
                        builder, dict_inputs=name not in _HUB_UNNAMED_INPUT, ci=False,
                        input_shapes=_HUB_INPUT_SHAPES.get(name, {}))
            for name, builder in _hub_backbones_2026_11_26().items()]
    out.append(CorpusEntry("hub-bert-classifier", "keras-hub",
                           "keras-hub BERT with a mean-pool + Dense head (its pooler unused)",
                           _bert_with_head, dict_inputs=True))
    return out


def transformers_available() -> bool:
    """Whether Hugging Face transformers imports here with its TensorFlow models (the
    ``test`` extra installs 4.57, the last release that has them, with tf-keras)."""
    try:
        transformers = importlib.import_module("transformers")
        return hasattr(transformers, "TFBertModel")
    except ImportError:
        return False


# Hugging Face's TensorFlow models are Keras 2 (tf_keras) models: they look embeddings up
# straight from the variable (ResourceGather) and draw dropout with stateful random ops
_HF_CI = frozenset({"bert", "t5"})   # in the CI slice; the others in the scripts' matrices


def _hf_models() -> dict[str, tuple[Callable[..., Any], Any, str, Mapping[str, Any]]]:
    """name -> (TF model class, config class, output to train on, input kind and config)."""
    import transformers as hf
    text = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, max_position_embeddings=64)
    seq2seq = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                   decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                   vocab_size=VOCAB)
    vit = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               image_size=IMAGE, patch_size=8)
    speech = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 4),
                  conv_kernel=(10, 4), num_conv_pos_embeddings=16,
                  num_conv_pos_embedding_groups=4)
    last = "last_hidden_state"
    return {
        # encoders
        "bert": (hf.TFBertModel, hf.BertConfig, last, dict(text, _inputs="text+types")),
        "roberta": (hf.TFRobertaModel, hf.RobertaConfig, last, text),
        "distilbert": (hf.TFDistilBertModel, hf.DistilBertConfig, last, dict(
            vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
            max_position_embeddings=64)),
        "albert": (hf.TFAlbertModel, hf.AlbertConfig, last, dict(text, embedding_size=16)),
        "electra": (hf.TFElectraModel, hf.ElectraConfig, last, dict(text, embedding_size=16)),
        "deberta": (hf.TFDebertaModel, hf.DebertaConfig, last, text),
        "deberta-v2": (hf.TFDebertaV2Model, hf.DebertaV2Config, last, text),
        "mpnet": (hf.TFMPNetModel, hf.MPNetConfig, last, text),
        "convbert": (hf.TFConvBertModel, hf.ConvBertConfig, last, dict(text, embedding_size=32)),
        "roformer": (hf.TFRoFormerModel, hf.RoFormerConfig, last, dict(text, embedding_size=32)),
        "funnel": (hf.TFFunnelBaseModel, hf.FunnelConfig, last, dict(
            vocab_size=VOCAB, d_model=32, n_head=4, d_head=8, d_inner=64, block_sizes=[1, 1],
            num_decoder_layers=1)),
        "xlm-roberta": (hf.TFXLMRobertaModel, hf.XLMRobertaConfig, last, text),
        "esm": (hf.TFEsmModel, hf.EsmConfig, last, dict(text, pad_token_id=1)),
        "rembert": (hf.TFRemBertModel, hf.RemBertConfig, last, dict(
            text, input_embedding_size=16, output_embedding_size=16)),
        "xlnet": (hf.TFXLNetModel, hf.XLNetConfig, last, dict(
            vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, d_inner=64)),
        # decoders
        "gpt2": (hf.TFGPT2Model, hf.GPT2Config, last, dict(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
        "gptj": (hf.TFGPTJModel, hf.GPTJConfig, last, dict(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4)),
        "opt": (hf.TFOPTModel, hf.OPTConfig, last, dict(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32)),
        "ctrl": (hf.TFCTRLModel, hf.CTRLConfig, last, dict(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, dff=64, n_positions=64)),
        "xglm": (hf.TFXGLMModel, hf.XGLMConfig, last, dict(
            vocab_size=VOCAB, d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
            max_position_embeddings=64)),
        "mistral": (hf.TFMistralModel, hf.MistralConfig, last, dict(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)),
        # encoder-decoders (trained on the decoder's output)
        "t5": (hf.TFT5Model, hf.T5Config, last, dict(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            _inputs="seq2seq")),
        "bart": (hf.TFBartModel, hf.BartConfig, last, dict(
            seq2seq, max_position_embeddings=64, _inputs="seq2seq")),
        "marian": (hf.TFMarianModel, hf.MarianConfig, last, dict(
            seq2seq, decoder_vocab_size=VOCAB, max_position_embeddings=64, _inputs="seq2seq")),
        "pegasus": (hf.TFPegasusModel, hf.PegasusConfig, last, dict(
            seq2seq, max_position_embeddings=64, _inputs="seq2seq")),
        "blenderbot": (hf.TFBlenderbotModel, hf.BlenderbotConfig, last, dict(
            seq2seq, max_position_embeddings=64, _inputs="seq2seq")),
        "mbart": (hf.TFMBartModel, hf.MBartConfig, last, dict(
            seq2seq, max_position_embeddings=64, _inputs="seq2seq")),
        "led": (hf.TFLEDModel, hf.LEDConfig, last, dict(
            seq2seq, attention_window=4, max_encoder_position_embeddings=64,
            max_decoder_position_embeddings=64, _inputs="seq2seq")),
        # vision (channels first, as Hugging Face takes pixel values)
        "vit": (hf.TFViTModel, hf.ViTConfig, last, dict(vit, _inputs="image")),
        "deit": (hf.TFDeiTModel, hf.DeiTConfig, last, dict(vit, _inputs="image")),
        "data2vec-vision": (hf.TFData2VecVisionModel, hf.Data2VecVisionConfig, last,
                            dict(vit, _inputs="image")),
        "swin": (hf.TFSwinModel, hf.SwinConfig, last, dict(
            image_size=IMAGE, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
            window_size=4, _inputs="image")),
        "convnext": (hf.TFConvNextModel, hf.ConvNextConfig, last, dict(
            num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], image_size=IMAGE,
            _inputs="image")),
        "convnextv2": (hf.TFConvNextV2Model, hf.ConvNextV2Config, last, dict(
            num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], image_size=IMAGE,
            _inputs="image")),
        "resnet": (hf.TFResNetModel, hf.ResNetConfig, last, dict(
            embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], _inputs="image")),
        "regnet": (hf.TFRegNetModel, hf.RegNetConfig, last, dict(
            embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8,
            _inputs="image")),
        "segformer": (hf.TFSegformerModel, hf.SegformerConfig, last, dict(
            num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
            num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2],
            mlp_ratios=[2, 2], decoder_hidden_size=32, _inputs="image")),
        "mobilevit": (hf.TFMobileViTModel, hf.MobileViTConfig, last, dict(
            image_size=IMAGE, hidden_sizes=[16, 24, 32],
            neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 48], num_attention_heads=2,
            _inputs="image")),
        # speech (raw audio)
        "wav2vec2": (hf.TFWav2Vec2Model, hf.Wav2Vec2Config, last, dict(speech, _inputs="audio")),
        "hubert": (hf.TFHubertModel, hf.HubertConfig, last, dict(speech, _inputs="audio")),
    }


# a batch of 1600 raw audio samples: the speech models' two convolutions (stride 5, 4)
# make 79 frames
_HF_AUDIO = 1600


def _hf_inputs(kind: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """The named inputs (shape without the batch, dtype) of a Hugging Face model's kind."""
    text = {"input_ids": ((SEQ,), "int32"), "attention_mask": ((SEQ,), "int32")}
    return {"text": text,
            "text+types": dict(text, token_type_ids=((SEQ,), "int32")),
            "seq2seq": dict(text, decoder_input_ids=((SEQ,), "int32")),
            "image": {"pixel_values": ((3, IMAGE, IMAGE), "float32")},
            "audio": {"input_values": ((_HF_AUDIO,), "float32")}}[kind]


def _hf_builder(name: str) -> Callable[[], Any]:
    def build() -> Any:
        import tf_keras
        model_cls, config_cls, key, config = _hf_models()[name]
        config = dict(config)
        kind = config.pop("_inputs", "text")
        tf_keras.utils.set_random_seed(0)
        backbone = model_cls(config_cls(**config))
        inputs = {k: tf_keras.Input(shape, batch_size=None, dtype=dtype, name=k)
                  for k, (shape, dtype) in _hf_inputs(kind).items()}
        return tf_keras.Model(inputs, backbone(inputs)[key], name=f"hf_{name}".replace("-", "_"))
    return build


def _hugging_face() -> list[CorpusEntry]:
    if not transformers_available():
        return []
    return [CorpusEntry(f"hf-{name}", "transformers",
                        f"Hugging Face transformers TF{model_cls.__name__[2:]} (Keras 2) from "
                        "a small config", _hf_builder(name), dict_inputs=True,
                        ci=name in _HF_CI)
            for name, (model_cls, *_rest) in _hf_models().items()]


def model_garden_available() -> bool:
    """Whether the TensorFlow Model Garden's NLP modeling library imports here
    (``tf-models-official``, Keras 2)."""
    try:
        importlib.import_module("official.nlp.modeling.networks")
    except ImportError:
        return False
    return True


_TFM_CI = frozenset({"fnet"})   # in the CI slice (the complex-valued Fourier mixing)
_TFM_TEXT = ("input_word_ids", "input_mask", "input_type_ids")


def _tfm_models() -> dict[str, tuple[Callable[[], Any], tuple[str, ...]]]:
    """name -> (builder of the Model Garden network or model, its input names)."""
    from official.nlp.modeling import models, networks
    text = dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4,
                max_sequence_length=SEQ)
    return {
        "bert": (lambda: networks.BertEncoderV2(inner_dim=64, **text), _TFM_TEXT),
        "albert": (lambda: networks.AlbertEncoder(embedding_width=16, intermediate_size=64,
                                                  **text), _TFM_TEXT),
        "mobilebert": (lambda: networks.MobileBERTEncoder(
            word_vocab_size=VOCAB, word_embed_size=16, type_vocab_size=2,
            max_sequence_length=SEQ, num_blocks=2, hidden_size=32, num_attention_heads=4,
            intermediate_size=32, intra_bottleneck_size=16), _TFM_TEXT),
        "fnet": (lambda: networks.FNet(inner_dim=64, **text), _TFM_TEXT),
        "funnel": (lambda: networks.FunnelTransformerEncoder(inner_dim=64, pool_stride=2,
                                                             **text), _TFM_TEXT),
        # a sparse MoE (top-k router, experts as einsums); its router's metrics (Keras 2
        # add_metric, updated in the forward pass) off: the program cannot replay them
        "sparse-mixer": (lambda: networks.SparseMixer(
            inner_dim=64, num_experts=4, moe_layers=(1,), attention_layers=(0,),
            export_metrics=False, **text), _TFM_TEXT),
        "bert-classifier": (lambda: models.BertClassifier(
            networks.BertEncoderV2(inner_dim=64, **text), num_classes=3), _TFM_TEXT),
        "seq2seq": (lambda: models.Seq2SeqTransformer(
            vocab_size=VOCAB, embedding_width=32,
            encoder_layer=models.TransformerEncoder(num_layers=2, num_attention_heads=4,
                                                    intermediate_size=64),
            decoder_layer=models.TransformerDecoder(num_layers=2, num_attention_heads=4,
                                                    intermediate_size=64)),
            ("inputs", "targets")),
    }


def _tfm_builder(name: str) -> Callable[[], Any]:
    def build() -> Any:
        import tf_keras
        make, names = _tfm_models()[name]
        tf_keras.utils.set_random_seed(0)
        network = make()
        inputs = {k: tf_keras.Input((SEQ,), dtype="int32", name=k) for k in names}
        out = network(inputs)
        if isinstance(out, dict):        # an encoder: its sequence output
            out = out["sequence_output"]
        elif isinstance(out, (list, tuple)):
            out = out[0]
        return tf_keras.Model(inputs, out, name=f"tfm_{name}".replace("-", "_"))
    return build


def _model_garden() -> list[CorpusEntry]:
    if not model_garden_available():
        return []
    return [CorpusEntry(f"tfm-{name}", "tf-models-official",
                        f"TensorFlow Model Garden {name} (Keras 2) from a small config",
                        _tfm_builder(name), dict_inputs=True, ci=name in _TFM_CI)
            for name in _tfm_models()]


def kimm_available() -> bool:
    """Whether kimm (Keras Image Models, Keras 3) imports here."""
    try:
        importlib.import_module("kimm")
    except ImportError:
        return False
    return True


_KIMM_CI = frozenset({"mobileone"})   # in the CI slice (its blocks: parallel conv branches)


def _kimm_models() -> dict[str, tuple[str, int]]:
    """family -> (kimm constructor, image size): the smallest variant of each family at the
    smallest input its blocks accept (GhostNet v2/v3 pool a 2x2 map: 64 pixels; Inception v3:
    75). kimm's VGG is left out: its head is a 7x7 convolution over a 7x7 map (224 pixels,
    133 M parameters); keras.applications' VGG is in the corpus."""
    return {
        "convmixer": ("ConvMixer736D32", IMAGE),
        "convnext": ("ConvNeXtAtto", IMAGE),
        "densenet": ("DenseNet121", IMAGE),
        "efficientnet": ("EfficientNetB0", IMAGE),
        "efficientnet-lite": ("EfficientNetLiteB0", IMAGE),
        "efficientnetv2": ("EfficientNetV2B0", IMAGE),
        "ghostnet": ("GhostNetW050", IMAGE),
        "ghostnet-v2": ("GhostNetV2W100", 64),
        "ghostnet-v3": ("GhostNetV3W050", 64),
        "hgnet": ("HGNetTiny", IMAGE),
        "hgnet-v2": ("HGNetV2B0", IMAGE),
        "inception-next": ("InceptionNeXtTiny", IMAGE),
        "inception-v3": ("InceptionV3", 75),
        "lcnet": ("LCNet035", IMAGE),
        "mobilenet-v2": ("MobileNetV2W050", IMAGE),
        "mobilenet-v3": ("MobileNetV3W050Small", IMAGE),
        "mobileone": ("MobileOneS0", IMAGE),
        "mobilevit": ("MobileViTXXS", IMAGE),
        "mobilevit-v2": ("MobileViTV2W050", IMAGE),
        "regnet-x": ("RegNetX002", IMAGE),
        "regnet-y": ("RegNetY002", IMAGE),
        "repvgg": ("RepVGGA0", IMAGE),
        "resnet": ("ResNet18", IMAGE),
        "tinynet": ("TinyNetE", IMAGE),
        "vit": ("VisionTransformerTiny16", IMAGE),
        "xception": ("Xception", IMAGE),
    }


def _kimm_builder(ctor_name: str, size: int) -> Callable[[], keras.Model]:
    def build() -> keras.Model:
        import warnings

        import kimm
        with warnings.catch_warnings():   # "... doesn't have pretrained weights for 'None'"
            warnings.simplefilter("ignore")
            return getattr(kimm.models, ctor_name)(weights=None, input_shape=(size, size, 3),
                                                   classes=10)
    return build


def _kimm() -> list[CorpusEntry]:
    if not kimm_available():
        return []
    return [CorpusEntry(f"kimm-{family}", "kimm",
                        f"kimm {ctor} (Keras 3), {size}x{size}, 10 classes",
                        _kimm_builder(ctor, size), ci=family in _KIMM_CI)
            for family, (ctor, size) in _kimm_models().items()]


def entries(library: str | None = None) -> list[CorpusEntry]:
    """Every corpus entry (of ``library`` when given: "keras.applications", "keras-hub",
    "transformers", "tf-models-official", "kimm")."""
    found = _applications() + _keras_hub() + _hugging_face() + _model_garden() + _kimm()
    return [e for e in found if library is None or e.library == library]


def get(name: str) -> CorpusEntry:
    """The entry called ``name``."""
    for e in entries():
        if e.name == name:
            return e
    hint = "" if keras_hub_available() else " (keras-hub is not installed: hub-* entries are missing)"
    raise ValueError(f"no corpus model {name!r}{hint}; use one of {[e.name for e in entries()]}")


def run(entry: CorpusEntry, devices: tuple[int, ...] = (2, 4, 8)) -> dict[str, Any]:
    """Capture, mine and search ``entry`` on one V100 node of each device count; returns the
    sizes, per-phase seconds and, per device count, the strategy's cost, the number of
    sharded GraphNodes and the GraphNodes the search had to replicate (with why)."""
    import time

    import tapas

    start = time.perf_counter()
    model, specs = entry.build()
    row: dict[str, Any] = {"model": entry.name, "library": entry.library,
                           "build_s": time.perf_counter() - start}
    start = time.perf_counter()
    graph = tapas.capture(model, specs, name=entry.name)
    row["capture_s"] = time.perf_counter() - start
    start = time.perf_counter()
    folded = tapas.mine(graph)
    row.update(mine_s=time.perf_counter() - start, graph_nodes=len(graph.nodes),
               templates=folded.num_templates, coverage=folded.coverage, searches={})
    for n in devices:
        start = time.perf_counter()
        strategy = tapas.search(graph, cluster=tapas.Cluster.v100_ethernet(1, n), folded=folded)
        row["searches"][n] = {
            "search_s": time.perf_counter() - start, "cost_s": strategy.total_cost,
            "sharded": sum(1 for p in strategy.patterns if p != "replicate"),
            "notes": list(strategy.notes)}
    return row
