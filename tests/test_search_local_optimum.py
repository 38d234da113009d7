"""An exact search's plan is cheapest GraphNode by GraphNode under its own cost.

Whatever the folding, the frontier and its cuts do, a plan the search calls exact can
not be made cheaper by changing one GraphNode's pattern and pricing the whole plan again
with :func:`tapas.planning.explore.plan_cost` (the cost the search ranks by). A cheaper
neighbour would mean the enumeration dropped a plan it should have kept.
"""

import pytest

from models import capture_preset
from tapas.planning.cluster import Cluster
from tapas.planning.cost import CostOptions
from tapas.planning.explore import plan_cost
from tapas.planning.precision import resolve
from tapas.planning.search import search
from tapas.planning.table import EdgeCoster, pattern_table


def _cheaper_neighbours(graph, strategy):
    opts = resolve(CostOptions.for_cluster(strategy.cluster), graph)[0]
    table = pattern_table(graph, strategy.num_devices, strategy.cluster, opts)
    edges = EdgeCoster(strategy.num_devices, strategy.cluster, opts,
                       gradients=table.gradients)
    bound = strategy.bind(graph)
    chosen = [table.index(v, bound.patterns[v]) for v in range(len(graph.nodes))]
    base = plan_cost(graph, table, chosen, edges)[0].total
    found, tried = [], 0
    for v, infos in enumerate(table.infos):
        for i in range(len(infos)):
            if i == chosen[v]:
                continue
            patterns = list(chosen)
            patterns[v] = i
            try:
                total = plan_cost(graph, table, patterns, edges)[0].total
            except ValueError:      # an edge that cannot be resharded
                continue
            tried += 1
            if total < base * (1 - 1e-9):
                found.append((graph.nodes[v].name, str(infos[chosen[v]].name),
                              str(infos[i].name), total - base))
    return base, tried, found


@pytest.mark.parametrize("preset,devices", [("t5-tiny", 4), ("resnet-tiny", 8),
                                            ("moe-tiny", 4)])
def test_no_single_graphnode_change_makes_the_searched_plan_cheaper(preset, devices):
    graph = capture_preset(preset)[0]
    strategy = search(graph, cluster=Cluster.v100_ethernet(devices_per_node=devices))
    assert strategy.exact, f"{preset} on {devices}: the search is not exact here"
    base, tried, found = _cheaper_neighbours(graph, strategy)
    assert base == pytest.approx(strategy.cost["total"], rel=1e-9)
    assert tried > len(graph.nodes) / 2, "too few neighbours priced to say anything"
    assert not found, f"cheaper single-GraphNode changes of {preset}'s plan: {found[:5]}"
