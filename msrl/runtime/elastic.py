"""Elastic replicas: which fragments' replicas a job may replace alone when one is lost, and how
a replacement rejoins its boundaries (``cluster.on_replica_loss``).

A replica can be replaced alone when nothing another replica computes depends on it exactly:
its fragment holds no learner and no collective, it does not return the method's output, every
boundary it is an end of in ``train_step`` is asynchronous, it consumes only ``latest`` slots
(never a ``fifo`` queue), and it puts on exactly one ``fifo`` queue, once per iteration (not
inside a loop or a branch) -- an actor under ``async_learner`` or overlapped coarse. Its
consumer then takes one item from it per iteration, so the replacement owes its consumer exactly
the items the lost replica had not delivered: the consumer's count of delivered items (its
mailbox, :meth:`~msrl.runtime.asynchronous.Mailbox.counts`, read from its heartbeat once the lost
replica's stream has ended) says how many.

Central inference's client fragment (its env replicas) is replaceable too, though it takes
actions from the server's queue: every boundary of it is a ``fifo`` with the server, which drops
what the lost process sent and starts that client's served run of the current iteration again
for the replacement (:class:`~msrl.runtime.inference.InferenceServer`); the replacement owes the
iterations from that one on.

A replacement starts as the job started: its components built afresh, its envs reset with the
run's seeds for its shard (fresh episodes). Where the fragment's ``reset`` program receives a
value over a synchronous boundary (the learner's weights, broadcast), the replacement takes it
from the ``train_step`` slot that carries the same call's result (:func:`substitutes`) -- the
learner's newest weights, which its stream sends a replacement at once
(:meth:`~msrl.cluster.streams.StreamTransport.rejoin`). A ``reset`` boundary without such a slot
makes the fragment not replaceable.

What is not replaceable keeps the exact restart of every replica from the last checkpoint.
"""

from __future__ import annotations

from typing import Any, Mapping

from msrl.errors import ConfigError
from msrl.graph import NodeKind
from msrl.policy import SLOT_CHANNELS
from msrl.runtime.endpoint import Endpoint

__all__ = ["LOSS_MODES", "replaceable", "replaced_fragments", "substitutes", "fifo_out", "SubstituteEndpoint"]

#: values of ``cluster.on_replica_loss``: ``auto`` replaces the replicas of every replaceable
#: fragment of an asynchronous policy and restarts the rest; ``replace`` asks for it (an error
#: when no fragment can be); ``restart`` restarts every replica from the last checkpoint
LOSS_MODES = ("auto", "replace", "restart")


def _producer_of(graph: Any, value: str) -> Any:
    """The node of ``graph`` (nested regions included) that outputs ``value``, or ``None``."""
    for node in graph:
        if value in node.outputs:
            return node
        for region in (getattr(node, "body", None), getattr(node, "orelse", None)):
            if region is not None:
                found = _producer_of(region, value)
                if found is not None:
                    return found
    return None


def _same_call(a: Any, b: Any) -> bool:
    """Whether nodes ``a`` and ``b`` are the same component call without arguments (its result
    is the same function of the component's state in any method)."""
    return (a is not None and b is not None and a.kind == b.kind == NodeKind.CALL and a.target == b.target
            and not a.args and not b.args and not a.kwargs and not b.kwargs)


def substitutes(fragment_graph: Any, fragment: str) -> tuple[dict[str, str], str | None]:
    """The ``train_step`` slot that stands for each synchronous boundary into ``fragment`` in its
    other methods (``reset``), and the reason the fragment cannot be rejoined (``None``: it can).

    Returns:
        ``({reset boundary: latest boundary}, reason or None)``.
    """
    slots = [b for b in fragment_graph.boundaries
             if b.method == "train_step" and b.dst == fragment and b.channel in SLOT_CHANNELS]
    out: dict[str, str] = {}
    for b in fragment_graph.boundaries:
        if b.method == "train_step" or fragment not in (b.src, b.dst):
            continue
        if b.src == fragment:
            return out, f"its {b.method} program sends on boundary {b.name}"
        made = _producer_of(fragment_graph.graphs[b.method], b.value)
        sub = next((s for s in slots if s.src == b.src and s.pattern == b.pattern
                    and _same_call(made, _producer_of(fragment_graph.graphs["train_step"], s.value))), None)
        if sub is None:
            return out, (f"its {b.method} program receives {b.value} on boundary {b.name}, which no train_step slot "
                         "carries again")
        out[b.name] = sub.name
    return out, None


def fifo_out(fragment_graph: Any, fragment: str) -> list[Any]:
    """The ``train_step`` ``fifo`` boundaries ``fragment`` puts on."""
    return [b for b in fragment_graph.boundaries
            if b.method == "train_step" and b.src == fragment and b.channel == "fifo"]


