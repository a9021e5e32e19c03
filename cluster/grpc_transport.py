"""The gRPC transport of asynchronous boundaries between processes (DESIGN.md §5).

Every replica that consumes an asynchronous boundary (``fifo`` queue, ``latest`` slot; see
:mod:`msrl.runtime.asynchronous`) runs one :class:`BoundaryServer`; every producer opens one
bidirectional stream to each consumer replica it sends to (:class:`GrpcTransport`). Frames are
raw bytes, never pickle::

    request  (producer -> consumer): b"MSRA" | format 1 | type | boundary tag (u16) |
                                     producer replica (u16) | versions n (u16) | version (u64) |
                                     n x (boundary tag u16, version u64) | codec message
    batch    (producer -> consumer): b"MSRA" | format 1 | BATCH | count (u16) | count x (length (u32) | request)
    response (consumer -> producer): b"MSRA" | format 1 | CREDIT | boundary tag (u16) | count (u32)

``type`` is ``ITEM`` (a ``fifo`` item; the versions are the ``latest`` slots its producer had
read) or ``LATEST`` (version ``version`` of a slot). The codec message is
:func:`msrl.runtime.codec.encode`'s (dtype + shape + raw bytes). A ``BATCH`` message carries
several requests in one gRPC message: a producer holds the ``fifo`` items it puts until it is
about to wait for anything (a ``get``, a synchronous receive, a full queue's credits, the end
of its iteration) and then sends what it holds at once (:meth:`GrpcTransport.flush`); an env
replica's five values of one step (observation, reward, terminated, truncated, final
observation) cross as one message instead of five.

Flow control: a producer holds ``capacity`` credits per (boundary, consumer); a ``fifo`` item
spends one, and the consumer returns it (a ``CREDIT`` frame) when its program takes the item,
so a producer's ``put`` waits exactly while the consumer's queue is full. ``latest`` frames are
coalesced: a newer version replaces an older one not yet on the wire, and ``put`` never waits.

Security: every stream presents the job's token (``msrl-token`` metadata, a random value the
driver makes and hands to replicas through Ray) and its producer's name (``msrl-producer``:
``fragment/replica``), checked with a constant-time comparison before anything is read; a
server binds one address (the node's, as Ray reports it), never all interfaces; TLS when a
certificate and key are given. Every frame is checked before it is used: its size (gRPC's
``max_receive_message_length``, then the codec's own checks), its type, its boundary (one this
producer may send on to this consumer), its producer replica, its credits. A bad stream is
aborted with a status naming the problem (``UNAUTHENTICATED``, ``PERMISSION_DENIED``,
``INVALID_ARGUMENT``, ``RESOURCE_EXHAUSTED``) and counted in :attr:`BoundaryServer.rejected`;
the server goes on serving every other stream.

Faults: when a stream breaks (the consumer's process restarted), the producer reconnects to
the same address for up to ``reconnect_s`` seconds; what it had in flight is dropped and counted
(:attr:`GrpcTransport.dropped`).
"""

from __future__ import annotations

import dataclasses
import hmac
import queue
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Mapping, Sequence

import grpc

from msrl.channels import ChannelClosed
from msrl.cluster.refusals import Refusals
from msrl.errors import MsrlError
from msrl.runtime.asynchronous import Item, Mailbox
from msrl.runtime.codec import MAX_MESSAGE as CODEC_MAX_MESSAGE
from msrl.runtime.codec import CodecError, decode, encode

__all__ = ["TransportError", "TlsConfig", "BoundaryServer", "GrpcTransport", "METHOD", "MAX_MESSAGE",
           "ITEM", "LATEST", "CREDIT", "BATCH", "encode_frame", "parse_frame", "encode_batch", "split_batch",
           "deliver_frame"]

