"""The frames of asynchronous boundaries between processes, whatever carries them (gRPC streams
between machines, Unix sockets within one; DESIGN.md §5), and the producer side every such
transport shares (:class:`StreamTransport`). The wire format is described in
:mod:`msrl.cluster.grpc_transport`; frames are raw bytes, never pickle.
"""

from __future__ import annotations

import struct
import threading
from typing import Any, Mapping, Sequence

from msrl.errors import MsrlError
from msrl.policy import SLOT_CHANNELS
from msrl.runtime.asynchronous import Item, Mailbox
from msrl.runtime.channels import ChannelClosed
from msrl.runtime.transports.codec import MAX_MESSAGE as CODEC_MAX_MESSAGE
from msrl.runtime.transports.codec import decode, encode

__all__ = ["TransportError", "StreamTransport", "MAX_MESSAGE", "MAGIC", "FORMAT", "ITEM", "LATEST", "CREDIT", "BATCH",
           "encode_frame", "parse_frame", "encode_batch", "is_batch", "split_batch", "deliver_frame", "CREDIT_FRAME",
           "ProcessTransport"]

MAGIC = b"MSRA"
FORMAT = 1
ITEM, LATEST, CREDIT, BATCH = 1, 2, 3, 4
_HEAD = struct.Struct("<4sBBHHHQ")
_BATCH = struct.Struct("<4sBBH")
_LENGTH = struct.Struct("<I")
#: the most requests one BATCH message may carry
MAX_BATCH_FRAMES = 4096
_VERSION = struct.Struct("<HQ")
#: a CREDIT response: magic, format, CREDIT, boundary tag, count
CREDIT_FRAME = struct.Struct("<4sBBHI")
_CREDIT = CREDIT_FRAME
#: the largest frame a server accepts by default (bytes): the codec's default limit of a message
#: between processes; ``cluster.max_message_mb`` sets it
MAX_MESSAGE = CODEC_MAX_MESSAGE


class TransportError(MsrlError, ValueError):
    """A malformed, unauthorised or out-of-order frame: the message names what is wrong."""


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
    want = ITEM if b.channel == "fifo" else LATEST
    if kind != want:
        raise TransportError(f"a {'LATEST' if kind == LATEST else 'ITEM'} frame on {b.channel} boundary {b.name}")
    slots = {}
    for t, v in versions.items():
        sb = boundaries[t]
        if sb.channel not in SLOT_CHANNELS:
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


