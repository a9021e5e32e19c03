"""The in-process transport: fragment replicas living in one process (threads) exchange values
through a :class:`LocalHub`'s queues.

Every generated program talks to its replica's endpoint (:class:`msrl.runtime.endpoint.Endpoint`,
the ops written once); here that is a :class:`LocalEndpoint`, which supplies only how a value
travels. The semantics are those the Ray runtime implements over torch.distributed and gRPC; the
replica mapping of each pattern is :mod:`msrl.runtime.patterns`' table:

==========  =====================================================================================
op          semantics (``R_s`` src replicas, ``R_d`` dst replicas)
==========  =====================================================================================
send/recv   ``R_s == R_d``: src replica ``i`` -> dst replica ``i``
gather      ``R_s -> 1``: the dst concatenates the replicas' shards along the env axis, replica 0
            first (so a gathered batch of ``R`` replicas x ``N/R`` envs lists envs in order)
scatter     ``1 -> R_d``: the src splits along the env axis into ``R_d`` equal shards
broadcast   ``1 -> R_d``: every dst replica receives the value
put/get     an asynchronous boundary (a ``fifo`` queue or a ``latest`` slot): the endpoint's
            :class:`~msrl.runtime.asynchronous.AsyncEndpoint` (see that module)
==========  =====================================================================================

A receiver always gets its own copy (as it would over a network): mutating it never changes
the sender's value. The copy is made on the receiving fragment's device (:func:`deliver`): a
value crosses a boundary onto its consumer's device whatever its producer's, moved once. When one
replica fails, :meth:`LocalHub.close` wakes every waiting peer with :class:`ChannelClosed`.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Mapping, Sequence

import torch

from msrl.errors import MsrlError
from msrl.graph.fragmented import Boundary
from msrl.runtime.endpoint import Endpoint
from msrl.runtime.generators import BATON
from msrl.runtime.patterns import concat, split  # noqa: F401 - re-exported
from msrl.runtime.values import copy_value, deliver, move_tensor, payload_bytes, reduce_leaves, tensor_leaves  # noqa: F401

__all__ = ["ChannelClosed", "LocalHub", "LocalEndpoint", "concat", "split", "copy_value", "deliver", "move_tensor",
           "tensor_leaves", "reduce_leaves", "payload_bytes"]

_POLL_S = 0.05


class ChannelClosed(MsrlError, RuntimeError):
    """A peer fragment replica failed or the job stopped while this one waited on a boundary."""


class ProducerReplaced(MsrlError, RuntimeError):
    """The producer a run of central inference serves was lost and is being replaced: the run
    stops where it is (its items were dropped) and starts again for the replacement
    (:meth:`msrl.runtime.asynchronous.Mailbox.redo`)."""


class LocalHub:
    """The queues of every boundary of a job whose fragment replicas share one process.

    Args:
        boundaries: from :class:`msrl.graph.fragmented.FragmentGraph`.
        fragment_replicas: fragment -> its replica count (for ``allreduce`` among a fragment's
            replicas; fragments not listed have one).
        devices: fragment -> the device its values are delivered on (fragments not listed: each
            tensor stays on its producer's device).
    """

    def __init__(self, boundaries: Sequence[Boundary], fragment_replicas: Mapping[str, int] | None = None,
                 devices: Mapping[str, torch.device | str] | None = None) -> None:
        self.boundaries = {b.name: b for b in boundaries}
        self.fragment_replicas = dict(fragment_replicas or {})
        self.devices = {f: torch.device(d) for f, d in (devices or {}).items()}
        self._reduce_cond = threading.Condition()
        self._reduce_parts: dict[str, dict[int, torch.Tensor]] = {}
        self._reduce_done: dict[str, tuple[int, torch.Tensor]] = {}
        self._reduce_round: dict[str, int] = {}
        #: (boundary, src replica, dst replica) -> what src sent dst, in order
        self._queues: dict[tuple[str, int, int], queue.Queue] = {}
        for b in boundaries:
            for s in range(b.src_replicas):
                for r in range(b.dst_replicas):
                    self._queues[(b.name, s, r)] = queue.Queue()
        self._closed = threading.Event()
        self._reason = ""
        #: boundary -> bytes of tensors that crossed it (every replica's sends)
        self.bytes: dict[str, int] = {}
        self._bytes_lock = threading.Lock()
        #: the endpoints' :attr:`~msrl.runtime.endpoint.Endpoint.frame_padding` (set by the runtime)
        self.frame_padding: str | None = None

    def endpoint(self, fragment: str, replica: int, asynchronous: Any = None, inference: Any = None) -> "LocalEndpoint":
        """The endpoint generated programs of ``fragment`` replica ``replica`` call
        (``asynchronous``: its :class:`~msrl.runtime.asynchronous.AsyncEndpoint`, for ``put``/``get``;
        ``inference``: its :class:`~msrl.runtime.inference.InferenceServer`, for ``serve``)."""
        ep = LocalEndpoint(self, fragment, replica, asynchronous, inference)
        ep.frame_padding = self.frame_padding
        return ep

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed.is_set()

    def close(self, reason: str) -> None:
        """Wakes every waiting replica with :class:`ChannelClosed` (``reason`` in its message)."""
        self._reason = reason
        self._closed.set()
        with self._reduce_cond:
            self._reduce_cond.notify_all()

    def _allreduce(self, fragment: str, replica: int, flat: torch.Tensor) -> torch.Tensor:
        """The mean of every replica's ``flat`` (summed in replica order), once all arrived."""
        n = self.fragment_replicas.get(fragment, 1)
        with BATON.released(), self._reduce_cond:  # the other replicas (threads) run meanwhile
            round_ = self._reduce_round.get(fragment, 0)
            parts = self._reduce_parts.setdefault(fragment, {})
            parts[replica] = flat
            if len(parts) == n:
                total = parts[0].clone()
                for r in range(1, n):
                    total += parts[r]
                self._reduce_done[fragment] = (round_, total / n)
                self._reduce_parts[fragment] = {}
                self._reduce_round[fragment] = round_ + 1
                self._reduce_cond.notify_all()
            while self._reduce_done.get(fragment, (-1, None))[0] != round_:
                if self._closed.is_set():
                    raise ChannelClosed(f"allreduce of fragment {fragment}: {self._reason}")
                self._reduce_cond.wait(_POLL_S)
            return self._reduce_done[fragment][1].clone()

    def _put(self, boundary: str, src: int, dst: int, value: Any) -> None:
        """Delivers ``value`` from src replica ``src`` to dst replica ``dst`` (a copy on the dst
        fragment's device, :func:`deliver`)."""
        n = payload_bytes(value)
        with self._bytes_lock:
            self.bytes[boundary] = self.bytes.get(boundary, 0) + n
        self._queues[(boundary, src, dst)].put(deliver(value, self.devices.get(self.boundaries[boundary].dst)))

    def _get(self, boundary: str, src: int, dst: int) -> Any:
        """The oldest value src replica ``src`` sent dst replica ``dst``, waiting for it."""
        q = self._queues[(boundary, src, dst)]
        try:
            return q.get_nowait()
        except queue.Empty:
            pass
        with BATON.released():  # the other replicas (threads) run meanwhile
            while True:
                if self._closed.is_set():
                    raise ChannelClosed(f"boundary {boundary}: {self._reason}")
                try:
                    return q.get(timeout=_POLL_S)
                except queue.Empty:
                    continue


class LocalEndpoint(Endpoint):
    """One fragment replica's endpoint in this process (:class:`~msrl.runtime.endpoint.Endpoint`:
    the ops generated code calls); values travel through the hub's queues."""

    def __init__(self, hub: LocalHub, fragment: str, replica: int, asynchronous: Any = None,
                 inference: Any = None) -> None:
        self.hub, self.fragment, self.replica = hub, fragment, replica
        self.boundaries = hub.boundaries
        self.asynchronous = asynchronous
        self.inference = inference

    def _post(self, boundary: Boundary, routes: list[tuple[int, Any]]) -> None:
        for r, value in routes:
            self.hub._put(boundary.name, self.replica, r, value)

    def _take(self, boundary: Boundary, src_replica: int) -> Any:
        return self.hub._get(boundary.name, src_replica, self.replica)

    def _fragment_size(self) -> int:
        return self.hub.fragment_replicas.get(self.fragment, 1)

    def _reduce_flat(self, name: str, flat: torch.Tensor) -> torch.Tensor:
        with self.hub._bytes_lock:  # what this replica contributes, as a send counts what it sends
            self.hub.bytes[name] = self.hub.bytes.get(name, 0) + flat.numel() * flat.element_size()
        return self.hub._allreduce(self.fragment, self.replica, flat)
