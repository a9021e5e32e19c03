"""Where replicas go: the placement group's bundles (one per replica) and their text in
messages, the note a restart prints while the cluster lacks capacity, and which replicas run at
a lower priority (``cluster.learner_priority``)."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, Mapping, Sequence

from msrl.cluster.bootstrap import live_nodes

__all__ = ["bundles_text", "capacity_note", "CAPACITY_SETTLE_S", "PRODUCER_NICE", "producer_only_fragments",
           "producers_to_lower", "lacking_capacity", "node_cores", "bundles_total", "resources_text"]


#: the longest a restart's note waits for Ray to count a lost node out of the live ones
CAPACITY_SETTLE_S = 60.0


def bundles_total(bundles: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The CPUs (and GPUs, where any bundle has some) that ``bundles`` need in all."""
    return {k: sum(b.get(k, 0) for b in bundles) for k in ("CPU", "GPU") if k == "CPU" or any(b.get(k) for b in bundles)}


def lacking_capacity(bundles: Sequence[Mapping[str, float]]) -> bool:
    """Whether the live nodes of the cluster have, in all, fewer CPUs/GPUs than ``bundles`` need."""
    import ray

    have = ray.cluster_resources()
    return any(v > have.get(k, 0) for k, v in bundles_total(bundles).items())


def bundles_text(keys: Sequence[tuple[str, int]], bundles: Sequence[Mapping[str, float]]) -> str:
    """``"3 bundles of 2 CPU"`` where every replica's bundle is the same, else each fragment's:
    ``"3 bundles (actor: 1 CPU x2, learner: 2 CPU)"``."""
    if all(b == bundles[0] for b in bundles):
        return f"{len(bundles)} bundles of {resources_text(bundles[0])}"
    per: dict[str, list] = {}
    for (fragment, _), b in zip(keys, bundles):
        per.setdefault(fragment, [b, 0])[1] += 1
    parts = [f"{f}: {resources_text(b)}" + (f" x{n}" if n > 1 else "") for f, (b, n) in per.items()]
    return f"{len(bundles)} bundles ({', '.join(parts)})"


def resources_text(res: Mapping[str, float]) -> str:
    """``{"CPU": 4.0, "GPU": 0.0, "memory": ...}`` as ``"4 CPU, 0 GPU"`` (CPUs and GPUs only)."""
    return ", ".join(f"{res.get(k, 0):g} {k}" for k in ("CPU", "GPU") if k == "CPU" or res.get(k))


def capacity_note(keys: Sequence[tuple[str, int]], bundles: Sequence[Mapping[str, float]], strategy: str,
                  timeout_s: float) -> str:
    """The one line a restarting job prints while the cluster cannot hold the ``bundles`` of its
    replicas ``keys``: what the job needs, the live nodes (addresses) and what they have and have
    free, how the job gets going again, and the key that bounds the wait."""
    import ray

    nodes = live_nodes()
    have = {k: sum(x.get("Resources", {}).get(k, 0) for x in nodes) for k in ("CPU", "GPU")}
    need = bundles_total(bundles)
    n = len(bundles)
    try:
        head = ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - only for the message
        head = "HEAD:PORT"
    return (f"msrl: waiting for capacity: the job's {n} replicas need {bundles_text(keys, bundles)} "
            f"({strategy}), {resources_text(need)} in all; the cluster's {len(nodes)} live node(s) "
            f"({', '.join(sorted(x.get('NodeManagerAddress', '?') for x in nodes))}) have {resources_text(have)}, "
            f"{resources_text(ray.available_resources())} free. The replicas start when nodes join "
            f"(ray start --address={head}) or resources free up, for up to cluster.capacity_timeout_s={timeout_s:g} s")


#: the niceness producer-only replicas get under ``cluster.learner_priority`` (of -20..19; a
#: niceness-10 thread weighs ~1/10 of a niceness-0 one in Linux's fair scheduler)
PRODUCER_NICE = 10


def node_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def producer_only_fragments(fragment_graph: Any) -> set[str]:
    """The fragments that put on some ``fifo`` boundary and take from none, nor read a ``fresh``
    slot (the actors of overlapped coarse and of ``async_learner``: a ``latest`` slot they read
    never makes them wait): their consumers wait on them, they wait on nobody but their queue's
    credits."""
    fifo = [b for b in fragment_graph.boundaries if b.asynchronous and b.channel == "fifo"]
    fresh = {b.dst for b in fragment_graph.boundaries if b.channel == "fresh"}
    return {b.src for b in fifo} - {b.dst for b in fifo} - fresh


def producers_to_lower(keys: Sequence[tuple[str, int]], peers: Mapping[tuple[str, int], Mapping[str, Any]],
                       producers: set[str], mode: str) -> list[tuple[str, int]]:
    """The replicas ``cluster.learner_priority`` runs at :data:`PRODUCER_NICE`: with ``mode``
    ``"on"`` every replica of a ``producers`` fragment; ``"auto"`` those on a machine where the
    job's replicas (``peers[k]["node_id"]``) outnumber its cores (``peers[k]["cores"]``); ``"off"``
    none. With three busy processes on two cores, an overlapped learner otherwise gets ~2/3 of
    a core while its actors roll out, and the actors wait on its credits
    (``python bench/bench_overlap_floor.py``: the hand-written overlapped x2 loop runs 1.30x
    ``single`` with its actors at niceness 10, 1.11x without)."""
    if mode == "off":
        return []
    per_node = Counter(peers[k]["node_id"] for k in keys)
    return [k for k in keys if k[0] in producers
            and (mode == "on" or per_node[peers[k]["node_id"]] > peers[k]["cores"])]

