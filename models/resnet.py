"""ResNet v1.5 with bottleneck blocks (He et al., 2016) in Keras 3.

The convolutional family of the TAPAS experiments (paper section 5): TAPAS
scales ResNet along *width* by enlarging the classification layer (1024 ->
10K -> 100K -> 250K -> 400K classes), where sharding the final ``Dense`` pays
off while the convolutional trunk stays replicated.

Architecture (the "v1.5" variant used by torchvision and the MLPerf reference:
the stride-2 of a down-sampling bottleneck sits in its 3x3 convolution, not in
the first 1x1):

* stem: 7x7/2 convolution with ``width`` filters, batch norm, ReLU, 3x3/2 max
  pool (explicit zero padding of 3 and 1, like the reference models);
* four stages with ``width * (1, 2, 4, 8)`` bottleneck filters, strides
  ``(1, 2, 2, 2)`` and block counts 3-4-6-3 (depth 50), 3-4-23-3 (101) or
  3-8-36-3 (152). A :class:`BottleneckBlock` is ``1x1 -> 3x3 -> 1x1 (x4
  expansion)`` convolutions, each ``Conv2D(use_bias=False)`` + batch norm
  (+ ReLU), added to the shortcut and passed through ReLU. The first block of
  every stage uses a projection shortcut (1x1 convolution with the block's
  stride + batch norm); the others use the identity;
* global average pooling and a ``Dense(num_classes)`` classifier (with bias)
  producing logits.

Batch norms use ``momentum=0.9, epsilon=1e-5``. Their four weights (gamma,
beta, moving mean, moving variance) all count in ``count_params()``.

Layer names: ``stem_pad``, ``stem_conv``, ``stem_bn``, ``stem_relu``,
``stem_pool_pad``, ``stem_pool``, ``stage{s}_block{b}`` (s, b from 1; inside:
``conv1 bn1 conv2 bn2 conv3 bn3`` and ``shortcut_conv shortcut_bn``),
``avg_pool``, ``classifier``.

Input: ``images`` float32 ``[B, image_size, image_size, 3]`` (channels last);
output: logits float32 ``[B, num_classes]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from ._common import Initializers, require_positive_int

__all__ = [
    "ResNetConfig",
    "BLOCK_COUNTS",
    "BottleneckBlock",
    "build_model",
    "param_count",
    "input_spec",
    "synthetic_batch",
]

#: Bottleneck blocks per stage for each supported depth.
BLOCK_COUNTS: dict[int, tuple[int, int, int, int]] = {
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
}
_STAGE_MULTIPLIERS = (1, 2, 4, 8)
_STAGE_STRIDES = (1, 2, 2, 2)
_EXPANSION = 4
_BN_MOMENTUM = 0.9
_BN_EPSILON = 1e-5
_MIN_IMAGE_SIZE = 32  # the trunk down-samples by 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResNetConfig:
    """Hyper-parameters of a bottleneck ResNet v1.5.

    Attributes:
        depth: 50, 101 or 152; selects the block counts (see
            :data:`BLOCK_COUNTS`).
        num_classes: classifier outputs.
        image_size: height = width of the square input images (>= 32).
        width: filters of the stem and of the first stage's bottleneck
            (64 in the standard models); stage ``s`` uses ``width * 2**(s-1)``.
        block_counts: overrides the depth's block counts (4 positive ints),
            e.g. ``(1, 1, 1, 1)`` for a tiny test model; ``None`` uses
            ``BLOCK_COUNTS[depth]``.
    """

    depth: int = 50
    num_classes: int
    image_size: int = 224
    width: int = 64
    block_counts: tuple[int, int, int, int] | None = None

    def __post_init__(self) -> None:
        if self.depth not in BLOCK_COUNTS:
            raise ValueError(
                f"ResNetConfig.depth must be one of {sorted(BLOCK_COUNTS)}, got {self.depth!r}; "
                "use block_counts=(...) for other layouts."
            )
        for field in ("num_classes", "image_size", "width"):
            require_positive_int("ResNetConfig", field, getattr(self, field))
        if self.image_size < _MIN_IMAGE_SIZE:
            raise ValueError(
                f"ResNetConfig.image_size must be >= {_MIN_IMAGE_SIZE} (the network down-samples by 32), "
                f"got {self.image_size}."
            )
        if self.block_counts is not None:
            counts = self.block_counts
            if (
                not isinstance(counts, tuple)
                or len(counts) != 4
                or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts)
            ):
                raise ValueError(
                    f"ResNetConfig.block_counts must be a tuple of 4 positive ints or None, got {counts!r}; "
                    "e.g. block_counts=(1, 1, 1, 1)."
                )

    @property
    def stage_blocks(self) -> tuple[int, int, int, int]:
        """Bottleneck blocks per stage actually built."""
        return self.block_counts if self.block_counts is not None else BLOCK_COUNTS[self.depth]


def _batch_norm(name: str, initializers: Initializers) -> keras.layers.BatchNormalization:
    return keras.layers.BatchNormalization(
        momentum=_BN_MOMENTUM,
        epsilon=_BN_EPSILON,
        gamma_initializer=initializers.ones(),
        moving_variance_initializer=initializers.ones(),
        name=name,
    )


class BottleneckBlock(keras.layers.Layer):
    """ResNet v1.5 bottleneck: ``relu(bn(conv1x1(relu(bn(conv3x3/s(relu(bn(conv1x1(x)))))))) + shortcut(x))``.

    Args:
        filters: bottleneck width; the block outputs ``4 * filters`` channels.
        stride: stride of the 3x3 convolution (and of the projection).
        projection: use a 1x1 convolution + batch norm shortcut (needed when
            the stride or the channel count changes) instead of the identity.
        initializers: the build's :class:`Initializers`.
    """

    def __init__(
        self, *, filters: int, stride: int, projection: bool, initializers: Initializers, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        if stride != 1 and not projection:
            raise ValueError(f"{self.name}: stride {stride} changes the shape, so projection=True is required.")
        self.stride = stride
        self.projection = projection

        def conv(out: int, size: int, stride_: int, padding: str, name: str) -> keras.layers.Conv2D:
            return keras.layers.Conv2D(
                out,
                size,
                strides=stride_,
                padding=padding,
                use_bias=False,
                kernel_initializer=initializers.he_normal(),
                name=name,
            )

        self.conv1 = conv(filters, 1, 1, "valid", "conv1")
        self.bn1 = _batch_norm("bn1", initializers)
        # Symmetric padding of 1 for the strided 3x3 (as the reference models);
        # "same" would pad asymmetrically for stride 2.
        self.pad2 = keras.layers.ZeroPadding2D(1, name="pad2") if stride > 1 else None
        self.conv2 = conv(filters, 3, stride, "valid" if stride > 1 else "same", "conv2")
        self.bn2 = _batch_norm("bn2", initializers)
        self.conv3 = conv(_EXPANSION * filters, 1, 1, "valid", "conv3")
        self.bn3 = _batch_norm("bn3", initializers)
        if projection:
            self.shortcut_conv = conv(_EXPANSION * filters, 1, stride, "valid", "shortcut_conv")
            self.shortcut_bn = _batch_norm("shortcut_bn", initializers)

    def _build_chain(self, input_shape: tuple, build: bool) -> tuple:
        """Output shape of the block; with ``build`` also builds every sub-layer on the way."""
        shape = tuple(input_shape)
        main = [self.conv1, self.bn1] + ([self.pad2] if self.pad2 is not None else [])
        main += [self.conv2, self.bn2, self.conv3, self.bn3]
        for layer in main:
            if build:
                layer.build(shape)
            shape = tuple(layer.compute_output_shape(shape))
        if build and self.projection:
            self.shortcut_conv.build(tuple(input_shape))
            self.shortcut_bn.build(tuple(self.shortcut_conv.compute_output_shape(tuple(input_shape))))
        return shape

    def build(self, input_shape: tuple) -> None:
        self._build_chain(input_shape, build=True)

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        return self._build_chain(input_shape, build=False)

    def call(self, x: Any, training: bool | None = None) -> Any:
        relu = keras.ops.relu
        h = relu(self.bn1(self.conv1(x), training=training))
        if self.pad2 is not None:
            h = self.pad2(h)
        h = relu(self.bn2(self.conv2(h), training=training))
        h = self.bn3(self.conv3(h), training=training)
        shortcut = self.shortcut_bn(self.shortcut_conv(x), training=training) if self.projection else x
        return relu(h + shortcut)


def build_model(config: ResNetConfig, *, fast_init: bool = False, seed: int = 0) -> keras.Model:
    """Build the functional ResNet ``keras.Model`` described by ``config``.

    Args:
        config: model hyper-parameters.
        fast_init: initialise every weight with zeros (structure-only use).
        seed: base seed of the random initialisers (ignored with ``fast_init``).
    """
    if not isinstance(config, ResNetConfig):
        raise TypeError(f"build_model expects a ResNetConfig, got {type(config).__name__}.")
    inits = Initializers(seed, fast_init)
    images = keras.Input(shape=(config.image_size, config.image_size, 3), dtype="float32", name="images")
    x = keras.layers.ZeroPadding2D(3, name="stem_pad")(images)
    x = keras.layers.Conv2D(
        config.width, 7, strides=2, use_bias=False, kernel_initializer=inits.he_normal(), name="stem_conv"
    )(x)
    x = _batch_norm("stem_bn", inits)(x)
    x = keras.layers.ReLU(name="stem_relu")(x)
    x = keras.layers.ZeroPadding2D(1, name="stem_pool_pad")(x)
    x = keras.layers.MaxPooling2D(3, strides=2, name="stem_pool")(x)
    for stage, (blocks, multiplier, stride) in enumerate(
        zip(config.stage_blocks, _STAGE_MULTIPLIERS, _STAGE_STRIDES), start=1
    ):
        for block in range(1, blocks + 1):
            first = block == 1
            x = BottleneckBlock(
                filters=config.width * multiplier,
                stride=stride if first else 1,
                projection=first,
                initializers=inits,
                name=f"stage{stage}_block{block}",
            )(x)
    x = keras.layers.GlobalAveragePooling2D(name="avg_pool")(x)
    logits = keras.layers.Dense(
        config.num_classes,
        kernel_initializer=inits.normal(0.01),
        bias_initializer=inits.zeros(),
        name="classifier",
    )(x)
    return keras.Model(inputs=[images], outputs=logits, name="resnet")


def param_count(config: ResNetConfig) -> int:
    """Exact number of weights of ``build_model(config)`` (batch-norm statistics included)."""
    bn = 4  # gamma, beta, moving mean, moving variance per channel
    width = config.width
    total = 7 * 7 * 3 * width + bn * width  # stem
    channels = width
    for blocks, multiplier in zip(config.stage_blocks, _STAGE_MULTIPLIERS):
        filters = width * multiplier
        out = _EXPANSION * filters
        for block in range(blocks):
            in_channels = channels if block == 0 else out
            total += in_channels * filters + bn * filters  # conv1 + bn1
            total += 9 * filters * filters + bn * filters  # conv2 + bn2
            total += filters * out + bn * out  # conv3 + bn3
            if block == 0:
                total += in_channels * out + bn * out  # projection shortcut
        channels = out
    return total + channels * config.num_classes + config.num_classes


def input_spec(config: ResNetConfig, batch_size: int) -> tuple[tf.TensorSpec, ...]:
    """Static ``(images,)`` spec for ``batch_size``."""
    require_positive_int("ResNet input batch", "batch_size", batch_size)
    return (tf.TensorSpec((batch_size, config.image_size, config.image_size, 3), tf.float32, name="images"),)


def synthetic_batch(
    config: ResNetConfig, batch_size: int, seed: int = 0
) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """Standard-normal images and uniform labels, deterministic per ``seed``: ``((images,), labels)``."""
    require_positive_int("ResNet input batch", "batch_size", batch_size)
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((batch_size, config.image_size, config.image_size, 3), dtype=np.float32)
    labels = rng.integers(0, config.num_classes, (batch_size,), dtype=np.int32)
    return (images,), labels
