"""Replacing lost replicas alone, the driver's side (:mod:`msrl.runtime.elastic` says which
fragments may be; ``cluster.on_replica_loss``): :class:`Replacements`, the object a
:class:`~msrl.cluster.ray_runtime.RayJob` holds (reading the job only through :class:`JobView`)
that answers a lost elastic replica while the others run -- a new process in its bundle that
rejoins its boundaries and owes its consumer exactly what the lost one had not delivered
(:meth:`Replacements.replace`); central inference's env replicas, whose iteration the server
serves again for the replacement (:meth:`Replacements._redo_client`); and running on without a
lost replica whose bundle no live node holds (its node lost; Ray has not placed it again), its
share done by the others of its fragment until Ray places it (:meth:`Replacements._go_absent`,
:meth:`Replacements.settle_absent`).

Every Ray actor call goes through the job's :class:`~msrl.cluster.actor_manager.ReplicaGroup`;
consumers are told what changed through their heartbeat's order (:meth:`Replacements._send_orders`)
while they are busy in a chunk. See ``docs/architecture/runtime.md`` ("Elastic replicas").
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import Any, Mapping, Protocol, Sequence

from msrl.cluster.actor_manager import StandIn
from msrl.runtime.elastic import fifo_out
from msrl.runtime.patterns import deliveries
from msrl.runtime.replica import ReplicaDied

__all__ = ["Replacements", "JobView", "CAPACITY_NOTE_S", "ENDED_WAIT_S"]

#: seconds a placement (a restart's, or a replacement's bundle) may take before the job says it
#: is waiting for capacity (where the live nodes are too small; a restart: else once
#: ``CAPACITY_SETTLE_S`` has passed), and a replacement whose bundle has no node runs on without it
CAPACITY_NOTE_S = 5.0
#: the longest a replacement waits for the consumer's heartbeat to show the lost replica's stream
#: ended (seconds) before every replica restarts instead
ENDED_WAIT_S = 120.0


class JobView(Protocol):
    """What :class:`Replacements` reads of its job and calls on it, and nothing else
    (:class:`~msrl.cluster.ray_runtime.RayJob` is one)."""

    spec: Any
    fragment_graph: Any
    #: every replica, ``(fragment, index)``, in replica order
    keys: list[tuple[str, int]]
    #: the fragments whose lost replicas are replaced alone
    elastic: set[str]
    #: the one owner of the replica actors (:class:`~msrl.cluster.actor_manager.ReplicaGroup`)
    replicas: Any
    #: the job's iteration when its replica processes started
    start_iteration: int
    #: each replica's env steps after the last finished chunk
    replica_steps: dict[tuple[str, int], int]
    #: the fault counters of the iterations in flight
    faults: dict[str, int]
    #: what a replacement rejoins with: the consumers' boundary servers, the job's token, TLS,
    #: the largest message, the boundary timeout, the stream transport and the priority mode
    rejoin_args: tuple

    @property
    def watchdog(self) -> Any:
        """The replicas' heartbeat :class:`~msrl.cluster.watchdog.Watchdog` (``None`` before they start)."""
        ...

    def lower_replacement(self, key: tuple[str, int], peers: Mapping[tuple[str, int], Mapping[str, Any]],
                          mode: str) -> None:
        """Lowers the OS priority of replacement ``key`` (fragment, index) where the job's
        priority ``mode`` lowers producers' (``peers``: each replica's rejoin details)."""
        ...

    def bundle_unplaced(self, key: tuple[str, int]) -> bool:
        """Whether replica ``key``'s placement-group bundle has no live node now (its node lost,
        not yet placed again)."""
        ...


