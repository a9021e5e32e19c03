"""Asynchronous boundaries: bounded FIFO queues and latest-value slots (DESIGN.md §3, "Boundary
kinds"), with the semantics every transport shares.

A boundary of kind ``fifo`` or ``latest`` is ``put`` on its src side and ``get`` on its dst
side. Values combine between the replica counts as the boundary's collective (its ``pattern``)
would combine them synchronously (the one table of :mod:`msrl.runtime.patterns`):

==========  ==========================================================================
pattern     what ``put`` sends, and what ``get`` returns
==========  ==========================================================================
send        src replica ``i`` -> dst replica ``i``
gather      every src replica -> dst replica 0, which concatenates one value of each
            producer along the boundary's axis, replica 0 first
reduce      every src replica -> every dst replica, which sums (or averages) one value of
            each producer leaf by leaf, replica 0 first (a ``partial`` value: A3C's gradients)
scatter     src replica 0 splits along the axis -> one shard to each dst replica
broadcast   src replica 0 -> every dst replica
==========  ==========================================================================

``fifo``: one bounded queue per (boundary, producer, consumer). ``put`` waits while the queue
holds ``capacity`` items not yet taken (back-pressure); ``get`` takes the oldest item of each
producer it reads from, waiting while there is none. Every item is taken exactly once.

``latest``: one slot per (boundary, producer, consumer). ``put`` publishes the next version
(1, 2, ...) and never waits; ``get`` reads the newest version published, waiting only until the
first one arrives; a value may be read several times or never.

``fresh``: a ``latest`` slot whose ``get`` waits for a version newer than the one this consumer
last read from that producer: every read is a new publication (the newest; one it never read
may be skipped). A broadcast in lockstep, over a transport that survives a peer's loss.

Policy lag: each ``fifo`` item carries the versions of the ``latest`` slots its producer had
read when it put the item (0: nothing read yet, i.e. the weights of ``reset``); a consumer that
itself publishes one of those slots records ``published - read`` for it when it takes the item
(:attr:`AsyncEndpoint.lags`): for an actor's trajectory and the learner's weights, the learner's
version minus the version the actor acted with.

Transports: :class:`LocalTransport` (threads of one process, :mod:`msrl.runtime.channels`) and the gRPC
transport (processes, :mod:`msrl.cluster.grpc_transport`) both deliver into a consumer's
:class:`Mailbox`; :class:`AsyncEndpoint` is the part both share.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from msrl.graph.fragmented import boundary_end
from msrl.policy import SLOT_CHANNELS
from msrl.runtime.channels import ChannelClosed, ProducerReplaced
from msrl.runtime.frame_stacks import compact_value, rebuild_value
from msrl.runtime.generators import BATON
from msrl.runtime.patterns import combine, deliveries, shards, sources
from msrl.runtime.values import copy_value, deliver, payload_bytes

__all__ = ["ChannelClosed", "Item", "Mailbox", "AsyncTransport", "AsyncEndpoint", "LocalTransport"]

_POLL_S = 0.05
#: the longest :meth:`Mailbox.newest` reads on for a frame partly read (a producer that stalls
#: mid-frame costs its reader this once; the newest whole version is returned then)
LATEST_WIRE_S = 1.0
_WIRE_POLL_S = 0.005


@dataclasses.dataclass
class Item:
    """One value in a ``fifo`` queue.

    Attributes:
        value: what the producer put (a copy the consumer owns).
        versions: ``latest`` boundary -> the version its producer had read when it put this.
    """

    value: Any
    versions: dict[str, int] = dataclasses.field(default_factory=dict)


class Mailbox:
    """What one consumer replica has received on its asynchronous boundaries. Thread-safe: a
    transport delivers from other threads (a producer's, or a gRPC server's), the replica's
    program takes.

    Args:
        capacity: boundary name -> a ``fifo`` queue's capacity (items per producer).
        timeout_s: how long :meth:`take` and :meth:`newest` wait before raising ``TimeoutError``.
        on_take: called with ``(boundary, producer)`` after an item is taken (the gRPC transport
            returns a credit to the producer).
        device: the consumer fragment's device: every transport delivers values onto it
            (:func:`msrl.runtime.channels.deliver`; a network transport decodes onto it). ``None``: values
            stay where they were made.

    Attributes:
        pump: ``pump(timeout_s)`` reads what arrived on the transport and delivers it, waiting
            up to ``timeout_s`` (a transport read by the replica's own thread sets it, see
            :mod:`msrl.cluster.uds_transport`): a waiting ``take`` or ``newest`` pumps instead of
            sleeping, one thread at a time, and ``newest`` pumps once without waiting so that it
            returns the newest version already sent.
        wake: ends a pump waiting in another thread (called when a value arrives by another way).
    """

    def __init__(self, capacity: Mapping[str, int], timeout_s: float = 600.0,
                 on_take: Callable[[str, int], None] | None = None, device: torch.device | str | None = None) -> None:
        self.capacity = dict(capacity)
        self.device = torch.device(device) if device is not None else None
        self.timeout_s = timeout_s
        self.on_take = on_take
        self._cond = threading.Condition(threading.Lock())
        self.pump: Callable[[float], None] | None = None
        self.wake: Callable[[], None] | None = None
        #: whether the transport :attr:`pump` reads holds a frame partly read (a big ``latest``
        #: value, a CNN's weights, arrives over many pumps: the kernel's socket buffer is ~200 KB)
        self.partial: Callable[[], bool] | None = None
        self._pumping: int | None = None  # the thread pumping now
        self._fifo: dict[tuple[str, int], collections.deque[Item]] = collections.defaultdict(collections.deque)
        self._slot: dict[tuple[str, int], tuple[int, Any]] = {}
        self._closed: str | None = None
        #: seconds a :meth:`take` or :meth:`newest` waited for a value to arrive
        self.wait_s = 0.0
        #: ``(boundary, producer) ->`` ``fifo`` items delivered since this mailbox was made
        self.received: dict[tuple[str, int], int] = collections.Counter()
        #: producers ``(fragment, replica)`` whose stream ended (its process gone) and has not
        #: been opened again since (:meth:`stream_ended`, :meth:`stream_opened`)
        self.ended: set[tuple[str, int]] = set()
        #: ``fifo`` boundary -> its producers that are absent (lost and not replaced, for want of
        #: capacity; :meth:`set_absent`): while any is, :meth:`take` with a ``pool`` serves a
        #: producer's share from any queue of the boundary
        self.absent: dict[str, frozenset[int]] = {}
        #: the sequence number of the last :meth:`set_absent` applied (older orders are ignored)
        self.absent_seq = 0
        #: producer ``(fragment, replica)`` -> its generation: how many times a run consuming
        #: it was told to start again for a replacement (:meth:`redo`; absent: 0)
        self.generation: dict[tuple[str, int], int] = {}

    def close(self, reason: str) -> None:
        """Wakes every waiter with :class:`ChannelClosed` (``reason`` in its message)."""
        with self._cond:
            self._closed = reason
            self._cond.notify_all()
        self._wake()

    def _wake(self) -> None:
        if self._pumping is not None and self._pumping != threading.get_ident() and self.wake is not None:
            self.wake()

    def _pump(self, timeout_s: float) -> None:
        """Pumps once (called with the lock held; released while pumping) unless another
        thread pumps already, in which case waits for what it delivers."""
        if self.pump is None or self._pumping is not None:
            self._cond.wait(timeout_s)
            return
        self._pumping = threading.get_ident()
        self._cond.release()
        try:
            self.pump(timeout_s)
        finally:
            self._cond.acquire()
            self._pumping = None
            self._cond.notify_all()  # what was delivered, and another waiter may pump now

    def _wait(self, ready: Callable[[], bool], what: str, block: bool = True, cancel: threading.Event | None = None) -> bool:
        if ready():
            return True
        deadline = time.monotonic() + self.timeout_s
        t0 = time.perf_counter()
        try:
            return self._wait_until(ready, what, block, deadline, cancel)
        finally:
            self.wait_s += time.perf_counter() - t0

    def _wait_until(self, ready: Callable[[], bool], what: str, block: bool, deadline: float,
                    cancel: threading.Event | None = None) -> bool:
        while not ready():
            if self._closed is not None:
                raise ChannelClosed(f"{what}: {self._closed}")
            if cancel is not None and cancel.is_set():
                raise ChannelClosed(f"{what}: the wait was cancelled (another run of this replica failed)")
            if not block:
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what}: nothing arrived within {self.timeout_s:g} s")
            self._pump(min(_POLL_S, left))
        return True

    def deliver(self, boundary: str, producer: int, item: Item, block: bool = True) -> bool:
        """Appends ``item`` to the queue of ``(boundary, producer)``. While the queue is full,
        waits (``block``) or returns ``False`` (a transport whose producers hold credits: a
        full queue means a producer sent more than it may).

        Raises:
            ChannelClosed: the mailbox was closed; TimeoutError: full for ``timeout_s``.
        """
        cap = self.capacity.get(boundary, 1)
        with BATON.released(), self._cond:  # other replicas of this process run while it waits
            q = self._fifo[(boundary, producer)]
            if not self._wait(lambda: len(q) < cap, f"queue {boundary} (producer {producer}) full", block):
                return False
            q.append(item)
            self.received[(boundary, producer)] += 1
            self._cond.notify_all()
        self._wake()
        return True

    def poll(self) -> None:
        """Reads what arrived on a transport read by the replica's own thread (:attr:`pump`),
        without waiting, unless a thread pumps already. The heartbeat's thread calls it, so that a
        replica idle between chunks still notes a producer's stream ended (a lost replica's:
        :mod:`msrl.runtime.elastic` waits for that end before the replacement); frames arrive
        without blocking (a producer holds credits for its queue's room)."""
        if self.pump is None:
            return
        with self._cond:
            if self._pumping is None:
                self._pump(0.0)

    def stream_ended(self, producer: tuple[str, int]) -> None:
        """A transport's note that ``producer``'s stream ended after every whole frame on it was
        delivered: its :attr:`received` counts are final until it connects again."""
        with self._cond:
            self.ended.add(producer)

    def stream_opened(self, producer: tuple[str, int]) -> None:
        """A transport's note that ``producer`` opened a stream (anew)."""
        with self._cond:
            self.ended.discard(producer)

    def counts(self) -> dict[str, Any]:
        """What an elastic job's driver reads from a consumer's heartbeat
        (:mod:`msrl.runtime.elastic`): ``received`` (``"boundary|producer replica" -> items``;
        the boundary names the producer's fragment), ``ended`` (``"fragment/replica"``
        of the producers whose stream ended), and, once a producer was told to start again,
        ``generations`` (``"fragment/replica" ->`` :attr:`generation`)."""
        with self._cond:
            out = {"received": {f"{b}|{p}": n for (b, p), n in self.received.items()},
                   "ended": sorted(f"{f}/{r}" for f, r in self.ended)}
            if self.generation:
                out["generations"] = {f"{f}/{r}": g for (f, r), g in self.generation.items()}
            return out

    def redo(self, producer: tuple[str, int], boundaries: Sequence[str], generation: int) -> bool:
        """Central inference's replacement of a lost client ``producer``: drops every item of
        it still queued on ``boundaries`` (what the lost process sent; its stream has ended) and
        moves it to ``generation``, so that a :meth:`take` or :meth:`check` of the run serving
        it under an older generation raises :class:`~msrl.runtime.channels.ProducerReplaced`. Returns
        whether it was applied (``generation`` newer than the producer's)."""
        with self._cond:
            if generation <= self.generation.get(producer, 0):
                return False
            self.generation[producer] = generation
            for b in boundaries:
                self._fifo[(b, producer[1])].clear()
            self._cond.notify_all()
        self._wake()
        return True

    def check(self, generation: tuple[tuple[str, int], int] | None) -> None:
        """Raises :class:`~msrl.runtime.channels.ProducerReplaced` when ``generation`` = ``(producer,
        the generation a run started under)`` is not the producer's now (:meth:`redo`)."""
        if generation is not None and self.generation.get(generation[0], 0) != generation[1]:
            raise ProducerReplaced(f"producer {generation[0][0]} replica {generation[0][1]} is being replaced")

    def set_absent(self, seq: int, absent: Mapping[str, Sequence[int]]) -> bool:
        """The job driver's order ``seq``: the producers of each ``fifo`` boundary in ``absent``
        that are lost and not replaced (for want of capacity), replacing the last order (a
        boundary left out has none absent). An order older than the last applied is ignored;
        returns whether this one was applied. While a boundary has an absent producer, the
        driver asks its live producers for the absent ones' items (:meth:`take`)."""
        with self._cond:
            if seq <= self.absent_seq:
                return False
            self.absent_seq = seq
            self.absent = {b: frozenset(int(r) for r in rs) for b, rs in absent.items() if rs}
            self._cond.notify_all()
        self._wake()
        return True

    def take(self, boundary: str, producer: int, cancel: threading.Event | None = None,
             pool: Sequence[int] = (), generation: tuple[tuple[str, int], int] | None = None) -> Item:
        """The oldest item of ``(boundary, producer)``, waiting while there is none (or until
        ``cancel`` is set). ``pool``: every producer of the boundary; while one of them is
        absent (:meth:`set_absent`), a producer whose queue is empty has its share served from
        the fullest queue of the pool (IMPALA's shared queue: the driver asks the live producers
        for as many items in all as the consumer takes, so any item may stand for any).
        ``generation``: ``(producer key, generation)`` of a central inference run (:meth:`check`).

        Raises:
            ChannelClosed: the mailbox was closed, or ``cancel`` set; TimeoutError: nothing for
            ``timeout_s``; ProducerReplaced: ``generation`` is not the producer's (now or
            while it waited).
        """
        with BATON.released(), self._cond:
            own = self._fifo[(boundary, producer)]

            def source() -> int | None:
                if own:
                    return producer
                if pool and self.absent.get(boundary):
                    best = max(pool, key=lambda r: len(self._fifo[(boundary, r)]))
                    return best if self._fifo[(boundary, best)] else None
                return None

            def stale() -> bool:
                return generation is not None and self.generation.get(generation[0], 0) != generation[1]

            self._wait(lambda: stale() or source() is not None, f"boundary {boundary} (from replica {producer})",
                       cancel=cancel)
            self.check(generation)
            producer = source()  # type: ignore[assignment]
            item = self._fifo[(boundary, producer)].popleft()
            self._cond.notify_all()
        if self.on_take is not None:
            self.on_take(boundary, producer)
        return item

    def publish(self, boundary: str, producer: int, version: int, value: Any) -> None:
        """Stores ``value`` as the slot's newest unless a newer version is there already."""
        with self._cond:
            have = self._slot.get((boundary, producer))
            if have is None or version > have[0]:
                self._slot[(boundary, producer)] = (version, value)
                self._cond.notify_all()
        self._wake()

    def newest(self, boundary: str, producer: int, after: int = 0) -> tuple[int, Any]:
        """``(version, value)`` newest in the slot of ``(boundary, producer)``; waits until a
        version newer than ``after`` arrives (``0``: any, i.e. the first).

        Raises:
            ChannelClosed: the mailbox was closed; TimeoutError: nothing for ``timeout_s``.
        """
        key = (boundary, producer)
        with BATON.released(), self._cond:
            if self.pump is not None and key in self._slot:
                self._pump(0.0)  # versions already sent, not yet read
                # and a version on the wire: read it whole (its sender is writing it now), or the
                # reader gets one ~200 KB socket buffer of it per read and acts with weights
                # many versions old (A3C on Pong: 6.8 MB of weights, a lag of 6-7 updates)
                deadline = time.monotonic() + LATEST_WIRE_S
                while self.partial is not None and self.partial() and time.monotonic() < deadline:
                    self._pump(_WIRE_POLL_S)
            what = (f"boundary {boundary} (first value from replica {producer})" if not after else
                    f"boundary {boundary} (a version after {after} from replica {producer})")
            self._wait(lambda: key in self._slot and self._slot[key][0] > after, what)
            return self._slot[key]

    def queued(self) -> int:
        """Items delivered and not yet taken, over every queue."""
        with self._cond:
            return sum(len(q) for q in self._fifo.values())

    def drop_queued(self) -> int:
        """Empties every queue; returns how many items it dropped."""
        with self._cond:
            n = sum(len(q) for q in self._fifo.values())
            for q in self._fifo.values():
                q.clear()
            self._cond.notify_all()
            return n


class AsyncTransport(Protocol):
    """Moves one asynchronous value from a producer to one consumer replica."""

    def send_item(self, boundary: Any, producer: int, consumer: int, item: Item) -> None:
        """Delivers a ``fifo`` item into the consumer's queue; waits while it is full."""

    def send_latest(self, boundary: Any, producer: int, consumer: int, version: int, value: Any) -> None:
        """Publishes ``value`` as version ``version`` of the consumer's slot; never waits."""

    def flush(self) -> None:
        """Sends what the transport holds (it may hold ``fifo`` items until the producer is about
        to wait for anything)."""


class AsyncEndpoint:
    """One replica's side of every asynchronous boundary it is an end of: ``put`` and ``get``
    with the semantics in the module docstring, over any :class:`AsyncTransport`.

    Args:
        boundaries: the job's boundaries (only asynchronous ones are used).
        fragment, replica: who this endpoint is.
        mailbox: where this replica's asynchronous values arrive.
        transport: how its values reach other replicas' mailboxes.

    Attributes:
        lags: policy lags recorded by ``get`` since :meth:`pop_lags` (see the module docstring).
    """

    def __init__(self, boundaries: Sequence[Any], fragment: str, replica: int, mailbox: Mailbox,
                 transport: AsyncTransport) -> None:
        self.boundaries = {b.name: b for b in boundaries if b.asynchronous}
        self.fragment, self.replica = fragment, replica
        self.mailbox, self.transport = mailbox, transport
        #: latest (and fresh) slots this replica reads -> the version it last read (0: none yet)
        self.read_versions = {n: 0 for n, b in self.boundaries.items() if b.channel in SLOT_CHANNELS and b.dst == fragment}
        #: (fresh slot, producer) -> the version this replica last read from that producer
        self.fresh_read: dict[tuple[str, int], int] = {}
        #: (slot, producer) -> the version :meth:`substitute` handed a replacement's ``reset``
        self.substituted: dict[tuple[str, int], int] = {}
        #: latest (and fresh) slots this replica publishes -> the versions it published
        self.published = {n: 0 for n, b in self.boundaries.items() if b.channel in SLOT_CHANNELS and b.src == fragment}
        self.lags: list[int] = []
        #: boundary -> this replica's deliveries / sources (the pattern table's answers, fixed)
        self._routes: dict[str, list[tuple[int, int | None]]] = {}
        self._sources: dict[str, list[int]] = {}
        #: how the job's env pads a first frame stack when its rollouts leave in compact form
        #: (:attr:`msrl.runtime.endpoint.Endpoint.frame_padding`); ``None``: whole
        self.frame_padding: str | None = None
        self._whole: set[str] = set()  # fifo boundaries whose stacks broke the padding once

    def _flush(self) -> None:
        if self.transport is not None:
            self.transport.flush()

    def _get_boundary(self, name: str) -> Any:
        if name not in self.boundaries:
            raise KeyError(f"{name!r} is not an asynchronous boundary of this job")
        return boundary_end(self.boundaries, name, self.fragment)

    def put(self, name: str, value: Any) -> None:
        """Src side: queue (``fifo``) or publish (``latest``) ``value``.

        Raises:
            ChannelClosed, TimeoutError: a full queue stayed full (``fifo`` only).
        """
        b = self._get_boundary(name)
        if self.frame_padding is not None and b.channel == "fifo" and name not in self._whole:
            value, broken = compact_value(value, self.frame_padding)  # a frame-stacked rollout: compact
            if broken:
                self._whole.add(name)
        routes = self._routes.get(name)
        if routes is None:  # the replica mapping (msrl.runtime.patterns' table), fixed per boundary
            routes = self._routes[name] = deliveries(b, self.replica)
        if len(routes) == 1 and routes[0][1] is None:  # one whole value (send, gather): no shards
            targets = [(routes[0][0], value)]
        else:
            parts = shards(b, value)
            targets = [(r, value if part is None else parts[part]) for r, part in routes]
        if b.channel == "fifo":
            for key, version in self.substituted.items():  # an item made with a substituted value: read
                self.fresh_read[key] = max(self.fresh_read.get(key, 0), version)
            self.substituted.clear()
            versions = dict(self.read_versions)
            items: dict[int, Item] = {}  # one item per distinct value: a broadcast's is shared
            for r, v in targets:
                item = items.setdefault(id(v), Item(v, versions))
                self.transport.send_item(b, self.replica, r, item)
        else:
            version = self.published[name] = self.published[name] + 1
            for r, v in targets:
                self.transport.send_latest(b, self.replica, r, version, v)

    def get(self, name: str) -> Any:
        """Dst side: the oldest queued value of each producer (``fifo``) or the newest
        published one (``latest``), combined as the boundary's pattern says.

        Raises:
            ChannelClosed: the job stopped; TimeoutError: nothing arrived in time.
        """
        b = self._get_boundary(name)
        self._flush()  # what this replica holds leaves before it waits
        producers = self._sources.get(name)
        if producers is None:
            producers = self._sources[name] = sources(b, self.replica)
        if b.channel == "fifo":
            values = []
            for p in producers:
                item = self.mailbox.take(name, p, pool=producers)
                for slot, read in item.versions.items():
                    if slot in self.published:
                        self.lags.append(self.published[slot] - read)
                values.append(rebuild_value(item.value))
        else:
            fresh = b.channel == "fresh"  # a version newer than this reader's last, else the newest
            got = [self.mailbox.newest(name, p, self.fresh_read.get((name, p), 0) if fresh else 0) for p in producers]
            if fresh:
                for p, (v, _) in zip(producers, got):
                    self.fresh_read[(name, p)] = v
                    self.substituted.pop((name, p), None)
            self.read_versions[name] = min(v for v, _ in got)
            values = [copy_value(v) for _, v in got]  # a slot may be read again: the reader owns its copy
        return combine(b, values)

    def substitute(self, name: str, producer: int) -> Any:
        """The newest value in slot ``name`` from ``producer`` (waiting only for a first), for a
        replacement replica's ``reset`` (:class:`msrl.runtime.elastic.SubstituteEndpoint`): the
        value the lost replica had been given. Its version is what this replica's next items are
        made with (their policy lag); on a ``fresh`` slot it counts as read once this replica has
        put an item -- its program reads the slot after putting, so its next read must be a newer
        version -- and not before, when its program reads the slot first and must get this one.

        Raises:
            ChannelClosed, TimeoutError: as :meth:`get`.
        """
        version, value = self.mailbox.newest(name, producer)
        self.read_versions[name] = version
        if self.boundaries[name].channel == "fresh":
            self.substituted[(name, producer)] = version
        return copy_value(value)

    def take_from(self, name: str, producer: int, cancel: threading.Event | None = None,
                  generation: int | None = None) -> Any:
        """Dst side of a ``fifo`` boundary, one producer only (central inference serves each
        client replica on its own): that producer's oldest item. ``generation``: the producer's
        generation the run started under (:meth:`Mailbox.redo`).

        Raises:
            ChannelClosed: the job stopped, or ``cancel`` was set; TimeoutError: nothing in time;
            ProducerReplaced: the producer is being replaced (the run starts again).
        """
        b = self._get_boundary(name)
        if b.channel != "fifo":
            raise RuntimeError(f"boundary {name} is {b.channel}, not fifo: it has no per-producer queue to take from")
        self._flush()
        gen = ((b.src, producer), generation) if generation is not None else None
        return rebuild_value(self.mailbox.take(name, producer, cancel, generation=gen).value)

    def put_to(self, name: str, consumer: int, value: Any) -> None:
        """Src side of a ``fifo`` boundary, to one consumer replica only (its whole ``value``).

        Raises:
            ChannelClosed, TimeoutError: the consumer's queue stayed full.
        """
        b = self._get_boundary(name)
        if b.channel != "fifo":
            raise RuntimeError(f"boundary {name} is {b.channel}, not fifo: it has no per-consumer queue to put into")
        self.transport.send_item(b, self.replica, consumer, Item(value, dict(self.read_versions)))

    def pop_lags(self) -> list[int]:
        """The policy lags recorded since the last call."""
        out, self.lags = self.lags, []
        return out


class LocalTransport:
    """Delivers between replicas that are threads of one process: straight into the
    consumer's :class:`Mailbox`, as a copy on the consumer's device (``Mailbox.device``,
    :func:`~msrl.runtime.channels.deliver`: the one copy a network would make), blocking on a full queue.

    Args:
        mailboxes: ``(fragment, replica) -> Mailbox`` of every consumer replica.
    """

    def __init__(self, mailboxes: Mapping[tuple[str, int], Mailbox]) -> None:
        self.mailboxes = mailboxes
        #: boundary -> bytes of tensors sent on it
        self.bytes: dict[str, int] = {}
        self._lock = threading.Lock()

    def _count(self, boundary: str, value: Any) -> None:
        n = payload_bytes(value)
        with self._lock:
            self.bytes[boundary] = self.bytes.get(boundary, 0) + n

    def send_item(self, boundary: Any, producer: int, consumer: int, item: Item) -> None:
        """Copies ``item``'s value into the consumer's queue (waits while it is full)."""
        self._count(boundary.name, item.value)
        mailbox = self.mailboxes[(boundary.dst, consumer)]
        mailbox.deliver(boundary.name, producer, Item(deliver(item.value, mailbox.device), item.versions))

    def send_latest(self, boundary: Any, producer: int, consumer: int, version: int, value: Any) -> None:
        """Copies ``value`` into the consumer's slot."""
        self._count(boundary.name, value)
        mailbox = self.mailboxes[(boundary.dst, consumer)]
        mailbox.publish(boundary.name, producer, version, deliver(value, mailbox.device))

    def flush(self) -> None:
        """Nothing is held: every value was delivered when it was sent."""
