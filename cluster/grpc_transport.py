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
:func:`msrl.runtime.transports.codec.encode`'s (dtype + shape + raw bytes). A ``BATCH`` message carries
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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Mapping, Sequence

import grpc

from msrl.cluster.refusals import Refusals
from msrl.cluster.streams import (  # noqa: F401 - re-exported: the wire format
    _CREDIT,
    _HEAD,
    BATCH,
    CREDIT,
    FORMAT,
    ITEM,
    LATEST,
    MAGIC,
    MAX_BATCH_FRAMES,
    MAX_MESSAGE,
    StreamTransport,
    TransportError,
    deliver_frame,
    encode_batch,
    encode_frame,
    is_batch,
    parse_frame,
    split_batch,
)
from msrl.runtime.asynchronous import Mailbox
from msrl.runtime.channels import ChannelClosed
from msrl.runtime.transports.codec import CodecError

__all__ = ["TransportError", "TlsConfig", "BoundaryServer", "GrpcTransport", "METHOD", "MAX_MESSAGE",
           "ITEM", "LATEST", "CREDIT", "BATCH", "encode_frame", "parse_frame", "encode_batch", "split_batch",
           "deliver_frame"]

METHOD = "/msrl.Boundaries/Stream"


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
        #: ``on_rejoin(producer, address)``: called when a replacement replica of ``producer``
        #: opens its stream with its own server's ``address`` (``msrl-reply`` metadata: an
        #: elastic job; :meth:`~msrl.cluster.streams.StreamTransport.rejoin`)
        self.on_rejoin: Any = None
        other = mailbox.on_take  # another server's credits (producers on this machine), whichever started first
        mailbox.on_take = lambda b, p: self._credit(b, p) or (other is not None and other(b, p))
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
        out.superseded = False  # type: ignore[attr-defined] # set when the producer opens a newer stream
        with self._lock:
            old = self._streams.get(producer)
            self._streams[producer] = out  # a reconnecting producer replaces its old stream
            if old is not None:
                old.superseded = True
        if old is not None:
            old.put(None)
        self.mailbox.stream_opened(producer)
        reply = md.get("msrl-reply", "")  # a replacement replica's own server address
        if reply and self.on_rejoin is not None:
            self.on_rejoin(producer, reply)
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
        with self._lock:
            # not "is it still in _streams": the RPC's own end (its callback) may have removed it
            # first, and the producer's count is final all the same
            current = not out.superseded
        if current:  # it ended after its last whole frame: the producer's count is final
            self.mailbox.stream_ended(producer)
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
        md = (("msrl-token", self.t.token), ("msrl-producer", f"{self.t.fragment}/{self.t.replica}"),
              *((("msrl-reply", self.t.reply["grpc"]),) if self.t.reply.get("grpc") else ()))
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
            if self.t.lost(getattr(self, "key", None)):  # a replaceable replica: its replacement reopens the stream
                self.error = f"{why} (a replaceable replica)"
                self.cond.notify_all()
                return
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


def GrpcTransport(boundaries: Sequence[Any], fragment: str, replica: int, addresses: Mapping[tuple[str, int], str],  # noqa: N802
                  token: str, **kwargs: Any) -> StreamTransport:
    """A producer replica's side of the gRPC transport: a :class:`~msrl.cluster.streams.StreamTransport`
    whose streams are gRPC streams to ``host:port`` addresses (arguments and errors as that class's)."""
    return StreamTransport(boundaries, fragment, replica, addresses, token, open_stream=_Stream, **kwargs)
