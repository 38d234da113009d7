"""Registry of the model presets TAPAS experiments on (paper section 5).

A :class:`ModelEntry` ties a name (``"t5-large"``) to a family (``"t5"``,
``"moe"``, ``"resnet"``), a frozen config dataclass of that family and the
default batch size, and knows how to build the Keras model, describe its
inputs (static ``tf.TensorSpec`` s), make a deterministic synthetic batch, and
count its parameters analytically *without* building it.

Usage::

    from tapas import models
    entry = models.get("t5-tiny")
    model = entry.build(seed=0)
    (inputs, targets) = entry.synthetic_batch()
    logits = model(list(inputs))
    entry.param_count() == model.count_params()   # True

Built-in presets (sizes from the published papers; each ``description`` names
its source):

* T5 (Raffel et al., 2020): ``t5-tiny`` (tests), ``t5-small``, ``t5-base``,
  ``t5-large`` and the depth-scaled T5-Large variants
  ``t5-large-depth{6,12,24,48}`` (layers per stack) used for the TAPAS depth
  scaling. Non-tiny presets use 128 encoder / 128 decoder tokens.
* GShard MoE (Lepikhin et al., 2021) with the sizes of Alpa (Zheng et al.,
  2022, Table 7 and its benchmark scripts: d_ff = 8 x hidden, vocab 32000,
  sequence length 1024): ``moe-tiny`` (tests), ``moe-380m``, ``moe-1.3b``,
  ``moe-2.4b``.
* ResNet v1.5 (He et al., 2016) with the TAPAS class scaling:
  ``resnet-tiny`` (tests) and ``resnet{50,101,152}-{1k,10k,100k,250k,400k}``.
* ``t5-tiny-tapas``, ``t5-large-tapas``, ``moe-tiny-tapas``, ``moe-1.3b-tapas``:
  the same models built from ``tapas.layers`` (``layer_impl="tapas"``).
* T5 with padding-mask inputs read by every attention layer (as T5s written for
  batched text have): ``t5-tiny-masked`` (tests) and
  ``t5-large-masked-depth{6,12,24,48}``.
* BERT (Devlin et al., 2019) masked-LM: ``bert-tiny`` (tests), ``bert-base``,
  ``bert-large``: token/segment/padding-mask inputs, post-norm layers, a backbone
  whose pooler output the head leaves unused.
* Llama-style decoders (Touvron et al., 2023; Llama 3.2 1B sizes): ``llama-tiny``
  and ``llama-tiny-fused`` (tests), ``llama-1b``: rotary
  embeddings, grouped-query attention, separate or fused q/k/v, SwiGLU.
"""

from __future__ import annotations

import dataclasses
import difflib
from types import ModuleType
from typing import Any, Union

import keras
import numpy as np
import tensorflow as tf

from . import bert, llama, moe, resnet, t5
from ._common import require_positive_int, resolve_batch_size

__all__ = [
    "ModelEntry",
    "ModelConfig",
    "FAMILIES",
    "LOSS",
    "DEFAULT_MODEL",
    "get",
    "names",
    "register",
    "capture_preset",
]

#: Any family config.
ModelConfig = Union[t5.T5Config, moe.MoEConfig, resnet.ResNetConfig, bert.BertConfig, llama.LlamaConfig]

# family name -> (module implementing the family API, its config class)
_FAMILY_MODULES: dict[str, tuple[ModuleType, type]] = {
    "t5": (t5, t5.T5Config),
    "moe": (moe, moe.MoEConfig),
    "resnet": (resnet, resnet.ResNetConfig),
    "bert": (bert, bert.BertConfig),
    "llama": (llama, llama.LlamaConfig),
}

#: The model families, in registration order.
FAMILIES: tuple[str, ...] = tuple(_FAMILY_MODULES)

#: Training loss of every built-in preset: integer targets, logits outputs.
LOSS = "sparse_categorical_crossentropy_from_logits"

