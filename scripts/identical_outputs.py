"""Before/after check for refactors: dump what the pipeline produces, or diff two dumps.

    python scripts/identical_outputs.py dump OUT.json [--models=name,...] [--devices=4]
    python scripts/identical_outputs.py diff BEFORE.json AFTER.json

``dump`` captures the zoo's tiny presets and five models from other libraries (one each of
keras.applications, keras-hub, transformers, the Model Garden and kimm, from
``tapas.models.corpus``), and writes per model: the captured graph's digest (sha1 of its
JSON, keys sorted) and every GraphNode's id, name, kind and structural signature; for each zoo preset the
Strategy JSON of ``tapas.search`` in ``gp`` and ``es`` mode (search timings dropped: they are
wall-clock seconds); for every GraphNode the ``explain()`` message of every candidate pattern
name and of an unknown name (which lists the candidates). Other libraries' models get the
``gp`` Strategy only (``es`` over a whole backbone takes minutes). ``diff`` prints every
difference and exits 1 when there is one. A refactor that changes none of these is
behaviour-neutral for capture, patterns and search; ``tests/test_identical_outputs.py`` runs
one preset of it.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ZOO = ("t5-tiny", "moe-tiny", "resnet-tiny", "t5-tiny-tapas", "moe-tiny-tapas",
       "t5-tiny-masked", "bert-tiny", "llama-tiny", "llama-tiny-fused")
CORPUS = ("keras-mobilenet", "hub-bert", "hf-bert", "tfm-fnet", "kimm-mobileone")
UNKNOWN = "no-such-pattern"


def _graph(name: str) -> Any:
    import keras

    import tapas
    keras.backend.clear_session()
    if name in ZOO:
        from tapas.models import registry
        return registry.capture_preset(name)[0]
    from tapas.models import corpus
    model, specs = corpus.get(name).build()
    return tapas.capture(model, specs, name=name)


def _strategy(graph: Any, mode: str, devices: int) -> dict[str, Any]:
    import tapas
    strategy = tapas.search(graph, cluster=tapas.Cluster.v100_ethernet(1, devices), mode=mode)
    d = strategy.to_json()
    d.pop("timings")
    return d


def _explanations(graph: Any, devices: int) -> dict[str, list[str]]:
    """"ID:NAME" of each GraphNode (names may repeat) -> explain() of an unknown name, then
    of each candidate it lists."""
    from tapas.sharding.patterns import explain
    out = {}
    for node in graph.nodes:
        first = explain(node, graph, devices, UNKNOWN)
        names = first.rpartition("its candidates are: ")[2].split(", ")
        out[f"{node.id}:{node.name}"] = [first] + [explain(node, graph, devices, n) for n in names]
    return out


def dump_one(name: str, devices: int, modes: tuple[str, ...]) -> dict[str, Any]:
    """Everything compared for model ``name``."""
    graph = _graph(name)
    text = json.dumps(graph.to_json(), sort_keys=True)   # attrs' key order may vary
    row = {"graph_sha1": hashlib.sha1(text.encode()).hexdigest(),
           "nodes": [[n.id, n.name, n.kind.value, n.signature] for n in graph.nodes],
           "strategies": {m: _strategy(graph, m, devices) for m in modes},
           "explain": _explanations(graph, devices)}
    gc.collect()
    return row


def dump(path: str, models: list[str], devices: int) -> None:
    out: dict[str, Any] = {"devices": devices, "models": {}}
    for name in models:
        modes = ("gp", "es") if name in ZOO else ("gp",)
        out["models"][name] = dump_one(name, devices, modes)
        print(f"{name}: {len(out['models'][name]['nodes'])} GraphNodes", flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    print(f"wrote {path}")


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Every path at which ``a`` and ``b`` (JSON values) differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        found = []
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                found.append(f"{where}/{k}: only in {'after' if k not in a else 'before'}")
            else:
                found += differences(a[k], b[k], f"{where}/{k}")
        return found
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {json.dumps(a)[:200]} != {json.dumps(b)[:200]}"]


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "dump":
        opts = dict(a[2:].split("=", 1) for a in argv[2:])
        models = opts["models"].split(",") if "models" in opts else [*ZOO, *CORPUS]
        dump(argv[1], models, int(opts.get("devices", 4)))
        return 0
    if len(argv) == 3 and argv[0] == "diff":
        with open(argv[1]) as f, open(argv[2]) as g:
            found = differences(json.load(f), json.load(g))
        print("\n".join(found[:200]) or "identical")
        return 1 if found else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
