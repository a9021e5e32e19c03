"""The partitioner: splits traced graphs into fragments and inserts comm ops (DESIGN.md §3).

Generic over policies; a policy only answers which fragment each ``call`` node belongs to (by
its role). Everything else follows the graph's **def-use edges**, computed by a reaching-
definitions pass over the nested regions (loops run zero or more times; a branch takes one
side), never by value names:

1. **Assign** (one fixpoint over ``reset`` and ``train_step`` together).

   * ``call`` nodes go to their role's fragment.
   * *Control* nodes (``meta["control"]``: ``state_in``/``compute``/``state_out`` of control
     values, see :mod:`msrl.frontend.tracer`) are copied into every fragment that uses them; a control
     trainer attribute is kept by every fragment that reads it, so each fragment computes its
     own identical copy of a step counter.
   * A data ``compute`` follows the fragment of the data it reads; when that comes from
     several fragments it goes to the one fragment that uses its result. A data compute that
     reads no data (``torch.rand(3)``) runs in the first fragment that uses it.
   * A data trainer attribute (``self.obs``) is owned by the fragment that writes it: its
     ``state_in`` and ``state_out`` run there, and another fragment that reads it receives it
     over a boundary at the start of the method. Writes from two fragments are an error.
   * A ``loop`` or ``branch`` region is copied into every fragment that has a node in it, so
     every fragment runs the same trip counts, takes the same sides (their conditions are
     control values) and meets the others at the boundaries in lockstep.
2. **Boundaries.** For every def-use edge whose use runs in a fragment the definition does
   not, a comm op moves the value at the innermost region holding both, right after the
   definition's node there (after the loop, for a value a loop computes; at the end of an
   iteration, for a loop-carried value). The op is chosen by the replica counts and the
   value's kind, declared by the component method (:func:`msrl.api.returns`) or observed by
   the probe (:mod:`msrl.frontend.probe`): equal counts -> ``send``/``recv``; many -> one ->
   ``gather`` (sharded values and batches); one -> many -> ``scatter`` (sharded, batches) or
   ``broadcast`` (replicated). A ``train_step`` boundary in one of the policy's asynchronous
   classes (a ``fifo`` queue or a ``latest`` slot, chosen in YAML) is ``put``/``get`` instead,
   combining values between the replica counts as that collective would. A boundary that fits
   no rule raises :class:`PartitionError` naming the edge.
3. **Order.** Fragments are ordered by their first node in program order. Fragment replicas
   run concurrently, so instead of rejecting cycles between fragments (which a training loop
   always has: trajectories go one way, weights the other) the partitioner checks that any two
   fragments meet their shared boundaries in the same order (:meth:`FragmentGraph.check_schedule`).
"""

from __future__ import annotations

import ast
import dataclasses
from collections import defaultdict
from typing import Any, Iterable

from msrl.errors import PartitionError
from msrl.graph import CommTarget, Graph, Node, NodeKind
from msrl.graph.defuse import DefUse
from msrl.graph.fragmented import Boundary, Fragment, FragmentGraph, value_info
from msrl.policy import DistributionPolicy

__all__ = ["partition", "boundary_values"]


# -- 1. assignment ----------------------------------------------------------------------------
@dataclasses.dataclass
class _Comm:
    method: str
    region: Graph
    after: Node  # the node of ``region`` the comm follows
    value: str
    src: str
    dst: str
    defs: list[Node]  # the data definitions the value may come from
    reader: Node  # one node that reads it in ``dst`` (for messages)