METHOD = "/msrl.Boundaries/Stream"
MAGIC = b"MSRA"
FORMAT = 1
ITEM, LATEST, CREDIT, BATCH = 1, 2, 3, 4
_HEAD = struct.Struct("<4sBBHHHQ")
_BATCH = struct.Struct("<4sBBH")
_LENGTH = struct.Struct("<I")
#: the most requests one BATCH message may carry
MAX_BATCH_FRAMES = 4096
_VERSION = struct.Struct("<HQ")
_CREDIT = struct.Struct("<4sBBHI")
#: the largest frame a server accepts by default (bytes): the codec's default limit of a message
#: between processes; ``cluster.max_message_mb`` sets it
MAX_MESSAGE = CODEC_MAX_MESSAGE


class TransportError(MsrlError, ValueError):
    """A malformed, unauthorised or out-of-order frame: the message names what is wrong."""


@dataclasses.dataclass(frozen=True)
class TlsConfig:
    """TLS for the boundary streams.

    Attributes:
        cert: the PEM certificate chain servers present (clients trust it as their root).
        key: the PEM private key of ``cert``.
        server_name: the name clients check the certificate against (``None``: the address
            they dial; set it when the certificate names a host, not the nodes' addresses).
    """

    cert: bytes
    key: bytes
    server_name: str | None = None


def encode_frame(kind: int, tag: int, producer: int, version: int, versions: Mapping[int, int], message: bytes) -> bytes:
    """A request frame (see the module docstring)."""
    head = _HEAD.pack(MAGIC, FORMAT, kind, tag, producer, len(versions), version)
    return head + b"".join(_VERSION.pack(t, v) for t, v in versions.items()) + message


def parse_frame(frame: bytes, max_tags: int) -> tuple[int, int, int, int, dict[int, int], memoryview]:
    """``(type, boundary tag, producer replica, version, versions, codec message)`` of a
    request frame, every field checked against the frame's length and ``max_tags``.

    Raises:
        TransportError: a frame shorter than its header, a wrong magic or format, an unknown
            type, a tag out of range.
    """
    if not isinstance(frame, (bytes, bytearray)) or len(frame) < _HEAD.size:
        raise TransportError(f"a frame of {len(frame) if hasattr(frame, '__len__') else '?'} bytes, shorter than "
                             f"the {_HEAD.size}-byte header")
    magic, fmt, kind, tag, producer, n, version = _HEAD.unpack_from(frame)
    if magic != MAGIC:
        raise TransportError(f"a frame starting with {magic!r}, not {MAGIC!r}")
    if fmt != FORMAT:
        raise TransportError(f"frame format {fmt}; this msrl speaks format {FORMAT}")
    if kind not in (ITEM, LATEST):
        raise TransportError(f"frame type {kind}; producers send ITEM ({ITEM}) or LATEST ({LATEST})")
    if tag >= max_tags:
        raise TransportError(f"boundary tag {tag}; this job has {max_tags} boundaries")
    if n > max_tags:
        raise TransportError(f"{n} slot versions in one frame; this job has {max_tags} boundaries")
    end = _HEAD.size + n * _VERSION.size
    if end > len(frame):
        raise TransportError(f"{n} slot versions run past the {len(frame)}-byte frame")
    versions = {}
    for i in range(n):
        t, v = _VERSION.unpack_from(frame, _HEAD.size + i * _VERSION.size)
        if t >= max_tags:
            raise TransportError(f"a slot version for boundary tag {t}; this job has {max_tags} boundaries")
        versions[t] = v
    return kind, tag, producer, version, versions, memoryview(frame)[end:]


def encode_batch(frames: Sequence[bytes]) -> bytes:
    """A ``BATCH`` message carrying ``frames`` (requests) in order (see the module docstring).

    Raises:
        ValueError: no frames, or more than :data:`MAX_BATCH_FRAMES`.
    """
    if not 0 < len(frames) <= MAX_BATCH_FRAMES:
        raise ValueError(f"a batch of {len(frames)} frames; 1..{MAX_BATCH_FRAMES}")
    return _BATCH.pack(MAGIC, FORMAT, BATCH, len(frames)) + b"".join(_LENGTH.pack(len(f)) + f for f in frames)


