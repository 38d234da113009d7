"""TAPAS: Tensor Auto-Parallelisation for TensorFlow/Keras.

The pipeline, one subpackage per stage (paper section 4; docs/architecture.md):

1. capture     ``tapas.capturing``: Keras model / tf.function -> ``tapas.ir.Graph`` of GraphNodes
2. mine        ``tapas.mining``: Graph -> FoldedGraph (unique repeated subgraphs)
3. shard       ``tapas.sharding``: placements, SRC expressions, the sharding patterns of
               every GraphNode
4. plan        ``tapas.planning``: cluster S(m, n), its device meshes (``tapas.Mesh``:
               a data and a model axis, each with its link), overlap-aware alpha-beta
               costs, enumeration (gp / es) -> Strategy
5. execute     ``tapas.execution``: Strategy -> per-replica TF program with collectives,
               trained under tf.distribute (``tapas.parallelize``, ``tapas train``)

``tapas.layers`` holds Keras layers that are GraphNodes by construction
(``tapas.DenseLayer(4096, shard="column")``); ``tapas.cli`` is the ``tapas`` command.

The public entry points are re-exported here. TensorFlow is imported only when a stage
that needs it is first used, so ``import tapas`` and the pure stages stay fast.
"""

from __future__ import annotations

import importlib
from typing import Any

from tapas import ir
from tapas.ir import Edge, Graph, GraphNode, Kind, OpInfo, TensorInfo, WeightInfo
from tapas.planning import cost
from tapas.planning.cost import Cluster, CostBreakdown, CostOptions, collective_cost
from tapas.sharding.placements import Collective, Partial, Replica, Split

__version__ = "0.1.0"

# public name -> (module, attribute); resolved on first use
_LAZY = {
    "capture": ("tapas.capturing", "capture"),
    "trace": ("tapas.capturing", "trace"),
    "CaptureError": ("tapas.capturing", "CaptureError"),
    "models": ("tapas.models", None),
    "mine": ("tapas.mining", "mine"),
    "FoldedGraph": ("tapas.mining", "FoldedGraph"),
    "search": ("tapas.planning.search", "search"),
    "Strategy": ("tapas.planning.search", "Strategy"),
    "Mesh": ("tapas.planning.devicemesh", "Mesh"),
    "profile": ("tapas.execution.calibration.profiling", "profile"),
    "parallelize": ("tapas.execution.api.parallel", "parallelize"),
    "ParallelModel": ("tapas.execution.api.parallel", "ParallelModel"),
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
