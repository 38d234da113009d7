"""Stage 2, mining: a :class:`tapas.ir.Graph` -> its unique repeated subgraphs (pure, no TF).

In:  the GraphNode graph, ``min_support`` (instances a subgraph needs) and ``min_size``
     (GraphNodes it needs).
Out: :class:`FoldedGraph`: the templates (unique subgraphs such as a transformer layer or a
     ResNet block), the instances of each, the GraphNodes no template covers, and mining
     statistics. See docs/mining.md.
"""

from tapas.mining.apriori import (DEFAULT_MIN_SIZE, FoldedGraph, LevelStats, MiningStats,
                                  RoundStats, Subgraph, Template, detect_layers, draw_folded,
                                  frequent_subgraphs, mine)

__all__ = ["mine", "frequent_subgraphs", "detect_layers", "draw_folded", "FoldedGraph",
           "Template", "Subgraph", "LevelStats", "RoundStats", "MiningStats",
           "DEFAULT_MIN_SIZE"]
