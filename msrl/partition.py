"""The partitioner: splits a traced graph into fragments and inserts comm ops (DESIGN.md §3).

Generic over policies; a policy only answers which fragment each ``call`` node belongs to.

1. **Assign.** ``call`` nodes go to their role's fragment. ``compute`` nodes follow the
   fragment of the values they use; when those come from several fragments, they go to the
   fragment of their users. ``state_in`` nodes and computes on them alone (trip counts,
   hyperparameters) are pure and cheap: they are copied into every fragment that uses them.
   ``state_out``/``output`` follow the value they read.
2. **Loops.** A ``loop`` holding nodes of several fragments is copied into each of them, so
   every fragment runs the same trip count and meets the others at the boundaries in lockstep.
3. **Boundaries.** Every value a fragment reads that another fragment wrote gets a comm op,
   chosen by the replica counts and the value's kind (from the probe, :mod:`msrl.probe`):
   equal counts -> ``send``/``recv``; many -> one -> ``gather`` (sharded values);
   one -> many -> ``scatter`` (sharded) or ``broadcast`` (replicated); an asynchronous pair
   of fragments -> ``put``/``get``. Both sides sit at the position of the value's producer in
   program order, so every fragment meets its boundaries in the same global order and
   lockstep execution cannot deadlock. A boundary that fits no rule raises
   :class:`PartitionError` naming the edge.
4. **Order.** Fragments are ordered by their first node in program order. Fragment replicas
   run concurrently, so instead of rejecting cycles between fragments (which a training loop
   always has: trajectories go one way, weights the other) the partitioner checks that any two
   fragments meet their shared boundaries in the same order (:meth:`FragmentGraph.check_schedule`),
   which is what rules out a deadlock.
"""

from __future__ import annotations

import ast
import dataclasses
from collections import defaultdict
from typing import Any

from msrl.graph import COMM_KINDS, CommTarget, Graph, Node, NodeKind
from msrl.policy import DistributionPolicy, FragmentSpec

__all__ = ["PartitionError", "Boundary", "Fragment", "FragmentGraph", "partition", "value_info"]


class PartitionError(ValueError):
    """A graph that a policy cannot split: the message names the node or edge."""


@dataclasses.dataclass(frozen=True)
class Boundary:
    """One value crossing from one fragment to another.

    Attributes:
        name: unique id, ``"<method>/b<k>:<value>"``; both sides' comm nodes carry it.
        method: the traced method (``"train_step"``).
        value: the value name.
        op: the comm kind on both sides (``gather``; ``send``/``recv`` and ``put``/``get``
            pairs are recorded by their src kind).
        src, dst: fragment names; ``src_replicas``, ``dst_replicas``: their replica counts.
        kind: ``"sharded"`` or ``"replicated"`` (``None`` without probe info).
        axis: env-batch axis of a sharded value.
        in_loop: whether the boundary sits inside a loop region.
    """

    name: str
    method: str
    value: str
    op: NodeKind
    src: str
    dst: str
    src_replicas: int
    dst_replicas: int
    kind: str | None
    axis: int | None
    in_loop: bool


@dataclasses.dataclass
class Fragment:
    """One fragment: its spec and, per traced method, its region graph (comm ops included)."""

    spec: FragmentSpec
    programs: dict[str, Graph]

    @property
    def name(self) -> str:
        """The fragment's name (its spec's)."""
        return self.spec.name


@dataclasses.dataclass
class FragmentGraph:
    """The result of partitioning: fragments in order and the boundaries between them.

    Attributes:
        policy: the (overridden) policy used.
        graphs: the traced graphs, per method, before partitioning.
        fragments: fragments in order; each holds a program region per method.
        boundaries: every boundary, in program order per method.
    """

    policy: DistributionPolicy
    graphs: dict[str, Graph]
    fragments: list[Fragment]
    boundaries: list[Boundary]

    def fragment(self, name: str) -> Fragment:
        """The fragment called ``name`` (KeyError if absent)."""
        for f in self.fragments:
            if f.name == name:
                return f
        raise KeyError(name)

    def fragment_of_role(self, role: str) -> Fragment:
        """The fragment running ``role``'s calls."""
        return self.fragment(self.policy.fragment_of_role(role))

    def check_schedule(self) -> None:
        """Checks that any two fragments meet their shared boundaries in the same order.

        Fragments run concurrently and block at boundaries, so this is what rules out a
        deadlock (the role a "cycle between fragments" check plays for partitions run one
        after another). The partitioner guarantees it by placing both sides of a boundary at
        the producer's position in program order; this re-checks the result.

        Raises:
            PartitionError: naming the two fragments and their differing boundary orders.
        """
        for method in self.graphs:
            seqs = {
                fr.name: [n.target.boundary for n in fr.programs[method].walk() if n.kind in COMM_KINDS]
                for fr in self.fragments
            }
            for a in seqs:
                for b in seqs:
                    if a >= b:
                        continue
                    shared_a = [x for x in seqs[a] if any(x == y for y in seqs[b])]
                    shared_b = [x for x in seqs[b] if any(x == y for y in seqs[a])]
                    if shared_a != shared_b:
                        raise PartitionError(
                            f"{method}: fragments {a} and {b} meet their boundaries in different orders "
                            f"({shared_a} vs {shared_b}); running them concurrently would deadlock"
                        )


