"""Reference plans: the search restricted to named families of patterns, for comparison.

In:  a :class:`tapas.ir.Graph` and the name of a reference plan (``REFERENCE_PLANS``:
     Megatron, FFN-only, MHA-only, expert, data parallel, replicate).
Out: the role of every GraphNode (:func:`node_roles`: attention, attention core, FFN,
     expert or other), the plans that apply to a graph (:func:`applicable_references`) and
     the predicate ``allowed(node, pattern_info)`` that restricts the search to one plan
     (:func:`reference_filter`). A predicate reads the pattern's ``family`` and
     ``data_parallel`` (``tapas.sharding.patterns.Family``), never its name.

This module imports no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tapas.ir import Graph, GraphNode, Kind
from tapas.planning.frontier import Allowed
from tapas.planning.steps import per_graph
from tapas.planning.table import PatternInfo
from tapas.sharding.patterns.pattern import REPLICATE, Family

__all__ = ["REFERENCE_PLANS", "reference_filter", "node_roles", "applicable_references",
           "DATA_PARALLEL", "REPLICATED"]

_ATTENTION_KINDS = (Kind.ATTENTION_SCORE, Kind.ATTENTION_CONTEXT)


_ROLES: dict[int, tuple[Graph, Any]] = {}


def node_roles(graph: Graph) -> list[str]:
    """The role of every GraphNode for the reference plans: ``"attention"`` (a dense
    feeding an attention score/context, or fed by a context: Q, K, V, O),
    ``"attention-core"`` (score, context, and a softmax between them), ``"ffn"`` (a dense
    next to another dense that is not attention: the two matrices of a feed-forward
    block), whole ``tapas.layers`` attention and feed-forward GraphNodes as ``"attention"``
    and ``"ffn"``, ``"expert"`` (an MoE expert einsum) or ``"other"``. Cached per graph
    (``steps.per_graph``): each reference plan asks."""
    return list(per_graph(_ROLES, graph, lambda g: tuple(_node_roles(g))))


def _node_roles(graph: Graph) -> list[str]:
    """:func:`node_roles`, computed."""
    preds: list[set[int]] = [set() for _ in graph.nodes]
    succs: list[set[int]] = [set() for _ in graph.nodes]
    for e in graph.edges:
        preds[e.dst].add(e.src)
        succs[e.src].add(e.dst)
    kinds = [n.kind for n in graph.nodes]
    roles = ["other"] * len(graph.nodes)
    for n in graph.nodes:
        v = n.id
        if n.kind is Kind.ATTENTION:          # a whole tapas.layers.MultiHeadAttention
            roles[v] = "attention"
        elif n.kind is Kind.FEED_FORWARD:     # a whole tapas.layers.FeedForward
            roles[v] = "ffn"
        elif n.kind in _ATTENTION_KINDS:
            roles[v] = "attention-core"
        elif n.kind is Kind.SOFTMAX and any(kinds[s] in _ATTENTION_KINDS for s in succs[v]) \
                and any(kinds[p] in _ATTENTION_KINDS for p in preds[v]):
            roles[v] = "attention-core"
        elif n.kind is Kind.EXPERT_EINSUM:
            roles[v] = "expert"
        elif n.kind is Kind.DENSE:
            if any(kinds[s] in _ATTENTION_KINDS for s in succs[v]) or \
                    any(kinds[p] is Kind.ATTENTION_CONTEXT for p in preds[v]):
                roles[v] = "attention"
    for n in graph.nodes:
        v = n.id
        if n.kind is Kind.DENSE and roles[v] == "other":
            near = preds[v] | succs[v]
            if any(kinds[u] is Kind.DENSE and roles[u] == "other" for u in near):
                roles[v] = "ffn"
    # a dense two steps from another FFN dense through an elementwise (gated FFN: wi_0 * wi_1)
    for n in graph.nodes:
        v = n.id
        if n.kind is Kind.DENSE and roles[v] == "other":
            for u in succs[v]:
                if kinds[u] is Kind.ELEMENTWISE and any(roles[w] == "ffn" for w in succs[u]):
                    roles[v] = "ffn"
    return roles


# the roles each tensor-parallel reference plan shards
_SHARDED_ROLES: Mapping[str, tuple[str, ...]] = {
    "megatron": ("attention", "attention-core", "ffn"), "ffn-only": ("ffn",),
    "mha-only": ("attention", "attention-core"), "expert": ("expert",)}
# the pattern families a sharded role may take
_ROLE_FAMILIES: Mapping[str, tuple[Family, ...]] = {
    "attention": (Family.HEADS, Family.COLUMN, Family.ROW),
    "ffn": (Family.COLUMN, Family.ROW, Family.COLUMN_ROW),
    "expert": (Family.EXPERT,),
    "attention-core": (Family.HEADS, Family.FOLLOW)}

# the two plans every graph has: its GraphNodes all data parallel, or all replicated (the
# plan named after the pattern family it keeps)
DATA_PARALLEL = "data-parallel"
REPLICATED = str(REPLICATE)

# plan name -> description; the predicate is built by reference_filter
REFERENCE_PLANS: Mapping[str, str] = {
    "megatron": "Megatron-style: attention split on heads (Q/K/V column, O row), FFN "
                "column then row",
    "ffn-only": "FFN column then row, attention replicated (the paper's T5 finding)",
    "mha-only": "attention split on heads, FFN replicated",
    "expert": "MoE experts split on the expert dimension, attention and FFN replicated",
    DATA_PARALLEL: "every GraphNode split on the batch dimension (weights replicated, "
                   "gradient all-reduce)",
    REPLICATED: "every GraphNode replicated (no communication, no saving)",
}


def reference_filter(plan: str, graph: Graph) -> Allowed:
    """``allowed(node, pattern_info)`` for the reference plan ``plan`` (REFERENCE_PLANS)."""
    if plan not in REFERENCE_PLANS:
        raise ValueError(f"reference plan {plan!r} is unknown: use one of "
                         f"{list(REFERENCE_PLANS)}")
    roles = node_roles(graph)

    def allowed(node: GraphNode, pattern: PatternInfo) -> bool:
        role = roles[node.id]
        family = pattern.family
        if plan == REPLICATED:
            return family is Family.REPLICATE
        if plan == DATA_PARALLEL:
            return pattern.data_parallel
        if pattern.data_parallel:
            return False
        if role in _SHARDED_ROLES[plan]:
            return family in _ROLE_FAMILIES[role]
        if role in _ROLE_FAMILIES:
            return family is Family.REPLICATE      # a role this plan leaves whole
        return True                                # the rest (embeddings, head, glue): searched
    return allowed


def applicable_references(roles: Sequence[str]) -> list[str]:
    """The reference plans that apply to a graph whose GraphNodes have ``roles``."""
    present = set(roles)
    names = []
    if "attention" in present and "ffn" in present:
        names += ["megatron", "ffn-only", "mha-only"]
    elif "ffn" in present:
        names += ["ffn-only"]
    elif "attention" in present:
        names += ["mha-only"]
    if "expert" in present:
        names.append("expert")
    return names + [DATA_PARALLEL, REPLICATED]
