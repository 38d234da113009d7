"""TAPAS: Tensor Auto-Parallelisation for TensorFlow/Keras.

The pipeline, one module per stage (paper section 4):

1. capture     ``tapas.capturing`` + ``tapas.grouping``: model -> ``tapas.ir.Graph`` of GraphNodes
2. mine        ``tapas.mine``: Graph -> FoldedGraph (unique repeated subgraphs)
3. explore     ``tapas.src`` (placements, SRC expressions), ``tapas.patterns`` (sharding
               patterns per GraphNode), ``tapas.explore`` + ``tapas.search``: -> Strategy
4. cost        ``tapas.cost``: Cluster S(m, n), overlap-aware alpha-beta costs, memory, compute
5. reconstruct ``tapas.reconstruct`` (+ ``tapas.collectives``): Strategy -> per-replica TF
               program; ``tapas.runtime`` / ``tapas.parallel``: training under tf.distribute

``tapas.layers`` holds Keras layers that are GraphNodes by construction
(``tapas.DenseLayer(4096, shard="column")``).

The public entry points are re-exported here. TensorFlow is imported only when a stage
that needs it is first used, so ``import tapas`` and the pure stages stay fast.
"""

from __future__ import annotations

import importlib
from typing import Any

from tapas import cost, ir
from tapas.cost import Cluster, Collective, CostBreakdown, CostOptions, collective_cost
from tapas.ir import Edge, Graph, GraphNode, Kind, OpInfo, TensorInfo, WeightInfo
from tapas.src import Partial, Replica, Split

__version__ = "0.1.0"

# public name -> (module, attribute); resolved on first use
_LAZY = {
    "capture": ("tapas.capturing", "capture"),
    "trace": ("tapas.capturing", "trace"),
    "CaptureError": ("tapas.capturing", "CaptureError"),
    "models": ("tapas.models", None),
    "mine": ("tapas.mine", None),   # the module is callable: tapas.mine(graph, ...)
    "search": ("tapas.search", None),   # callable module: tapas.search(graph, ...)
    "Strategy": ("tapas.search", "Strategy"),
    "parallelize": ("tapas.parallel", "parallelize"),
    "ParallelModel": ("tapas.parallel", "ParallelModel"),
    "layers": ("tapas.layers", None),
    "DenseLayer": ("tapas.layers", "DenseLayer"),
}

__all__ = ["ir", "Graph", "GraphNode", "Edge", "Kind", "OpInfo", "TensorInfo", "WeightInfo",
           "cost", "Cluster", "Collective", "CostBreakdown", "CostOptions", "collective_cost",
           "Split", "Replica", "Partial", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        mod = importlib.import_module(module)
        value = mod if attr is None else getattr(mod, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tapas' has no attribute {name!r}")
