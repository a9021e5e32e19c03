"""The FDG's intermediate representation: nodes (:mod:`msrl.graph.node`), the region kinds'
table (:mod:`msrl.graph.regions`) and region graphs (:mod:`msrl.graph.graph`)."""

from msrl.graph.graph import Graph, GraphLintError
from msrl.graph.node import COMM_KINDS, IMPURE_KINDS, REGION_KINDS, CommTarget, Const, Node, NodeKind

__all__ = [
    "Graph",
    "GraphLintError",
    "Node",
    "NodeKind",
    "CommTarget",
    "Const",
    "COMM_KINDS",
    "IMPURE_KINDS",
    "REGION_KINDS",
]