class Replacements:
    """Replaces a :class:`JobView`'s lost elastic replicas alone (see the module docstring).

    Args:
        job: the job, read through :class:`JobView` only.
        replacement_timeout_s: how long a replacement waits for its bundle to be placed.

    Attributes:
        absent: lost replicas not replaced for want of room, the job running on without them.
        replacement_s: seconds each replacement took, from the loss noticed to the
            replacement rejoined.
    """

    def __init__(self, job: JobView, replacement_timeout_s: float) -> None:
        self.job = job
        #: lost replicas not replaced for want of room (the job runs on without them): key ->
        #: ``{"ref": the replacement's info() future, "cause", "lost_steps", "t0"}``
        self.absent: dict[tuple[str, int], dict[str, Any]] = {}
        #: key -> items asked of it beyond the consumers' iterations since the replicas
        #: started: + what it did for absent replicas, - the share it was not asked while absent
        self._asked_delta: Counter = Counter()
        self._order_seq = 0
        self._ordered: set[tuple[str, int]] = set()  # consumers given an absence order
        #: central inference's replaced clients: key -> how many times (the server's generation
        #: of it, :meth:`_redo_client`)
        self._generations: Counter = Counter()
        self._spread_at = 0
        #: seconds each replacement took, from the loss noticed to the replacement rejoined
        self.replacement_s: list[float] = []
        self._replacement_timeout_s = replacement_timeout_s

    def asked(self, key: tuple[str, int], end: int) -> int:
        """The items replica ``key``'s consumer has been promised from it, since the replicas
        started, when the consumers reach iteration ``end`` (of this start)."""
        return end + self._asked_delta[key]

    def _spread(self, total: int, keys: Sequence[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """``total`` items split over ``keys`` as evenly as whole items allow (the remainder's
        turns rotate from call to call)."""
        if not keys:
            return {}
        base, rest = divmod(total, len(keys))
        out = {k: base for k in keys}
        for j in range(rest):
            out[keys[(self._spread_at + j) % len(keys)]] += 1
        self._spread_at = (self._spread_at + rest) % len(keys)
        return out

    def _stand_ins(self, key: tuple[str, int]) -> list[tuple[str, int]]:
        """The live replicas that can do lost replica ``key``'s share: the other replicas of its
        fragment, not absent, when they all put on one ``fifo`` boundary read by one consumer
        (whose shared queue any of their items may stand in; empty: none can)."""
        outs = fifo_out(self.job.fragment_graph, key[0])
        if len(outs) != 1:
            return []
        b, n = outs[0], self.job.spec.policy.fragment(key[0]).replicas
        if len({deliveries(b, r)[0][0] for r in range(n)}) != 1:
            return []
        return [k for k in self.job.keys if k[0] == key[0] and k != key and k not in self.absent]

    def chunk_counts(self, n: int) -> dict[tuple[str, int], int]:
        """The iterations each replica runs in a chunk of ``n`` while some are absent: none for
        an absent one, ``n`` plus a share of the absent ones' for the live replicas of its
        fragment; the promises (:meth:`asked`) move with them."""
        counts = {k: n for k in self.job.keys}
        for key in self.absent:
            counts[key] = 0
            for q, e in self._hand_over(key, n).items():
                counts[q] += e
        return counts

    def _hand_over(self, key: tuple[str, int], items: int) -> dict[tuple[str, int], int]:
        """Moves ``items`` of absent replica ``key``'s promises to the live replicas of its
        fragment (:meth:`_stand_ins`, :meth:`_spread`); returns each one's extra items."""
        self._asked_delta[key] -= items
        extra = {q: e for q, e in self._spread(items, self._stand_ins(key)).items() if e > 0}
        for q, e in extra.items():
            self._asked_delta[q] += e
        return extra

    def _absent_by_consumer(self) -> dict[tuple[str, int], dict[str, list[int]]]:
        """Consumer -> ``{fifo boundary: its absent producers}``."""
        by_consumer: dict[tuple[str, int], dict[str, list[int]]] = {}
        for key in self.absent:
            b = fifo_out(self.job.fragment_graph, key[0])[0]
            consumer = (b.dst, deliveries(b, key[1])[0][0])
            by_consumer.setdefault(consumer, {}).setdefault(b.name, []).append(key[1])
        return by_consumer

    def _send_absent(self, sync: bool) -> None:
        """Tells each consumer which of its producers are absent (:meth:`ReplicaActor.set_absent`):
        through the store its heartbeat reads (it may be busy in a chunk), and, ``sync``
        (between chunks), by a call that returns once it applied."""
        by_consumer = self._absent_by_consumer()
        self._send_orders(sorted(self._ordered | set(by_consumer)), sync)
        self._ordered = set(by_consumer)

    def _send_orders(self, consumers: Sequence[tuple[str, int]], sync: bool) -> None:
        """Writes each consumer's whole order (its absent producers, :meth:`ReplicaActor.set_absent`,
        and its replaced central inference clients' generations, :meth:`_redo_client`) under a new
        sequence number: an order replaces the last one in the store, so each carries all of it.
        ``sync``: also applied by a call (between chunks)."""
        import ray

        by_consumer = self._absent_by_consumer()
        self._order_seq += 1
        for consumer in consumers:
            absent = by_consumer.get(consumer, {})
            redo = {f"{f}/{r}": g for (f, r), g in self._generations.items()
                    if self.job.fragment_graph.inference is not None and consumer == (self.job.fragment_graph.inference.server, 0)}
            self.job.watchdog.order(consumer, {"seq": self._order_seq, "absent": absent, "redo": redo})
            if sync:
                ray.get(self.job.replicas.submit(consumer, "set_absent", self._order_seq, absent))

    def _go_absent(self, cause: ReplicaDied, key: tuple[str, int], ref: Any, end: int, delivered: int,
                   lost_steps: int, t0: float, again: Any, result: Any) -> StandIn:
        """Runs on without lost replica ``key`` (no node has room for its replacement, which
        waits for one: :meth:`settle_absent`): what it still owed this call is spread over the
        live replicas of its fragment as extra iterations, and its consumer takes its share from
        theirs (:meth:`~msrl.runtime.asynchronous.Mailbox.set_absent`)."""
        extras = {self.job.keys.index(q): [self.job.replicas.submit(q, *again(q, e))]
                  for q, e in self._hand_over(key, self.asked(key, end) - delivered).items()}
        self.absent[key] = {"ref": ref, "cause": cause, "lost_steps": lost_steps, "t0": t0}
        self.job.replica_steps[key] = self._steps_at(key, delivered)  # its count stays there while absent
        self._count_loss(cause, lost_steps, self.job.replica_steps[key])
        self.job.watchdog.absent.add(key)
        self._send_absent(sync=False)
        frag = self.job.spec.policy.fragment(key[0])
        live = frag.replicas - sum(1 for k in self.absent if k[0] == key[0])
        self.job.faults["absent_replicas"] = self.job.faults.get("absent_replicas", 0) + 1
        print(f"msrl: {cause}; its placement-group bundle was on a lost node and is not placed again yet (Ray places "
              f"it once a live node has room): running on with {live} of {frag.replicas} {key[0]} replicas, the others "
              f"doing its share, until it is", file=sys.stderr, flush=True)
        return StandIn(result, extras)

    def settle_absent(self, end: int) -> None:
        """Between chunks (the consumers at iteration ``end``): each absent replica whose
        replacement a node now has room for rejoins (from the items it delivered on), and its
        consumer is told before the next chunk."""
        import ray

        back = []
        for key, a in list(self.absent.items()):
            if not self.job.replicas.done(a["ref"]):
                continue
            try:
                info = ray.get(a["ref"])
            except ray.exceptions.RayActorError:  # placed on a node lost in turn: it waits again
                self.job.replicas.replace(key)
                a["ref"] = self.job.replicas.submit(key, "info")
                continue
            del self.absent[key]
            self._finish_rejoin(a["cause"], key, info, self.asked(key, end), a["lost_steps"], a["t0"], back=True)
            back.append(key)
        if back:
            self._send_absent(sync=True)

    def replace(self, cause: ReplicaDied, end: int, again: Any, result: Any = None) -> Any:
        """Replaces the lost replica of ``cause`` alone (:mod:`msrl.runtime.elastic`) while the
        others run; returns the future of ``again(key, owed)``, the call the replacement runs in
        the lost one's place (``owed``: the iterations it owes its consumer), a
        :class:`~msrl.cluster.actor_manager.StandIn` (its result ``result``) when no node has
        room for a replacement and the job runs on without it (:meth:`_go_absent`), or ``None``
        when its fragment is not replaced (every replica then restarts from the checkpoint).

        ``end``: the iterations the consumers will have run since the replicas started when the
        running call ends; the replacement owes each consumer the items promised by then
        (:meth:`asked`) minus those it received from the lost replica (read from the consumer's
        heartbeat once the lost replica's stream has ended there)."""

        key = (cause.fragment, cause.replica)
        if key[0] not in self.job.elastic or self.job.watchdog is None:
            return None
        t0 = time.monotonic()
        timeout_s = self.job.rejoin_args[4]
        lost_steps = max(self.job.watchdog.env_steps().get(key, 0), self.job.replica_steps.get(key, 0))
        self.job.replicas.replace(key)
        plan = self.job.fragment_graph.inference
        if plan is not None and key[0] == plan.clients:
            delivered = self._redo_client(key, (plan.server, 0), min(timeout_s, ENDED_WAIT_S))
        else:
            delivered = self._delivered(key, end, min(timeout_s, ENDED_WAIT_S))
        if delivered is None:
            return None  # the consumer never saw the stream end: restart every replica
        try:
            return self._rejoin(cause, key, again, end, delivered, lost_steps, t0, result)
        except Exception as e:  # noqa: BLE001 - the replacement failed to start: every replica restarts
            print(f"msrl: the replacement of fragment {key[0]} replica {key[1]} failed ({type(e).__name__}: "
                  f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}); restarting every replica instead",
                  file=sys.stderr, flush=True)
            return None

    def _delivered(self, key: tuple[str, int], end: int, timeout_s: float) -> int | None:
        """The items lost replica ``key`` delivered to its consumer since the replicas started
        (at most what was asked of it by iteration ``end``), read from the consumer's heartbeat
        once the lost process's stream ended there; ``None``: it did not end within ``timeout_s``."""
        from msrl.cluster.watchdog import PERIOD_S

        b = fifo_out(self.job.fragment_graph, key[0])[0]
        consumer = (b.dst, deliveries(b, key[1])[0][0])
        name, asked = f"{key[0]}/{key[1]}", self.asked(key, end)
        # the lost process is gone (killed when hung): its stream ends at the consumer within a
        # heartbeat or two; one that does not is a fault of its own, answered by the restart
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            record = self.job.watchdog.record(consumer) or {}
            received = int(record.get("received", {}).get(f"{b.name}|{key[1]}", 0))
            # final once its stream ended there, or once it holds all the chunk asks of it
            if name in record.get("ended", ()) or received >= asked:
                return min(received, asked)
            time.sleep(PERIOD_S / 2)
        return None

    def _redo_client(self, key: tuple[str, int], server: tuple[str, int], timeout_s: float) -> int | None:
        """Central inference's lost client ``key`` (an env replica): once its stream ended at
        the ``server`` replica, orders the server (through its heartbeat: it is busy in its
        chunk) to drop what the lost process sent and start that client's served run of the
        current iteration again (:meth:`~msrl.runtime.asynchronous.Mailbox.redo`,
        :class:`~msrl.runtime.inference.InferenceServer`), and waits until no run serves the
        lost process any more. Returns the runs completed for it since the replicas started
        (the iterations its replacement does not owe); ``None``: not within ``timeout_s``."""
        from msrl.cluster.watchdog import PERIOD_S

        name = f"{key[0]}/{key[1]}"
        deadline = time.monotonic() + timeout_s
        while name not in (self.job.watchdog.record(server) or {}).get("ended", ()):
            if time.monotonic() > deadline:
                return None
            time.sleep(PERIOD_S / 2)
        self._generations[key] += 1
        self._send_orders([server], sync=False)
        while time.monotonic() < deadline:
            record = self.job.watchdog.record(server) or {}
            client = record.get("clients", {}).get(name, {})
            if record.get("generations", {}).get(name, 0) >= self._generations[key] and not client.get("stale", True):
                return int(client["runs"])
            time.sleep(PERIOD_S / 2)
        return None

    def _rejoin(self, cause: ReplicaDied, key: tuple[str, int], again: Any, end: int, delivered: int,
                lost_steps: int, t0: float, result: Any = None) -> Any:
        """The second half of :meth:`replace`: the new process's boundaries and reset, its
        count from ``delivered`` items on; returns its call ``again(key, owed)`` (method and
        arguments), or a :class:`~msrl.cluster.actor_manager.StandIn` when no node has room for
        it and its fragment can run on without it (:meth:`_go_absent`)."""
        import ray

        ref = self.job.replicas.submit(key, "info")
        deadline, noted = time.monotonic() + self._replacement_timeout_s, False
        while True:  # a new process starts (seconds); a bundle on a lost node waits for room elsewhere
            try:
                info = ray.get(ref, timeout=1.0)
                break
            except ray.exceptions.RayActorError:
                # sent to its bundle's node before Ray knew that node lost: once Ray marks it
                # dead it places the bundle again on a live node, where the next try starts
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
                self.job.replicas.replace(key)
                ref = self.job.replicas.submit(key, "info")
            except ray.exceptions.GetTimeoutError:
                if time.monotonic() > deadline:
                    raise
                if not noted and time.monotonic() - t0 > CAPACITY_NOTE_S and self.job.bundle_unplaced(key):
                    if self._stand_ins(key):
                        return self._go_absent(cause, key, ref, end, delivered, lost_steps, t0, again, result)
                    noted = True
                    print(f"msrl: waiting for capacity to replace fragment {key[0]} replica {key[1]} (its placement-group "
                          f"bundle was on a lost node and is placed again when a live node has room; the replicas that "
                          f"need it wait at their boundaries), for up to cluster.capacity_timeout_s="
                          f"{self._replacement_timeout_s:g} s", file=sys.stderr, flush=True)
        self._finish_rejoin(cause, key, info, delivered, lost_steps, t0)
        return self.job.replicas.submit(key, *again(key, self.asked(key, end) - delivered))

    def _steps_at(self, key: tuple[str, int], delivered: int) -> int:
        """Replica ``key``'s env steps after ``delivered`` items since the replicas started
        (every env replica steps ``env_steps_per_iteration / env replicas`` an item)."""
        env_replicas = sum(f.replicas for f in self.job.spec.policy.fragments if "env" in f.roles)
        has_env = "env" in self.job.spec.policy.fragment(key[0]).roles
        per_iteration = self.job.spec.env_steps_per_iteration // max(1, env_replicas) if has_env else 0
        return (self.job.start_iteration + delivered) * per_iteration

    def _count_loss(self, cause: ReplicaDied, lost_steps: int, offset: int) -> int:
        """Counts a lost replica's fault (a hang, the env steps of its rollout in flight dropped:
        those past ``offset``, the steps of the items it delivered); returns the dropped steps."""
        dropped = max(0, lost_steps - offset)
        hung = int(type(cause).__name__ == "ReplicaHung")
        for k, v in (("dropped_env_steps", dropped), ("replica_hangs", hung)):
            self.job.faults[k] = self.job.faults.get(k, 0) + v
        return dropped

    def _finish_rejoin(self, cause: ReplicaDied, key: tuple[str, int], info: Mapping[str, Any], delivered: int,
                       lost_steps: int, t0: float, back: bool = False) -> None:
        """A replacement started (``info``: its :meth:`ReplicaActor.info`) joins the job: its
        priority, its boundary server, its streams and ``reset``, its env-step count from the
        ``delivered`` items of the lost replica on; counts the fault and says so in one line.
        ``back``: it replaces a replica the job ran on without (its loss counted then)."""
        import ray

        servers, token, tls, max_message, timeout_s, transport, priority = self.job.rejoin_args
        offset = self._steps_at(key, delivered)
        self.job.replicas.relocate(key, info, ray.get_runtime_context().get_node_id())
        peers = dict(self.job.replicas.peers)
        self.job.lower_replacement(key, peers, priority)
        own = ray.get(self.job.replicas.submit(key, "start_boundary_server", token, timeout_s, tls, max_message, None, peers,
                                           transport))
        consumers = {k: a for k, a in servers.items() if k != key}
        if own is not None:
            servers[key] = own
        ray.get(self.job.replicas.submit(key, "rejoin", consumers, peers, own, token, tls, max_message, timeout_s,
                                     sorted(self.job.elastic), offset))
        self.job.replica_steps[key] = offset
        self.job.faults["replaced_replicas"] = self.job.faults.get("replaced_replicas", 0) + 1
        self.replacement_s.append(time.monotonic() - t0)
        if back:
            print(f"msrl: its bundle placed again: fragment {key[0]} replica {key[1]} replaced, "
                  f"{self.replacement_s[-1]:.0f} s after its loss (the job ran on without it meanwhile)",
                  file=sys.stderr, flush=True)
        else:
            dropped = self._count_loss(cause, lost_steps, offset)
            print(f"msrl: {cause}; replaced it alone in {self.replacement_s[-1]:.1f} s (the other replicas kept running; "
                  f"{dropped} env steps of its rollout in flight dropped)", file=sys.stderr, flush=True)
