"""Launch K worker processes on 127.0.0.1 for ``MultiWorkerMirroredStrategy``, and always
clean them up.

In:  a command line per worker (``argv(i)``), K, a deadline.
Out: :class:`WorkerResult` per worker (exit code, output), or :class:`LaunchError` naming the
     worker that failed or hung.

:class:`JoinWatchdog` bounds how long a worker waits for the others to join.

Each worker gets ``TF_CONFIG`` with a cluster of K free loopback ports and its own task
index (``tapas.execution.runtime.devices.make_strategy`` reads it). Workers run in their own process groups;
when one fails, when the deadline passes, or when the caller is interrupted, every worker
still running is terminated, then killed — only these processes, by their own ids. If the
launcher itself dies (even by SIGKILL), the kernel kills its workers (Linux: the parent-death
signal, set in each worker before it starts), so no worker trains on unsupervised.
Each worker's environment also gets :data:`WORKER_ENV_DEFAULTS` (glibc's malloc limited to
two arenas) wherever the caller's environment and ``env`` do not set those variables.
This module imports no TensorFlow.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence

__all__ = ["free_ports", "tf_config_for", "launch", "WorkerResult", "LaunchError",
           "JoinWatchdog", "join_failure_message", "JOIN_TIMEOUT_EXIT",
           "WORKER_ENV_DEFAULTS"]

#: set in a worker's environment unless the caller's environment or ``env`` sets it:
#: glibc's malloc gives each thread that finds the others' arenas busy its own arena (up to
#: 8 per core), and memory freed in one arena cannot serve an allocation in another, so a
#: worker's ~100 TensorFlow and gRPC threads raise its peak (docs/running.md, *Memory*)
WORKER_ENV_DEFAULTS = {"MALLOC_ARENA_MAX": "2"}

#: exit code of a worker ended by its join watchdog
JOIN_TIMEOUT_EXIT = 75


class LaunchError(RuntimeError):
    """A worker failed, or did not finish before the deadline; ``worker`` and
    ``returncode`` name the one that exited non-zero (None after a deadline)."""

    worker: int | None = None
    returncode: int | None = None
    outputs: dict[int, str] = {}   # every worker's output so far, when one exited non-zero


@dataclasses.dataclass(frozen=True)
class WorkerResult:
    index: int
    returncode: int
    output: str          # stdout and stderr, interleaved
    seconds: float


def free_ports(k: int) -> list[int]:
    """``k`` distinct TCP ports free on 127.0.0.1 right now."""
    socks, ports = [], []
    try:
        for _ in range(k):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def tf_config_for(ports: Sequence[int], index: int) -> str:
    """The ``TF_CONFIG`` of worker ``index`` in a loopback cluster on ``ports``."""
    return json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                       "task": {"type": "worker", "index": index}})


def launch(argv: Callable[[int], Sequence[str]], num_workers: int, *, timeout_s: float = 300.0,
           env: Mapping[str, str] | None = None, ports: Sequence[int] | None = None,
           start: Sequence[int] | None = None) -> list[WorkerResult]:
    """Run ``argv(i)`` for every worker ``i`` (only those in ``start``, default all: leaving
    one out simulates a worker that never joins) and wait for all of them.

    Raises :class:`LaunchError` when a worker exits non-zero (the others are stopped) or when
    ``timeout_s`` passes (all are stopped); the message names the worker and ends with the
    tail of its output.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers={num_workers}: need at least 1 worker")
    ports = list(ports or free_ports(num_workers))
    start = list(range(num_workers) if start is None else start)
    procs: dict[int, tuple[subprocess.Popen, object, float]] = {}
    results: dict[int, WorkerResult] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for i in start:
            worker_env = {**WORKER_ENV_DEFAULTS, **os.environ, **(env or {}),
                          "TF_CONFIG": tf_config_for(ports, i)}
            # append mode: reading it while the worker writes (a lost one's peers) never
            # moves where the worker writes
            log = tempfile.TemporaryFile(mode="a+")
            proc = subprocess.Popen(list(argv(i)), env=worker_env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=_die_with(os.getpid()))
            procs[i] = (proc, log, time.monotonic())
        while len(results) < len(procs):
            for i, (proc, log, t0) in procs.items():
                if i in results or proc.poll() is None:
                    continue
                results[i] = WorkerResult(i, proc.returncode, _read(log), time.monotonic() - t0)
                if proc.returncode != 0:
                    error = LaunchError(f"worker {i} (127.0.0.1:{ports[i]}) exited with code "
                                        f"{proc.returncode}; the other workers were stopped. "
                                        f"Its output ends:\n{_tail(results[i].output)}")
                    error.worker, error.returncode = i, proc.returncode
                    error.outputs = {k: _read(log) for k, (_, log, _) in procs.items()}
                    raise error
            if len(results) < len(procs):
                if time.monotonic() > deadline:
                    hung = [i for i in procs if i not in results]
                    tails = "\n".join(f"--- worker {i}:\n{_tail(_read(procs[i][1]))}"
                                      for i in hung)
                    raise LaunchError(f"worker(s) {hung} did not finish within {timeout_s:.0f} s "
                                      f"and were stopped.\n{tails}")
                time.sleep(0.1)
    finally:
        _stop([p for i, (p, _, _) in procs.items()])
        for _, log, _ in procs.values():
            log.close()
    return [results[i] for i in sorted(results)]


