"""Group the ops of a traced graph into GraphNodes (paper 4.2: "ops used together").

Pure Python, no TensorFlow: ``tapas.capture`` extracts a :class:`RawGraph` (plain op
records) from the ``tf.Graph`` and hands it here.

In:  :class:`RawGraph` -- ops in topological order, control inputs, graph inputs and
     outputs, and the model weights each resource placeholder stands for.
Out: :class:`tapas.ir.Graph`.

How ops are grouped
-------------------
1. *Dead* ops (nothing the outputs depend on, through data or control edges) are set
   aside. Graph-input placeholders become ``input`` GraphNodes. Ops we do not understand
   (function calls, control flow, unknown types) become ``opaque`` GraphNodes of their own.
2. *Weight-side* ops (variable reads and ops computing only from weights and constants,
   e.g. ``Reshape(kernel)``) and *constant* ops (consts, shape queries, ops on constants
   only) are attached later to the GraphNode that consumes them.
3. *Seeds*: every op that consumes a weight seeds the GraphNode of its layer (a layer is
   the parent of the weight's Keras path, ``.../dense_3`` for ``.../dense_3/kernel``);
   seeds of one layer that lie a few ops apart are one GraphNode (MatMul and BiasAdd),
   and the ops between them join it. Every weight-less matmul/einsum/convolution
   (attention scores and contexts, MoE dispatch) seeds a GraphNode of its own.
4. *Absorption*, repeated until nothing changes: an ungrouped op joins a neighbouring
   GraphNode G when
   - (forward) it is a light op (elementwise, activation, softmax, reshape) whose inputs
     all come from G, or from G and tensors G already reads (not for ``Add``: a residual
     add of a layer's output and its input is a GraphNode of its own); or
   - (backward) all its consumers are in G and at most one other GraphNode feeds it
     (the moments of a LayerNorm, the index arithmetic before an embedding lookup).
   When an op could join several GraphNodes, or could join one but its name scope points
   at a layer that has not reached it yet, the name scope decides. Scopes are used only
   as this tie-break, never as layer identity (Keras renumbers them).
5. Ops still left form GraphNodes of their own (residual adds, glue), growing forward.
6. A batch norm whose input is produced only for it by a convolution or dense layer is
   merged into that layer (Conv + BatchNorm + ReLU is one GraphNode).
Every live op ends in exactly one GraphNode.
"""

from __future__ import annotations

from tapas import ir
from tapas.capturing.grouping.building import Grouper
from tapas.capturing.grouping.raw import RawGraph
from tapas.capturing.op_kinds import HEAVY_OPS, KNOWN_OPS, LIGHT_OPS

__all__ = ["RawGraph", "group_ops", "HEAVY_OPS", "LIGHT_OPS", "KNOWN_OPS"]


def group_ops(raw: RawGraph) -> ir.Graph:
    """Group a traced graph's ops into GraphNodes; see the module docstring."""
    return Grouper(raw).build()