def value_info(node: Node, name: str) -> dict[str, Any] | None:
    """Probe info (``kind``, ``axis``, ``shape``, ``dtype``) of value ``name`` written by
    ``node``; for a loop, from the body node that last writes it. ``None`` if not probed."""
    if node.kind is NodeKind.LOOP:
        last = node.body.producers().get(name)
        return value_info(last, name) if last is not None else None
    return node.meta.get("values", {}).get(name)


# -- 1. assignment ----------------------------------------------------------------------------
class _Assigner:
    def __init__(self, policy: DistributionPolicy) -> None:
        self.policy = policy
        self.F: dict[int, set[str]] = {}
        self.floating: list[Node] = []
        self.deferred: list[Node] = []
        self.deferred_srcs: dict[int, dict[str, list[str]]] = {}
        self.readers: dict[str, list[Node]] = defaultdict(list)
        self.order = [f.name for f in policy.fragments]

    def run(self, graph: Graph) -> dict[int, set[str]]:
        for node in graph.walk():
            for name in node.inputs:
                self.readers[name].append(node)
        self.region(graph, {})
        # floating (pure, copyable) nodes go wherever their values are read; fixpoint because
        # floating nodes feed each other.
        changed = True
        while changed:
            changed = False
            for node in self.floating + self.deferred:
                users = self.users_frags(node)
                if node in self.deferred and len(users) > 1:
                    continue
                if users - self.F[node.id]:
                    self.F[node.id] |= users
                    changed = True
            for node in graph.walk():
                if node.kind is NodeKind.LOOP:
                    body = {f for n in node.body.walk() for f in self.F[n.id]}
                    if body - self.F[node.id]:
                        self.F[node.id] |= body
                        changed = True
        for node in self.deferred:
            users = self.users_frags(node)
            if len(users) != 1:
                ins = self.deferred_srcs[node.id]
                raise PartitionError(
                    f"compute node %{node.id} at {node.where()} ({ast.unparse(node.target)}) combines values "
                    f"of several fragments {ins} and is used in {sorted(users) or 'no fragment'}; "
                    "split the expression so each part uses one fragment's values"
                )
            self.F[node.id] = users
        return self.F

    def users_frags(self, node: Node) -> set[str]:
        out: set[str] = set()
        for name in node.outputs:
            for r in self.readers.get(name, []):
                if r is not node:
                    out |= self.F.get(r.id, set())
        return out

    def region(self, graph: Graph, written: dict[str, set[str]]) -> None:
        for node in graph:
            k = node.kind
            if k is NodeKind.CALL:
                try:
                    fs = {self.policy.assign(node)}
                except KeyError:
                    raise PartitionError(
                        f"node %{node.id} at {node.where()} calls role {node.role!r}, which policy "
                        f"{self.policy.name} places in no fragment"
                    ) from None
            elif k is NodeKind.LOOP:
                inner = dict(written)
                self.region(node.body, inner)
                fs = {f for n in node.body.walk() for f in self.F[n.id]}
                for name in node.outputs:
                    written[name] = set(inner.get(name, fs))
                self.F[node.id] = fs
                continue
            elif k is NodeKind.STATE_IN:
                fs = set()
                self.floating.append(node)
            elif k is NodeKind.COMPUTE:
                srcs = set().union(*[written.get(n, set()) for n in node.inputs]) if node.inputs else set()
                if not srcs:
                    fs = set()
                    self.floating.append(node)
                elif len(srcs) == 1:
                    fs = srcs
                else:
                    fs = set()
                    self.deferred.append(node)
                    self.deferred_srcs[node.id] = {n: sorted(written.get(n, set())) for n in node.inputs}
            elif k in (NodeKind.STATE_OUT, NodeKind.OUTPUT):
                srcs = set().union(*[written.get(n, set()) for n in node.inputs]) if node.inputs else set()
                fs = {min(srcs, key=self.order.index)} if srcs else {self.order[0]}
            else:
                raise PartitionError(f"node %{node.id} of kind {k} cannot be partitioned (already partitioned?)")
            self.F[node.id] = fs
            for name in node.outputs:
                written[name] = fs


