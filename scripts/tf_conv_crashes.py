"""Which small convolutions crash TensorFlow's CPU kernels (oneDNN) in this installation.

    python scripts/tf_conv_crashes.py [--ops=filter,input,dw_filter,dw_input,fwd]
        [--kernels=1,3,5] [--strides=1,2] [--batches=1,3] [--channels=1,2,3,4,8,12,16,24]
        [--sizes=7,8,14,16,32] [--paddings=SAME,VALID] [--calls=40]
        [--hang_seconds=120] [--json_out=out/tf_conv_crashes.json]

TensorFlow 2.21's oneDNN filter gradient of a 1x1 stride-2 convolution over an odd number of
images with few channels corrupts the heap (``docs/tensorflow-notes.md``); a plan that
splits the batch makes such shapes, so TAPAS's replay makes strided 1x1 convolutions as a
strided slice and a stride-1 convolution (``tapas/execution/program/replay.py``). This script maps
where such crashes are, to check the workaround still covers them after a TensorFlow
upgrade: every configuration of the grid (op x filter size x stride x batch x channels x
image size x padding; 48 output channels, NHWC) runs ``--calls`` times in a child process,
which writes the configuration it is about to run to a progress file first; when the child
dies of a signal, or makes no progress for ``--hang_seconds`` (a corrupted heap can also
leave it deadlocked: it is then killed), the configuration it was running is recorded as a
crash and a new child goes on after it; a configuration whose op raises TensorFlow's error
(oneDNN refusing a shape it should take: "could not create a primitive descriptor") is
recorded as an error and the child goes on. A heap corruption can surface an op or two late, so a crash is
evidence about its neighbourhood of the grid, not proof about one configuration. Prints the
crashes and errors as a table and writes them with the grid to ``--json_out``.

Ops: ``filter``/``input`` (Conv2D's two gradients), ``dw_filter``/``dw_input`` (the
depthwise convolution's), ``fwd`` (Conv2D itself).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from absl import app, flags

OPS = ("filter", "input", "dw_filter", "dw_input", "fwd")
COUT = 48

flags.DEFINE_list("ops", list(OPS), "Ops to run.")
flags.DEFINE_list("kernels", ["1", "3", "5"], "Filter sizes (square).")
flags.DEFINE_list("strides", ["1", "2"], "Strides (both spatial axes).")
flags.DEFINE_list("batches", ["1", "3"], "Numbers of images.")
flags.DEFINE_list("channels", ["1", "2", "3", "4", "8", "12", "16", "24"], "Input channels.")
flags.DEFINE_list("sizes", ["7", "8", "14", "16", "32"], "Image sizes (square).")
flags.DEFINE_list("paddings", ["SAME", "VALID"], "Paddings.")
flags.DEFINE_integer("calls", 40, "Calls of each configuration.")
flags.DEFINE_integer("hang_seconds", 120, "A child that stays on one configuration this long "
                     "is deadlocked (a corrupted heap can hang instead of crash): killed, and "
                     "that configuration recorded as a crash ('HANG').")
flags.DEFINE_string("json_out", "out/tf_conv_crashes.json", "Where to write the results.")
flags.DEFINE_string("child", None, "Internal: run the grid (a JSON file) from the progress "
                    "file.")
FLAGS = flags.FLAGS


def grid() -> list[tuple]:
    """Every configuration asked for, in a fixed order; VALID with a filter larger than
    the image is left out."""
    for op in FLAGS.ops:
        if op not in OPS:
            raise app.UsageError(f"--ops: unknown op {op!r}; one of {', '.join(OPS)}")
    if FLAGS.calls < 1:
        raise app.UsageError(f"--calls={FLAGS.calls}: run each configuration at least once")
    for pad in FLAGS.paddings:
        if pad not in ("SAME", "VALID"):
            raise app.UsageError(f"--paddings: unknown padding {pad!r}; SAME or VALID")
    out = []
    for op, k, s, b, c, hw, pad in itertools.product(
            FLAGS.ops, _sizes("kernels"), _sizes("strides"), _sizes("batches"),
            _sizes("channels"), _sizes("sizes"), FLAGS.paddings):
        if pad == "VALID" and hw < k:
            continue
        out.append((op, k, s, b, c, hw, pad))
    return out


def _sizes(flag: str) -> list[int]:
    """The positive integers of list flag ``--flag``, or a usage error naming the value."""
    out = []
    for v in getattr(FLAGS, flag):
        if not v.isdigit() or int(v) < 1:
            raise app.UsageError(f"--{flag}: {v!r} is not a positive integer "
                                 f"(e.g. --{flag}=1,3)")
        out.append(int(v))
    return out


def _named(config: tuple) -> dict:
    """A configuration as a dict keyed by the grid's axes."""
    return dict(zip(("op", "kernel", "stride", "batch", "channels", "size", "padding"), config))