#: The preset the CLI uses when no model is named.
DEFAULT_MODEL = "t5-tiny"


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """One registered model preset.

    Attributes:
        name: registry key, e.g. ``"t5-large"``.
        family: ``"t5"``, ``"moe"`` or ``"resnet"``.
        description: one line, naming the published source of the sizes.
        config: the family's config dataclass instance.
        default_batch_size: batch size used when none is given.
        loss: training loss identifier (:data:`LOSS` for all built-ins; see
            :meth:`keras_loss`).
    """

    name: str
    family: str
    description: str
    config: ModelConfig
    default_batch_size: int
    loss: str = LOSS

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"ModelEntry.name must be a non-empty string, got {self.name!r}.")
        if self.family not in _FAMILY_MODULES:
            raise ValueError(
                f"ModelEntry {self.name!r}: unknown family {self.family!r}; use one of {list(FAMILIES)}."
            )
        config_class = _FAMILY_MODULES[self.family][1]
        if not isinstance(self.config, config_class):
            raise ValueError(
                f"ModelEntry {self.name!r}: family {self.family!r} needs a {config_class.__name__}, "
                f"got {type(self.config).__name__}."
            )
        if not isinstance(self.description, str) or not self.description.strip() or "\n" in self.description:
            raise ValueError(
                f"ModelEntry {self.name!r}: description must be one non-empty line, got {self.description!r}."
            )
        require_positive_int(f"ModelEntry {self.name!r}", "default_batch_size", self.default_batch_size)
        if self.loss != LOSS:
            raise ValueError(f"ModelEntry {self.name!r}: unsupported loss {self.loss!r}; use {LOSS!r}.")
        if self.family == "moe":
            self.config.check_batch_size(self.default_batch_size)

    @property
    def _module(self) -> ModuleType:
        return _FAMILY_MODULES[self.family][0]

    def build(self, fast_init: bool = False, seed: int = 0) -> keras.Model:
        """Build the functional ``keras.Model``.

        Args:
            fast_init: initialise every weight with zeros -- cheap, for
                structure-only work (capture, search) on the large presets.
            seed: seed of the random initialisation (ignored with ``fast_init``).
        """
        return self._module.build_model(self.config, fast_init=fast_init, seed=seed)

    def input_spec(self, batch_size: int | None = None) -> tuple[tf.TensorSpec, ...]:
        """Static input specs, in model-input order and named like the model inputs."""
        return self._module.input_spec(self.config, resolve_batch_size(batch_size, self.default_batch_size))

    def synthetic_batch(
        self, batch_size: int | None = None, seed: int = 0
    ) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
        """``(inputs, targets)``: NumPy inputs matching :meth:`input_spec` and integer targets.

        Deterministic per ``seed``. ``inputs`` is a tuple in model-input order
        (pass ``list(inputs)`` to the model or ``inputs`` to ``fit``).
        """
        return self._module.synthetic_batch(
            self.config, resolve_batch_size(batch_size, self.default_batch_size), seed
        )

    def param_count(self) -> int:
        """Number of weights (``count_params()`` of the built model), from the config alone."""
        return int(self._module.param_count(self.config))

    def keras_loss(self) -> keras.losses.Loss:
        """The Keras loss object matching :attr:`loss`."""
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def keras_optimizer(self) -> keras.optimizers.Optimizer:
        """The optimizer its family is usually trained with: SGD with momentum for the
        convolutional family, AdamW (weight decay off the biases and norm scales) for
        the transformers."""
        if self.family == "resnet":
            return keras.optimizers.SGD(0.01, momentum=0.9)
        opt = keras.optimizers.AdamW(1e-3, weight_decay=0.01)
        opt.exclude_from_weight_decay(var_names=["bias", "norm", "gamma", "beta", "scale"])
        return opt

    def build_compiled(self, fast_init: bool = False, seed: int = 0) -> keras.Model:
        """:meth:`build`, compiled as a user would train it: :meth:`keras_optimizer` and
        :meth:`keras_loss`."""
        model = self.build(fast_init=fast_init, seed=seed)
        model.compile(optimizer=self.keras_optimizer(), loss=self.keras_loss())
        return model


