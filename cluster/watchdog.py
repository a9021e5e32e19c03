"""Heartbeats of the replica processes and the driver's watchdog over them.

Ray notices a replica whose process *died*; it does not notice one that stopped making progress
(``SIGSTOP``, a node swapping, a C extension spinning with the GIL held, a deadlock), and the
job would stall in silence until Ray's keepalive fires minutes later. So every replica process
runs a :class:`Heartbeat`: a daemon thread that every :data:`PERIOD_S` seconds writes a small JSON
record into Ray's key-value store (the GCS, reachable from every node of the cluster) -- a
sequence number and the replica's env steps so far. The driver's :class:`Watchdog` reads them while it waits for the replicas:

* a replica whose record has not changed for ``timeout_s`` is **hung** (its process is stopped,
  or its interpreter is stuck with the GIL held): named by fragment, replica and pid;
* the same records give the env steps every replica reached when another one died or hung, so
  the work dropped with a restart is counted in full (the running chunk included).

The heartbeat thread only holds the GIL for the few microseconds of building its record; its
write goes through Ray's own client (~1 ms, off the replica's thread).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from msrl.runtime.replica import ReplicaHung

__all__ = ["Heartbeat", "Watchdog", "ReplicaHung", "PERIOD_S", "NAMESPACE"]

#: seconds between two heartbeats of a replica
PERIOD_S = 0.5
#: the Ray key-value namespace of the heartbeats
NAMESPACE = "msrl"


def _key(job: str, fragment: str, replica: int) -> bytes:
    return f"heartbeat/{job}/{fragment}/{replica}".encode()


def _order_key(job: str, fragment: str, replica: int) -> bytes:
    return f"order/{job}/{fragment}/{replica}".encode()


class Heartbeat:
    """A replica process's heartbeat thread (started on construction).

    Args:
        job: the job's random id (keys of one job never meet another's).
        fragment, replica: whose heartbeat.
        snapshot: returns the record's fields (``env_steps``: int); called on the heartbeat
            thread, so it must only read plain attributes.
        period_s: seconds between writes.
        on_order: called on the heartbeat thread with each new order the driver wrote for this
            replica (:meth:`Watchdog.order`: a JSON object with a rising ``seq``), read once a
            period: how the driver reaches a replica busy running its iterations.
    """

    def __init__(self, job: str, fragment: str, replica: int, snapshot: Callable[[], Mapping[str, Any]],
                 period_s: float = PERIOD_S, on_order: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.key, self.snapshot, self.period_s = _key(job, fragment, replica), snapshot, period_s
        self.order_key, self.on_order, self._order_seq = _order_key(job, fragment, replica), on_order, 0
        self.seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="msrl-heartbeat", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        from ray.experimental import internal_kv

        while not self._stop.is_set():
            self.seq += 1
            record = json.dumps({"seq": self.seq, **self.snapshot()}).encode()
            try:
                internal_kv._internal_kv_put(self.key, record, overwrite=True, namespace=NAMESPACE)
                if self.on_order is not None:
                    raw = internal_kv._internal_kv_get(self.order_key, namespace=NAMESPACE)
                    order = json.loads(raw) if raw else None
                    if order is not None and int(order.get("seq", 0)) > self._order_seq:
                        self._order_seq = int(order["seq"])
                        self.on_order(order)
            except Exception:  # noqa: BLE001 - Ray shutting down: the driver sees a silence, as it should
                pass
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        """Ends the thread (it writes nothing more)."""
        self._stop.set()


class Watchdog:
    """The driver's view of its replicas' heartbeats.

    Args:
        job: the job's id (as given to every :class:`Heartbeat`).
        keys: ``(fragment, replica)`` of every replica, in replica order.
        pids: their process ids (named in the report).
        roles: fragment -> the roles it holds.
        timeout_s: seconds without a new heartbeat after which a replica is hung
            (``cluster.replica_timeout_s``); ``None``: never (``cluster.watchdog: off``; the
            heartbeats still give the env steps each replica reached).
    """

    def __init__(self, job: str, keys: Sequence[tuple[str, int]], pids: Sequence[int],
                 roles: Mapping[str, Sequence[str]], timeout_s: float | None) -> None:
        self.job, self.keys, self.pids, self.roles, self.timeout_s = job, list(keys), list(pids), dict(roles), timeout_s
        now = time.monotonic()
        #: key -> (the last record read, when it last changed: monotonic seconds on the driver)
        self.seen: dict[tuple[str, int], tuple[dict[str, Any] | None, float]] = {k: (None, now) for k in self.keys}
        #: replicas not watched for hangs: lost, their replacement waiting for a node with room
        self.absent: set[tuple[str, int]] = set()

    def read(self) -> dict[tuple[str, int], dict[str, Any] | None]:
        """Every replica's latest record (``None`` before its first), noting which changed."""
        from ray.experimental import internal_kv

        now, out = time.monotonic(), {}
        for k in self.keys:
            try:
                raw = internal_kv._internal_kv_get(_key(self.job, *k), namespace=NAMESPACE)
            except Exception:  # noqa: BLE001 - the GCS briefly unreachable: no news
                raw = None
            record = json.loads(raw) if raw else None
            last, since = self.seen[k]
            if record is not None and (last is None or record.get("seq") != last.get("seq")):
                self.seen[k] = (record, now)
            out[k] = self.seen[k][0]
        return out

    def hung(self) -> ReplicaHung | None:
        """The first replica without a new heartbeat for ``timeout_s`` (``None``: all beat, or
        the watchdog is off)."""
        if self.timeout_s is None:
            return None
        self.read()
        now = time.monotonic()
        for i, k in enumerate(self.keys):
            record, since = self.seen[k]
            if k not in self.absent and now - since > self.timeout_s:
                frag, r = k
                pid = self.pids[i] if i < len(self.pids) else None
                what = "gave no heartbeat" if record is not None else "gave no heartbeat since it started"
                return ReplicaHung(
                    f"fragment {frag} replica {r} (pid {pid}) {what} for {now - since:.0f} s "
                    f"(cluster.replica_timeout_s={self.timeout_s:g}): hung", frag, r, self.roles.get(frag, ()), pid)
        return None

    def replaced(self, key: tuple[str, int], pid: int) -> None:
        """Replica ``key`` runs in a new process ``pid`` (a replacement): its silence is counted
        from now, its records from the new heartbeat on."""
        self.pids[self.keys.index(key)] = pid
        self.seen[key] = (None, time.monotonic())
        self.absent.discard(key)

    def record(self, key: tuple[str, int]) -> dict[str, Any] | None:
        """Replica ``key``'s latest heartbeat record, read now (``None``: none yet)."""
        self.read()
        return self.seen[key][0]

    def env_steps(self) -> dict[tuple[str, int], int]:
        """Each replica's env steps in its latest record (replicas without one left out)."""
        self.read()
        return {k: int(r["env_steps"]) for k, (r, _) in self.seen.items() if r is not None and "env_steps" in r}

    def order(self, key: tuple[str, int], order: Mapping[str, Any]) -> None:
        """Writes ``order`` (JSON-able, with a ``seq`` higher than the last one's) for replica
        ``key``: its heartbeat thread reads it within a period (:class:`Heartbeat`'s ``on_order``)."""
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(_order_key(self.job, *key), json.dumps(dict(order)).encode(), overwrite=True,
                                     namespace=NAMESPACE)

    def clear(self) -> None:
        """Deletes the job's records and orders from the store."""
        from ray.experimental import internal_kv

        for k in self.keys:
            for key in (_key(self.job, *k), _order_key(self.job, *k)):
                try:
                    internal_kv._internal_kv_del(key, namespace=NAMESPACE)
                except Exception:  # noqa: BLE001 - Ray already gone
                    pass
