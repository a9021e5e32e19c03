"""Def-use over a region graph: reaching definitions across nested regions (:class:`DefUse`)."""

from __future__ import annotations

from collections import defaultdict

from msrl.graph.graph import Graph
from msrl.graph.node import Node, NodeKind

__all__ = ["DefUse", "Env"]

#: value name -> ids of the nodes whose writes of it may reach a point
Env = dict[str, frozenset[int]]


def _merge(a: Env, b: Env) -> Env:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, frozenset()) | v
    return out


class DefUse:
    """Reaching definitions of one traced method's region graph, over its nested regions (a loop's
    body to a fixpoint: zero or more trips; a branch's two arms merged): which node's write of a
    value each read may see. The one def-use analysis of the front end: the partitioner places
    boundaries by it, central inference's plan finds the values its served region leaves live.

    Args:
        graph: a method's top region (:class:`~msrl.graph.graph.Graph`).

    Attributes:
        nodes: id -> node, for every node of every region.
        uses: ``(user id, value) -> ids of the definitions reaching that read``. A loop node
            reads its range arguments, a branch node its condition.
        after: ``(region id, node id) -> env`` right after a node of a region.
        chain: node id -> ``[(region, ancestor node in it), ...]`` from the method's top
            region down to the node itself.
    """

    def __init__(self, graph: Graph) -> None:
        self.nodes: dict[int, Node] = {}
        self.uses: dict[tuple[int, str], frozenset[int]] = {}
        self.after: dict[tuple[int, int], Env] = {}
        self.chain: dict[int, list[tuple[Graph, Node]]] = {}
        self.region_of: dict[int, Graph] = {}
        self._index(graph, [])
        self._run(graph, {})

    def _index(self, region: Graph, prefix: list[tuple[Graph, Node]]) -> None:
        for node in region:
            self.nodes[node.id] = node
            self.region_of[node.id] = region
            self.chain[node.id] = prefix + [(region, node)]
            for sub in node.regions():
                self._index(sub, prefix + [(region, node)])

    def _run(self, region: Graph, env: Env) -> Env:
        env = dict(env)
        for node in region:
            if node.kind is NodeKind.LOOP:
                for a in node.args:
                    if isinstance(a, str):
                        self.uses[(node.id, a)] = env.get(a, frozenset())
                entry = dict(env)
                if node.target:
                    entry[node.target] = frozenset({node.id})
                while True:  # zero or more trips: iterate the body to a fixpoint
                    out = self._run(node.body, entry)
                    grown = _merge(entry, out)
                    if grown == entry:
                        break
                    entry = grown
                env = _merge(env, out)
                if node.target:
                    env[node.target] = env.get(node.target, frozenset()) | {node.id}
            elif node.kind is NodeKind.BRANCH:
                if isinstance(node.target, str):
                    self.uses[(node.id, node.target)] = env.get(node.target, frozenset())
                env = _merge(self._run(node.body, env), self._run(node.orelse, env))
            else:
                for name in node.inputs:
                    self.uses[(node.id, name)] = env.get(name, frozenset())
                for name in node.outputs:
                    env[name] = frozenset({node.id})
            self.after[(id(region), node.id)] = dict(env)
        return env

    @staticmethod
    def reads(node: Node) -> list[str]:
        """The value names ``node`` reads, as :attr:`uses` keys them: its inputs, a loop's range
        arguments, a branch's condition."""
        if node.kind is NodeKind.LOOP:
            return [a for a in node.args if isinstance(a, str)]
        if node.kind is NodeKind.BRANCH:
            return [node.target] if isinstance(node.target, str) else []
        return list(node.inputs)

    def users(self) -> dict[int, list[tuple[int, str]]]:
        """Definition id -> ``[(user id, value), ...]``."""
        out: dict[int, list[tuple[int, str]]] = defaultdict(list)
        for (u, name), defs in self.uses.items():
            for d in defs:
                out[d].append((u, name))
        return out

    def position(self, d: int, u: int) -> tuple[Graph, Node]:
        """Where a value defined by ``d`` and read by ``u`` crosses: the innermost region
        holding both, and the node of that region the definition lies in (the comm goes right
        after it)."""
        cd, cu = self.chain[d], self.chain[u]
        level = 0
        for i in range(min(len(cd), len(cu))):
            if cd[i][0] is cu[i][0]:
                level = i
            else:
                break
        return cd[level]

    def in_regions(self, region: Graph, node_id: int) -> tuple[bool, bool]:
        """Whether position ``region`` is inside a loop, inside a branch."""
        in_loop = in_branch = False
        chain = self.chain[node_id]
        for r, owner in chain:
            if r is region:
                break
            if owner.kind is NodeKind.LOOP:
                in_loop = True
            if owner.kind is NodeKind.BRANCH:
                in_branch = True
        return in_loop, in_branch
