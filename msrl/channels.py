"""In-process channels: the comm ops' semantics for fragment replicas living in one process.

Every generated program talks to its replica's :class:`LocalComm` endpoint. The semantics are
those the Ray runtime implements over torch.distributed and gRPC:

==========  =====================================================================================
op          semantics (``R_s`` src replicas, ``R_d`` dst replicas)
==========  =====================================================================================
send/recv   ``R_s == R_d``: src replica ``i`` -> dst replica ``i``
gather      ``R_s -> 1``: the dst concatenates the replicas' shards along the env axis, replica 0
            first (so a gathered batch of ``R`` replicas x ``N/R`` envs lists envs in order)
scatter     ``1 -> R_d``: the src splits along the env axis into ``R_d`` equal shards
broadcast   ``1 -> R_d``: every dst replica receives the value
put/get     asynchronous queue: ``put`` never waits for the consumer
==========  =====================================================================================

A receiver always gets its own copy (as it would over a network): mutating it never changes
the sender's value. When one replica fails, :meth:`LocalHub.close` wakes every waiting peer
with :class:`ChannelClosed`.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Sequence

import torch
from tensordict import TensorDictBase

from msrl.partition import Boundary

__all__ = ["ChannelClosed", "LocalHub", "LocalComm", "concat", "split", "copy_value"]

_POLL_S = 0.05


class ChannelClosed(RuntimeError):
    """A peer fragment replica failed or the job stopped while this one waited on a boundary."""


def copy_value(value: Any) -> Any:
    """A deep copy of tensors, TensorDicts and (nested) dicts/lists/tuples of them."""
    if isinstance(value, (torch.Tensor, TensorDictBase)):
        return value.clone()
    if isinstance(value, dict):
        return {k: copy_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(copy_value(v) for v in value)
    return value


def concat(values: Sequence[Any], axis: int) -> Any:
    """Concatenates replicas' shards along ``axis`` (tensors, TensorDicts, nested containers).

    Raises:
        TypeError: a leaf that is neither a tensor nor a TensorDict.
    """
    first = values[0]
    if isinstance(first, (torch.Tensor, TensorDictBase)):
        return torch.cat(list(values), dim=axis)
    if isinstance(first, dict):
        return {k: concat([v[k] for v in values], axis) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(concat([v[i] for v in values], axis) for i in range(len(first)))
    raise TypeError(f"cannot concatenate {type(first).__name__} values along the env axis")


def split(value: Any, parts: int, axis: int) -> list[Any]:
    """Splits ``value`` into ``parts`` equal shards along ``axis`` (copies).

    Raises:
        ValueError: the axis size is not divisible by ``parts``.
    """
    if isinstance(value, (torch.Tensor, TensorDictBase)):
        size = value.shape[axis] if isinstance(value, torch.Tensor) else value.batch_size[axis]
        if size % parts:
            raise ValueError(f"cannot scatter {size} envs over {parts} replicas")
        return [c.clone() for c in torch.chunk(value, parts, dim=axis)]
    if isinstance(value, dict):
        shards = {k: split(v, parts, axis) for k, v in value.items()}
        return [{k: s[i] for k, s in shards.items()} for i in range(parts)]
    if isinstance(value, (list, tuple)):
        shards_l = [split(v, parts, axis) for v in value]
        return [type(value)(s[i] for s in shards_l) for i in range(parts)]
    raise TypeError(f"cannot scatter a {type(value).__name__} along the env axis")


class LocalHub:
    """The queues of every boundary of a job whose fragment replicas share one process.

    Args:
        boundaries: from :class:`msrl.partition.FragmentGraph`.
    """

    def __init__(self, boundaries: Sequence[Boundary]) -> None:
        self.boundaries = {b.name: b for b in boundaries}
        self._queues: dict[tuple[str, int], queue.Queue] = {}
        for b in boundaries:
            for r in range(b.dst_replicas):
                self._queues[(b.name, r)] = queue.Queue()
        self._closed = threading.Event()
        self._reason = ""

    def endpoint(self, fragment: str, replica: int) -> "LocalComm":
        """The endpoint generated programs of ``fragment`` replica ``replica`` call."""
        return LocalComm(self, fragment, replica)

    def close(self, reason: str) -> None:
        """Wakes every waiting replica with :class:`ChannelClosed` (``reason`` in its message)."""
        self._reason = reason
        self._closed.set()

    def _put(self, boundary: str, replica: int, item: Any) -> None:
        self._queues[(boundary, replica)].put(item)

    def _get(self, boundary: str, replica: int) -> Any:
        q = self._queues[(boundary, replica)]
        while True:
            if self._closed.is_set():
                raise ChannelClosed(f"boundary {boundary}: {self._reason}")
            try:
                return q.get(timeout=_POLL_S)
            except queue.Empty:
                continue


class LocalComm:
    """One fragment replica's endpoint; generated code calls ``comm.<op>(boundary[, value])``:
    with a value on the src side, without on the dst side (which returns the value)."""

    def __init__(self, hub: LocalHub, fragment: str, replica: int) -> None:
        self.hub, self.fragment, self.replica = hub, fragment, replica

    def _boundary(self, name: str, op: str) -> Boundary:
        b = self.hub.boundaries.get(name)
        if b is None:
            raise KeyError(f"unknown boundary {name!r}")
        if self.fragment not in (b.src, b.dst):
            raise RuntimeError(f"fragment {self.fragment} is not an end of boundary {name} ({b.src} -> {b.dst})")
        return b

    def send(self, name: str, value: Any) -> None:
        """Src replica ``i`` -> dst replica ``i``."""
        self._boundary(name, "send")
        self.hub._put(name, self.replica, copy_value(value))

    def recv(self, name: str) -> Any:
        """Receives what src replica ``i`` sent."""
        self._boundary(name, "recv")
        return self.hub._get(name, self.replica)

    def gather(self, name: str, value: Any = None) -> Any:
        """Src side (with ``value``): contribute a shard. Dst side: returns the shards
        concatenated along the boundary's axis, replica 0 first."""
        b = self._boundary(name, "gather")
        if self.fragment == b.src:
            self.hub._put(name, 0, (self.replica, copy_value(value)))
            return None
        shards = sorted((self.hub._get(name, self.replica) for _ in range(b.src_replicas)), key=lambda s: s[0])
        return concat([s[1] for s in shards], b.axis if b.axis is not None else 0)

    def scatter(self, name: str, value: Any = None) -> Any:
        """Src side: split ``value`` over the dst replicas. Dst side: returns this replica's shard."""
        b = self._boundary(name, "scatter")
        if self.fragment == b.src:
            for r, shard in enumerate(split(value, b.dst_replicas, b.axis if b.axis is not None else 0)):
                self.hub._put(name, r, shard)
            return None
        return self.hub._get(name, self.replica)

    def broadcast(self, name: str, value: Any = None) -> Any:
        """Src side: send ``value`` to every dst replica. Dst side: returns it."""
        b = self._boundary(name, "broadcast")
        if self.fragment == b.src:
            for r in range(b.dst_replicas):
                self.hub._put(name, r, copy_value(value))
            return None
        return self.hub._get(name, self.replica)

    def put(self, name: str, value: Any) -> None:
        """Asynchronous: enqueue ``value`` for dst replica ``i mod R_d``; never waits."""
        b = self._boundary(name, "put")
        self.hub._put(name, self.replica % b.dst_replicas, copy_value(value))

    def get(self, name: str) -> Any:
        """Asynchronous: the oldest value queued for this replica (waits while empty)."""
        self._boundary(name, "get")
        return self.hub._get(name, self.replica)

    def allreduce(self, name: str, value: Any = None) -> Any:
        """All-reduce across the replicas of one fragment.

        Raises:
            NotImplementedError: in-process jobs have no multi-learner fragments; the
                ``multi_learner`` policy runs on the Ray runtime (torch.distributed).
        """
        raise NotImplementedError("allreduce runs on the Ray runtime's torch.distributed process groups")
