"""Graph-wide lookups the propagation and the seed functions read.

In:  a :class:`tapas.ir.Graph`.
Out: :class:`GraphIndex` -- the producing op and the static shape of every tensor, and the
     value of small constant tensors (through Identity/Snapshot).

This module imports no TensorFlow.
"""

from __future__ import annotations

from typing import Any

from tapas.ir import Graph, OpInfo, TensorInfo

__all__ = ["GraphIndex"]


class GraphIndex:
    """Graph-wide lookups: producing op and static shape of every tensor."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.op_of: dict[str, OpInfo] = {}
        self.tensor: dict[str, TensorInfo] = {}
        for n in graph.nodes:
            for op in n.ops:
                self.op_of[op.name] = op
                for t in op.outputs:
                    self.tensor[t.name] = t
        for t in graph.inputs:
            self.tensor.setdefault(t.name, t)

    def const_value(self, tensor_name: str) -> Any:
        op = self.op_of.get(tensor_name.rsplit(":", 1)[0])
        if op is None:
            return None
        if op.type == "Const":
            return op.value
        if op.type in ("Identity", "Snapshot") and op.inputs:
            return self.const_value(op.inputs[0])
        return None
