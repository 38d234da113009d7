"""The TAPAS model zoo: the three model families of the paper's experiments.

* :mod:`.t5` -- T5 encoder-decoder (dense transformer, scaled by depth);
* :mod:`.moe` -- GShard Mixture-of-Experts LM (scaled by experts and layers);
* :mod:`.resnet` -- ResNet v1.5 bottleneck CNN (scaled by classifier width).

All are Keras 3 functional models (TensorFlow backend) with static input
shapes. Presets live in a registry::

    from tapas import models
    models.names("t5")            # ['t5-tiny', 't5-small', ...]
    entry = models.get("t5-large")
    entry.param_count()           # analytic, no build
    model = entry.build(fast_init=True)

See ``models/README.md`` for the preset table and memory needs.
"""

from . import moe, resnet, t5
from .registry import (
    DEFAULT_MODEL,
    FAMILIES,
    LOSS,
    ModelConfig,
    ModelEntry,
    capture_preset,
    get,
    names,
    register,
)
from .moe import MoEConfig
from .resnet import ResNetConfig
from .t5 import T5Config

__all__ = [
    "DEFAULT_MODEL",
    "FAMILIES",
    "LOSS",
    "ModelConfig",
    "ModelEntry",
    "capture_preset",
    "MoEConfig",
    "ResNetConfig",
    "T5Config",
    "get",
    "names",
    "register",
    "moe",
    "resnet",
    "t5",
]
