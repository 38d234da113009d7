"""Baseline: XLA's automatic sharding pass (Alpa's intra-op ILP, maintained) on zoo presets.

    .venv-xla/bin/python scripts/baselines/xla_autoshard.py --models=t5-tiny,resnet-tiny
        [--devices=8] [--solver_timeout=60] [--memory_budget_ratio=1.1 | --memory_budget_gb=G]
        [--timeout=600] [--json_out=out/xla_autoshard.json] [--log_dir=out/xla_logs]

Runs in the optional baseline environment made by ``scripts/baselines/setup.sh`` (jax 0.6.2,
libtpu 0.0.17, Keras 3 with the JAX backend; what the pass does and how it is timed:
``docs/paper.md``, Figure 6). For every preset, in its own subprocess under a wall
``--timeout``: build the zoo model with ``KERAS_BACKEND=jax``, trace forward + backward
(``jax.grad`` of the sparse cross-entropy of the logits, inference-mode forward), and compile
it with every input (trainable weights, inputs, targets) sharded ``AUTO`` on a 1-D mesh of
``--devices`` chips of a described TPU v5e topology. Nothing executes: libtpu compiles
for the topology on this CPU machine.

The number reported as the search time is the auto-sharding pass alone, as the paper times
Alpa "excluding framework initialization": the libtpu log's timestamp of "Starting the auto
sharding pass" to that of "Auto Sharding took N seconds". Also parsed from the log: solver
status, ILP variable and node counts, objective, solver time, the memory lower bound and the
options the pass ran with (mesh shape, solver timeout, memory budget). The memory budget is
XLA's default (``xla_tpu_auto_spmd_partitioning_memory_budget_ratio`` 1.1 x the per-device
memory lower bound) unless a flag says otherwise; the JSON records which.

The log parser (:func:`parse_autoshard_log`) imports nothing outside the standard library, so
the TAPAS venv and the tests use it without jax.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir))
TOPOLOGY = "v5e:2x4"           # 8 chips; ``--devices`` must divide it
ACCELERATOR_TYPE = "v5litepod-8"
DEFAULT_BUDGET_RATIO = 1.1     # XLA's default xla_tpu_auto_spmd_partitioning_memory_budget_ratio

_GLOG = re.compile(r"^[IWEF](\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})\.(\d{6})\s+\d+\s+\S+\]\s?(.*)$")


def _seconds(m: re.Match) -> float:
    _, _, hh, mm, ss, us = (int(g) for g in m.groups()[:6])
    return hh * 3600 + mm * 60 + ss + us / 1e6


def parse_autoshard_log(text: str) -> dict:
    """Pass time and solver facts from libtpu's glog text (stderr or ``tpu_driver.INFO``).

    Returns ``passes`` (one dict per "Starting the auto sharding pass": ``seconds`` measured
    between the two timestamps, ``reported_s`` the truncated number libtpu prints), ``pass_s``
    (their sum), and the per-solve lists ``statuses``, ``ilp_variables``, ``ilp_nodes``,
    ``solver_ms``, ``objectives``, ``mesh_shapes`` (partial mesh shapes solved), plus
    ``memory_bytes`` / ``memory_lower_bound_bytes`` / ``memory_budget_bytes`` of the last
    solve and, in ``options``, the option dump's ``device_mesh_shape``,
    ``solver_timeout_in_seconds``, ``memory_budget_per_device`` and ``memory_budget_ratio``.
    Lines without a glog prefix are read as the continuation of the message above. ``pass_s`` is None when no pass started and finished.
    """
    passes: list[dict] = []
    out: dict = {"statuses": [], "ilp_variables": [], "ilp_nodes": [], "solver_ms": [],
                 "objectives": [], "mesh_shapes": [], "options": {}}
    start = None
    for line in text.splitlines():
        m = _GLOG.match(line.strip())
        # A line without a glog prefix continues the message above it (the option dump and
        # the solver's problem summary, e.g. "Number variables for ILP: N", are printed so).
        msg = m.group(7) if m else line.strip()
        if m and "Starting the auto sharding pass" in msg:
            start = _seconds(m)
        elif m and (took := re.search(r"Auto Sharding took (\d+(?:\.\d+)?) seconds", msg)):
            if start is not None:
                dt = _seconds(m) - start
                if dt < 0:      # the pass ran over midnight (glog stamps carry no date wrap)
                    dt += 86400
                passes.append({"seconds": round(dt, 6), "reported_s": float(took.group(1))})
                start = None
        elif (v := re.search(r"Number variables for ILP: (\d+)", msg)):
            out["ilp_variables"].append(int(v.group(1)))
        elif (v := re.search(r"Solver absl::Status: (\w+)", msg)):
            out["statuses"].append(v.group(1))
        elif (v := re.match(r"Objective value: ([-+0-9.eE]+)", msg)):
            out["objectives"].append(float(v.group(1)))
        elif (v := re.search(r"Solver took (\d+) ms", msg)):
            out["solver_ms"].append(int(v.group(1)))
        elif (v := re.search(r"Processing partial mesh shape: (\[[^\]]*\])", msg)):
            out["mesh_shapes"].append(v.group(1))
        elif (v := re.search(r"Total Maximum Memory: (\d+) \(lower bound: (\d+)\)", msg)):
            out["memory_bytes"] = int(v.group(1))
            out["memory_lower_bound_bytes"] = int(v.group(2))
        elif (v := re.search(r"Using memory budget: (\d+)", msg)):
            out["memory_budget_bytes"] = int(v.group(1))
        elif (v := re.fullmatch(r"N = (\d+)", msg)):
            out["ilp_nodes"].append(int(v.group(1)))
        elif (v := re.fullmatch(r"(device_mesh_shape|solver_timeout_in_seconds|"
                                r"memory_budget_per_device|memory_budget_ratio): (.+)", msg)):
            out["options"][v.group(1)] = v.group(2)
    out["passes"] = passes
    out["pass_s"] = round(sum(p["seconds"] for p in passes), 6) if passes else None
    out["status"] = out["statuses"][-1] if out["statuses"] else None
    return out


# --------------------------------------------------------------------------- #
# Worker: one compile, in the baseline venv (jax imported here only)
# --------------------------------------------------------------------------- #


def tapas_placements(shardings: dict, devices: int) -> tuple[dict, dict]:
    """XLA's parameter shardings (``weight_shardings`` of a result row: path -> split axes
    and ways) as TAPAS placements on a 1-D mesh of ``devices``: ``"R"`` (not split),
    ``"S<axis>"`` (one axis split ``devices`` ways), and, apart, the parameters no 1-D
    placement describes (split on several axes, or fewer ways with the rest replicated)
    with why. Standard library only: the TAPAS venv calls it."""
    placements, unmapped = {}, {}
    for path, s in shardings.items():
        axes, ways = list(s["axes"]), list(s["ways"])
        if not axes:
            placements[path] = "R"
        elif len(axes) == 1 and ways[0] == devices:
            placements[path] = f"S{axes[0]}"
        else:
            unmapped[path] = (f"XLA splits it {' x '.join(str(w) for w in ways)} ways on axes "
                              f"{axes} of {s['shape']}: not a 1-D placement over {devices}")
    return placements, unmapped


def _worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", ACCELERATOR_TYPE)
    os.environ["KERAS_BACKEND"] = "jax"
    sys.path.insert(0, ROOT)
    import jax
    import jax.numpy as jnp
    import keras
    jax.config.update("jax_use_shardy_partitioner", False)   # True: the process aborts (jax 0.6.2)
    from jax.experimental import topologies
    from jax.experimental.pjit import AUTO
    if keras.backend.backend() != "jax":
        raise RuntimeError(f"Keras backend is {keras.backend.backend()!r}, need 'jax': set "
                           "KERAS_BACKEND=jax before anything imports keras.")
    from models import registry

    entry = registry.get(args.model)
    result = {"model": args.model, "param_count": entry.param_count()}
    t0 = time.perf_counter()
    model = entry.build(fast_init=True)
    result["build_s"] = round(time.perf_counter() - t0, 3)
    inputs, targets = entry.synthetic_batch(args.batch_size)
    result["batch_size"] = int(inputs[0].shape[0])

    topo = topologies.get_topology_desc(TOPOLOGY, "tpu")
    mesh = topologies.make_mesh(topo, (args.devices,), ("x",))
    S = jax.ShapeDtypeStruct
    tv = [S(v.shape, v.dtype) for v in model.trainable_variables]
    ntv = [v.value for v in model.non_trainable_variables]
    xs = [S(a.shape, jnp.dtype(a.dtype)) for a in inputs]
    y = S(targets.shape, jnp.dtype(targets.dtype))
    loss_fn = entry.keras_loss()

    def loss(tvs, xs, y):
        logits, _ = model.stateless_call(tvs, ntv, list(xs), training=False)
        return loss_fn(y, logits)

    auto = AUTO(mesh)
    step = jax.jit(lambda p, xs, y: jax.grad(loss)(p, xs, y),
                   in_shardings=jax.tree.map(lambda _: auto, (tv, xs, y)), out_shardings=auto)
    options = {"xla_tpu_auto_spmd_partitioning_solver_timeout_seconds": args.solver_timeout}
    if args.memory_budget_gb is not None:
        options["xla_tpu_auto_spmd_partitioning_memory_budget_gb"] = args.memory_budget_gb
    elif args.memory_budget_ratio is not None:
        options["xla_tpu_auto_spmd_partitioning_memory_budget_ratio"] = args.memory_budget_ratio
    t0 = time.perf_counter()
    lowered = step.lower(tv, xs, y)
    result["lower_s"] = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    compiled = lowered.compile(compiler_options=options)
    result["compile_s"] = round(time.perf_counter() - t0, 3)
    param_shardings = compiled.input_shardings[0][0]
    result["trainable_variables"] = len(tv)
    result["split_variables"] = sum(1 for s in param_shardings if not s.is_fully_replicated)
    # each parameter's sharding as the axes it is split on and into how many parts
    # (tapas_placements turns them into TAPAS placements for figure7_throughput.py)
    shardings = {}
    for var, spec, sharding in zip(model.trainable_variables, tv, param_shardings):
        shard = sharding.shard_shape(tuple(spec.shape))
        axes = [i for i, (a, b) in enumerate(zip(spec.shape, shard)) if b < a]
        shardings[var.path] = {"shape": list(spec.shape), "axes": axes,
                               "ways": [int(spec.shape[i]) // int(shard[i]) for i in axes]}
    result["weight_shardings"] = shardings
    hlo = compiled.as_text()
    result["collectives"] = {c: hlo.count(f" {c}(") for c in
                             ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                              "collective-permute")}
    print("RESULT " + json.dumps(result), flush=True)


# --------------------------------------------------------------------------- #
# Driver: one subprocess per preset under a wall timeout
# --------------------------------------------------------------------------- #


def budget_description(args: argparse.Namespace) -> str:
    if args.memory_budget_gb is not None:
        return f"memory_budget_gb={args.memory_budget_gb}"
    ratio = DEFAULT_BUDGET_RATIO if args.memory_budget_ratio is None else args.memory_budget_ratio
    return (f"memory_budget_ratio={ratio} x per-device lower bound"
            + (" (XLA default)" if args.memory_budget_ratio is None else ""))


def run_one(model: str, args: argparse.Namespace) -> dict:
    """Compile ``model`` in a fresh process; the result dict always says what happened."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"--model={model}",
           f"--devices={args.devices}", f"--solver_timeout={args.solver_timeout}"]
    if args.batch_size:
        cmd.append(f"--batch_size={args.batch_size}")
    if args.memory_budget_gb is not None:
        cmd.append(f"--memory_budget_gb={args.memory_budget_gb}")
    if args.memory_budget_ratio is not None:
        cmd.append(f"--memory_budget_ratio={args.memory_budget_ratio}")
    row = {"model": model, "devices": args.devices, "mesh": [args.devices], "topology": TOPOLOGY,
           "solver_timeout": args.solver_timeout, "memory_budget": budget_description(args),
           "timeout_s": args.timeout}
    with tempfile.TemporaryDirectory(prefix="xla_autoshard_") as logdir:
        env = dict(os.environ, KERAS_BACKEND="jax", TPU_ACCELERATOR_TYPE=ACCELERATOR_TYPE,
                   TPU_STDERR_LOG_LEVEL="0", TPU_MIN_LOG_LEVEL="0", TPU_LOG_DIR=logdir,
                   TF_CPP_MIN_LOG_LEVEL="3")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            stdout = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            stderr = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            rc = None
        row["wall_s"] = round(time.perf_counter() - t0, 3)
        log_path = os.path.join(logdir, "tpu_driver.INFO")
        log = open(log_path, errors="replace").read() if os.path.exists(log_path) else stderr
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        row["log"] = os.path.join(args.log_dir, f"{model}.log")
        with open(row["log"], "w") as f:
            f.write(log)
    parsed = parse_autoshard_log(log)
    row.update(parsed)
    results = [json.loads(line[len("RESULT "):]) for line in stdout.splitlines()
               if line.startswith("RESULT ")]
    if results:
        row.update(results[-1])
    if rc is None:
        row["ok"] = False
        row["error"] = (f"timed out after {args.timeout} s (--timeout); the pass "
                        + ("finished" if parsed["pass_s"] is not None else "did not finish")
                        + "; raise --timeout or lower --solver_timeout")
    elif rc != 0 or not results:
        row["ok"] = False
        tail = [ln for ln in stderr.strip().splitlines() if not _GLOG.match(ln.strip())][-6:]
        row["error"] = f"exit status {rc}: " + " | ".join(tail)[-1500:]
    else:
        row["ok"] = parsed["pass_s"] is not None
        if not row["ok"]:
            row["error"] = ("compiled, but the libtpu log has no 'Starting the auto sharding "
                            "pass' / 'Auto Sharding took' pair: check TPU_MIN_LOG_LEVEL=0")
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="t5-tiny", help="comma-separated zoo presets")
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--devices", type=int, default=8, help="1-D mesh size (divides 8)")
    p.add_argument("--batch_size", type=int, default=None, help="default: the preset's")
    p.add_argument("--solver_timeout", type=int, default=60,
                   help="xla_tpu_auto_spmd_partitioning_solver_timeout_seconds (CP-SAT "
                        "deterministic time, not wall seconds)")
    p.add_argument("--memory_budget_ratio", type=float, default=None,
                   help=f"default: XLA's own ({DEFAULT_BUDGET_RATIO})")
    p.add_argument("--memory_budget_gb", type=float, default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="wall seconds per compile")
    p.add_argument("--json_out", default="out/xla_autoshard.json")
    p.add_argument("--log_dir", default="out/xla_logs",
                   help="where each preset's libtpu log is kept (<model>.log); empty: not kept")
    args = p.parse_args(argv)
    if args.devices < 1 or 8 % args.devices:
        p.error(f"--devices={args.devices}: the {TOPOLOGY} topology has 8 chips; "
                "use 1, 2, 4 or 8")
    if args.worker:
        _worker(args)
        return 0
    rows = []
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        row = run_one(model, args)
        rows.append(row)
        if row["ok"]:
            print(f"  {model}: pass {row['pass_s']:.2f} s, {row['status']}, "
                  f"ILP vars {row['ilp_variables'][-1] if row['ilp_variables'] else '-'}, "
                  f"compile {row.get('compile_s', float('nan')):.1f} s, "
                  f"{row.get('split_variables', '-')}/{row.get('trainable_variables', '-')} "
                  "weights split", flush=True)
        else:
            print(f"  {model}: FAILED: {row['error']}", flush=True)
    out = {"baseline": "XLA auto-sharding (libtpu, compile-only)",
           "memory_budget": budget_description(args), "topology": TOPOLOGY,
           "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "results": rows}
    if args.json_out:
        os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json_out}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
