"""The fragmented graph: what partitioning produces and every runtime reads (DESIGN.md §3).

The front end (:mod:`msrl.frontend.partition`, the passes of :mod:`msrl.passes`) builds these; the runtime
(:mod:`msrl.runtime`) and the code generator only read them, so they live here, with the graph
IR, and the runtime never imports the partitioner.

* :class:`Boundary` -- one value crossing from one fragment to another, with its comm op,
  pattern and channel;
* :class:`Collective` -- a collective among one fragment's replicas (the gradient all-reduce
  at a collective point);
* :class:`Fragment` -- a fragment's spec and its program region per traced method;
* :class:`InferencePlan` -- how the server fragment runs central inference;
* :class:`FragmentGraph` -- fragments in order, boundaries, collectives, the inference plan and
  the global generators the programs draw from, all set at construction (a pass returns a new
  one).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from msrl.errors import PartitionError
from msrl.graph.graph import Graph
from msrl.graph.node import COMM_KINDS, Node, NodeKind

__all__ = ["Boundary", "Collective", "Fragment", "FragmentGraph", "InferencePlan", "boundary_end", "value_info"]


@dataclasses.dataclass(frozen=True)
class Boundary:
    """One value crossing from one fragment to another.

    Attributes:
        name: unique id, ``"<method>/b<k>:<value>"``; both sides' comm nodes carry it.
        method: the traced method (``"train_step"``).
        value: the value name.
        comm_kind: the comm node kind on both sides (``gather``; ``send``/``recv`` and
            ``put``/``get`` pairs are recorded by their src kind). An asynchronous boundary is
            ``put``/``get``.
        pattern: how values combine between the replica counts: ``send`` (replica ``i`` ->
            ``i``), ``gather``, ``reduce``, ``scatter`` or ``broadcast``; the same as ``comm_kind``
            when synchronous.
        channel: what carries it, one of :data:`msrl.policy.BOUNDARY_CHANNELS` (``sync``: a
            collective both sides wait on, ``fifo``: a bounded queue, ``latest``: a latest-value
            slot); ``boundary_class``: the policy's class that set it, if any.
        capacity: a ``fifo`` boundary's items per producer and consumer.
        src, dst: fragment names; ``src_replicas``, ``dst_replicas``: their replica counts.
        value_kind: one of :data:`msrl.api.VALUE_KINDS` (``None`` without probe info or declaration).
        axis: the env (or batch) axis of a sharded value or a batch.
        in_loop: whether the boundary sits inside a loop region.
        in_branch: whether it sits inside a branch region (met only when the side is taken).
        reduce: a ``partial`` value's reduction (``sum`` or ``mean``); ``None`` for other kinds.
    """

    name: str
    method: str
    value: str
    comm_kind: NodeKind
    src: str
    dst: str
    src_replicas: int
    dst_replicas: int
    value_kind: str | None
    axis: int | None
    in_loop: bool
    in_branch: bool = False
    pattern: NodeKind | None = None
    channel: str = "sync"
    boundary_class: str | None = None
    capacity: int = 1
    reduce: str | None = None

    def __post_init__(self) -> None:
        if self.pattern is None:
            object.__setattr__(self, "pattern", self.comm_kind)

    @property
    def asynchronous(self) -> bool:
        """Whether the boundary is a queue or a latest-value slot (``put``/``get``)."""
        return self.channel != "sync"


@dataclasses.dataclass(frozen=True)
class Collective:
    """A collective among the replicas of one fragment, placed by the partitioner at one of a
    replicated learner's collective points (:data:`msrl.api.COLLECTIVE_POINTS`): the gradient
    all-reduce (an ``allreduce`` region around the call that takes the gradient steps; DD-PPO,
    Wijmans et al. 2020; as torch DDP averages gradients) and, beside it, the all-reduce of its
    running statistics (as SyncBatchNorm's own collective beside DDP's).

    Attributes:
        name: unique id, ``"<method>/a<k>:<point>"``; the region's :class:`CommTarget` carries it.
        method: the traced method; ``fragment``: whose replicas take part; ``replicas``: how many.
        comm_kind: :attr:`NodeKind.ALLREDUCE`; ``value``: the point, what is reduced (``"gradients"``
            or ``"statistics"``).
        call: ``file:line`` and ``role.method`` of the call that reaches the point.
        gradient_step: the probe's ``{"tensors", "bytes"}`` of one reduction at the point (the
            largest; ``None``: not probed).
        in_loop, in_branch: whether the region sits inside a loop, a branch.
    """

    name: str
    method: str
    fragment: str
    replicas: int
    call: str
    comm_kind: NodeKind = NodeKind.ALLREDUCE
    value: str = "gradients"
    gradient_step: Any = None
    in_loop: bool = False
    in_branch: bool = False


def boundary_end(boundaries: Mapping[str, Boundary], name: str, fragment: str) -> Boundary:
    """The boundary ``name`` seen from ``fragment``, one of its two ends.

    Raises:
        KeyError: ``name`` is not among ``boundaries``.
        RuntimeError: ``fragment`` is neither the boundary's src nor its dst.
    """
    b = boundaries.get(name)
    if b is None:
        raise KeyError(f"unknown boundary {name!r}")
    if fragment not in (b.src, b.dst):
        raise RuntimeError(f"fragment {fragment} is not an end of boundary {name} ({b.src} -> {b.dst})")
    return b


@dataclasses.dataclass
class Fragment:
    """One fragment: its spec (a :class:`msrl.policy.FragmentSpec`) and, per traced method, its
    region graph (comm ops included)."""

    spec: Any
    programs: dict[str, Graph]

    @property
    def name(self) -> str:
        """The fragment's name (its spec's)."""
        return self.spec.name


@dataclasses.dataclass
class FragmentGraph:
    """The result of partitioning: fragments in order and the boundaries between them.

    Attributes:
        policy: the (overridden) :class:`msrl.policy.DistributionPolicy` used.
        graphs: the traced graphs, per method, before partitioning.
        fragments: fragments in order; each holds a program region per method.
        boundaries: every boundary, in program order per method.
        collectives: every collective among one fragment's replicas (the gradient all-reduce
            of a replicated learner), in program order per method.
        inference: under central inference, its :class:`InferencePlan` (the serving pass,
            :func:`msrl.passes.serving.serve_inference`); ``None`` otherwise.
        generator_kinds: the global generators (``"torch"``, ``"numpy"``, ``"python"``) the
            probe saw the programs draw from (``None``: not probed, every one); a hand-over
            between replicas of one process swaps these (:mod:`msrl.runtime.generators`).
    """

    policy: Any
    graphs: dict[str, Graph]
    fragments: list[Fragment]
    boundaries: list[Boundary]
    inference: InferencePlan | None = None
    generator_kinds: frozenset[str] | None = None
    collectives: list[Collective] = dataclasses.field(default_factory=list)

    def copy(self) -> "FragmentGraph":
        """A copy whose fragment programs a pass may edit (:meth:`Graph.copy`); the policy,
        the traced graphs and the frozen boundaries and collectives are shared."""
        fragments = [Fragment(fr.spec, {m: g.copy() for m, g in fr.programs.items()}) for fr in self.fragments]
        return dataclasses.replace(self, fragments=fragments, boundaries=list(self.boundaries),
                                   collectives=list(self.collectives))

    def next_node_id(self) -> int:
        """An id above every node of every fragment's programs (for a node a pass adds)."""
        return 1 + max((n.id for fr in self.fragments for g in fr.programs.values() for n in g.walk()), default=0)

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
        the same program position; this re-checks the result. Boundaries inside a branch are
        met only when its side is taken, which every fragment decides identically.

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
    ``node``; for a region node, from the body node that last writes it. ``None`` if neither
    probed nor declared."""
    if node.kind in (NodeKind.LOOP, NodeKind.BRANCH):
        for region in node.regions():
            last = region.producers().get(name)
            if last is not None:
                info = value_info(last, name)
                if info is not None:
                    return info
        return None
    return node.meta.get("values", {}).get(name)


@dataclasses.dataclass(frozen=True)
class InferencePlan:
    """How the server fragment runs central inference.

    Attributes:
        server, clients: fragment names; ``clients_count``: the client replicas.
        role: the role whose calls are batched (``"actor"``).
        max_batch: client requests per batch (1..``clients_count``).
        timeout_ms: the longest a request waits for its batch to fill (``None``: no deadline).
        region: how many top-level nodes of the server's ``train_step`` program the served
            region holds.
        shard_roles: roles of the server fragment with one component shard per client.
        combine: ``(role, method) -> env axis of each result`` for the calls on sharded
            components outside the served region (``()``: a call without results, made on
            every shard).
        live_outs: values the served region computes and the rest reads: control values
            (every client's run computes the same; the first client's is used) and the
            :attr:`sharded_outs`.
        state_writes: control trainer attributes the served region writes (copied back from
            the first client's run).
        sharded_state: trainer attributes sharded along the env axis (axis 0) that the served
            region reads (an LSTM's state): each client's run reads its own rows.
        sharded_outs: live-outs sharded along the env axis: the clients' runs' values are
            concatenated in client order, as a gather of the env replicas would.
    """

    server: str
    clients: str
    clients_count: int
    role: str
    max_batch: int
    timeout_ms: float | None
    region: int
    shard_roles: tuple[str, ...]
    combine: dict[tuple[str, str], tuple[int, ...]]
    live_outs: tuple[str, ...]
    state_writes: tuple[str, ...]
    sharded_state: tuple[str, ...] = ()
    sharded_outs: tuple[str, ...] = ()