def is_batch(message: bytes) -> bool:
    """Whether ``message`` is a ``BATCH`` message (by its header; :func:`split_batch` checks the rest)."""
    return len(message) >= _BATCH.size and message[:4] == MAGIC and message[5] == BATCH


def split_batch(message: bytes) -> list[bytes]:
    """The requests of a ``BATCH`` message, every length checked against the message.

    Raises:
        TransportError: a wrong header, a count of 0 or over :data:`MAX_BATCH_FRAMES`, a length
            running past the message, bytes left over.
    """
    if len(message) < _BATCH.size:
        raise TransportError(f"a batch of {len(message)} bytes, shorter than its {_BATCH.size}-byte header")
    magic, fmt, kind, count = _BATCH.unpack_from(message)
    if magic != MAGIC or fmt != FORMAT or kind != BATCH:
        raise TransportError("a batch with a wrong header")
    if not 0 < count <= MAX_BATCH_FRAMES:
        raise TransportError(f"a batch of {count} frames; 1..{MAX_BATCH_FRAMES}")
    out, at = [], _BATCH.size
    for i in range(count):
        if at + _LENGTH.size > len(message):
            raise TransportError(f"frame {i} of a batch of {count} starts past the {len(message)}-byte message")
        (n,) = _LENGTH.unpack_from(message, at)
        at += _LENGTH.size
        if at + n > len(message):
            raise TransportError(f"frame {i} of a batch ({n} bytes) runs past the {len(message)}-byte message")
        out.append(bytes(message[at:at + n]))
        at += n
    if at != len(message):
        raise TransportError(f"{len(message) - at} bytes after the {count} frames of a batch")
    return out


def _channel(target: str, tls: TlsConfig | None, max_message: int) -> grpc.Channel:
    options = [("grpc.max_send_message_length", max_message), ("grpc.max_receive_message_length", max_message)]
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=tls.cert), options=options)


class _Abort:
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code, self.message = code, message


def deliver_frame(boundaries: Sequence[Any], fragment: str, mailbox: Mailbox, frame: bytes,
                  producer: tuple[str, int]) -> None:
    """Checks one request frame from ``producer`` (``(fragment, replica)``, as its stream
    authenticated it) against the job's ``boundaries`` and delivers it into ``mailbox``, the
    consumer ``fragment``'s: a ``fifo`` item without waiting, a ``latest`` version.

    Raises:
        TransportError: a malformed frame, a boundary this producer does not send on to this
            consumer, another replica's frame, the wrong type for the boundary, an item beyond
            the producer's credits; CodecError: a malformed codec message; ChannelClosed: the
            mailbox was closed.
    """
    kind, tag, rep, version, versions, message = parse_frame(frame, len(boundaries))
    b = boundaries[tag]
    if not b.asynchronous or b.dst != fragment or b.src != producer[0]:
        raise TransportError(f"boundary tag {tag} ({b.name}) is not an asynchronous boundary from "
                             f"{producer[0]} to {fragment}")
    if rep != producer[1]:
        raise TransportError(f"a frame of replica {rep} on the stream of replica {producer[1]}")
    want = ITEM if b.mode == "fifo" else LATEST
    if kind != want:
        raise TransportError(f"a {'LATEST' if kind == LATEST else 'ITEM'} frame on {b.mode} boundary {b.name}")
    slots = {}
    for t, v in versions.items():
        sb = boundaries[t]
        if sb.mode != "latest":
            raise TransportError(f"a slot version for boundary {sb.name}, which is not a latest-value slot")
        slots[sb.name] = v
    # a fresh buffer: its tensors are viewed in it, or moved once onto the consumer's device
    value = decode(bytearray(message), mailbox.device, copy=False)
    if kind == ITEM:
        if not mailbox.deliver(b.name, rep, Item(value, slots), block=False):
            raise TransportError(f"more than {b.capacity} items in flight on {b.name}: the producer ignored "
                                 "its credits")
    else:
        mailbox.publish(b.name, rep, version, value)


