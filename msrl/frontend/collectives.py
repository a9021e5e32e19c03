"""The collective-placement pass: an ``allreduce`` region at every collective point a replicated
learner reaches (DESIGN.md §3; :data:`msrl.api.COLLECTIVE_POINTS`).

Under a policy whose learner fragment has several replicas (``multi_learner``), every call of
that fragment that reaches :meth:`~msrl.api.Learner.apply_gradients` (the gradient all-reduce,
DD-PPO, Wijmans et al. 2020, as torch DDP averages gradients) or
:meth:`~msrl.api.Learner.reduce_statistics` (its running statistics, as SyncBatchNorm's
collective beside DDP's) is wrapped in one ``allreduce`` region per point, the first point
outermost; each region is a :class:`~msrl.graph.fragmented.Collective` of the graph. Which points a
call reaches is what the probe saw (``meta["collective_steps"]``); a learner call the probe never
ran reaches every point (to be safe).
"""

from __future__ import annotations

from msrl.api import COLLECTIVE_POINTS
from msrl.errors import PartitionError
from msrl.graph import CommTarget, Graph, Node, NodeKind
from msrl.graph.fragmented import Collective, FragmentGraph

__all__ = ["place_collectives", "collective_points"]


def collective_points(fg: FragmentGraph, node: Node, fragment: str) -> list[str]:
    """The collective points ``node`` (a node of ``fragment``'s program) reaches that the
    fragment's replicas average, outermost first: none unless ``fragment`` has several replicas
    holding the learner.

    Raises:
        PartitionError: the call steps an optimiser outside ``apply_gradients`` (``file:line``
            of both).
    """
    spec = fg.policy.fragment(fragment)
    if node.kind is not NodeKind.CALL or spec.replicas < 2 or "learner" not in spec.roles:
        return []
    if "direct_step" in node.meta:
        raise PartitionError(
            f"{node.describe()} at {node.where()} steps an optimiser outside apply_gradients (at "
            f"{node.meta['direct_step']}): fragment {fragment} has {spec.replicas} replicas whose gradients are averaged "
            "at every apply_gradients, so this step would make the replicas' weights diverge silently; take the "
            "step through self.apply_gradients(loss, optimizer=...), or give the learner one replica")
    if "collective_steps" in node.meta:
        return [p for p in COLLECTIVE_POINTS if node.meta["collective_steps"].get(p)]
    return list(COLLECTIVE_POINTS) if node.role == "learner" else []


class _Placer:
    """Wraps the calls of one method's fragment programs, numbering the method's collectives."""

    def __init__(self, fg: FragmentGraph, method: str, next_id: int) -> None:
        self.fg, self.method, self.next_id = fg, method, next_id
        self.placed: list[Collective] = []

    def region(self, inner: Node, call: Node, point: str, k: int, fragment: str, in_loop: bool,
               in_branch: bool) -> Node:
        step = call.meta.get("collective_steps", {}).get(point)
        c = Collective(name=f"{self.method}/a{k}:{point}", method=self.method, fragment=fragment,
                       replicas=self.fg.policy.fragment(fragment).replicas,
                       call=f"{call.target[0]}.{call.target[1]} ({call.where()})", value=point,
                       gradient_step=step, in_loop=in_loop, in_branch=in_branch)
        self.placed.append(c)
        body = Graph(f"{call.meta.get('fragment', fragment)}.allreduce")
        body.append(inner)
        node = Node(NodeKind.ALLREDUCE, CommTarget(c.name, point, fragment, fragment, "all"), inputs=body.free_values(),
                    outputs=body.written_values(), body=body,
                    meta={"file": call.meta.get("file", "<generated>"), "line": call.meta.get("line", 0),
                          "fragment": fragment, "role": call.role,
                          **({"gradient_step": step} if point == "gradients" else {})})
        node.id = self.next_id + k
        return node

    def wrap(self, graph: Graph, fragment: str, in_loop: bool = False, in_branch: bool = False) -> None:
        """Wraps, in place (``graph`` is the pass's own copy), every call of ``graph`` and its
        sub-graphs that reaches a collective point; pre-order, so collectives number in program
        order. A region's inputs and outputs stay as they are: an ``allreduce`` region reads
        and writes what its call does."""
        for node in graph.nodes:
            points = collective_points(self.fg, node, fragment)
            if points:
                base, wrapped = len(self.placed), node
                for j in reversed(range(len(points))):  # the first point outermost, numbered first
                    wrapped = self.region(wrapped, node, points[j], base + j, fragment, in_loop, in_branch)
                self.placed[base:] = self.placed[base:][::-1]  # in program order
                graph.replace(node, wrapped)
                continue
            if node.kind is NodeKind.LOOP:
                self.wrap(node.body, fragment, True, in_branch)
            elif node.kind is NodeKind.BRANCH:
                self.wrap(node.body, fragment, in_loop, True)
                self.wrap(node.orelse, fragment, in_loop, True)


def place_collectives(fg: FragmentGraph) -> FragmentGraph:
    """The pass: ``fg`` with an ``allreduce`` region at every collective point its replicated
    learner reaches, and those regions in ``collectives`` (per method, in program order).

    Args:
        fg: a partitioned graph (:func:`msrl.frontend.partition.partition`), without collectives yet.

    Returns:
        a new :class:`~msrl.graph.fragmented.FragmentGraph` (``fg`` itself unchanged; the same
        object where nothing is replicated with a learner), its programs linted.

    Raises:
        PartitionError: a call steps an optimiser outside ``apply_gradients`` in a replicated
            learner.
    """
    if not any(f.replicas > 1 and "learner" in f.roles for f in fg.policy.fragments):
        return fg
    out = fg.copy()
    next_id = out.next_node_id()
    order = [f.name for f in fg.policy.fragments]  # the policy's order: the collectives' numbering
    for method in fg.graphs:
        placer = _Placer(out, method, next_id)
        for name in order:
            placer.wrap(out.fragment(name).programs[method], name)
        out.collectives += placer.placed
        next_id += len(placer.placed)
    for fr in out.fragments:
        for g in fr.programs.values():
            g.lint(defined=set())
    return out