def run_one(config: tuple, calls: int) -> None:
    """``calls`` runs of one configuration (in the child)."""
    import numpy as np
    import tensorflow as tf
    op, k, s, b, c, hw, pad = config
    o = -(-hw // s) if pad == "SAME" else (hw - k) // s + 1
    x = tf.constant(np.random.RandomState(0).rand(b, hw, hw, c), tf.float32)
    strides = [1, s, s, 1]
    for _ in range(calls):
        if op == "filter":
            tf.raw_ops.Conv2DBackpropFilter(input=x, filter_sizes=[k, k, c, COUT],
                                            out_backprop=tf.ones([b, o, o, COUT]),
                                            strides=strides, padding=pad)
        elif op == "input":
            tf.raw_ops.Conv2DBackpropInput(input_sizes=[b, hw, hw, c],
                                           filter=tf.ones([k, k, c, COUT]),
                                           out_backprop=tf.ones([b, o, o, COUT]),
                                           strides=strides, padding=pad)
        elif op == "dw_filter":
            tf.raw_ops.DepthwiseConv2dNativeBackpropFilter(
                input=x, filter_sizes=[k, k, c, 1], out_backprop=tf.ones([b, o, o, c]),
                strides=strides, padding=pad)
        elif op == "dw_input":
            tf.raw_ops.DepthwiseConv2dNativeBackpropInput(
                input_sizes=[b, hw, hw, c], filter=tf.ones([k, k, c, 1]),
                out_backprop=tf.ones([b, o, o, c]), strides=strides, padding=pad)
        else:
            tf.raw_ops.Conv2D(input=x, filter=tf.ones([k, k, c, COUT]), strides=strides,
                              padding=pad)


def child(job: str) -> None:
    """Run the grid from the index after the progress file's, writing each index first."""
    with open(job) as f:
        spec = json.load(f)
    configs, progress = [tuple(c) for c in spec["grid"]], spec["progress"]
    with open(progress) as f:
        start = int(f.read().split()[0]) + 1
    import tensorflow as tf
    for i in range(start, len(configs)):
        _write(progress, f"{i}\n")
        try:
            run_one(configs[i], spec["calls"])
        except tf.errors.OpError as e:   # oneDNN refusing a shape it should take
            with open(spec["errors"], "a") as f:
                f.write(json.dumps({"index": i, "error": f"{type(e).__name__}: "
                                    f"{e.message.splitlines()[0][:300]}"}) + "\n")
    _write(progress, f"{len(configs)} done\n")


def _progress(path: str) -> list[str]:
    with open(path) as f:
        return f.read().split()


def run_watched(cmd: list[str], progress: str, env: dict[str, str], log: str,
                hang_seconds: float) -> tuple[int, str, bool]:
    """Run ``cmd`` (a child) until it exits, or kill it when the ``progress`` file stays
    the same for ``hang_seconds``: (exit code, its stderr, whether it hung)."""
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True,
                                env=env)
        seen, since, hung = None, time.monotonic(), False
        while proc.poll() is None:
            time.sleep(0.2)
            now = _progress(progress)
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since > hang_seconds:
                proc.kill()
                proc.wait()
                hung = True
    with open(log) as f:
        return proc.returncode, f.read(), hung


def _write(path: str, text: str) -> None:
    """``text`` into ``path`` at once (a process dying mid-write leaves the old text)."""
    with open(path + ".new", "w") as f:
        f.write(text)
    os.replace(path + ".new", path)


def main(argv: list[str]) -> None:
    if FLAGS.child:
        child(FLAGS.child)
        return
    configs = grid()
    crashes, start = [], time.perf_counter()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    with tempfile.TemporaryDirectory() as tmp:
        progress = os.path.join(tmp, "progress")
        with open(progress, "w") as f:
            f.write("-1\n")
        job, errors = os.path.join(tmp, "job.json"), os.path.join(tmp, "errors.jsonl")
        open(errors, "w").close()
        with open(job, "w") as f:
            json.dump({"grid": configs, "progress": progress, "calls": FLAGS.calls,
                       "errors": errors}, f)
        print(f"running {len(configs)} configurations x {FLAGS.calls} calls in child "
              "processes (a line per crash)", flush=True)
        last = None
        while True:
            code, stderr, hung = run_watched(
                [sys.executable, os.path.abspath(__file__), "--child", job], progress, env,
                os.path.join(tmp, "stderr"), FLAGS.hang_seconds)
            words = _progress(progress)
            if words[1:] == ["done"]:
                break
            i = int(words[0])
            if (code >= 0 and not hung) or i == last:   # an error of the script or its start
                raise SystemExit(f"the child failed (exit {code}"
                                 + (f", no progress for {FLAGS.hang_seconds} s" if hung else "")
                                 + ") " + (f"at configuration {configs[i]}" if i != last else
                                           "before running any configuration")
                                 + f":\n{stderr[-2000:]}")
            last = i
            crashes.append({"config": _named(configs[i]),
                            "signal": "HANG" if hung else signal.Signals(-code).name})
            print(f"crash {len(crashes)}: {configs[i]} ({crashes[-1]['signal']})", flush=True)
        with open(errors) as f:
            failed = [{"config": _named(configs[r["index"]]), "error": r["error"]}
                      for r in map(json.loads, f)]
    seconds = time.perf_counter() - start
    print(f"\n{len(configs)} configurations, {len(crashes)} crashed, {len(failed)} raised an "
          f"error, {seconds:.0f} s; "
          f"TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS', 'unset')}")
    print("| op | kernel | stride | batch | channels | size | padding | what |")
    print("|---|---|---|---|---|---|---|---|")
    for c in crashes + failed:
        what = c.get("signal") or c["error"][:120]
        print("| " + " | ".join(str(v) for v in c["config"].values()) + f" | {what} |")
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json_out)), exist_ok=True)
    with open(FLAGS.json_out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "calls": FLAGS.calls,
                   "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset"),
                   "grid": {k: getattr(FLAGS, k) for k in ("ops", "kernels", "strides",
                                                           "batches", "channels", "sizes",
                                                           "paddings")},
                   "configurations": len(configs), "seconds": seconds,
                   "crashes": crashes, "errors": failed}, f, indent=1)
    print(f"written to {FLAGS.json_out}")


if __name__ == "__main__":
    app.run(main)