class _Assigner:
    """The fixpoint of step 1, over every traced method at once."""

    def __init__(self, graphs: dict[str, Graph], policy: DistributionPolicy) -> None:
        self.graphs, self.policy = graphs, policy
        self.order = [f.name for f in policy.fragments]
        self.flows = {m: DefUse(g) for m, g in graphs.items()}
        self.users = {m: fl.users() for m, fl in self.flows.items()}
        #: (method, node id) -> the fragments the node runs in (the fixpoint being computed)
        self.fragments_of: dict[tuple[str, int], set[str]] = {}
        self.comms: dict[tuple[str, int, int, str, str], _Comm] = {}
        # trainer attribute -> its state_in / state_out nodes over every method
        self.state_in: dict[str, list[tuple[str, Node]]] = defaultdict(list)
        self.state_out: dict[str, list[tuple[str, Node]]] = defaultdict(list)
        for m, g in graphs.items():
            for node in g.walk():
                if node.kind is NodeKind.STATE_IN:
                    self.state_in[node.target].append((m, node))
                elif node.kind is NodeKind.STATE_OUT:
                    self.state_out[node.target].append((m, node))

    # helpers
    def f(self, m: str, node: Node | int) -> set[str]:
        nid = node if isinstance(node, int) else node.id
        return self.fragments_of.setdefault((m, nid), set())

    def node(self, m: str, nid: int) -> Node:
        return self.flows[m].nodes[nid]

    @staticmethod
    def control(node: Node) -> bool:
        """Whether a definition is of a control value (a loop node defines its index)."""
        if node.kind is NodeKind.LOOP:
            return True
        return bool(node.meta.get("control")) and node.kind in (NodeKind.STATE_IN, NodeKind.COMPUTE, NodeKind.STATE_OUT)

    def data_defs(self, m: str, defs: Iterable[int]) -> list[Node]:
        return [self.node(m, d) for d in sorted(defs) if not self.control(self.node(m, d))]

    def frags_of(self, m: str, defs: Iterable[Node]) -> set[str]:
        out: set[str] = set()
        for d in defs:
            out |= self.f(m, d)
        return out

    def first(self, frags: Iterable[str]) -> str:
        return min(frags, key=self.order.index)

    def owner(self, attr: str) -> set[str]:
        """Fragments writing data attribute ``attr`` (its own old value excluded)."""
        out: set[str] = set()
        for m, so in self.state_out[attr]:
            defs = [d for d in self.data_defs(m, self.flows[m].uses[(so.id, so.inputs[0])])
                    if not (d.kind is NodeKind.STATE_IN and d.target == attr)]
            out |= self.frags_of(m, defs)
        return out

    def user_frags(self, m: str, node: Node) -> set[str]:
        out: set[str] = set()
        for u, _ in self.users[m].get(node.id, []):
            out |= self.f(m, u)
        return out

    # the fixpoint
    def run(self) -> None:
        for m, g in self.graphs.items():
            for node in g.walk():
                if node.kind is NodeKind.CALL:
                    try:
                        self.fragments_of[(m, node.id)] = {self.policy.assign(node)}
                    except KeyError:
                        raise PartitionError(
                            f"node %{node.id} at {node.where()} calls role {node.role!r}, which policy "
                            f"{self.policy.name} places in no fragment"
                        ) from None
        for _ in range(1000):
            changed = False
            for m, g in self.graphs.items():
                for node in g.walk():
                    new = self.rule(m, node)
                    if new is not None and new != self.f(m, node):
                        self.fragments_of[(m, node.id)] = new
                        changed = True
            self.comms = {}
            changed |= self.plan_comms()
            if not changed:
                break
        else:  # pragma: no cover - the rules only grow sets
            raise PartitionError("the fragment assignment did not settle (a bug in msrl)")
        self.check()

    def rule(self, m: str, node: Node) -> set[str] | None:
        k, cur = node.kind, self.f(m, node)
        if k is NodeKind.CALL:
            return None
        if k in (NodeKind.LOOP, NodeKind.BRANCH):
            return {f for r in node.regions() for n in r for f in self.f(m, n)}
        if self.control(node):
            need = cur | self.user_frags(m, node)
            if k is NodeKind.STATE_OUT:  # every fragment reading the attribute keeps it
                for m2, si in self.state_in[node.target]:
                    need |= self.f(m2, si)
            return need
        # data nodes: recomputed each round from what they read
        if k in (NodeKind.STATE_IN, NodeKind.STATE_OUT):
            return self.owner(node.target)
        if k is NodeKind.OUTPUT:
            if not node.inputs:
                return {self.order[0]}
            srcs = self.frags_of(m, self.data_defs(m, self.flows[m].uses[(node.id, node.inputs[0])]))
            return srcs or {self.order[0]}
        srcs: set[str] = set()
        for name in node.inputs:
            srcs |= self.frags_of(m, self.data_defs(m, self.flows[m].uses[(node.id, name)]))
        if len(srcs) == 1:
            return srcs
        users = self.user_frags(m, node)
        if not srcs:  # reads no data (an impure call on control values): the first user runs it
            return {self.first(users)} if users else {self.order[0]}
        return users  # mixes fragments: runs where its result is used

    def plan_comms(self) -> bool:
        """Finds every cross-fragment def-use edge; makes sure the sending fragment holds every
        definition that may reach the comm's position. Returns whether an F grew."""
        grown = False
        self.check_owners()
        for m, flow in self.flows.items():
            for (u, name), defs in flow.uses.items():
                for d in self.data_defs(m, defs):
                    for dst in sorted(self.f(m, u) - self.f(m, d), key=self.order.index):
                        region, after = flow.position(d.id, u)
                        key = (m, id(region), after.id, name, dst)
                        at = flow.after[(id(region), after.id)].get(name, frozenset())
                        data = self.data_defs(m, at)
                        srcs = self.frags_of(m, data)
                        if len(srcs) != 1:
                            if not srcs:
                                continue  # not assigned yet
                            where = ", ".join(f"%{x.id} at {x.where()} in {sorted(self.f(m, x))}" for x in data)
                            raise PartitionError(
                                f"{m}: value {name!r} read by %{u} at {self.node(m, u).where()} in fragment {dst} may "
                                f"come from several fragments ({where}); assign it in one fragment, or give the "
                                "values different names"
                            )
                        src = next(iter(srcs))
                        if src == dst:
                            continue
                        for c in at:
                            cn = self.node(m, c)
                            if self.control(cn) and cn.kind is not NodeKind.LOOP and src not in self.f(m, cn):
                                self.fragments_of[(m, c)] = self.f(m, cn) | {src}
                                grown = True
                        if key not in self.comms:
                            self.comms[key] = _Comm(m, region, after, name, src, dst, data, self.node(m, u))
        return grown

    def check(self) -> None:
        self.check_owners()
        for m, g in self.graphs.items():
            for node in g.walk():
                if node.kind is NodeKind.COMPUTE and not self.control(node) and len(self.f(m, node)) > 1:
                    srcs = {
                        n: sorted(self.frags_of(m, self.data_defs(m, self.flows[m].uses[(node.id, n)])))
                        for n in node.inputs
                    }
                    if len({f for v in srcs.values() for f in v}) > 1:
                        raise PartitionError(
                            f"compute node %{node.id} at {node.where()} ({ast.unparse(node.target)}) combines values "
                            f"of several fragments {srcs} and is used in {sorted(self.f(m, node))}; "
                            "split the expression so each part uses one fragment's values"
                        )
        for m, g in self.graphs.items():
            out = g.nodes[-1]
            if out.kind is NodeKind.OUTPUT and len(self.f(m, out)) > 1:
                raise PartitionError(
                    f"{m}: the value returned at {out.where()} comes from fragments {sorted(self.f(m, out))} "
                    "depending on the branch taken; return values computed in one fragment"
                )

    def check_owners(self) -> None:
        """Raises PartitionError when a data attribute is written by several fragments."""
        for attr, outs in self.state_out.items():
            if not outs or self.control(outs[0][1]):
                continue
            owners = self.owner(attr)
            if len(owners) > 1:
                writes = []
                for m, so in outs:
                    for d in self.data_defs(m, self.flows[m].uses[(so.id, so.inputs[0])]):
                        if not (d.kind is NodeKind.STATE_IN and d.target == attr):
                            writes.append(f"{d.where()} (fragment {', '.join(sorted(self.f(m, d)))})")
                raise PartitionError(
                    f"trainer attribute self.{attr} is written by several fragments: {'; '.join(writes)}; "
                    "a data attribute has one owner: write it in one fragment, or use two attributes"
                )


