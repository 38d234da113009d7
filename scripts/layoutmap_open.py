"""What GSPMD does where an exported LayoutMap leaves an activation open: a small block with
a residual sum inside its layer's ``call`` (as the zoo BERT's encoder layer has), exported
by TAPAS (the GraphNodes it lists as open, ``kind="activations"``) and compiled under
``ModelParallel`` on the JAX backend (the collectives of the train step, each with the JAX
operation it came from).

Two phases, two virtual environments (the JAX one optional, as in layoutmap_check.py):

  # 1. TensorFlow venv: capture, search (one V100 node of 8, the loss priced), export
  python scripts/layoutmap_open.py export
  # 2. JAX venv, 8 CPU devices: train one step under the exported layout, compile its train
  #    step, list its collectives by source op; write benchmarks/results/layoutmap_open.json
  PYTHONPATH=. KERAS_BACKEND=jax JAX_PLATFORMS=cpu \\
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
    ${TAPAS_XLA_VENV:-.venv-xla}/bin/python scripts/layoutmap_open.py check

The model: Dense 1024 -> 4096 -> 1024 (Megatron), then a layer computing
``norm(x + proj(x))`` inside its ``call`` (proj 1024 -> 1024), then another Megatron block;
batch 8, sequence 64. docs/export.md reads the result.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

B, S, H = 8, 64, 1024


def build() -> Any:
    """The block (see the module docstring), seeded."""
    import keras

    class Block(keras.layers.Layer):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.proj = keras.layers.Dense(H, name="proj")
            self.norm = keras.layers.LayerNormalization(name="norm")

        def call(self, x: Any) -> Any:
            return self.norm(x + self.proj(x))

    keras.utils.set_random_seed(0)
    inp = keras.Input((S, H), name="x")
    h = keras.layers.Dense(4 * H, activation="relu", name="up")(inp)
    h = Block(name="block")(keras.layers.Dense(H, name="down")(h))
    h = keras.layers.Dense(4 * H, activation="relu", name="up2")(h)
    return keras.Model(inp, keras.layers.Dense(H, name="down2")(h), name="residual_block")


def export(out_dir: str) -> None:
    import keras
    import tensorflow as tf

    from tapas import capturing
    from tapas.export import export_layout
    from tapas.planning.cluster import Cluster
    from tapas.planning.cost import CostOptions
    from tapas.planning.search import search
    from tapas.sharding.losses import LossSpec
    os.makedirs(out_dir, exist_ok=True)
    model = build()
    graph = capturing.capture(model, [tf.TensorSpec((B, S, H), tf.float32, name="x")],
                              training=True, name="residual_block")
    cluster = Cluster.resolve("v100", 1, 8)
    loss = keras.losses.MeanSquaredError()
    strategy = search(graph, cluster=cluster, loss=loss)
    layout = export_layout(strategy, graph, layers=model,
                           options=CostOptions.for_cluster(cluster, loss=LossSpec.of(loss)))
    layout.save(os.path.join(out_dir, "residual_block.json"))
    for u in layout.unexpressed:
        print(f"{u.kind}: {[n for _, n in u.nodes]}: chose {u.chosen}, open "
              f"{[(a, round(c * 1e3, 4)) for a, c in u.alternatives]} (ms)")


_OP = re.compile(r"=\s*(\S+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
                 r"collective-permute)(?:-start)?\(")


def _by_source(hlo: str) -> list[dict[str, Any]]:
    """(kind, result shape, the JAX op it came from) of every collective in ``hlo``."""
    out = []
    for line in hlo.splitlines():
        m = _OP.search(line)
        if m is None:
            continue
        name = re.search(r'op_name="([^"]*)"', line)
        source = name.group(1).split("jit(main)/")[-1] if name else ""
        out.append({"kind": m.group(2), "shape": m.group(1).split("{")[0],
                    "source": source, "phase": "bwd" if "transpose(" in source else
                    ("fwd" if source else "")})
    return out


def check(out_dir: str, result: str) -> None:
    import jax
    import keras
    import numpy as np

    import layoutmap_check as lc
    from tapas.export import load_layout
    layout = load_layout(os.path.join(out_dir, "residual_block.json"))
    lc._record_jit()
    distribution = keras.distribution.ModelParallel(
        layout_map=layout.to_keras(jax.devices()), batch_dim_name="batch")
    rng = np.random.default_rng(1)
    x, y = (rng.standard_normal((B, S, H)).astype("float32") for _ in range(2))
    with distribution.scope():
        model = build()
        losses, jitted = lc._fit(model, x, y, keras.losses.MeanSquaredError(), 1)
        hlo = lc._compiled_step(model, jitted, x, y)
    ran = _by_source(hlo)
    counted = Counter((r["kind"], r["shape"], r["source"]) for r in ran)
    for (kind, shape, source), n in sorted(counted.items()):
        print(f"{n} x {kind} {shape}  <- {source or '(no source recorded)'}")
    with open(result, "w") as f:
        json.dump({"jax": jax.__version__, "keras": keras.__version__, "devices": 8,
                   "batch": B, "seq": S, "hidden": H, "loss": losses,
                   "open": [u.to_json() for u in layout.unexpressed
                            if u.kind == "activations"],
                   "predicted": [dict(p) for p in layout.predicted],
                   "compiled": ran}, f, indent=1)
    print(f"written {result}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", choices=["export", "check"])
    parser.add_argument("--out_dir", default=os.path.join(ROOT, "out", "layoutmap"))
    parser.add_argument("--result", default=os.path.join(ROOT, "benchmarks", "results",
                                                         "layoutmap_open.json"))
    args = parser.parse_args()
    if args.phase == "export":
        export(args.out_dir)
    else:
        check(args.out_dir, args.result)


if __name__ == "__main__":
    main()