_PR_SET_PDEATHSIG = 1


def _die_with(parent: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when ``parent`` (the
    launcher) dies, and ends the child at once if it already has; None where the kernel has
    no parent-death signal (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def arm() -> None:   # in the child, between fork and exec: no Python locks taken
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:   # the launcher died before the signal was armed
            os._exit(1)
    return arm


def _read(log: object) -> str:
    log.flush()
    log.seek(0)
    return log.read()


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _stop(procs: Sequence[subprocess.Popen], grace_s: float = 3.0) -> None:
    """Terminate, then kill, every process of ``procs`` still running (its own group)."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        _signal_group(p, signal.SIGTERM)
    end = time.monotonic() + grace_s
    for p in alive:
        try:
            p.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)   # the worker's own session, started by us
    except (ProcessLookupError, PermissionError):
        try:
            p.send_signal(sig)
        except ProcessLookupError:
            pass


# ---- joining a cluster -------------------------------------------------------------------------

def join_failure_message(cfg: Mapping, waited: float) -> str:
    """Which workers of ``TF_CONFIG`` ``cfg`` are missing (nothing listens at their address)."""
    task = cfg["task"]
    me = (task.get("type", "worker"), int(task.get("index", 0)))
    silent, listening = [], []
    for kind in ("chief", "worker"):
        for i, address in enumerate(cfg["cluster"].get(kind, [])):
            if (kind, i) == me:
                continue
            (listening if _port_open(address) else silent).append(f"{kind} {i} ({address})")
    if silent:
        return (f"{me[0]} {me[1]}: {', '.join(silent)} never joined the cluster within "
                f"{waited:.0f} s (nothing listens at that address); start it with its own "
                "TF_CONFIG task index, or raise the join timeout")
    return (f"{me[0]} {me[1]}: every worker listens ({', '.join(listening)}) but the cluster "
            f"did not form within {waited:.0f} s; check that all workers share the same "
            "TF_CONFIG cluster")


def _port_open(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


class JoinWatchdog:
    """Ends this process if it has not joined its cluster within ``timeout_s``.

    ``MultiWorkerMirroredStrategy()`` blocks inside TensorFlow, holding the GIL, until every
    worker joins, so no Python thread or signal handler of this process can run. The watchdog
    is a small child process (no TensorFlow): after ``timeout_s`` it prints which workers are
    missing (:func:`join_failure_message`) and kills this process (exit by SIGKILL; TF
    ignores SIGTERM while joining). :meth:`cancel` once the strategy exists.
    """

    def __init__(self, cfg: Mapping, timeout_s: float) -> None:
        code = ("import sys, json; from tapas.execution.runtime.launch import _watchdog_main; "
                "_watchdog_main(json.loads(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]))")
        self._proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(dict(cfg)),
                                       str(timeout_s), str(os.getpid())])

    def cancel(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()


def _watchdog_main(cfg: Mapping, timeout_s: float, parent: int) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if os.getppid() != parent:
            return  # the parent is gone
        time.sleep(0.2)
    message = join_failure_message(cfg, timeout_s)
    print(f"RESULT {json.dumps({'check': 'join', 'error': message})}", flush=True)
    print(f"tapas: WorkerTimeoutError: {message}", file=sys.stderr, flush=True)
    try:
        os.kill(parent, signal.SIGKILL)
    except ProcessLookupError:
        pass