# -- 3. boundaries ----------------------------------------------------------------------------
@dataclasses.dataclass
class _Comm:
    after: int | None  # producer node id in the region (None: at region start)
    value: str
    src: str
    dst: str
    producer: Node


class _CommPlanner:
    def __init__(self, F: dict[int, set[str]], order: list[str]) -> None:
        self.F, self.order = F, order
        self.plan: dict[int, list[_Comm]] = defaultdict(list)  # region id -> comms

    def region(self, graph: Graph) -> dict[str, list[str]]:
        """Plans the comms of ``graph``; returns, per fragment, the names its copy reads from
        outside the region."""
        have: dict[str, set[str]] = {}
        producer: dict[str, Node] = {}
        free: dict[str, list[str]] = defaultdict(list)
        readers_of_free: dict[str, set[str]] = defaultdict(set)
        for node in graph:
            fs = sorted(self.F[node.id], key=self.order.index)
            if node.kind is NodeKind.LOOP:
                body_free = self.region(node.body)
                range_names = [a for a in node.args if isinstance(a, str)]
                reads = {f: range_names + [n for n in body_free.get(f, []) if n != node.target] for f in fs}
                writes = {f: self.written_in(node.body, f) + [node.target] for f in fs}
            else:
                reads = {f: list(node.inputs) for f in fs}
                writes = {f: list(node.outputs) for f in fs}
            for f in fs:
                for x in reads[f]:
                    holders = have.get(x)
                    if holders is None:
                        if x not in free[f]:
                            free[f].append(x)
                        readers_of_free[x].add(f)
                        continue
                    if f not in holders:
                        src = min(holders, key=self.order.index)
                        self.plan[id(graph)].append(_Comm(producer[x].id, x, src, f, producer[x]))
                        holders.add(f)
            for x in {x for f in fs for x in writes[f]}:
                have[x] = {f for f in fs if x in writes[f]}
                producer[x] = node
        # loop-carried values: the next iteration's readers need the value written at the end.
        for x, readers in readers_of_free.items():
            if x in have:
                for f in sorted(readers - have[x], key=self.order.index):
                    src = min(have[x], key=self.order.index)
                    self.plan[id(graph)].append(_Comm(producer[x].id, x, src, f, producer[x]))
        return free

    def written_in(self, body: Graph, frag: str) -> list[str]:
        out: list[str] = []
        for node in body:
            if frag in self.F[node.id]:
                names = node.outputs if node.kind is not NodeKind.LOOP else self.written_in(node.body, frag) + [node.target]
                out += [n for n in names if n not in out]
        for c in self.plan.get(id(body), []):
            if c.dst == frag and c.value not in out:
                out.append(c.value)
        return out


def _choose_op(policy: DistributionPolicy, c: _Comm, info: dict[str, Any] | None) -> tuple[NodeKind, NodeKind, int | None]:
    src, dst = policy.fragment(c.src), policy.fragment(c.dst)
    edge = (
        f"value {c.value!r} written by %{c.producer.id} at {c.producer.where()} in fragment {src.name} (x{src.replicas}) "
        f"and read in fragment {dst.name} (x{dst.replicas})"
    )
    if (src.name, dst.name) in policy.async_boundaries:
        return NodeKind.PUT, NodeKind.GET, None
    if src.replicas == dst.replicas:
        return NodeKind.SEND, NodeKind.RECV, None
    if info is None:
        raise PartitionError(f"{edge}: no probe info says whether it is sharded or replicated; run msrl.probe first")
    kind, axis = info["kind"], info.get("axis")
    if src.replicas > 1 and dst.replicas == 1:
        if kind == "sharded":
            return NodeKind.GATHER, NodeKind.GATHER, axis
        raise PartitionError(
            f"{edge}: a replicated value cannot be gathered from many replicas to one; "
            "reduce it inside a component or make it sharded along the env axis"
        )
    if src.replicas == 1 and dst.replicas > 1:
        if kind == "sharded":
            return NodeKind.SCATTER, NodeKind.SCATTER, axis
        return NodeKind.BROADCAST, NodeKind.BROADCAST, None
    raise PartitionError(f"{edge}: no comm op moves a value between {src.replicas} and {dst.replicas} replicas")


# -- building the fragments -------------------------------------------------------------------
def _copy(node: Node) -> Node:
    return dataclasses.replace(node, inputs=list(node.inputs), outputs=list(node.outputs), meta=dict(node.meta))


