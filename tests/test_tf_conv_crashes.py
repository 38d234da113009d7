"""scripts/tf_conv_crashes.py: the map of TensorFlow's crashing convolutions that TAPAS's
replay works around (tapas/execution/replay.py, docs/tensorflow-notes.md)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "tf_conv_crashes.py")


def test_the_script_finds_the_1x1_stride_2_filter_gradient_crash_and_goes_on(tmp_path):
    """A slice of the grid: the filter gradient of a 1x1 convolution over one 32x32 image
    of 3 or 8 channels, at stride 1 and 2. With TensorFlow 2.21 and oneDNN on, the stride-2
    ones crash their child process (why TAPAS replays them as a slice; if an upgrade fixes
    TensorFlow, this test says so) and the script records them and goes on; the stride-1
    ones run."""
    out = tmp_path / "crashes.json"
    env = {k: v for k, v in os.environ.items() if k != "TF_ENABLE_ONEDNN_OPTS"}
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--ops=filter", "--kernels=1", "--strides=1,2",
         "--batches=1", "--channels=3,8", "--sizes=32", "--paddings=VALID", "--calls=200",
         f"--json_out={out}"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["configurations"] == 4
    crashed = [(c["config"]["stride"], c["config"]["channels"]) for c in report["crashes"]]
    assert all(stride == 2 for stride, _ in crashed), crashed
    assert proc.stdout.count("| filter | 1 | 2 | 1 |") == len(crashed) + len(report["errors"])
    if _measured_cpu():   # where the crash was measured it has happened every time
        assert crashed, proc.stdout


def _measured_cpu() -> bool:
    """Whether this is the kind of CPU the crash was measured on (x86 with AVX-512, where
    oneDNN picks the kernels that crash); elsewhere oneDNN takes other paths."""
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f" in f.read()
    except OSError:
        return False


def test_bad_grid_values_are_usage_errors_that_name_them():
    for flag, words in (("--ops=bogus", "unknown op 'bogus'"),
                        ("--kernels=1,x", "--kernels: 'x' is not a positive integer"),
                        ("--batches=0", "--batches: '0' is not a positive integer"),
                        ("--paddings=FULL", "unknown padding 'FULL'")):
        proc = subprocess.run([sys.executable, SCRIPT, flag], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode != 0 and words in proc.stderr, (flag, proc.stderr[-1000:])