class StreamTransport:
    """A producer replica's side of the transports between processes (an
    :class:`~msrl.runtime.asynchronous.AsyncTransport`): one stream to each consumer replica,
    opened on first use by ``open_stream`` -- a gRPC stream (:func:`msrl.cluster.grpc_transport.GrpcTransport`)
    or a Unix-socket stream (:func:`ProcessTransport` picks by address):
    peers, each moving this class's frames.

    Args:
        boundaries: the job's boundaries in the job's order.
        fragment, replica: the producer replica.
        addresses: ``(fragment, replica) -> "host:port"`` of every consumer replica's server.
        token: the job's secret.
        tls: a :class:`~msrl.cluster.grpc_transport.TlsConfig`: its gRPC streams connect with TLS, trusting its certificate.
        timeout_s: how long a ``put`` waits on a full queue.
        reconnect_s: how long a broken stream tries to reconnect.
        max_message: the largest frame sent (bytes).
        hold: hold ``fifo`` items until :meth:`flush` (which the endpoint calls before it
            waits for anything), sending them as one ``BATCH`` message; ``False``: each at once.
        open_stream: ``open_stream(transport, target)`` -> the stream to the consumer server at
            ``target`` (its ``send_item``, ``send_latest``, ``flush``, ``close``).

    Attributes:
        dropped: items and slot values in flight on streams that broke.
        reconnects: streams re-opened after a break.
        wait_s: seconds ``put`` waited for credits (back-pressure).
        bytes_sent: frame bytes queued for sending.
    """

    def __init__(self, boundaries: Sequence[Any], fragment: str, replica: int, addresses: Mapping[tuple[str, int], str],
                 token: str, tls: Any = None, timeout_s: float = 600.0, reconnect_s: float = 30.0,
                 max_message: int = MAX_MESSAGE, hold: bool = False, open_stream: Any = None) -> None:
        if open_stream is None:
            raise TypeError("StreamTransport needs open_stream (GrpcTransport() or ProcessTransport() give one)")
        self.open_stream = open_stream
        self.tags = {b.name: i for i, b in enumerate(boundaries)}
        self.fragment, self.replica = fragment, replica
        self.addresses = dict(addresses)
        self.token, self.tls = token, tls
        self.timeout_s, self.reconnect_s, self.max_message = timeout_s, reconnect_s, max_message
        self.hold = hold
        self.dropped = self.reconnects = 0
        self.wait_s = 0.0
        self.bytes_sent = 0
        self._streams: dict[tuple[str, int], Any] = {}
        self._streams_lock = threading.Lock()  # central inference sends from one thread per client
        #: consumers that may be replaced (an elastic job, :mod:`msrl.runtime.elastic`): a broken
        #: stream to one is not reconnected; it is *gone*, what is sent to it dropped and counted,
        #: until its replacement greets this replica's server (:meth:`rejoin`)
        self.elastic: set[tuple[str, int]] = set()
        self._gone: set[tuple[str, int]] = set()
        #: this producer's own servers (``{"unix": ..., "grpc": ...}``) named in its greetings: set
        #: on a replacement replica, whose consumers reopen their streams to it there
        self.reply: dict[str, str] = {}
        #: ``(consumer, tag) ->`` the newest ``latest`` frame sent to it: a replacement gets it at once
        self._newest: dict[tuple[tuple[str, int], int], bytes] = {}
        #: the last frame made and what it was made of (held, so no other object can take its
        #: id): a broadcast sends one item or slot value to every consumer, encoded once
        self._last: tuple[int, str, int, Any, bytes] | None = None

    def producer_name(self, kind: str) -> str:
        """The name this producer greets with on a stream of ``kind`` (``"unix"``, ``"grpc"``):
        ``fragment/replica``, and ``|address`` of its own server of that kind when it is a
        replacement (:attr:`reply`)."""
        name = f"{self.fragment}/{self.replica}"
        return f"{name}|{self.reply[kind]}" if self.reply.get(kind) else name

    def _stream(self, fragment: str, replica: int) -> Any:
        with self._streams_lock:
            s = self._streams.get((fragment, replica))
            if s is None:
                target = self.addresses.get((fragment, replica))
                if target is None:
                    raise ChannelClosed(f"no boundary server address for {fragment} replica {replica}")
                s = self._streams[(fragment, replica)] = self.open_stream(self, target)
                s.key = (fragment, replica)
            return s

    def open_all(self) -> None:
        """Opens the stream to every consumer now (a replacement replica: its greeting tells
        each consumer where to reopen its own streams to it)."""
        for key in list(self.addresses):
            self._stream(*key)

    def lost(self, key: tuple[str, int] | None) -> bool:
        """Called by a stream that broke: whether its consumer ``key`` is elastic, in which case
        it is marked gone (the stream does not reconnect; sends to it are dropped and counted)."""
        if key is None or key not in self.elastic:
            return False
        self._gone.add(key)
        return True

    def rejoin(self, key: tuple[str, int], address: str) -> None:
        """Consumer ``key`` was replaced by a replica whose server is at ``address``: the stream
        to it reopens there and gets the newest ``latest`` frame of each slot at once (the
        replacement starts from the current weights). Called on a server's thread."""
        with self._streams_lock:
            old = self._streams.pop(key, None)
            self.addresses[key] = address
        if old is not None:
            old.close()
        s = self._stream(*key)
        self._gone.discard(key)
        for (k, tag), frame in list(self._newest.items()):
            if k == key:
                s.send_latest(tag, frame)

    def _send(self, key: tuple[str, int], send: Any) -> None:
        """``send(stream)`` on the stream to ``key``; to a gone consumer nothing is sent (counted
        in :attr:`dropped`); a stream replaced while it sent (:meth:`rejoin`) is sent on anew."""
        for _ in range(3):
            if key in self._gone:
                self.dropped += 1
                return
            s = self._stream(*key)
            try:
                return send(s)
            except ChannelClosed:
                if key in self._gone:  # it broke in this send (the stream counted what it dropped)
                    return
                if self._streams.get(key) is s:
                    raise
        raise ChannelClosed(f"the stream to {key[0]} replica {key[1]} was replaced while sending, three times")

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
        tag = self.tags[boundary.name]
        self._send((boundary.dst, consumer), lambda s: s.send_item(tag, boundary.capacity, frame, self.hold))

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
        key, tag = (boundary.dst, consumer), self.tags[boundary.name]
        if key in self.elastic:
            self._newest[(key, tag)] = frame
        self._send(key, lambda s: s.send_latest(tag, frame))

    def close(self) -> None:
        """Ends every stream cleanly."""
        for s in list(self._streams.values()):
            s.close()
        self._streams.clear()


def ProcessTransport(boundaries: Sequence[Any], fragment: str, replica: int,  # noqa: N802
                     addresses: Mapping[tuple[str, int], str], token: str, **kwargs: Any) -> StreamTransport:
    """A producer replica's side of every asynchronous boundary between processes: a
    :class:`StreamTransport` whose stream to each consumer is of the kind its address names
    (:func:`msrl.runtime.transports.kinds.open_stream`: a
    :class:`~msrl.cluster.uds_stream.UdsStream` to ``unix:/path``, same machine; a gRPC stream
    to ``host:port``). Arguments and errors are ``StreamTransport``'s (``tls`` applies to the gRPC
    streams)."""
    from msrl.runtime.transports.kinds import open_stream

    return StreamTransport(boundaries, fragment, replica, addresses, token, open_stream=open_stream, **kwargs)
