"""tapas.progress: the progress line (bar, ETA, delay, redraw rate, off a terminal) and its
use by the commands (``tapas mine`` / ``search`` with ``TAPAS_PROGRESS=1``)."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from tapas.progress import ProgressBar, enabled_for, format_seconds


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_eta_and_delay() -> None:
    clock, out = Clock(), Terminal()
    bar = ProgressBar("stitching", 10, stream=out, delay=2.0, clock=clock)
    bar.update(1)
    assert out.getvalue() == ""   # quick work shows nothing
    clock.t += 4.0
    bar.update(4, detail="1,234 candidates")
    line = out.getvalue().split("\r")[-1].rstrip()
    # 4 of 10 in 4 s: 6 more steps at 1 s each
    assert line == "stitching [##########..............] 4/10 1,234 candidates 4.0s, ETA 6.0s"
    clock.t += 0.01
    bar.update(5)   # within 0.1 s of the last redraw: not drawn again
    assert out.getvalue().count("\r") == 1
    bar.close()
    assert out.getvalue().endswith("\r") and not bar.shown


def test_unknown_total_phases_and_format() -> None:
    clock, out = Clock(), Terminal()
    bar = ProgressBar("mining", stream=out, delay=0.0, clock=clock)
    bar.update(3, None, "level 3")
    assert "mining 3 level 3 0.0s" in out.getvalue()
    clock.t += 10
    bar.phase("references", 4)
    clock.t += 2
    bar.update(1)
    assert out.getvalue().split("\r")[-1].rstrip().endswith("1/4 12.0s, ETA 6.0s")
    assert [format_seconds(s) for s in (4.25, 185, 3725)] == ["4.2s", "3m05s", "1h02m"]


def test_off_when_not_a_terminal(monkeypatch) -> None:
    monkeypatch.delenv("TAPAS_PROGRESS", raising=False)
    assert not enabled_for(io.StringIO()) and enabled_for(Terminal())
    out = io.StringIO()
    ProgressBar("x", 2, stream=out, delay=0.0).update(1)
    assert out.getvalue() == ""
    monkeypatch.setenv("TAPAS_PROGRESS", "0")
    assert not enabled_for(Terminal())
    monkeypatch.setenv("TAPAS_PROGRESS", "1")
    assert enabled_for(io.StringIO())


def test_ticking_redraws_the_elapsed_time_of_a_blocking_call() -> None:
    import time
    out = Terminal()
    with ProgressBar("tracing 'm'", stream=out, delay=0.0).ticking():
        time.sleep(1.2)
    assert "tracing 'm'" in out.getvalue() and out.getvalue().count("\r") >= 2


def test_ticking_draws_a_quick_call_at_once_without_delay_but_not_with_one() -> None:
    """A call shorter than the redraw tick (tracing a model that is in a cache) still shows
    its line when there is no delay; with the default delay quick work prints nothing."""
    out = Terminal()
    with ProgressBar("tracing 'q'", stream=out, delay=0.0).ticking():
        pass
    assert "tracing 'q'" in out.getvalue()
    out = Terminal()
    with ProgressBar("tracing 'q'", stream=out, delay=2.0).ticking():
        pass
    assert out.getvalue() == ""


@pytest.mark.parametrize("command,phase", [("mine", "mining"), ("search", None)])
def test_commands_show_progress_on_stderr_when_asked(command: str, phase: str | None) -> None:
    """With TAPAS_PROGRESS=1 (as on a terminal; no delay) the tracing, graph-reading and
    mining lines appear on stderr and stdout keeps only the report (the search reports
    every 2 s, so a quick one draws no line of its own: tests/test_search.py checks its
    line); with TAPAS_PROGRESS=0 stderr has no bar."""
    args = [sys.executable, "-m", "tapas.cli", command, "--model=t5-tiny"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TAPAS_PROGRESS_DELAY="0")
    def run(progress: str) -> tuple[str, str]:   # bytes: text mode would turn \r into \n
        proc = subprocess.run(args, capture_output=True, timeout=120,
                              env=dict(env, TAPAS_PROGRESS=progress))
        out, err = proc.stdout.decode(), proc.stderr.decode()
        assert proc.returncode == 0, err
        return out, err

    out, err = run("1")
    assert "\r" not in out
    assert "\rtracing 't5-tiny'" in err and "\rreading the graph" in err
    assert phase is None or "\r" + phase in err, err[-2000:]
    out, err = run("0")
    assert "\r" not in err
