"""Progress bars for long work: capture, mining, search and training (``tapas`` commands).

In:  a label; then ``update(done, total, detail)`` calls as work advances (``total`` None
     when it is not known), or a blocking call wrapped in :meth:`ProgressBar.ticking`.
Out: one line on a terminal, rewritten in place: the label, a bar and the fraction done,
     the detail, the elapsed time and an ETA (``elapsed / done * (total - done)``); shown
     only once the work has run for ``delay`` seconds (2 by default), so quick work
     prints nothing, and redrawn at most 10 times a second. Off when the stream is not a
     terminal (a log file, a pipe, CI) unless ``TAPAS_PROGRESS=1``; ``TAPAS_PROGRESS=0``
     turns it off everywhere; ``TAPAS_PROGRESS_DELAY`` sets the delay in seconds.

This module imports no TensorFlow.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

__all__ = ["ProgressBar", "enabled_for", "format_seconds"]

_REDRAW_SECONDS = 0.1
_WIDTH = 100   # characters of the line (longer lines are cut)


def enabled_for(stream: Any) -> bool:
    """Whether progress is drawn on ``stream``: ``TAPAS_PROGRESS`` (``0`` off, ``1`` on)
    when set, else whether the stream is a terminal."""
    forced = os.environ.get("TAPAS_PROGRESS", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def format_seconds(s: float) -> str:
    """``42.0s``, ``3m05s``, ``1h02m``."""
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


class ProgressBar:
    """One progress line (module docstring). ``clock`` is for tests."""

    def __init__(self, label: str, total: int | None = None, *, stream: TextIO | None = None,
                 delay: float | None = None, enabled: bool | None = None, width: int = 24,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.total, self.width = label, total, width
        self.delay = float(os.environ.get("TAPAS_PROGRESS_DELAY", 2.0)) if delay is None \
            else delay
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled_for(self.stream) if enabled is None else enabled
        self.clock = clock
        self.start = clock()
        self.done = 0
        self.detail = ""
        self.shown = False
        self._drawn_at = -1.0
        self._phase_start = self.start
        self._lock = threading.Lock()

    # -- what the work reports ---------------------------------------------------------------

    def update(self, done: int, total: int | None = None, detail: str = "") -> None:
        """``done`` of ``total`` (the one given at construction when None) steps are done."""
        with self._lock:
            if total is not None:
                self.total = total
            self.done, self.detail = done, detail
            self._draw()

    def phase(self, label: str, total: int | None = None) -> None:
        """A new phase: another label and total, its ETA measured from now."""
        with self._lock:
            self.label, self.total, self.done, self.detail = label, total, 0, ""
            self._phase_start = self.clock()
            self._drawn_at = -1.0   # the next update draws the new phase at once

    def close(self) -> None:
        """End the line (if one was drawn), so that what is printed next starts afresh."""
        with self._lock:
            if self.shown:
                self.stream.write("\r" + " " * _WIDTH + "\r")
                self.stream.flush()
                self.shown = False

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @contextlib.contextmanager
    def ticking(self) -> Iterator[ProgressBar]:
        """Redraw the elapsed time while a blocking call runs in this thread (e.g. tracing
        a model: one call whose length is not known)."""
        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(_REDRAW_SECONDS * 5):
                with self._lock:
                    self._draw()

        thread = threading.Thread(target=tick, daemon=True)
        if self.enabled:
            with self._lock:
                self._draw()   # at once when there is no delay: the call may be quick
            thread.start()
        try:
            yield self
        finally:
            stop.set()
            if thread.is_alive():
                thread.join()
            self.close()

    # -- drawing ------------------------------------------------------------------------------

    def line(self) -> str:
        """The progress line as it would be drawn now."""
        now = self.clock()
        elapsed = now - self.start
        parts = [self.label]
        if self.total:
            frac = min(max(self.done / self.total, 0.0), 1.0)
            filled = int(round(frac * self.width))
            parts.append(f"[{'#' * filled}{'.' * (self.width - filled)}] "
                         f"{self.done:,}/{self.total:,}")
        elif self.done:
            parts.append(f"{self.done:,}")
        if self.detail:
            parts.append(self.detail)
        timing = format_seconds(elapsed)
        if self.total and 0 < self.done < self.total:
            phase = now - self._phase_start
            timing += f", ETA {format_seconds(phase / self.done * (self.total - self.done))}"
        parts.append(timing)
        return " ".join(parts)

    def _draw(self) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if now - self.start < self.delay or now - self._drawn_at < _REDRAW_SECONDS:
            return
        self._drawn_at = now
        self.stream.write("\r" + self.line()[:_WIDTH].ljust(_WIDTH))
        self.stream.flush()
        self.shown = True