_REGISTRY: dict[str, ModelEntry] = {}


def register(entry: ModelEntry) -> ModelEntry:
    """Add ``entry`` to the registry and return it.

    Raises:
        TypeError: ``entry`` is not a :class:`ModelEntry`.
        ValueError: the name is already registered.
    """
    if not isinstance(entry, ModelEntry):
        raise TypeError(f"register() expects a ModelEntry, got {type(entry).__name__}.")
    if entry.name in _REGISTRY:
        raise ValueError(
            f"model {entry.name!r} is already registered (family {_REGISTRY[entry.name].family!r}); "
            "choose another name."
        )
    _REGISTRY[entry.name] = entry
    return entry


def get(name: str) -> ModelEntry:
    """The entry registered as ``name``.

    Raises:
        ValueError: unknown name; the message lists close matches and all names.
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        pass
    close = difflib.get_close_matches(str(name), list(_REGISTRY), n=5, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(f"unknown model {name!r}.{hint} Registered models: {', '.join(_REGISTRY)}.")


def names(family: str | None = None) -> list[str]:
    """Registered names in registration order, optionally only those of ``family``."""
    if family is not None and family not in _FAMILY_MODULES:
        raise ValueError(f"unknown family {family!r}; use one of {list(FAMILIES)} or None for all.")
    return [n for n, e in _REGISTRY.items() if family is None or e.family == family]


def capture_preset(name: str, cache_dir: str | None = None) -> tuple["Any", float]:
    """The captured ``tapas.ir.Graph`` of preset ``name`` (default batch, zero-initialised
    weights: structure only) and the seconds building and capturing took.

    With ``cache_dir`` the graph is read from ``<cache_dir>/<name>.json`` when present
    (0.0 seconds) and written there otherwise: benchmarks and figure scripts reuse it.
    """
    import gc
    import os
    import time

    import tapas
    from tapas.ir import Graph

    path = os.path.join(cache_dir, f"{name}.json") if cache_dir else None
    if path and os.path.exists(path):
        with open(path) as f:
            return Graph.loads(f.read()), 0.0
    entry = get(name)
    start = time.perf_counter()
    model = entry.build(fast_init=True)
    graph = tapas.capture(model, list(entry.input_spec()), name=name)
    seconds = time.perf_counter() - start
    del model
    gc.collect()
    if path:
        os.makedirs(cache_dir, exist_ok=True)
        with open(path, "w") as f:
            f.write(graph.dumps())
    return graph, seconds


# --------------------------------------------------------------------------- #
# Built-in presets
# --------------------------------------------------------------------------- #

_T5_SOURCE = "Raffel et al. 2020 (JMLR), sec. 3.7"
_T5_VOCAB = 32128  # released T5 SentencePiece vocabulary (32000 pieces + 128 sentinels, padded)
_T5_SEQ = 128  # encoder and decoder length for the non-tiny presets (our choice)
_T5_LARGE = dict(d_model=1024, d_ff=4096, num_heads=16, d_kv=64)

_ALPA_SOURCE = "Alpa (Zheng et al. 2022, OSDI) Table 7 + benchmark: d_ff=8*hidden, vocab 32000, seq 1024"
_RESNET_CLASSES = {"1k": 1024, "10k": 10240, "100k": 102400, "250k": 256000, "400k": 409600}


def _t5_config(layers: int, sizes: dict) -> "t5.T5Config":
    """A paper-sized T5 with ``layers`` encoder and decoder layers, the zoo's vocabulary and
    sequence lengths."""
    return t5.T5Config(
        num_layers=layers,
        num_decoder_layers=layers,
        vocab_size=_T5_VOCAB,
        encoder_seq_len=_T5_SEQ,
        decoder_seq_len=_T5_SEQ,
        **sizes,
    )


def _register_builtin_presets() -> None:
    register(
        ModelEntry(
            name="t5-tiny",
            family="t5",
            description="Tiny T5 for tests (2+2 layers, d_model 64, 4 heads, vocab 512, seq 16/16); no paper.",
            config=t5.T5Config(
                num_layers=2,
                num_decoder_layers=2,
                d_model=64,
                d_ff=128,
                num_heads=4,
                d_kv=16,
                vocab_size=512,
                encoder_seq_len=16,
                decoder_seq_len=16,
            ),
            default_batch_size=2,
        )
    )
    for name, label, layers, sizes in (
        ("t5-small", "T5-Small", 6, dict(d_model=512, d_ff=2048, num_heads=8, d_kv=64)),
        ("t5-base", "T5-Base", 12, dict(d_model=768, d_ff=3072, num_heads=12, d_kv=64)),
        ("t5-large", "T5-Large", 24, _T5_LARGE),
    ):
        register(
            ModelEntry(
                name=name,
                family="t5",
                description=(
                    f"{label} ({layers}+{layers} layers, d_model {sizes['d_model']}, d_ff {sizes['d_ff']}, "
                    f"{sizes['num_heads']} heads; {_T5_SOURCE}), seq 128/128."
                ),
                config=_t5_config(layers, sizes),
                default_batch_size=8,
            )
        )
    for depth in (6, 12, 24, 48):
        register(
            ModelEntry(
                name=f"t5-large-depth{depth}",
                family="t5",
                description=(
                    f"T5-Large widths ({_T5_SOURCE}) with {depth}+{depth} layers: TAPAS sec. 5.2 depth "
                    "scaling, seq 128/128."
                ),
                config=_t5_config(depth, _T5_LARGE),
                default_batch_size=8,
            )
        )

    register(
        ModelEntry(
            name="moe-tiny",
            family="moe",
            description="Tiny GShard MoE LM for tests (1 dense + 1 MoE block, d_model 32, 4 experts, seq 16).",
            config=moe.MoEConfig(
                num_layers=2, d_model=32, d_ff=64, num_heads=2, num_experts=4, vocab_size=256, seq_len=16
            ),
            default_batch_size=2,
        )
    )
    for name, label, hidden, layers, heads, experts in (
        ("moe-380m", "380M", 768, 8, 16, 8),
        ("moe-1.3b", "1.3B", 768, 16, 16, 16),
        ("moe-2.4b", "2.4B", 1024, 16, 16, 16),
    ):
        register(
            ModelEntry(
                name=name,
                family="moe",
                description=(
                    f"GShard MoE {label} (hidden {hidden}, {layers} layers, {heads} heads, {experts} experts, "
                    f"MoE every 2nd layer; {_ALPA_SOURCE})."
                ),
                config=moe.MoEConfig(
                    num_layers=layers,
                    d_model=hidden,
                    d_ff=8 * hidden,
                    num_heads=heads,
                    num_experts=experts,
                    vocab_size=32000,
                    seq_len=1024,
                ),
                default_batch_size=8,
            )
        )

    register(
        ModelEntry(
            name="resnet-tiny",
            family="resnet",
            description="Tiny ResNet for tests (1-1-1-1 bottlenecks, width 8, 32x32 images, 10 classes).",
            config=resnet.ResNetConfig(
                depth=50, block_counts=(1, 1, 1, 1), width=8, image_size=32, num_classes=10
            ),
            default_batch_size=4,
        )
    )
    for depth in (50, 101, 152):
        for suffix, classes in _RESNET_CLASSES.items():
            register(
                ModelEntry(
                    name=f"resnet{depth}-{suffix}",
                    family="resnet",
                    description=(
                        f"ResNet-{depth} v1.5 (He et al. 2016, CVPR) with {classes} classes: TAPAS sec. 5.2.1 "
                        "classifier scaling, 224x224 images."
                    ),
                    config=resnet.ResNetConfig(depth=depth, num_classes=classes, image_size=224, width=64),
                    default_batch_size=8,
                )
            )

    # The same architectures built from tapas.layers (issue 6): every attention,
    # feed-forward, norm, MoE and embedding is one GraphNode by construction.
    for base in ("t5-tiny", "t5-large", "moe-tiny", "moe-1.3b"):
        entry = _REGISTRY[base]
        register(
            dataclasses.replace(
                entry,
                name=f"{base}-tapas",
                description=f"{base} from tapas.layers (layer_impl='tapas'). " + entry.description,
                config=dataclasses.replace(entry.config, layer_impl="tapas"),
            )
        )

    _register_text_presets()


_BERT_SOURCE = "Devlin et al. 2019 (NAACL), sec. 3"
_LLAMA_SOURCE = "Llama 3.2 1B (Meta 2024): 16 layers, hidden 2048, 32 query / 8 key-value heads, ffn 8192"


def _register_text_presets() -> None:
    """Transformer stacks with the traits models from other libraries have (issue 10):
    padding masks as inputs, post-norm BERT encoders, pre-norm decoders with rotary
    embeddings and grouped-query attention, separate and fused q/k/v projections."""
    base = _REGISTRY["t5-tiny"]
    register(dataclasses.replace(
        base, name="t5-tiny-masked", config=dataclasses.replace(base.config, padding_mask=True),
        description="t5-tiny with encoder/decoder padding-mask inputs read by every attention layer."))
    for depth in (6, 12, 24, 48):
        register(ModelEntry(
            name=f"t5-large-masked-depth{depth}", family="t5",
            description=(f"T5-Large widths ({_T5_SOURCE}), {depth}+{depth} layers, with padding-mask inputs "
                         "read by every attention layer and the shared relative position bias, seq 128/128."),
            config=dataclasses.replace(_t5_config(depth, _T5_LARGE), padding_mask=True),
            default_batch_size=8))
    register(ModelEntry(
        name="bert-tiny", family="bert",
        description="Tiny BERT masked-LM for tests (2 layers, hidden 64, 4 heads, seq 16, vocab 512).",
        config=bert.BertConfig(num_layers=2, hidden_size=64, num_heads=4, intermediate_size=256,
                               vocab_size=512, seq_len=16),
        default_batch_size=4))
    for name, label, layers, hidden, heads in (("bert-base", "BERT-Base", 12, 768, 12),
                                               ("bert-large", "BERT-Large", 24, 1024, 16)):
        register(ModelEntry(
            name=name, family="bert",
            description=(f"{label} masked-LM ({layers} layers, hidden {hidden}, {heads} heads, vocab 30522; "
                         f"{_BERT_SOURCE}), seq 128."),
            config=bert.BertConfig(num_layers=layers, hidden_size=hidden, num_heads=heads,
                                   intermediate_size=4 * hidden, vocab_size=30522, seq_len=128),
            default_batch_size=8))
    for fused in (False, True):
        qkv = "fused qkv" if fused else "separate q/k/v"
        register(ModelEntry(
            name="llama-tiny-fused" if fused else "llama-tiny", family="llama",
            description=(f"Tiny Llama-style decoder for tests (2 layers, hidden 64, 4 query / 2 key-value heads, "
                         f"{qkv}, seq 16, vocab 512)."),
            config=llama.LlamaConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                                     intermediate_size=176, vocab_size=512, seq_len=16, fused_qkv=fused),
            default_batch_size=4))
    register(ModelEntry(
        name="llama-1b", family="llama",
        description=f"Llama-style decoder ({_LLAMA_SOURCE}, vocab 128256, tied embeddings), seq 128.",
        config=llama.LlamaConfig(num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8,
                                 intermediate_size=8192, vocab_size=128256, seq_len=128),
        default_batch_size=8))


_register_builtin_presets()
