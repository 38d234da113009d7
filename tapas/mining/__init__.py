"""Stage 2, mining: a :class:`tapas.ir.Graph` -> its unique repeated subgraphs (pure, no TF).

In:  the GraphNode graph, ``min_support`` (instances a subgraph needs) and ``min_size``
     (GraphNodes it needs).
Out: :class:`FoldedGraph`: the templates (unique subgraphs such as a transformer layer or a
     ResNet block), the instances of each, the GraphNodes no template covers, and mining
     statistics. See docs/mining.md.

The modules, in the order they run:

* :mod:`~.folding` -- the driver: :func:`mine` (rounds of search and selection),
  :func:`frequent_subgraphs`, :func:`detect_layers`;
* :mod:`~.apriori` -- the level-wise frequent-subgraph search (Algorithm 1);
* :mod:`~.selection` -- frequent subgraphs -> templates;
* :mod:`~.folded` -- the result types;
* :mod:`~.draw` -- :func:`draw_folded` (PNG).
"""

from tapas.mining.draw import draw_folded
from tapas.mining.folded import (FoldedGraph, LevelStats, MiningStats, RoundStats, Subgraph,
                                 Template)
from tapas.mining.folding import DEFAULT_MIN_SIZE, detect_layers, frequent_subgraphs, mine

__all__ = ["mine", "frequent_subgraphs", "detect_layers", "draw_folded", "FoldedGraph",
           "Template", "Subgraph", "LevelStats", "RoundStats", "MiningStats",
           "DEFAULT_MIN_SIZE"]
