"""Equivalence matrix: reconstructed training equals single-device Keras (issue 5).

    python scripts/equivalence.py [--devices=2,4]
        [--models=t5-tiny,moe-tiny,resnet-tiny,resnet50-keras]
        [--random=5] [--json_out=out/equivalence.json] [--timeout=6000]

For each device count (one worker process each: logical CPU devices are fixed per process)
and each model, runs the searched ("best", on a V100 cluster of N devices) strategy with SGD
and with Adam, and ``--random`` random valid plans (``tapas.execution.parallel.random_plan``, seeds
0..R-1, SGD for even seeds and Adam for odd ones). Each run compares outputs, gradients and
the weights after 3 optimizer steps with the single-device Keras model (rtol 1e-5, atol 1e-5
times the largest reference magnitude) and the collective audit with the prediction.
``resnet50-keras`` is keras.applications.ResNet50 at 32x32, batch 4, 10 classes (softmax
head, sparse crossentropy). Prints a table and writes JSON. Slow: every run traces the
program twice (about 30-90 s per run on 2 shared cores for the zoo models; ResNet50 takes
about 10 min for its 7 runs on 2 devices and 22 min on 4).
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tapas.execution import launch# noqa: E402

flags.DEFINE_list("devices", ["2", "4"], "Device counts.")
flags.DEFINE_list("models", ["t5-tiny", "moe-tiny", "resnet-tiny", "resnet50-keras"],
                  "Zoo models, or resnet50-keras (keras.applications.ResNet50).")
flags.DEFINE_integer("random", 5, "Random valid plans per model and device count.")
flags.DEFINE_string("json_out", "out/equivalence.json", "Where to write the results.")
flags.DEFINE_integer("timeout", 6000, "Seconds per worker process (one per device count).")
FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
    del argv
    worker = os.path.join(ROOT, "tests", "runtime_worker.py")
    rows, raw = [], {}
    for n in map(int, FLAGS.devices):
        zoo = []
        for model in FLAGS.models:
            odd = [f"random:{s}" for s in range(FLAGS.random) if s % 2]
            even = [f"random:{s}" for s in range(FLAGS.random) if s % 2 == 0]
            zoo.append({"model": model, "strategies": ["best", *even], "optimizer": "sgd"})
            zoo.append({"model": model, "strategies": ["best", *odd], "optimizer": "adam"})
        job = {"devices": n, "checks": ["zoo"], "zoo": zoo}
        start = time.perf_counter()
        (result,) = launch.launch(lambda i: [sys.executable, worker, json.dumps(job)], 1,
                                  timeout_s=FLAGS.timeout)
        seconds = time.perf_counter() - start
        for line in result.output.splitlines():
            if not line.startswith("RESULT "):
                continue
            d = json.loads(line[len("RESULT "):])
            for key, v in d.items():
                if key == "check":
                    continue
                raw[f"{n}/{key}"] = v
                rows.append((n, key, v))
        print(f"{n} devices: {seconds:.0f} s", flush=True)
    print(f"\n{'N':>2} {'model/strategy':<26} {'opt':<4} {'sharded':>7} {'out diff':>9} "
          f"{'grad diff':>9} {'weight diff':>11} {'audit':>6}  result")
    for n, key, v in rows:
        if "error" in v:
            print(f"{n:>2} {key:<26} {'':<4} {'':>7} {'':>9} {'':>9} {'':>11} {'':>6}  "
                  f"ERROR {v['error'][:80]}")
            continue
        print(f"{n:>2} {key:<26} {v['optimizer']:<4} {v['sharded_nodes']:>7} "
              f"{v['outputs']['max_abs_diff']:>9.1e} {v['gradients']['max_abs_diff']:>9.1e} "
              f"{v['weights']['max_abs_diff']:>11.1e} "
              f"{'same' if v['audit']['matches'] else 'DIFF':>6}  "
              f"{'ok' if v['ok'] else 'MISMATCH'}")
    d = os.path.dirname(FLAGS.json_out)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(FLAGS.json_out, "w") as f:
        json.dump(raw, f, indent=1, default=str)
    print(f"\nwritten to {FLAGS.json_out}")


if __name__ == "__main__":
    app.run(main)
