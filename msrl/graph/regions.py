"""The region kinds of the IR in one table: a region node holds sub-graphs, and everything that
walks the graph reads what a kind's sub-graphs are, how it is checked and how it reads from
this table (JAX's higher-order primitives carry their rules the same way), so a new region kind
is one entry here and one lowering rule (:data:`msrl.runtime.programs.codegen.REGION_LOWERING`, which must
cover this table), not a branch in every file.

===========  ==========================  ===================================================
kind         sub-graphs (label)          what it is
===========  ==========================  ===================================================
``loop``     ``body``                    ``for target in range(args)``, run in lockstep by
                                         every fragment that holds part of it
``branch``   ``body``, ``orelse``        ``if target:`` on a control value (``else:``)
             (``else:``)
``allreduce``  ``body``                  a collective point's all-reduce around the one call
                                         that reaches it (or the region of its next point)
``serve``    ``body``                    central inference: the part run once per client
===========  ==========================  ===================================================

(An ``allreduce`` node without a body is not a region.)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from msrl.graph.node import REGION_TABLE, CommTarget, Const, Node, NodeKind

__all__ = ["RegionKind", "REGIONS", "region_of"]

#: lint(node, where, avail, lint_sub) -> what is wrong with a region node (``None``: nothing;
#: the graph raises it as a ``GraphLintError``); ``avail`` is the set of values defined before
#: it (``None``: unknown), ``lint_sub(graph, avail)`` checks a sub-graph (raising itself)
Lint = Callable[[Node, str, "set[str] | None", Callable[[Any, "set[str] | None"], None]], "str | None"]


@dataclasses.dataclass(frozen=True)
class RegionKind:
    """One kind of region node.

    Attributes:
        kind: its node kind.
        subgraphs: ``(node attribute, label)`` of each sub-graph in program order; the label
            is printed before a sub-graph after the first (``"else:"``), ``None`` for none.
        lint: checks the node's own invariants and its sub-graphs (see :data:`Lint`).
        describe: the node's one-line form without its id (``None``: a comm node's form).
        endpoint_op: the :class:`~msrl.runtime.endpoint.Endpoint` op the region is lowered to
            (``None``: plain Python control flow, no communication).
    """

    kind: NodeKind
    subgraphs: tuple[tuple[str, str | None], ...]
    lint: Lint
    describe: Callable[[Node], str] | None = None
    endpoint_op: str | None = None


def _is_graph(value: Any) -> bool:
    """Whether ``value`` is a region graph (:class:`msrl.graph.graph.Graph`, which imports this
    module: recognised by its interface)."""
    return callable(getattr(value, "free_values", None)) and callable(getattr(value, "written_values", None))


def _lint_loop(node: Node, where: str, avail: set[str] | None, lint_sub: Callable[[Any, set[str] | None], None]) -> str | None:
    if not _is_graph(node.body):
        return f"{where}: loop body must be a Graph"
    inner = None
    if avail is not None:
        inner = avail | ({node.target} if node.target else set())
        outside = [n for n in node.body.free_values() if n not in inner]
        if outside:
            return f"{where}: loop body reads undefined {outside}"
    lint_sub(node.body, inner)
    return None


def _lint_branch(node: Node, where: str, avail: set[str] | None, lint_sub: Callable[[Any, set[str] | None], None]) -> str | None:
    if not (_is_graph(node.body) and _is_graph(node.orelse)):
        return f"{where}: branch body and orelse must be Graphs"
    if not isinstance(node.target, (str, Const)):
        return f"{where}: branch condition must be a value name or Const"
    if isinstance(node.target, str) and node.target not in node.inputs:
        return f"{where}: branch inputs must hold its condition {node.target!r}"
    for region in (node.body, node.orelse):
        if avail is not None:
            outside = [n for n in region.free_values() if n not in avail]
            if outside:
                return f"{where}: branch body reads undefined {outside}"
        lint_sub(region, set(avail) if avail is not None else None)
    return None


def _lint_serve(node: Node, where: str, avail: set[str] | None, lint_sub: Callable[[Any, set[str] | None], None]) -> str | None:
    if not _is_graph(node.body):
        return f"{where}: a serve region's body must be a Graph"
    if node.inputs != node.body.free_values() or not set(node.outputs) <= set(node.body.written_values()):
        return f"{where}: a serve region reads what its body reads and writes values its body writes"
    lint_sub(node.body, set(avail) if avail is not None else None)
    return None


def _lint_allreduce(node: Node, where: str, avail: set[str] | None,
                    lint_sub: Callable[[Any, set[str] | None], None]) -> str | None:
    t = node.target
    if not (isinstance(t, CommTarget) and t.side == "all" and _is_graph(node.body)):
        return f"{where}: an allreduce region has a CommTarget of side 'all' and a body Graph"
    inner = list(node.body)
    if len(inner) != 1 or not (inner[0].kind is NodeKind.CALL or region_of(inner[0]) is REGIONS[NodeKind.ALLREDUCE]):
        return (f"{where}: an allreduce region holds exactly one call (the call that reaches its collective "
                "point) or the region of the call's next point")
    if node.inputs != node.body.free_values() or node.outputs != node.body.written_values():
        return f"{where}: an allreduce region reads and writes what its call does"
    lint_sub(node.body, set(avail) if avail is not None else None)
    return None


def _describe_loop(node: Node) -> str:
    carried = node.meta.get("carried", [])
    rng = ", ".join(a if isinstance(a, str) else repr(a) for a in node.args)
    text = f"loop {node.target or '_'} in range({rng})"
    return text + (f" carried=({', '.join(carried)})" if carried else "")


def _describe_branch(node: Node) -> str:
    return f"branch if {node.target if isinstance(node.target, str) else repr(node.target)}"


def _describe_serve(node: Node) -> str:
    return (f"serve {node.target} to {node.meta.get('clients', '?')} (x{node.meta.get('clients_count', '?')}), "
            "once per client replica")


#: every region kind, by node kind
REGIONS: dict[NodeKind, RegionKind] = {r.kind: r for r in (
    RegionKind(NodeKind.LOOP, (("body", None),), _lint_loop, _describe_loop),
    RegionKind(NodeKind.BRANCH, (("body", None), ("orelse", "else:")), _lint_branch, _describe_branch),
    RegionKind(NodeKind.ALLREDUCE, (("body", None),), _lint_allreduce, endpoint_op="allreduce_region"),
    RegionKind(NodeKind.SERVE, (("body", None),), _lint_serve, _describe_serve, endpoint_op="serve"),
)}


REGION_TABLE.update(REGIONS)  # what Node.regions() and Node.describe() read


def region_of(node: Node) -> RegionKind | None:
    """The :class:`RegionKind` of a region node, ``None`` for any other node (an ``allreduce``
    without a body among them): :meth:`msrl.graph.node.Node.region_kind`."""
    return node.region_kind()