class BoundaryServer:
    """The gRPC server of one consumer replica: takes its producers' streams and delivers
    their frames into its :class:`~msrl.runtime.asynchronous.Mailbox`.

    Args:
        boundaries: the job's boundaries in the job's order (a boundary's position is its tag).
        fragment, replica: the consumer replica this server belongs to.
        mailbox: where frames are delivered (its ``on_take`` is set here to return credits).
        token: the job's secret; a stream without it is refused.
        host: the address to bind (the node's own; never ``0.0.0.0`` unless asked for).
        port: the port (0: any free one).
        tls: serve TLS with this certificate and key.
        max_message: the largest frame accepted (bytes).

    Attributes:
        address: ``host:port`` the server listens on.
        rejected: the most recent refused streams and frames, each ``(producer, reason)``
            (bounded: :class:`~msrl.cluster.refusals.Refusals`, whose counts feed
            ``security/refused_*`` in ``metrics.csv``).

    Raises:
        RuntimeError: the address cannot be bound.
    """

    def __init__(self, boundaries: Sequence[Any], fragment: str, replica: int, mailbox: Mailbox, token: str,
                 host: str = "127.0.0.1", port: int = 0, tls: TlsConfig | None = None,
                 max_message: int = MAX_MESSAGE) -> None:
        self.boundaries = list(boundaries)
        self.fragment, self.replica = fragment, replica
        self.mailbox, self.token = mailbox, token
        self.max_message = max_message
        self.refusals = Refusals(f"boundary server (gRPC) of {fragment} replica {replica}")
        self._tags = {b.name: i for i, b in enumerate(self.boundaries)}
        # the producers that may stream to this replica: fragment -> replica count
        self._producers = {b.src: b.src_replicas for b in self.boundaries if b.asynchronous and b.dst == fragment}
        self._streams: dict[tuple[str, int], queue.Queue] = {}
        self._lock = threading.Lock()
        mailbox.on_take = self._credit
        workers = 2 * sum(self._producers.values()) + 8
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="msrl-boundary"),
            handlers=[grpc.method_handlers_generic_handler(
                "msrl.Boundaries", {"Stream": grpc.stream_stream_rpc_method_handler(self._stream)})],
            options=[("grpc.max_receive_message_length", max_message), ("grpc.max_send_message_length", 1 << 16),
                     ("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=workers,
        )
        bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if tls is None:
                bound = self._server.add_insecure_port(bind)
            else:
                bound = self._server.add_secure_port(bind, grpc.ssl_server_credentials([(tls.key, tls.cert)]))
        except RuntimeError as e:
            raise RuntimeError(f"cannot listen on {bind}: {e}") from None
        if not bound:
            raise RuntimeError(f"cannot listen on {bind}")
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        self._server.start()

    # -- a stream -------------------------------------------------------------------------
    @property
    def rejected(self) -> Any:
        """The most recent refusals, ``(producer, reason)`` each, oldest first (bounded)."""
        return self.refusals.recent

    def _refuse(self, context: grpc.ServicerContext, who: str, code: grpc.StatusCode, why: str) -> None:
        kind = "connections" if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) else "frames"
        self.refusals.add(kind, who, why)
        context.abort(code, f"msrl boundary server of {self.fragment} replica {self.replica}: {why}")

    def _stream(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        md = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        peer = context.peer()
        if not hmac.compare_digest(md.get("msrl-token", "").encode(), self.token.encode()):
            self._refuse(context, peer, grpc.StatusCode.UNAUTHENTICATED, "missing or wrong job token")
        name = md.get("msrl-producer", "")
        frag, _, rep = name.partition("/")
        if frag not in self._producers or not rep.isdigit() or int(rep) >= self._producers[frag]:
            self._refuse(context, peer, grpc.StatusCode.PERMISSION_DENIED,
                         f"producer {name!r} sends on no boundary to this replica (producers: "
                         f"{', '.join(f'{f}/0..{n - 1}' for f, n in self._producers.items())})")
        producer = (frag, int(rep))
        out: queue.Queue = queue.Queue()
        with self._lock:
            old = self._streams.get(producer)
            self._streams[producer] = out  # a reconnecting producer replaces its old stream
        if old is not None:
            old.put(None)
        context.add_callback(lambda: out.put(None))
        threading.Thread(target=self._read, args=(requests, producer, out), daemon=True,
                         name=f"msrl-boundary-read-{frag}{rep}").start()
        try:
            while True:
                x = out.get()
                if x is None:
                    return
                if isinstance(x, _Abort):
                    self._refuse(context, name, x.code, x.message)
                yield x
        finally:
            with self._lock:
                if self._streams.get(producer) is out:
                    del self._streams[producer]

    def _read(self, requests: Iterator[bytes], producer: tuple[str, int], out: queue.Queue) -> None:
        try:
            for message in requests:
                try:
                    for frame in (split_batch(message) if is_batch(message) else (message,)):
                        deliver_frame(self.boundaries, self.fragment, self.mailbox, frame, producer)
                except (TransportError, CodecError) as e:
                    out.put(_Abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad frame from {producer[0]}/{producer[1]}: {e}"))
                    return
                except ChannelClosed:
                    break
        except grpc.RpcError:
            # the producer went away, or gRPC refused a message over max_receive_message_length
            # unread: the two raise the same bare error here, so the latter is not counted
            pass
        except Exception as e:  # noqa: BLE001 - never let a frame kill the server
            out.put(_Abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"))
            return
        out.put(None)

    def _credit(self, boundary: str, producer: int) -> bool:
        b = self.boundaries[self._tags[boundary]]
        with self._lock:
            out = self._streams.get((b.src, producer))
        if out is not None:
            out.put(_CREDIT.pack(MAGIC, FORMAT, CREDIT, self._tags[boundary], 1))
        return out is not None

    def stop(self, grace_s: float = 1.0) -> None:
        """Ends every stream and stops listening."""
        with self._lock:
            streams = list(self._streams.values())
        for out in streams:
            out.put(None)
        self._server.stop(grace_s).wait(grace_s + 1.0)


class _Stream:
    """One producer's stream to one consumer replica: queued frames out, credits in."""

    def __init__(self, transport: "GrpcTransport", target: str) -> None:
        self.t, self.target = transport, target
        self.cond = threading.Condition()
        self.in_flight: dict[int, int] = {}
        self.latest: dict[int, bytes] = {}
        #: fifo frames put and not yet sent (sent together by :meth:`flush`)
        self.held: list[bytes] = []
        self.error: str | None = None
        self.closed = False
        self.channel = _channel(target, transport.tls, transport.max_message)
        self._open()

    def _open(self) -> None:
        self.out: queue.Queue = queue.Queue()
        stub = self.channel.stream_stream(METHOD, request_serializer=None, response_deserializer=None)
        md = (("msrl-token", self.t.token), ("msrl-producer", f"{self.t.fragment}/{self.t.replica}"))
        self.call = stub(self._requests(self.out), metadata=md, wait_for_ready=True)
        threading.Thread(target=self._responses, args=(self.call,), daemon=True,
                         name=f"msrl-boundary-credits-{self.target}").start()

    def _requests(self, out: queue.Queue) -> Iterator[bytes]:
        while True:
            x = out.get()
            if x is None:
                return
            if isinstance(x, int):  # a latest slot's turn: its newest frame, if still unsent
                with self.cond:
                    frame = self.latest.pop(x, None)
                if frame is None:
                    continue
                x = frame
            yield x

    def _responses(self, call: Any) -> None:
        try:
            for frame in call:
                if len(frame) != _CREDIT.size:
                    raise TransportError(f"a response of {len(frame)} bytes from {self.target}")
                magic, fmt, kind, tag, count = _CREDIT.unpack(frame)
                if magic != MAGIC or fmt != FORMAT or kind != CREDIT:
                    raise TransportError(f"a malformed credit from {self.target}")
                with self.cond:
                    self.in_flight[tag] = max(0, self.in_flight.get(tag, 0) - count)
                    self.cond.notify_all()
            if self.closed:
                return
            why = f"the boundary stream to {self.target} ended"
        except grpc.RpcError as e:
            if self.closed:
                return
            why = f"the boundary stream to {self.target} broke: {e.code().name}: {e.details()}"
        except TransportError as e:
            why = str(e)
        self._reconnect(why)

    def _reconnect(self, why: str) -> None:
        """Drops what was in flight (counted) and reopens the stream, for up to ``reconnect_s``."""
        with self.cond:
            lost = sum(self.in_flight.values()) + sum(1 for x in list(self.out.queue) if isinstance(x, bytes))
            self.t.dropped += lost
            self.in_flight.clear()
            self.latest.clear()
            self.held.clear()  # counted in in_flight
            self.out.put(None)
        deadline = time.monotonic() + self.t.reconnect_s
        while not self.closed and time.monotonic() < deadline:
            try:
                grpc.channel_ready_future(self.channel).result(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except grpc.FutureTimeoutError:
                continue
            with self.cond:
                self.t.reconnects += 1
                self._open()
                self.cond.notify_all()
            return
        with self.cond:
            self.error = f"{why}; no reconnection within {self.t.reconnect_s:g} s"
            self.cond.notify_all()

    def flush(self) -> None:
        """Sends the held frames, as one message."""
        with self.cond:
            self._flush()

    def _flush(self) -> None:
        if self.held:
            self.out.put(self.held[0] if len(self.held) == 1 else encode_batch(self.held))
            self.held = []

    def send_item(self, tag: int, capacity: int, frame: bytes, hold: bool = False) -> None:
        deadline = time.monotonic() + self.t.timeout_s
        with self.cond:
            t0 = time.perf_counter()
            if self.in_flight.get(tag, 0) >= capacity:
                self._flush()  # what it holds must leave before it waits for the credits they return
            while self.in_flight.get(tag, 0) >= capacity and self.error is None and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"queue to {self.target} full for {self.t.timeout_s:g} s")
                self.cond.wait(min(0.05, left))
            self.t.wait_s += time.perf_counter() - t0
            if self.error is not None or self.closed:
                raise ChannelClosed(self.error or f"the stream to {self.target} is closed")
            self.in_flight[tag] = self.in_flight.get(tag, 0) + 1
            if hold and len(self.held) < MAX_BATCH_FRAMES:
                self.held.append(frame)
            else:
                self._flush()
                self.out.put(frame)

    def send_latest(self, tag: int, frame: bytes) -> None:
        with self.cond:
            if self.error is not None or self.closed:
                raise ChannelClosed(self.error or f"the stream to {self.target} is closed")
            self._flush()  # the stream keeps the order of the puts
            queued = tag in self.latest
            self.latest[tag] = frame  # replaces an older version not yet on the wire
            if not queued:
                self.out.put(tag)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.out.put(None)
            self.cond.notify_all()
        self.channel.close()


class GrpcTransport:
    """A producer replica's side of the gRPC transport (an
    :class:`~msrl.runtime.asynchronous.AsyncTransport`): one stream to each consumer replica,
    opened on first use.

    Args:
        boundaries: the job's boundaries in the job's order.
        fragment, replica: the producer replica.
        addresses: ``(fragment, replica) -> "host:port"`` of every consumer replica's server.
        token: the job's secret.
        tls: connect with TLS, trusting this certificate.
        timeout_s: how long a ``put`` waits on a full queue.
        reconnect_s: how long a broken stream tries to reconnect.
        max_message: the largest frame sent (bytes).
        hold: hold ``fifo`` items until :meth:`flush` (which the endpoint calls before it
            waits for anything), sending them as one ``BATCH`` message; ``False``: each at once.

    Attributes:
        dropped: items and slot values in flight on streams that broke.
        reconnects: streams re-opened after a break.
        wait_s: seconds ``put`` waited for credits (back-pressure).
        bytes_sent: frame bytes queued for sending.
    """

    def __init__(self, boundaries: Sequence[Any], fragment: str, replica: int, addresses: Mapping[tuple[str, int], str],
                 token: str, tls: TlsConfig | None = None, timeout_s: float = 600.0, reconnect_s: float = 30.0,
                 max_message: int = MAX_MESSAGE, hold: bool = False) -> None:
        self.tags = {b.name: i for i, b in enumerate(boundaries)}
        self.fragment, self.replica = fragment, replica
        self.addresses = dict(addresses)
        self.token, self.tls = token, tls
        self.timeout_s, self.reconnect_s, self.max_message = timeout_s, reconnect_s, max_message
        self.hold = hold
        self.dropped = self.reconnects = 0
        self.wait_s = 0.0
        self.bytes_sent = 0
        self._streams: dict[tuple[str, int], _Stream] = {}
        self._streams_lock = threading.Lock()  # central inference sends from one thread per client
        #: the last frame made and what it was made of (held, so no other object can take its
        #: id): a broadcast sends one item or slot value to every consumer, encoded once
        self._last: tuple[int, str, int, Any, bytes] | None = None

    def _stream(self, fragment: str, replica: int) -> _Stream:
        with self._streams_lock:
            s = self._streams.get((fragment, replica))
            if s is None:
                target = self.addresses.get((fragment, replica))
                if target is None:
                    raise ChannelClosed(f"no boundary server address for {fragment} replica {replica}")
                s = self._streams[(fragment, replica)] = self._open_stream(target)
            return s

    def _open_stream(self, target: str) -> Any:
        """A stream to the consumer server at ``target`` (``host:port``)."""
        return _Stream(self, target)

    def _frame(self, kind: int, boundary: Any, version: int, versions: Mapping[str, int], value: Any,
               source: Any) -> bytes:
        last = self._last
        if last is not None and last[:3] == (kind, boundary.name, version) and last[3] is source:
            self.bytes_sent += len(last[4])
            return last[4]  # the same item or slot value to another consumer
        message = encode(value).numpy().tobytes()
        frame = encode_frame(kind, self.tags[boundary.name], self.replica, version,
                             {self.tags[n]: v for n, v in versions.items()}, message)
        if len(frame) > self.max_message:
            raise TransportError(f"boundary {boundary.name}: a value of {len(frame)} bytes exceeds the "
                                 f"{self.max_message}-byte message limit (cluster.max_message_mb)")
        self.bytes_sent += len(frame)
        self._last = (kind, boundary.name, version, source, frame)
        return frame

    def send_item(self, boundary: Any, producer: int, consumer: int, item: Item) -> None:
        """Queues ``item`` for the consumer (held until :meth:`flush` when ``hold``); waits
        while ``boundary.capacity`` are unacknowledged, sending what it holds first. The same
        ``item`` object sent to several consumers (a broadcast) is encoded once.

        Raises:
            ChannelClosed: the stream broke for good; TimeoutError: no credit in ``timeout_s``;
            TransportError: the value exceeds the message limit.
        """
        frame = self._frame(ITEM, boundary, 0, item.versions, item.value, item)
        self._stream(boundary.dst, consumer).send_item(self.tags[boundary.name], boundary.capacity, frame, self.hold)

    def flush(self) -> None:
        """Sends every frame held on every stream (each stream's as one message)."""
        for s in list(self._streams.values()):
            s.flush()

    def send_latest(self, boundary: Any, producer: int, consumer: int, version: int, value: Any) -> None:
        """Publishes ``value`` as ``version``; never waits (an unsent older version is replaced).

        Raises:
            ChannelClosed: the stream broke for good; TransportError: over the message limit.
        """
        frame = self._frame(LATEST, boundary, version, {}, value, value)
        self._stream(boundary.dst, consumer).send_latest(self.tags[boundary.name], frame)

    def close(self) -> None:
        """Ends every stream cleanly."""
        for s in self._streams.values():
            s.close()
        self._streams.clear()