# -- 2. boundaries ----------------------------------------------------------------------------
def _info(c: _Comm) -> dict[str, Any] | None:
    infos = [i for i in (value_info(d, c.value) for d in c.defs) if i is not None]
    if not infos:
        return None
    kinds = {i["kind"] for i in infos}
    if len(kinds) > 1:
        where = ", ".join(d.where() for d in c.defs)
        raise PartitionError(
            f"value {c.value!r} read in fragment {c.dst} is {' at one definition and '.join(sorted(kinds))} at another "
            f"({where}); both must relate to the env axis the same way"
        )
    return infos[0]


def _choose_op(policy: DistributionPolicy, c: _Comm, info: dict[str, Any] | None) -> tuple[NodeKind, NodeKind, int | None]:
    """The comm kinds of both sides and the axis: the synchronous collective the replica
    counts and the value's kind call for (an asynchronous boundary combines values the same
    way, through ``put``/``get``)."""
    src, dst = policy.fragment(c.src), policy.fragment(c.dst)
    producer = c.defs[0]
    edge = (
        f"value {c.value!r} written by %{producer.id} at {producer.where()} in fragment {src.name} (x{src.replicas}) "
        f"and read by %{c.reader.id} at {c.reader.where()} in fragment {dst.name} (x{dst.replicas})"
    )
    if info is not None and info["kind"] == "partial" and src.replicas > 1:
        return NodeKind.REDUCE, NodeKind.REDUCE, None  # every dst replica gets the whole sum
    if src.replicas == dst.replicas:
        return NodeKind.SEND, NodeKind.RECV, None
    if info is None:
        raise PartitionError(
            f"{edge}: no probe run observed it and its method declares no kind, so msrl cannot tell whether it is "
            "sharded, a batch, partial or replicated; declare it with @msrl.api.returns(...) on the component method"
        )
    kind, axis = info["kind"], info.get("axis")
    few, many = sorted((src.replicas, dst.replicas))
    if many % few:
        raise PartitionError(f"{edge}: no comm op moves a value between {src.replicas} and {dst.replicas} replicas: "
                             "a gather or scatter needs one replica count to be a multiple of the other (set "
                             f"distribution_policy.replicas.{dst.name} to a divisor or multiple of {src.replicas})")
    groups = "" if few == 1 else f" in groups of {many // few}"
    if src.replicas > dst.replicas:  # a gather to each dst replica from its group of src replicas
        if kind in ("sharded", "batch"):
            return NodeKind.GATHER, NodeKind.GATHER, axis
        raise PartitionError(
            f"{edge}: a replicated value cannot be gathered from many replicas to fewer{groups}; if each replica "
            "holds a part of a sum (the gradients of its own rollout), declare it @msrl.api.returns('partial') "
            "(summed over the replicas; reduce='mean' averages them); if it has one row per env, make it sharded "
            "along the env axis; if it is the same on every replica, send it from one fragment that has one replica"
        )
    if kind in ("sharded", "batch"):  # each src replica's rows split over its group of dst replicas
        return NodeKind.SCATTER, NodeKind.SCATTER, axis
    return NodeKind.BROADCAST, NodeKind.BROADCAST, None


