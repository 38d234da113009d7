"""Export a TAPAS strategy as a plan other tools run: a Keras 3 distribution ``LayoutMap``
(``keras.distribution.ModelParallel`` on the JAX backend), in JSON or as a Python module
that needs only Keras, and read a (hand-edited) layout back to cost it.

In:  a ``Strategy`` and the ``tapas.ir.Graph`` it was searched on (``tapas.search``).
Out: :func:`export_layout` (a :class:`LayoutExport`: mesh, layouts, what they cannot pin
     and its cost, the predicted collectives), :func:`layout_map` (the Keras ``LayoutMap``),
     :func:`load_layout`, :func:`cost_layout` (the round trip), :func:`key_matches`,
     :func:`output_layouts` (the layer outputs the plan pins, ``"<layer path>/output"``),
     :func:`open_patterns` (the GraphNodes whose pattern those pins leave open).
Raises: ``ValueError`` (see :mod:`tapas.export.exporter` and :mod:`tapas.export.layouts`).
This package imports no TensorFlow; Keras only to build a ``LayoutMap``.
"""

from tapas.export.exporter import (LayoutCost, cost_layout, export_layout, layout_map,
                                   stored_placements)
from tapas.export.layouts import (LayoutExport, Unexpressed, key_matches, load_layout,
                                  placements_from_layouts)
from tapas.export.open_nodes import open_patterns
from tapas.export.outputs import check_keys, layer_paths, output_layouts, pinned_outputs

__all__ = ["LayoutExport", "LayoutCost", "Unexpressed", "export_layout", "layout_map",
           "cost_layout", "load_layout", "key_matches", "placements_from_layouts",
           "stored_placements", "output_layouts", "layer_paths", "check_keys",
           "pinned_outputs", "open_patterns"]
