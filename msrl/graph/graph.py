"""The graph container of the FDG: nodes in program order plus their data edges.

A :class:`Graph` is one region: the body of a traced method, the body of a ``loop`` node, or
one side of a ``branch`` node.
Nodes keep program order (the order the user wrote them); data edges run from the node that
last wrote a value name to each node that reads it within the region. Values a region reads
but does not write first come from the enclosing region (``free_values``).

networkx holds the edges; it is not exposed.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Any, Iterator

from msrl.errors import MsrlError
from msrl.graph.node import COMM_KINDS, CommTarget, Const, Node, NodeKind
from msrl.graph.regions import region_of

__all__ = ["Graph", "GraphLintError"]


class GraphLintError(MsrlError, AssertionError):
    """A graph breaks an invariant of the IR (raised by :meth:`Graph.lint`)."""


class Graph:
    """An ordered region of FDG nodes with data edges between them.

    Args:
        name: e.g. ``"PPOTrainer.train_step"`` or ``"loop@12"``.

    Nodes are appended in program order with :meth:`append` (or placed with :meth:`insert`);
    edges are derived from value names, so they stay consistent by construction.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._nodes: list[Node] = []
        self._next_id = 0

    # -- building ---------------------------------------------------------------------------
    def append(self, node: Node) -> Node:
        """Adds ``node`` at the end of the region; assigns its id. Returns the node."""
        return self.insert(len(self._nodes), node)

    def insert(self, index: int, node: Node) -> Node:
        """Places ``node`` at position ``index`` of the program order. Returns the node."""
        if node.id < 0:
            node.id = self._new_id()
        self._nodes.insert(index, node)
        return node

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def replace(self, node: Node, new: Node) -> Node:
        """Puts ``new`` in ``node``'s place in the program order (``new`` keeps its own id, or
        gets one). Returns ``new``.

        Raises:
            ValueError: ``node`` is not in this region.
        """
        i = next((k for k, n in enumerate(self._nodes) if n is node), None)
        if i is None:
            raise ValueError(f"node %{node.id} is not in region {self.name}")
        if new.id < 0:
            new.id = self._new_id()
        self._nodes[i] = new
        return new

    def copy(self) -> "Graph":
        """A copy a pass may edit without touching this graph: new nodes (their input, output
        and meta containers new too) and, through the region table, new sub-graphs; ids, names
        and every other value are kept."""
        g = Graph(self.name)
        g._next_id = self._next_id
        for node in self._nodes:
            copy = dataclasses.replace(node, inputs=list(node.inputs), outputs=list(node.outputs), meta=dict(node.meta))
            region = node.region_kind()
            for attr, _ in (region.subgraphs if region is not None else ()):
                sub = getattr(node, attr)
                setattr(copy, attr, sub.copy() if sub is not None else None)
            g._nodes.append(copy)
        return g

    def set_id_base(self, base: int) -> None:
        """Makes new node ids start at ``base`` (so ids stay unique across nested regions)."""
        self._next_id = max(self._next_id, base)

    # -- reading ----------------------------------------------------------------------------
    @property
    def nodes(self) -> list[Node]:
        """The region's nodes in program order (a copy)."""
        return list(self._nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(list(self._nodes))

    def __len__(self) -> int:
        return len(self._nodes)

    def walk(self) -> Iterator[Node]:
        """Every node of the region and of nested regions (loop bodies, both sides of a
        branch, the true side first), in program order."""
        for node in self._nodes:
            yield node
            for region in node.regions():
                yield from region.walk()

    def index(self, node: Node) -> int:
        """Position of ``node`` in program order."""
        return self._nodes.index(node)

    def producers(self) -> dict[str, Node]:
        """Value name -> the last node of this region that writes it."""
        out: dict[str, Node] = {}
        for node in self._nodes:
            for name in node.outputs:
                out[name] = node
        return out

    def free_values(self) -> list[str]:
        """Names read by the region before any node of the region writes them (in order)."""
        written: set[str] = set()
        free: list[str] = []
        for node in self._nodes:
            for name in node.inputs:
                if name not in written and name not in free:
                    free.append(name)
            written.update(node.outputs)
        return free

    def written_values(self) -> list[str]:
        """Every name some node of the region writes, in order of first write."""
        seen: list[str] = []
        for node in self._nodes:
            for name in node.outputs:
                if name not in seen:
                    seen.append(name)
        return seen

    def edges(self) -> list[tuple[Node, Node, str]]:
        """``(producer, consumer, value)`` for every data edge of the region."""
        g = self._nx()
        return [(self._by_id[u], self._by_id[v], d["value"]) for u, v, d in g.edges(data=True)]

    def users(self, node: Node) -> list[Node]:
        """Nodes of the region that read a value ``node`` writes (before it is rewritten)."""
        return [c for p, c, _ in self.edges() if p is node]

    def _nx(self) -> Any:
        """The region's data edges as a ``networkx.MultiDiGraph`` (networkx is imported here, on
        first use: no run needs it, and it is 0.16 s of a run's start-up)."""
        import networkx as nx

        g = nx.MultiDiGraph()
        self._by_id = {n.id: n for n in self._nodes}
        last: dict[str, Node] = {}
        for node in self._nodes:
            g.add_node(node.id)
            for name in node.inputs:
                if name in last:
                    g.add_edge(last[name].id, node.id, value=name)
            for name in node.outputs:
                last[name] = node
        return g

    def topological_order(self) -> list[Node]:
        """A topological order of the data edges that keeps impure nodes in program order.

        Raises:
            GraphLintError: the data edges have a cycle.
        """
        g = self._nx()
        prev = None
        for node in self._nodes:
            if node.is_impure:
                if prev is not None:
                    g.add_edge(prev.id, node.id, value="<effect>")
                prev = node
        import networkx as nx

        try:
            order = list(nx.lexicographical_topological_sort(g, key=lambda i: self._pos(i)))
        except nx.NetworkXUnfeasible as e:
            raise GraphLintError(f"{self.name}: the data edges have a cycle") from e
        return [self._by_id[i] for i in order]

    def _pos(self, node_id: int) -> int:
        for i, n in enumerate(self._nodes):
            if n.id == node_id:
                return i
        raise KeyError(node_id)

    # -- checking ---------------------------------------------------------------------------
    def lint(self, defined: set[str] | None = None) -> None:
        """Checks the IR invariants of this region and every nested one.

        Invariants: each node's kind is a :class:`NodeKind` and its target has that kind's
        shape; each value read is written earlier in the region or comes from outside
        (``defined``, when given); loop bodies are graphs; comm nodes carry a
        :class:`CommTarget` whose side matches their inputs/outputs; ``output`` is last;
        node ids are unique.

        Args:
            defined: names available from enclosing regions; ``None`` skips the
                read-before-write check for this region's free values.

        Raises:
            GraphLintError: naming the node and the broken invariant.
        """
        seen_ids: set[int] = set()
        self._lint(defined, seen_ids)

    def _lint(self, defined: set[str] | None, seen_ids: set[int]) -> None:
        avail = set(defined) if defined is not None else None
        for i, node in enumerate(self._nodes):
            where = f"{self.name}: node %{node.id} ({node.kind}) at {node.where()}"
            if not isinstance(node.kind, NodeKind):
                raise GraphLintError(f"{where}: unknown kind {node.kind!r}")
            if node.id in seen_ids:
                raise GraphLintError(f"{where}: duplicate node id")
            seen_ids.add(node.id)
            if avail is not None:
                missing = [n for n in node.inputs if n not in avail]
                if missing:
                    raise GraphLintError(f"{where}: reads {missing} before they are written")
            k = node.kind
            if k in (NodeKind.STATE_IN, NodeKind.STATE_OUT):
                if not isinstance(node.target, str):
                    raise GraphLintError(f"{where}: target must be an attribute name")
                if k is NodeKind.STATE_IN and (node.inputs or len(node.outputs) != 1):
                    raise GraphLintError(f"{where}: state_in reads nothing and writes one value")
                if k is NodeKind.STATE_OUT and (len(node.inputs) != 1 or node.outputs):
                    raise GraphLintError(f"{where}: state_out reads one value and writes none")
            elif k is NodeKind.CALL:
                if not (isinstance(node.target, tuple) and len(node.target) == 2):
                    raise GraphLintError(f"{where}: call target must be (role, method)")
                used = [a for a in list(node.args) + list(node.kwargs.values()) if isinstance(a, str)]
                if sorted(set(used)) != sorted(set(node.inputs)):
                    raise GraphLintError(f"{where}: inputs {node.inputs} differ from args {used}")
                for a in list(node.args) + list(node.kwargs.values()):
                    if not isinstance(a, (str, Const)):
                        raise GraphLintError(f"{where}: argument {a!r} is neither a value nor Const")
            elif k is NodeKind.COMPUTE:
                if not isinstance(node.target, ast.expr):
                    raise GraphLintError(f"{where}: compute target must be an ast.expr")
                if not node.outputs:
                    raise GraphLintError(f"{where}: compute writes no value")
            elif k is NodeKind.OUTPUT:
                if i != len(self._nodes) - 1:
                    raise GraphLintError(f"{where}: output must be the last node")
            elif region_of(node) is not None:  # loop, branch, allreduce, serve: the region table's own checks
                wrong = region_of(node).lint(node, where, None if avail is None else set(avail),
                                             lambda sub, names: sub._lint(names, seen_ids))
                if wrong is not None:
                    raise GraphLintError(wrong)
            elif k in COMM_KINDS:
                t = node.target
                if not isinstance(t, CommTarget):
                    raise GraphLintError(f"{where}: comm target must be a CommTarget")
                if t.side == "src" and (node.inputs != [t.value] or node.outputs):
                    raise GraphLintError(f"{where}: src side reads the value and writes nothing")
                if t.side == "dst" and (node.outputs != [t.value] or node.inputs):
                    raise GraphLintError(f"{where}: dst side reads nothing and writes the value")
            if avail is not None:
                avail.update(node.outputs)

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, {len(self._nodes)} nodes)"