class _Builder:
    def __init__(self, method: str, F: dict[int, set[str]], planner: _CommPlanner, policy: DistributionPolicy, next_id: int) -> None:
        self.method, self.F, self.planner, self.policy = method, F, planner, policy
        self.next_id = next_id
        self.boundaries: dict[tuple[int, str, str, str], Boundary] = {}
        self.count = 0

    def boundary(self, c: _Comm, in_loop: bool) -> tuple[Boundary, NodeKind, NodeKind]:
        key = (c.producer.id, c.value, c.src, c.dst)
        info = value_info(c.producer, c.value)
        src_kind, dst_kind, axis = _choose_op(self.policy, c, info)
        if key not in self.boundaries:
            s, d = self.policy.fragment(c.src), self.policy.fragment(c.dst)
            self.boundaries[key] = Boundary(
                name=f"{self.method}/b{self.count}:{c.value}",
                method=self.method,
                value=c.value,
                op=src_kind,
                src=c.src,
                dst=c.dst,
                src_replicas=s.replicas,
                dst_replicas=d.replicas,
                kind=info["kind"] if info else None,
                axis=axis,
                in_loop=in_loop,
            )
            self.count += 1
        return self.boundaries[key], src_kind, dst_kind

    def comm_nodes(self, comms: list[_Comm], frag: str, in_loop: bool) -> list[Node]:
        out = []
        for c in comms:
            if frag not in (c.src, c.dst):
                continue
            b, src_kind, dst_kind = self.boundary(c, in_loop)
            side = "src" if frag == c.src else "dst"
            target = CommTarget(b.name, c.value, c.src, c.dst, side, b.axis)
            node = Node(
                src_kind if side == "src" else dst_kind,
                target,
                inputs=[c.value] if side == "src" else [],
                outputs=[c.value] if side == "dst" else [],
                meta={"file": c.producer.meta.get("file", "<generated>"), "line": c.producer.meta.get("line", 0), "fragment": frag},
            )
            node.id = self.next_id + list(self.boundaries).index((c.producer.id, c.value, c.src, c.dst)) * 2 + (side == "dst")
            out.append(node)
        return out

    def build(self, graph: Graph, frag: str, in_loop: bool = False) -> Graph:
        g = Graph(graph.name)
        comms = self.planner.plan.get(id(graph), [])
        by_after: dict[int, list[_Comm]] = defaultdict(list)
        for c in comms:
            by_after[c.after].append(c)
        for node in graph:
            if frag in self.F[node.id]:
                copy = _copy(node)
                copy.meta["fragment"] = frag
                if node.kind is NodeKind.LOOP:
                    copy.body = self.build(node.body, frag, in_loop=True)
                    free = [n for n in copy.body.free_values() if n != node.target]
                    range_names = [a for a in node.args if isinstance(a, str)]
                    copy.inputs = range_names + [n for n in free if n not in range_names]
                    copy.outputs = copy.body.written_values() + ([node.target] if node.target not in copy.body.written_values() else [])
                    copy.meta["carried"] = [n for n in free if n in copy.body.written_values()]
                g.append(copy)
            for cnode in self.comm_nodes(by_after.get(node.id, []), frag, in_loop):
                g.append(cnode)
        return g


def partition(graphs: dict[str, Graph], policy: DistributionPolicy) -> FragmentGraph:
    """Splits traced graphs into the fragments of ``policy``.

    Args:
        graphs: method name -> traced graph (``{"reset": ..., "train_step": ...}``), probed
            (:func:`msrl.probe.probe`) when the policy has fragments with different replica counts.
        policy: the distribution policy (with YAML overrides applied).

    Returns:
        a :class:`FragmentGraph` whose fragment programs are linted.

    Raises:
        PartitionError: a node or boundary the policy cannot place, naming it.
    """
    order = [f.name for f in policy.fragments]
    boundaries: list[Boundary] = []
    programs: dict[str, dict[str, Graph]] = {f: {} for f in order}
    first_seen: dict[str, int] = {}
    next_id = 1 + max((n.id for g in graphs.values() for n in g.walk()), default=0)
    for method, graph in graphs.items():
        graph.lint(defined=set())
        F = _Assigner(policy).run(graph)
        planner = _CommPlanner(F, order)
        planner.region(graph)
        builder = _Builder(method, F, planner, policy, next_id)
        for f in order:
            programs[f][method] = builder.build(graph, f)
        for i, node in enumerate(graph.walk()):
            for f in F[node.id]:
                first_seen.setdefault(f, i + 10_000 * list(graphs).index(method))
        boundaries += list(builder.boundaries.values())
        next_id += 2 * len(builder.boundaries)
    fragments = [Fragment(policy.fragment(f), programs[f]) for f in order]
    fragments.sort(key=lambda fr: first_seen.get(fr.name, 10**9))
    fg = FragmentGraph(policy, graphs, fragments, boundaries)
    for fr in fragments:
        for method, g in fr.programs.items():
            g.name = f"{fr.name}.{method}"
            g.lint(defined=set())
    fg.check_schedule()
    return fg
