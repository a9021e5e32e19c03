"""The process group's rendezvous through Ray's key-value store: no listening socket at all.

``torch.distributed`` ranks find each other through a store. Its usual one, a ``TCPStore``
served by rank 0, takes any client that reaches its port and lets it list, read, write and
delete keys (``list_keys`` included, so a key prefix hides nothing): a process that connects
to a live job's store can redirect the Gloo pairs' addresses. :class:`RayStore` keeps the
rendezvous in the Ray cluster's own key-value store (the GCS) instead, under a per-job random
prefix: only a client of the Ray cluster -- authenticated by the cluster's token where token
authentication is on, Ray's default -- reaches it, and msrl itself opens no port for it.

Gloo's rendezvous only sets, gets and waits (a handful of keys per rank, at start-up): the
store polls the GCS every millisecond while it waits, so joining costs about a millisecond per
key.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import torch.distributed as dist

__all__ = ["RayStore", "NAMESPACE"]

#: the Ray key-value namespace of rendezvous keys
NAMESPACE = "msrl-rendezvous"
_POLL_S = 0.001


class RayStore(dist.Store):
    """A ``torch.distributed`` store over Ray's internal key-value store, for one job.

    Every rank of a job makes one with the same ``prefix`` (the job's secret, handed to the
    replicas by the driver through Ray) in a process connected to the Ray cluster.

    Args:
        prefix: the job's random key prefix (nothing else reads or writes under it).
        timeout_s: how long ``get`` and ``wait`` wait for a key.

    Raises (from its methods):
        TimeoutError: a key did not appear within the timeout (names the key).
        NotImplementedError: ``compare_set``, which Gloo's rendezvous does not use.
    """

    def __init__(self, prefix: str, timeout_s: float) -> None:
        super().__init__()
        self.prefix = prefix
        self.timeout_s = timeout_s

    def _key(self, key: str) -> bytes:
        return f"{self.prefix}/{key}".encode()

    @staticmethod
    def _kv():
        from ray.experimental import internal_kv

        return internal_kv

    def set(self, key: str, value: bytes | str) -> None:
        """Sets ``key`` (overwriting)."""
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._kv()._internal_kv_put(self._key(key), data, overwrite=True, namespace=NAMESPACE)

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting for it to be set."""
        self.wait([key])
        return self._kv()._internal_kv_get(self._key(key), namespace=NAMESPACE)

    def check(self, keys: list[str]) -> bool:
        """Whether every key is set (no waiting)."""
        kv = self._kv()
        return all(kv._internal_kv_exists(self._key(k), namespace=NAMESPACE) for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Waits until every key is set."""
        limit = timeout.total_seconds() if timeout is not None else self.timeout_s
        deadline = time.monotonic() + limit
        kv = self._kv()
        for k in keys:
            while not kv._internal_kv_exists(self._key(k), namespace=NAMESPACE):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rendezvous: key {k!r} not set within {limit:g} s (a replica did not join)")
                time.sleep(_POLL_S)

    def add(self, key: str, amount: int) -> int:
        """Adds ``amount`` to the counter ``key``; returns its value after the addition. Each
        addition is its own key (the store has no atomic increment), so concurrent additions
        are never lost; the value is their sum."""
        kv = self._kv()
        kv._internal_kv_put(self._key(f"{key}/+{uuid.uuid4().hex}"), str(amount).encode(), overwrite=True,
                            namespace=NAMESPACE)
        parts = kv._internal_kv_list(self._key(f"{key}/+"), namespace=NAMESPACE)
        return sum(int(kv._internal_kv_get(p, namespace=NAMESPACE) or b"0") for p in parts)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Not supported (raises ``NotImplementedError``): Gloo's rendezvous never calls it."""
        raise NotImplementedError("RayStore.compare_set: not used by Gloo's rendezvous")

    def delete_key(self, key: str) -> bool:
        """Deletes ``key``; whether it was set."""
        return bool(self._kv()._internal_kv_del(self._key(key), namespace=NAMESPACE))

    def num_keys(self) -> int:
        """The keys set under this job's prefix."""
        return len(self._kv()._internal_kv_list(self._key(""), namespace=NAMESPACE))

    def set_timeout(self, timeout: timedelta) -> None:
        """Sets the default wait."""
        self.timeout_s = timeout.total_seconds()

    def clear(self) -> None:
        """Deletes every key of this job (the driver, when the job closes)."""
        self._kv()._internal_kv_del(self._key(""), del_by_prefix=True, namespace=NAMESPACE)
