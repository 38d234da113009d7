"""scripts/tf_conv_crashes.py: the map of TensorFlow's crashing convolutions that TAPAS's
replay works around (tapas/execution/program/replay.py, docs/tensorflow-notes.md)."""

import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "tf_conv_crashes.py")


def test_the_script_finds_the_1x1_stride_2_filter_gradient_crash_and_goes_on(tmp_path):
    """A slice of the grid: the filter gradient of a 1x1 convolution over one 32x32 image
    of 3 or 8 channels, at stride 1 and 2. With TensorFlow 2.21 and oneDNN on, the stride-2
    ones crash (or, rarely, deadlock) their child process (why TAPAS replays them as a
    slice; if an upgrade fixes TensorFlow, this test says so) and the script records them
    and goes on; the stride-1 ones run."""
    out = tmp_path / "crashes.json"
    env = {k: v for k, v in os.environ.items() if k != "TF_ENABLE_ONEDNN_OPTS"}
    # its own process group: on a timeout the script's child goes too
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, "--ops=filter", "--kernels=1", "--strides=1,2",
         "--batches=1", "--channels=3,8", "--sizes=32", "--paddings=VALID", "--calls=200",
         "--hang_seconds=60", f"--json_out={out}"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["configurations"] == 4
    crashed = [(c["config"]["stride"], c["config"]["channels"]) for c in report["crashes"]]
    assert all(stride == 2 for stride, _ in crashed), crashed
    assert stdout.count("| filter | 1 | 2 | 1 |") == len(crashed) + len(report["errors"])
    if _measured_cpu():   # where the crash was measured it has happened every time
        assert crashed, stdout


def test_a_child_that_makes_no_progress_is_killed_as_a_hang(tmp_path):
    """A corrupted heap can deadlock the child instead of crashing it (seen once in CI:
    the stride-2 configuration sat on a futex for 10 minutes): the parent kills a child
    whose progress file stays the same for ``--hang_seconds`` and records a hang; a child
    that writes progress and exits is left alone."""
    progress, log = tmp_path / "progress", str(tmp_path / "stderr")
    progress.write_text("0\n")
    writes = (f"import os, time\nfor i in range(1, 4):\n    time.sleep(0.6)\n"
              f"    open({str(progress)!r} + '.n', 'w').write(f'{{i}}\\n')\n"
              f"    os.replace({str(progress)!r} + '.n', {str(progress)!r})\n")
    # the script defines absl flags: load it in a fresh interpreter, not in this one
    driver = (
        "import importlib.util, json, os, sys, time\n"
        f"spec = importlib.util.spec_from_file_location('probe', {SCRIPT!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "out = []\n"
        f"for code in ('import time; time.sleep(60)', {writes!r}):\n"
        "    t = time.monotonic()\n"
        f"    c, _, hung = m.run_watched([sys.executable, '-c', code], {str(progress)!r},\n"
        f"                               dict(os.environ), {log!r}, 1.0)\n"
        "    out.append([c, hung, time.monotonic() - t])\n"
        "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (code, hung, seconds), (code2, hung2, _) = json.loads(proc.stdout.splitlines()[-1])
    assert hung and code < 0 and seconds < 30          # killed after 1 s without progress
    assert (code2, hung2) == (0, False) and progress.read_text() == "3\n"


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
