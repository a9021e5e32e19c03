"""The FDG's intermediate representation: nodes (:mod:`msrl.graph.node`), the region kinds'
table (:mod:`msrl.graph.regions`), region graphs (:mod:`msrl.graph.graph`) and the fragmented
graph that partitioning produces and the runtime reads (:mod:`msrl.graph.fragmented`).
Nothing here imports the front end (tracer, probe, partitioner, passes) or the runtime."""

from msrl.graph.fragmented import Boundary, Collective, Fragment, FragmentGraph, InferencePlan
from msrl.graph.graph import Graph, GraphLintError
from msrl.graph.node import COMM_KINDS, IMPURE_KINDS, REGION_KINDS, CommTarget, Const, Node, NodeKind

__all__ = [
    "Boundary",
    "Collective",
    "Fragment",
    "FragmentGraph",
    "InferencePlan",
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
