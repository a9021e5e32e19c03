"""The producer's side of an asynchronous boundary over a Unix-domain stream socket (one machine):
:class:`UdsStream`. The frames, the greeting and the consumer's side are
:mod:`msrl.cluster.uds_transport`'s."""

from __future__ import annotations

import collections
import errno
import select
import socket
import threading
import time
from typing import Any

from msrl.cluster.streams import CREDIT, CREDIT_FRAME, FORMAT, MAGIC, TransportError
from msrl.cluster.uds_transport import REFUSED, FrameReader, encode_hello, length_prefixed
from msrl.runtime.channels import ChannelClosed

__all__ = ["UdsStream"]


class UdsStream:
    """One producer's stream to one consumer replica's :class:`UdsServer` (the interface of the
    gRPC transport's streams: ``send_item``, ``send_latest``, ``flush``, ``close``).

    Args:
        transport: the :class:`ProcessTransport` it belongs to (its token, producer name,
            timeouts and counters).
        path: the server's socket file.
    """

    def __init__(self, transport: Any, path: str) -> None:
        self.t, self.path, self.target = transport, path, f"unix:{path}"
        self.cond = threading.Condition()
        self.in_flight: dict[int, int] = {}
        self.held: list[bytes] = []
        #: what the kernel did not take yet: [kind, tag, bytes, offset] entries, oldest first
        self.pending: collections.deque[list] = collections.deque()
        self.error: str | None = None
        self.closed = False
        self._reader = FrameReader(1 << 16)
        self._writer: threading.Thread | None = None
        self.sock = self._connect(time.monotonic() + self.t.timeout_s)

    def _connect(self, deadline: float) -> socket.socket:
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.path)
                sock.sendall(length_prefixed(encode_hello(self.t.token, self.t.producer_name("unix"))))
                sock.setblocking(False)
                return sock
            except OSError as e:
                sock.close()
                if time.monotonic() >= deadline or self.closed:
                    raise ChannelClosed(f"cannot connect to the boundary socket {self.path}: {e}") from None
                time.sleep(0.05)

    # -- credits and failures (called with cond held) -------------------------------------
    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return
            except OSError as e:
                return self._broken(f"the boundary stream to {self.target} broke: {e}")
            if not data:
                return self._broken(f"the boundary stream to {self.target} ended")
            try:
                bodies = self._reader.feed(data)
            except TransportError as e:
                return self._broken(str(e))
            for body in bodies:
                if len(body) >= 6 and body[:4] == MAGIC and body[4] == FORMAT and body[5] == REFUSED:
                    return self._broken(body[6:].decode(errors="replace"), retry=False)
                if len(body) != CREDIT_FRAME.size:
                    return self._broken(f"a response of {len(body)} bytes from {self.target}", retry=False)
                magic, fmt, kind, tag, count = CREDIT_FRAME.unpack(body)
                if magic != MAGIC or fmt != FORMAT or kind != CREDIT:
                    return self._broken(f"a malformed credit from {self.target}", retry=False)
                self.in_flight[tag] = max(0, self.in_flight.get(tag, 0) - count)

    def _broken(self, why: str, retry: bool = True) -> None:
        """Drops what was in flight (counted) and reconnects for up to ``reconnect_s``."""
        # fifo items in flight (held and pending ones among them) and slot values not fully written
        lost = sum(self.in_flight.values()) + sum(1 for e in self.pending if e[0] == "latest")
        self.t.dropped += lost
        self.in_flight.clear()
        self.pending.clear()
        self.held.clear()
        self._reader = FrameReader(1 << 16)
        self.sock.close()
        if retry and self.t.lost(getattr(self, "key", None)):
            retry, why = False, f"{why} (a replaceable replica: its replacement reopens the stream)"
        if retry and not self.closed:
            try:
                self.sock = self._connect(time.monotonic() + self.t.reconnect_s)
                self.t.reconnects += 1
                self.cond.notify_all()
                return
            except ChannelClosed as e:
                why = f"{why}; no reconnection within {self.t.reconnect_s:g} s ({e})"
        self.error = why
        self.cond.notify_all()

    def _check(self) -> None:
        if self.error is not None or self.closed:
            raise ChannelClosed(self.error or f"the stream to {self.target} is closed")

    # -- writing (called with cond held) --------------------------------------------------
    def _write(self, kind: str, tag: int, data: bytes) -> None:
        """Queues ``data`` behind what is pending and writes as much as the kernel takes now;
        the rest is the writer thread's."""
        if kind == "latest":
            for e in self.pending:  # an unsent older version of this slot: replaced
                if e[0] == "latest" and e[1] == tag and e[3] == 0:
                    e[2] = data
                    return
        self.pending.append([kind, tag, data, 0])
        self._drain()
        if self.pending and self._writer is None:
            self._writer = threading.Thread(target=self._write_rest, daemon=True, name=f"msrl-uds-writer-{self.path}")
            self._writer.start()

    def _drain(self) -> None:
        while self.pending:
            e = self.pending[0]
            try:
                n = self.sock.send(memoryview(e[2])[e[3]:])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                if err.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF):
                    return self._broken(f"the boundary stream to {self.target} broke: {err}")
                raise
            e[3] += n
            if e[3] == len(e[2]):
                self.pending.popleft()

    def _write_rest(self) -> None:
        with self.cond:
            while self.pending and not self.closed and self.error is None:
                sock = self.sock
                self.cond.release()
                try:
                    select.select([], [sock], [], 0.05)
                except (OSError, ValueError):
                    pass  # closed, or replaced by a reconnection: the loop looks again
                finally:
                    self.cond.acquire()
                if sock is self.sock and not self.closed:
                    self._drain()
            self._writer = None  # under the lock: a later _write starts another

    # -- the interface of a stream --------------------------------------------------------
    def flush(self) -> None:
        """Writes the held frames."""
        with self.cond:
            self._flush()

    def _flush(self) -> None:
        if self.held:
            data = b"".join(length_prefixed(f) for f in self.held)
            self.held = []
            self._write("item", -1, data)

    def send_item(self, tag: int, capacity: int, frame: bytes, hold: bool = False) -> None:
        """Queues one ``fifo`` frame; waits (reading credits) while ``capacity`` are unacknowledged.

        Raises:
            ChannelClosed: the stream broke for good; TimeoutError: no credit in ``timeout_s``.
        """
        deadline = time.monotonic() + self.t.timeout_s
        with self.cond:
            self._check()
            self._read()
            if self.in_flight.get(tag, 0) >= capacity:
                t0 = time.perf_counter()
                self._flush()  # what it holds must leave before it waits for the credits they return
                while self.in_flight.get(tag, 0) >= capacity and self.error is None and not self.closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"queue to {self.target} full for {self.t.timeout_s:g} s")
                    sock = self.sock
                    self.cond.release()
                    try:
                        select.select([sock], [], [], min(0.05, left))
                    except (OSError, ValueError):
                        pass  # closed, or replaced by a reconnection: the loop looks again
                    finally:
                        self.cond.acquire()
                    if not self.closed:
                        self._read()
                self.t.wait_s += time.perf_counter() - t0
            self._check()
            self.in_flight[tag] = self.in_flight.get(tag, 0) + 1
            if hold:
                self.held.append(frame)
                if len(self.held) >= 4096:
                    self._flush()
            else:
                self._flush()
                self._write("item", tag, length_prefixed(frame))

    def send_latest(self, tag: int, frame: bytes) -> None:
        """Publishes one ``latest`` frame; never waits (an unsent older version is replaced).

        Raises:
            ChannelClosed: the stream broke for good.
        """
        with self.cond:
            self._check()
            self._read()
            self._check()
            self._flush()  # the stream keeps the order of the puts
            self._write("latest", tag, length_prefixed(frame))

    def close(self) -> None:
        """Ends the stream."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.sock.close()