def replaceable(fragment_graph: Any) -> dict[str, str | None]:
    """Fragment -> ``None`` when a lost replica of it can be replaced alone (see the module
    docstring), else the reason it cannot, in a few words."""
    output = {fr.name for fr in fragment_graph.fragments
              if any(n.kind == NodeKind.OUTPUT and n.inputs for n in fr.programs.get("train_step", []))}
    collective = {c.fragment for c in getattr(fragment_graph, "collectives", [])}
    plan = getattr(fragment_graph, "inference", None)
    out: dict[str, str | None] = {}
    for fr in fragment_graph.fragments:
        name, why = fr.name, None
        mine = [b for b in fragment_graph.boundaries if b.method == "train_step" and name in (b.src, b.dst)]
        fifo = fifo_out(fragment_graph, name)
        if "learner" in fr.spec.roles:
            why = "it holds the learner"
        elif name in output:
            why = "it returns the iteration's metrics"
        elif name in collective:
            why = "it all-reduces among its replicas"
        elif any(not b.asynchronous for b in mine):
            why = "a synchronous boundary: " + next(b.name for b in mine if not b.asynchronous)
        elif plan is not None and name == plan.clients:
            # central inference's client: the server starts its served run of the iteration
            # again for the replacement (every boundary of it is a fifo with the server)
            odd = next((b.name for b in mine if b.channel != "fifo" or {b.src, b.dst} != {name, plan.server}), None)
            why = f"boundary {odd} is not a fifo queue with the server" if odd else substitutes(fragment_graph, name)[1]
        elif any(b.dst == name and b.channel == "fifo" for b in mine):
            why = "it takes from a fifo queue: " + next(b.name for b in mine if b.dst == name and b.channel == "fifo")
        elif len(fifo) != 1:
            why = f"it puts on {len(fifo)} fifo queues (one is replaceable)"
        elif fifo[0].in_loop or fifo[0].in_branch or fifo[0].pattern not in (NodeKind.GATHER, NodeKind.REDUCE, NodeKind.SEND):
            why = f"its queue {fifo[0].name} is not put once per iteration to one consumer"
        else:
            why = substitutes(fragment_graph, name)[1]
        out[name] = why
    return out


def replaced_fragments(mode: str, fragment_graph: Any) -> set[str]:
    """The fragments whose lost replicas the job replaces alone under ``cluster.on_replica_loss``
    = ``mode``.

    Raises:
        ConfigError: an unknown mode, or ``replace`` where no fragment of the policy can be
            replaced (each fragment's reason named).
    """
    if mode not in LOSS_MODES:
        raise ConfigError(f"cluster.on_replica_loss must be one of {', '.join(LOSS_MODES)}, got {mode!r}")
    if mode == "restart":
        return set()
    can = replaceable(fragment_graph)
    chosen = {f for f, why in can.items() if why is None}
    if mode == "replace" and not chosen:
        raise ConfigError(
            f"cluster.on_replica_loss=replace: no fragment of policy {fragment_graph.policy.name} can be replaced alone ("
            + "; ".join(f"{f}: {why}" for f, why in can.items())
            + "); a lost replica restarts every replica from the last checkpoint (cluster.on_replica_loss=restart); "
              "actors are replaced alone under async_learner, overlapped coarse (distribution_policy.boundaries."
              "trajectories=fifo, distribution_policy.boundaries.weights=latest) and coarse in lockstep over streams "
              "(trajectories=fifo, weights=fresh: synchronous coarse's values, bit for bit)")
    if mode == "auto" and not any(b.asynchronous for b in fragment_graph.boundaries):
        return set()  # a synchronous policy: its exact restart
    return chosen


class SubstituteEndpoint(Endpoint):
    """The endpoint a replacement replica runs its ``reset`` program through: a synchronous
    boundary's value is taken from the ``latest`` slot that carries the same call's result
    (:func:`substitutes`); everything else is the replica's own endpoint's.

    Args:
        inner: the replica's endpoint (its ``asynchronous`` side is read).
        subs: ``{reset boundary: train_step latest boundary}``.
    """

    def __init__(self, inner: Any, subs: Mapping[str, str]) -> None:
        self.inner, self.subs = inner, dict(subs)
        self.fragment, self.replica = inner.fragment, inner.replica
        self.boundaries, self.asynchronous, self.inference = inner.boundaries, inner.asynchronous, inner.inference

    def _take(self, boundary: Any, src_replica: int) -> Any:
        return self.asynchronous.substitute(self.subs[boundary.name], src_replica)

    def _post(self, boundary: Any, routes: Any) -> None:
        raise RuntimeError(f"a replacement replica of {self.fragment} cannot send on {boundary.name} while it rejoins")

    def _fragment_size(self) -> int:
        return self.inner._fragment_size()

    def _reduce_flat(self, name: str, flat: Any) -> Any:
        return self.inner._reduce_flat(name, flat)
