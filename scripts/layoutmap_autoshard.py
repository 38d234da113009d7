"""XLA's automatic sharding as a third plan beside the exported LayoutMap and DataParallel
(``scripts/layoutmap_check.py``): the layouts XLA's auto-sharding pass chose for a model's
training step, read from a compile for a described TPU topology and laid out on the 8 CPU
devices as a Keras ``LayoutMap``.

On the CPU backend jax accepts ``AUTO`` shardings but does not run the pass (every input
comes back replicated, /work/shared/BASELINES.md); it runs when compiling for a described
TPU v5e topology, where nothing executes. So, per model, in its own subprocess of the JAX
venv (libtpu, ``TPU_ACCELERATOR_TYPE``; the pass can abort the process):

  1. ``solve``: build the model as the check does, trace one SGD training step (the
     model's loss of ``stateless_call(training=True)``, ``jax.grad``, ``w - lr * g``),
     jit it with every input (the trainable weights, the inputs, the targets) and every
     output ``AUTO`` on a 1-D mesh of the topology's 8 chips, compile (XLA's default
     memory budget), and write the shardings the solver chose for each weight, input and
     updated weight, and the collectives of the TPU program, to ``out/layoutmap/NAME.auto.json``;
  2. ``auto_layout`` (standard library only: the tests call it): those shardings as a
     Keras layout on the same 8 devices, ``DeviceMesh((1, 8), ["batch", "model"])``, the
     solver's one mesh axis as ``model``: each weight the solver split keyed by its escaped
     Keras path, and each input's layout (the solver may split the data on any axis, e.g.
     the tokens on the sequence) given by ``data_layouts`` to ``AutoParallel``
     (``layoutmap_check.py``), a ``ModelParallel`` whose ``get_data_layout`` returns it.
     What has no such form (a tensor split on several axes or fewer ways, two inputs of
     one shape split differently, an updated weight the solver returns in another layout
     than it takes) is listed under ``unmapped`` with why and left as Keras would
     (replicated where it has no key).

The check then trains and times that layout with Keras's ``ModelParallel`` exactly as it
does the exported one: what runs is the solver's weight and input layouts with GSPMD's
sharding propagation choosing everything inside, not the solver's own intermediate layouts
(its TPU program's collectives are recorded beside the CPU program's).

    .venv-xla/bin/python scripts/layoutmap_autoshard.py --models=hub-bert
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPOLOGY, ACCELERATOR_TYPE = "v5e:2x4", "v5litepod-8"
LEARNING_RATE = 0.01          # the check's SGD(0.01)


# ---- the translation (standard library only) ---------------------------------------------

def _split(ways: Sequence[int], devices: int) -> tuple[int | None, str | None]:
    """(the axis split ``devices`` ways or None when not split, why there is no 1-D form)."""
    split = [i for i, w in enumerate(ways) if w > 1]
    if not split:
        return None, None
    if len(split) == 1 and ways[split[0]] == devices:
        return split[0], None
    return None, (f"split {' x '.join(str(ways[i]) for i in split)} ways on axes {split}: "
                  f"not one axis over the {devices} devices")


def _axes(ways: Sequence[int], devices: int, what: str, unmapped: dict[str, str]
          ) -> tuple[Any, ...] | None:
    """The layout axes of a tensor split ``ways`` (None: replicated, or no 1-D form)."""
    axis, why = _split(ways, devices)
    if why:
        unmapped[what] = why + "; replicated here"
    if axis is None:
        return None
    axes: list[str | None] = [None] * len(ways)
    axes[axis] = "model"
    return tuple(axes)


def auto_layout(solved: Mapping[str, Any], devices: int = 8) -> dict[str, Any]:
    """The Keras layout of a solve (``solve``'s JSON: ``weights``/``updated`` path ->
    ``{"shape", "ways"}``, ``inputs`` name -> the same): ``mesh_shape`` ``(1, devices)``,
    ``layouts`` (escaped path -> axes over ``"model"``), ``weights`` (path -> TAPAS
    placement ``"S<k>"``), ``replicated`` (paths), ``data_layouts`` (input shape -> axes,
    the replicated ones included), ``data`` (input name -> axes or None) and ``unmapped``
    (what -> why; see the module docstring)."""
    unmapped: dict[str, str] = {}
    data: dict[str, Any] = {}
    data_layouts: dict[tuple[int, ...], Any] = {}
    for name, s in solved["inputs"].items():
        axes = data[name] = _axes(s["ways"], devices, f"input {name}", unmapped)
        axes = axes or (None,) * len(s["shape"])
        shape = tuple(s["shape"])
        if data_layouts.setdefault(shape, axes) != axes:
            unmapped[f"input {name}"] = (f"laid out {axes}, another input of shape {shape} "
                                         f"{data_layouts[shape]}: Keras gives the data a "
                                         "layout by shape; the first is used")
    layouts, weights, replicated = {}, {}, []
    for path, s in solved["weights"].items():
        out = solved.get("updated", {}).get(path)
        if out is not None and list(out["ways"]) != list(s["ways"]):
            unmapped[f"updated {path}"] = (f"taken split {s['ways']} ways, returned "
                                           f"{out['ways']}: Keras keeps one layout per weight, "
                                           "the taken one is used")
        axes = _axes(s["ways"], devices, path, unmapped)
        if axes is None:
            replicated.append(path)
            continue
        layouts[re.escape(path)] = axes
        weights[path] = f"S{axes.index('model')}"
    return {"mesh_shape": (1, devices), "axis_names": ("batch", "model"),
            "layouts": layouts, "weights": weights, "replicated": tuple(replicated),
            "data_layouts": data_layouts, "data": data, "unmapped": unmapped}


def layout_export(name: str, solved: Mapping[str, Any], devices: int = 8) -> Any:
    """``auto_layout`` as a :class:`tapas.export.LayoutExport` (``to_keras`` builds it)."""
    from tapas.export.layouts import LayoutExport
    t = auto_layout(solved, devices)
    return LayoutExport(name, "", f"xla-auto {TOPOLOGY}", t["mesh_shape"], t["layouts"],
                        t["weights"], t["replicated"], axis_names=t["axis_names"])


# ---- the solve (JAX venv with libtpu, one subprocess per model) ---------------------------

def _ways(sharding: Any, shape: Sequence[int]) -> list[int]:
    shard = sharding.shard_shape(tuple(shape))
    return [int(a) // int(b) for a, b in zip(shape, shard)]


def _worker(name: str, solver_timeout: int) -> dict[str, Any]:
    os.environ["KERAS_BACKEND"] = "jax"
    import jax
    import jax.numpy as jnp
    import keras
    jax.config.update("jax_use_shardy_partitioner", False)   # True aborts (jax 0.6.2)
    from jax.experimental import topologies
    from jax.experimental.pjit import AUTO

    import layoutmap_check as check
    keras.backend.clear_session()
    model, inputs, targets, loss_fn, _ = check.build(name)
    mesh = topologies.make_mesh(topologies.get_topology_desc(TOPOLOGY, "tpu"),
                                (check.DEVICES,), ("x",))
    S = jax.ShapeDtypeStruct
    tv = [S(v.shape, v.dtype) for v in model.trainable_variables]
    ntv = [v.value for v in model.non_trainable_variables]
    xs = jax.tree.map(lambda a: S(a.shape, jnp.dtype(a.dtype)), inputs)
    y = S(targets.shape, jnp.dtype(targets.dtype))

    def loss(p, xs, y):
        out, _ = model.stateless_call(p, ntv, xs, training=True)
        return loss_fn(y, out)

    def step(p, xs, y):
        grads = jax.grad(loss)(p, xs, y)
        return [w - LEARNING_RATE * g for w, g in zip(p, grads)]

    auto = AUTO(mesh)
    jitted = jax.jit(step, in_shardings=jax.tree.map(lambda _: auto, (tv, xs, y)),
                     out_shardings=auto)
    start = time.perf_counter()
    compiled = jitted.lower(tv, xs, y).compile(compiler_options={
        "xla_tpu_auto_spmd_partitioning_solver_timeout_seconds": solver_timeout})
    seconds = time.perf_counter() - start
    (w_in, x_in, y_in), _ = compiled.input_shardings
    paths = [v.path for v in model.trainable_variables]
    x_named = jax.tree_util.tree_flatten_with_path(xs)[0]
    row = {"model": name, "topology": TOPOLOGY, "mesh": [check.DEVICES],
           "solver_timeout": solver_timeout, "memory_budget": "XLA default (ratio 1.1)",
           "compile_s": round(seconds, 2),
           "weights": {p: {"shape": list(s.shape), "ways": _ways(sh, s.shape)}
                       for p, s, sh in zip(paths, tv, w_in)},
           "updated": {p: {"shape": list(s.shape), "ways": _ways(sh, s.shape)}
                       for p, s, sh in zip(paths, tv, compiled.output_shardings)},
           "inputs": {jax.tree_util.keystr(k) or "x": {"shape": list(s.shape),
                                                       "ways": _ways(sh, s.shape)}
                      for (k, s), sh in zip(x_named, jax.tree.leaves(x_in))}}
    row["inputs"]["targets"] = {"shape": list(y.shape), "ways": _ways(y_in, y.shape)}
    row["tpu_collectives"] = check.hlo_collectives(compiled.as_text())
    return row


def solve(names: Sequence[str], out_dir: str, solver_timeout: int, timeout: float) -> None:
    """One subprocess per model (``--worker``); writes ``<out_dir>/<name>.auto.json`` or,
    when the compile fails or runs past ``timeout`` wall seconds, says so and writes nothing."""
    os.makedirs(out_dir, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env.update(KERAS_BACKEND="jax", TPU_ACCELERATOR_TYPE=ACCELERATOR_TYPE,
               TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    for name in names:
        path = os.path.join(out_dir, f"{name}.auto.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"--models={name}",
               f"--solver_timeout={solver_timeout}"]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"{name}: XLA auto-sharding compile ran past {timeout:.0f} s "
                  "(--timeout)", flush=True)
            continue
        rows = [ln[len("RESULT "):] for ln in proc.stdout.splitlines()
                if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not rows:
            tail = " | ".join(proc.stderr.strip().splitlines()[-4:])[-800:]
            print(f"{name}: XLA auto-sharding failed (exit {proc.returncode}): {tail}",
                  flush=True)
            continue
        with open(path, "w") as f:
            f.write(rows[-1])
        t = auto_layout(json.loads(rows[-1]))
        print(f"{name}: XLA auto-sharding {time.perf_counter() - start:.0f} s: data "
              f"{t['data']}, {len(t['layouts'])} weights split, {len(t['replicated'])} "
              f"replicated, {len(t['unmapped'])} unmapped -> {path}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="t5-small-2l,bert-base-2l,hub-bert,hub-gpt2,"
                                            "hub-llama")
    parser.add_argument("--out_dir", default=os.path.join(ROOT, "out", "layoutmap"))
    parser.add_argument("--solver_timeout", type=int, default=60,
                        help="xla_tpu_auto_spmd_partitioning_solver_timeout_seconds")
    parser.add_argument("--timeout", type=float, default=900.0, help="wall seconds a model")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = [n for n in args.models.split(",") if n]
    if args.worker:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        print("RESULT " + json.dumps(_worker(names[0], args.solver_timeout)), flush=True)
    else:
        solve(names, args.out_dir, args.solver_timeout, args.timeout)


if __name__ == "__main__":
    main()