def _copy(node: Node) -> Node:
    return dataclasses.replace(node, inputs=list(node.inputs), outputs=list(node.outputs), meta=dict(node.meta))


class _Builder:
    def __init__(self, method: str, assigner: _Assigner, policy: DistributionPolicy, next_id: int) -> None:
        self.method, self.a, self.policy = method, assigner, policy
        self.next_id = next_id
        self.by_pos: dict[tuple[int, int], list[_Comm]] = defaultdict(list)
        self.boundaries: dict[int, tuple[Boundary, NodeKind, NodeKind]] = {}
        comms = [c for (m, *_), c in assigner.comms.items() if m == method]
        order = {n.id: i for i, n in enumerate(assigner.graphs[method].walk())}
        comms.sort(key=lambda c: (order[c.after.id], assigner.order.index(c.dst)))
        flow = assigner.flows[method]
        for k, c in enumerate(comms):
            info = _info(c)
            src_kind, dst_kind, axis = _choose_op(policy, c, info)
            pattern = src_kind
            channel, cls = policy.boundary_channel(method, c.src, c.dst)
            if channel != "sync":  # a queue or a latest-value slot, combining values as the collective would
                src_kind, dst_kind = NodeKind.PUT, NodeKind.GET
            s, d = policy.fragment(c.src), policy.fragment(c.dst)
            in_loop, in_branch = flow.in_regions(c.region, c.after.id)
            b = Boundary(
                name=f"{method}/b{k}:{c.value}",
                method=method,
                value=c.value,
                comm_kind=src_kind,
                pattern=pattern,
                channel=channel,
                boundary_class=cls,
                capacity=policy.queue_capacity,
                src=c.src,
                dst=c.dst,
                src_replicas=s.replicas,
                dst_replicas=d.replicas,
                value_kind=info["kind"] if info else None,
                axis=axis,
                reduce=info.get("reduce") if info else None,
                in_loop=in_loop,
                in_branch=in_branch,
            )
            self.boundaries[id(c)] = (b, src_kind, dst_kind)
            self.by_pos[(id(c.region), c.after.id)].append(c)
        self.index = {id(c): k for k, c in enumerate(comms)}

    def comm_nodes(self, comms: list[_Comm], frag: str) -> list[Node]:
        out = []
        for c in comms:
            if frag not in (c.src, c.dst):
                continue
            b, src_kind, dst_kind = self.boundaries[id(c)]
            side = "src" if frag == c.src else "dst"
            target = CommTarget(b.name, c.value, c.src, c.dst, side, b.axis)
            producer = c.defs[0]
            node = Node(
                src_kind if side == "src" else dst_kind,
                target,
                inputs=[c.value] if side == "src" else [],
                outputs=[c.value] if side == "dst" else [],
                meta={"file": producer.meta.get("file", "<generated>"), "line": producer.meta.get("line", 0), "fragment": frag},
            )
            node.id = self.next_id + 2 * self.index[id(c)] + (side == "dst")
            out.append(node)
        return out

    def build(self, graph: Graph, frag: str, in_loop: bool = False, in_branch: bool = False) -> Graph:
        g = Graph(graph.name)
        for node in graph:
            if frag in self.a.f(self.method, node):
                copy = _copy(node)
                copy.meta["fragment"] = frag
                if node.kind is NodeKind.LOOP:
                    copy.body = self.build(node.body, frag, True, in_branch)
                    written = copy.body.written_values()
                    free = [n for n in copy.body.free_values() if n != node.target]
                    range_names = [a for a in node.args if isinstance(a, str)]
                    copy.inputs = range_names + [n for n in free if n not in range_names]
                    copy.outputs = written + ([node.target] if node.target not in written else [])
                    copy.meta["carried"] = [n for n in free if n in written]
                elif node.kind is NodeKind.BRANCH:
                    copy.body = self.build(node.body, frag, in_loop, True)
                    copy.orelse = self.build(node.orelse, frag, in_loop, True)
                    sides = [copy.body, copy.orelse]
                    cond = [node.target] if isinstance(node.target, str) else []
                    copy.inputs = list(dict.fromkeys(cond + [n for r in sides for n in r.free_values()]))
                    copy.outputs = list(dict.fromkeys(n for r in sides for n in r.written_values()))
                g.append(copy)
            for cnode in self.comm_nodes(self.by_pos.get((id(graph), node.id), []), frag):
                g.append(cnode)
        return g


