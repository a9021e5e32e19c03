"""How a job runs on Ray, in one validated value: :class:`RayOptions` (the ``cluster.*`` keys of a
config, as :func:`msrl.run.driver.make_job` reads them), which :class:`~msrl.cluster.ray_runtime.RayJob`
receives with the compiled job."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from msrl.runtime.transports.kinds import BOUNDARY_TRANSPORTS, INTRA_NODE, SYNC_TRANSPORTS

__all__ = ["RayOptions", "STRATEGIES", "LEARNER_PRIORITIES", "per_fragment"]

#: ``cluster.strategy``: the placement group's strategy
STRATEGIES = ("PACK", "SPREAD")
#: ``cluster.learner_priority``: which producer-only replicas run at a lower priority
LEARNER_PRIORITIES = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class RayOptions:
    """The placement and transport settings of a job on Ray, checked once, when made.

    Attributes:
        address: a Ray cluster's address (``None``: the running Ray instance of this process, or
            a new local one; :func:`~msrl.cluster.bootstrap.init_ray`).
        cpus_per_replica: the CPUs of each replica's bundle (its torch/OpenMP threads): one number
            for every fragment, or fragment name -> CPUs (a fragment not named: 1).
        gpus_per_replica: the GPUs of each replica's bundle (``ray.get_gpu_ids()`` in the
            replica): one number, or fragment name -> GPUs (a fragment not named: 0).
        strategy: the placement group's strategy, one of :data:`STRATEGIES`.
        timeout_s: how long a replica waits at a boundary before the process group gives up.
        placement_timeout_s: how long to wait for the placement group to be placed.
        intra_node: ``"shm"``: a fragment whose replicas share one machine all-reduces host
            tensors through shared memory (:mod:`msrl.runtime.transports.shm`); ``"gloo"``: through Gloo.
        tls: a :class:`~msrl.cluster.grpc_transport.TlsConfig` for the gRPC streams of
            asynchronous boundaries (``None``: plain TCP, still token-checked).
        max_message: the largest message of a boundary (bytes; a Gloo channel's buffer, a gRPC
            frame; ``None``: :data:`~msrl.runtime.transports.codec.MAX_MESSAGE`).
        replica_timeout_s: seconds without a heartbeat after which a replica is hung
            (:class:`~msrl.cluster.watchdog.ReplicaHung`, raised like a death); ``None``: the
            watchdog never calls a replica hung (``cluster.watchdog: off``).
        boundary_transport: asynchronous boundaries between replicas of one machine over Unix
            sockets and between machines over gRPC (``"auto"``), or all over gRPC (``"grpc"``).
        sync_transport: synchronous boundaries per peer pair (:mod:`msrl.runtime.transports.links`): a Unix
            socket between host replicas of one machine and Gloo otherwise (``"auto"``, or
            ``"unix"``), or Gloo for all (``"gloo"``).
        learner_priority: ``"on"``: the replicas of producer-only fragments
            (:func:`~msrl.cluster.placement.producer_only_fragments`) run at niceness
            :data:`~msrl.cluster.placement.PRODUCER_NICE`; ``"auto"``: those on a machine where
            the job's replicas outnumber the cores; ``"off"``: none.
        connect_timeout_s: the longest a join of ``address`` may take (seconds).
        on_ray_started: called with the pids of the Ray processes this job starts on this
            machine and their log folder (:func:`~msrl.cluster.bootstrap.init_ray`); the ``msrl``
            command passes its supervisor's report, so that a dead driver's Ray is stopped.
        capacity_timeout_s: ``None`` (a first start): a cluster without the resources for the
            bundles is a :class:`~msrl.errors.PlacementError` at once, one that has them but
            cannot place them within ``placement_timeout_s`` one then. A number (a restart after
            a replica's or a node's death): the job waits up to that many seconds for the cluster
            to hold its bundles again, saying once on stderr what it waits for; then
            :class:`~msrl.errors.PlacementError`.
        on_replica_loss: ``cluster.on_replica_loss`` (:mod:`msrl.runtime.elastic`): which lost
            replicas are replaced alone.
        replacement_timeout_s: how long a replacement waits for its bundle to be placed (its node
            lost), saying so once; then every replica restarts.

    Raises:
        ValueError: a value outside its key's set (the message names the key and the valid
            values).
    """

    address: str | None = None
    cpus_per_replica: float | Mapping[str, float] = 1.0
    gpus_per_replica: float | Mapping[str, float] = 0.0
    strategy: str = "PACK"
    timeout_s: float = 600.0
    placement_timeout_s: float = 60.0
    intra_node: str = "shm"
    tls: Any = None
    max_message: int | None = None
    replica_timeout_s: float | None = 30.0
    boundary_transport: str = "auto"
    sync_transport: str = "auto"
    learner_priority: str = "auto"
    connect_timeout_s: float = 60.0
    capacity_timeout_s: float | None = None
    on_replica_loss: str = "auto"
    replacement_timeout_s: float = 600.0
    on_ray_started: Callable[[dict[str, Any]], None] | None = None

    def __post_init__(self) -> None:
        for key, valid in (("strategy", STRATEGIES), ("intra_node", INTRA_NODE), ("sync_transport", SYNC_TRANSPORTS),
                           ("boundary_transport", BOUNDARY_TRANSPORTS), ("learner_priority", LEARNER_PRIORITIES)):
            value = getattr(self, key)
            if value not in valid:
                raise ValueError(f"cluster.{key} must be {' or '.join(valid) if len(valid) == 2 else ', '.join(valid)}, "
                                 f"got {value!r}")

    def bundles(self, fragments: Sequence[str]) -> tuple[dict[str, float], dict[str, float]]:
        """The CPUs and GPUs of each of ``fragments``' replica bundles.

        Raises:
            ValueError: a per-fragment mapping names a fragment not among ``fragments``.
        """
        return (per_fragment(self.cpus_per_replica, fragments, "cluster.cpus_per_replica", 1.0),
                per_fragment(self.gpus_per_replica, fragments, "cluster.gpus_per_replica", 0.0))


def per_fragment(value: float | Mapping[str, float], fragments: Sequence[str], key: str, default: float) -> dict[str, float]:
    """A per-replica resource (``cluster.cpus_per_replica``, ``gpus_per_replica``) for each fragment.

    Args:
        value: one number for every fragment, or fragment name -> number.
        fragments: the policy's fragment names.
        key: the config key, for the error.
        default: the number of a fragment ``value`` does not name.

    Returns:
        fragment name -> number, for every name of ``fragments``.

    Raises:
        ValueError: ``value`` names a fragment the policy does not have (the message names the
            valid ones).
    """
    if not isinstance(value, Mapping):
        return {name: float(value) for name in fragments}
    unknown = sorted(set(value) - set(fragments))
    if unknown:
        raise ValueError(f"{key} names fragment(s) {', '.join(unknown)}, which the policy does not have; "
                         f"its fragments: {', '.join(fragments)}")
    return {name: float(value.get(name, default)) for name in fragments}