def boundary_values(graphs: dict[str, Graph], policy: DistributionPolicy) -> list[tuple[str, Node, str]]:
    """The values that cross between fragments with different replica counts: what the probe
    must observe (or a declaration must describe) before :func:`partition` can choose their
    comm ops.

    Returns:
        ``(method, defining node, value name)`` triples.

    Raises:
        PartitionError: as :func:`partition` does for assignment problems.
    """
    assigner = _Assigner(graphs, policy)
    assigner.run()
    out = []
    for (m, *_), c in assigner.comms.items():
        if policy.fragment(c.src).replicas != policy.fragment(c.dst).replicas:
            out += [(m, d, c.value) for d in c.defs]
    return out


def partition(graphs: dict[str, Graph], policy: DistributionPolicy) -> FragmentGraph:
    """Splits traced graphs into the fragments of ``policy``.

    Args:
        graphs: method name -> traced graph (``{"reset": ..., "train_step": ...}``), traced
            together (:func:`msrl.frontend.tracer.trace_methods`) and probed (:func:`msrl.frontend.probe.probe`)
            when the policy has fragments with different replica counts.
        policy: the distribution policy (with YAML overrides applied).

    Returns:
        a :class:`FragmentGraph` whose fragment programs are linted.

    Raises:
        PartitionError: a node or boundary the policy cannot place, naming it.
    """
    order = [f.name for f in policy.fragments]
    for g in graphs.values():
        g.lint(defined=set())
    assigner = _Assigner(graphs, policy)
    assigner.run()
    boundaries: list[Boundary] = []
    programs: dict[str, dict[str, Graph]] = {f: {} for f in order}
    first_seen: dict[str, int] = {}
    next_id = 1 + max((n.id for g in graphs.values() for n in g.walk()), default=0)
    for mi, (method, graph) in enumerate(graphs.items()):
        builder = _Builder(method, assigner, policy, next_id)
        for f in order:
            programs[f][method] = builder.build(graph, f)
        for i, node in enumerate(graph.walk()):
            for f in assigner.f(method, node):
                first_seen.setdefault(f, i + 10_000 * mi)
        boundaries += [b for b, _, _ in builder.boundaries.values()]
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
