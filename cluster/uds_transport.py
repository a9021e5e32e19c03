"""Asynchronous boundaries between processes of one machine over Unix-domain stream sockets,
read and written by the replicas' own threads (DESIGN.md §5, "Boundary kinds").

Why not gRPC here: over gRPC's Python streams every message passes four to five threads and
their GIL hand-offs; over a Unix socket written by the producer's thread and read by the
consumer's while it waits, an item and its credit take a fraction of the time and CPU, close to
a bare socket's (``python bench/bench_hop.py``; figures: bench/results/startup.md, "Figures behind the
code"). Between machines the gRPC transport stays.

Frames are the gRPC transport's (:mod:`msrl.cluster.grpc_transport`: request frames ``ITEM`` and
``LATEST``, ``CREDIT``), each preceded on the stream by its length (u32), plus two of its own::

    HELLO    (producer -> consumer, first): b"MSRA" | format | HELLO | token length (u16) |
             producer name length (u16) | token | producer name ("fragment/replica")
    REFUSED  (consumer -> producer, last):  b"MSRA" | format | REFUSED | reason (utf-8)

Consumer (:class:`UdsServer`): listens on a socket file in a fresh directory of mode 0700 (no
other user can connect; nothing listens on any network interface). An acceptor thread takes each
connection: the peer's uid must be this process's (``SO_PEERCRED``), and its ``HELLO`` must
arrive whole within 5 s of the connection with the job's token (constant-time comparison) and a
producer that sends to this replica, else the connection is refused and counted in
:attr:`UdsServer.rejected`. Greetings are read side by side (up to 64 at once), each against its
own deadline: a silent or slow peer delays no other. Frames
are read by the replica's own thread while it waits for a value (the mailbox's ``pump``), every
length and frame checked before anything is allocated or delivered; a bad frame refuses that one
stream (``REFUSED`` with the reason, then closed) and the server goes on serving the others.

Producer (:class:`~msrl.cluster.uds_stream.UdsStream`, made by :func:`msrl.cluster.streams.ProcessTransport` for a ``unix:`` address):
writes without blocking from the producer's thread; bytes the kernel cannot take at once (a
value larger than the socket's buffer, a consumer that is not reading) go to a writer thread,
so a ``put`` never waits on the consumer's reading, only on its credits; an unsent older
``latest`` version is replaced by a newer one. Credits are read when the producer needs one. A
broken stream (the consumer's process restarted) drops and counts what was in flight, then
reconnects to the same path for up to ``reconnect_s``.
"""

from __future__ import annotations

import hmac
import os
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
from typing import Any, Sequence

from msrl.cluster.refusals import Refusals
from msrl.cluster.streams import CREDIT, CREDIT_FRAME, FORMAT, MAGIC, TransportError, deliver_frame
from msrl.runtime.asynchronous import Mailbox
from msrl.runtime.channels import ChannelClosed
from msrl.runtime.transports.codec import CodecError

__all__ = ["UdsServer", "HELLO", "REFUSED", "encode_hello", "length_prefixed", "FrameReader"]

HELLO, REFUSED = 5, 6
_LEN = struct.Struct("<I")
_HELLO = struct.Struct("<4sBBHH")
#: seconds a new connection has to deliver its whole greeting
_HELLO_TIMEOUT_S = 5.0
_MAX_HELLO = 4096
#: greetings read at once; a connection beyond them is refused at once
_MAX_GREETING = 64
_CHUNK = 1 << 20


def encode_hello(token: str, producer: str) -> bytes:
    """The ``HELLO`` body a producer sends first (see the module docstring)."""
    t, p = token.encode(), producer.encode()
    return _HELLO.pack(MAGIC, FORMAT, HELLO, len(t), len(p)) + t + p


def length_prefixed(body: bytes) -> bytes:
    """``body`` preceded by its length (u32, little-endian): one message on the stream."""
    return _LEN.pack(len(body)) + body


class FrameReader:
    """Splits a stream's bytes into length-prefixed bodies, refusing a length over ``limit``
    before anything of that size is buffered."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buf = bytearray()

    def need(self) -> int:
        """Bytes to ask the socket for (at most what completes the current message, and at
        least a chunk's worth of small messages)."""
        if len(self.buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self.buf)
            return max(min(_LEN.size + n - len(self.buf), _CHUNK), 65536)
        return 65536

    def feed(self, data: bytes) -> list[bytes]:
        """Appends ``data``; returns the complete bodies.

        Raises:
            TransportError: a declared length over the limit.
        """
        self.buf += data
        out, at = [], 0
        while len(self.buf) - at >= _LEN.size:
            (n,) = _LEN.unpack_from(self.buf, at)
            if n > self.limit:
                raise TransportError(f"a message of {n} bytes declared; the limit is {self.limit} "
                                     "(cluster.max_message_mb)")
            if len(self.buf) - at < _LEN.size + n:
                break
            out.append(bytes(self.buf[at + _LEN.size:at + _LEN.size + n]))
            at += _LEN.size + n
        if at:
            del self.buf[:at]
        return out


class _Conn:
    def __init__(self, sock: socket.socket, producer: tuple[str, int], limit: int) -> None:
        self.sock, self.producer = sock, producer
        self.reader = FrameReader(limit)
        self.out = bytearray()  # credits the kernel has not taken yet


class UdsServer:
    """The same-machine counterpart of :class:`~msrl.cluster.grpc_transport.BoundaryServer`:
    one consumer replica's socket, read by the replica's own thread while it waits on its
    :class:`~msrl.runtime.asynchronous.Mailbox` (this server becomes the mailbox's ``pump``).

    Args:
        boundaries: the job's boundaries in the job's order (a boundary's position is its tag).
        fragment, replica: the consumer replica this server belongs to.
        mailbox: where frames are delivered.
        token: the job's secret; a connection without it is refused.
        max_message: the largest frame accepted (bytes).
        path: the socket file to listen on (default: ``s`` in a fresh directory of mode 0700
            under the temp directory, named ``prefix...``, removed by :meth:`stop`); its
            directory must not be writable by other users.
        prefix: the fresh directory's name prefix (the Ray runtime puts the job's id in it, so
            the driver removes what a killed replica left).

    Attributes:
        address: ``unix:<path>`` of the listening socket.
        rejected: the most recent refused connections and frames, each ``(producer, reason)``
            (bounded: :class:`~msrl.cluster.refusals.Refusals`, whose counts feed
            ``security/refused_*`` in ``metrics.csv``).
    """

    def __init__(self, boundaries: Sequence[Any], fragment: str, replica: int, mailbox: Mailbox, token: str,
                 max_message: int, path: str | None = None, prefix: str = "msrl-boundary-") -> None:
        self.boundaries = list(boundaries)
        self.fragment, self.replica = fragment, replica
        self.mailbox, self.token, self.max_message = mailbox, token, max_message
        self.refusals = Refusals(f"boundary server (Unix socket) of {fragment} replica {replica}")
        self._tags = {b.name: i for i, b in enumerate(self.boundaries)}
        self._producers = {b.src: b.src_replicas for b in self.boundaries if b.asynchronous and b.dst == fragment}
        self._conns: dict[tuple[str, int], _Conn] = {}
        self._lock = threading.Lock()  # the connection table and credit writes
        self._dir = tempfile.mkdtemp(prefix=prefix) if path is None else None  # mode 0700
        path = path if path is not None else os.path.join(self._dir, "s")
        self.path = path
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(64)
        self.address = f"unix:{path}"
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._closed = False
        #: ``on_rejoin(producer, address)``: called (on the acceptor thread) when a replacement
        #: replica of ``producer`` greets with its own server's ``address`` (an elastic job:
        #: this replica's streams to it reopen there, :meth:`~msrl.cluster.streams.StreamTransport.rejoin`)
        self.on_rejoin: Any = None
        mailbox.pump, mailbox.wake, mailbox.partial = self.pump, self.wake, self.partial
        grpc_credit = mailbox.on_take  # producers on other machines: the gRPC server's credits
        mailbox.on_take = lambda b, p: self.credit(b, p) or (grpc_credit is not None and grpc_credit(b, p))
        self._acceptor = threading.Thread(target=self._accept, daemon=True, name=f"msrl-uds-accept-{fragment}{replica}")
        self._acceptor.start()

    # -- connections ----------------------------------------------------------------------
    def _accept(self) -> None:
        """The acceptor thread: takes new connections and reads their greetings side by side,
        each with its own deadline (:data:`_HELLO_TIMEOUT_S` from its connection), so a silent
        or slow peer never delays another's greeting; at most :data:`_MAX_GREETING` greetings
        are read at once (more are refused at once)."""
        import selectors

        sel = selectors.DefaultSelector()
        try:
            sel.register(self._listener, selectors.EVENT_READ)
        except (OSError, ValueError):  # the server was closed before this thread first ran
            sel.close()
            return
        pending: dict[socket.socket, list[Any]] = {}  # sock -> [bytes so far, deadline, peer pid]
        try:
            while not self._closed:
                now = time.monotonic()
                soonest = min((p[1] for p in pending.values()), default=now + 0.5)
                try:
                    events = sel.select(max(0.0, min(soonest - now, 0.5)))
                except (OSError, ValueError):
                    return  # stopped
                for key, _ in events:
                    if key.fileobj is self._listener:
                        self._take_connection(sel, pending)
                    else:
                        self._read_greeting(sel, pending, key.fileobj)
                now = time.monotonic()
                for sock in [s for s, p in pending.items() if p[1] <= now]:
                    sel.unregister(sock)
                    _, _, pid = pending.pop(sock)
                    self._refuse_socket(sock, f"pid {pid}", f"no complete greeting within {_HELLO_TIMEOUT_S:g} s")
        finally:
            for sock in pending:
                sock.close()
            sel.close()

    def _take_connection(self, sel: Any, pending: dict[socket.socket, list[Any]]) -> None:
        import selectors

        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._closed = True  # stopped
            return
        pid: Any = "?"
        if hasattr(socket, "SO_PEERCRED"):  # Linux; elsewhere the 0700 directory alone keeps other users out
            pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid():
                return self._refuse_socket(sock, f"pid {pid}", f"a process of uid {uid}, not this job's ({os.getuid()})")
        if len(pending) >= _MAX_GREETING:
            return self._refuse_socket(sock, f"pid {pid}", f"{_MAX_GREETING} greetings are being read already")
        sock.setblocking(False)
        pending[sock] = [b"", time.monotonic() + _HELLO_TIMEOUT_S, pid]
        sel.register(sock, selectors.EVENT_READ)

    def _read_greeting(self, sel: Any, pending: dict[socket.socket, list[Any]], sock: Any) -> None:
        entry = pending[sock]
        have, _, pid = entry
        want = _LEN.size + (_LEN.unpack_from(have)[0] if len(have) >= _LEN.size else 0)
        try:
            chunk = sock.recv(max(1, want - len(have)) if len(have) >= _LEN.size else _LEN.size - len(have))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            chunk, why = b"", f"{type(e).__name__}: {e}"
        else:
            why = "closed before the greeting was complete"
        if not chunk:
            sel.unregister(sock)
            del pending[sock]
            return self._refuse_socket(sock, f"pid {pid}", why)
        entry[0] = have = have + chunk
        if len(have) < _LEN.size:
            return
        (n,) = _LEN.unpack_from(have)
        if not _HELLO.size <= n <= _MAX_HELLO:
            sel.unregister(sock)
            del pending[sock]
            return self._refuse_socket(sock, f"pid {pid}", f"a greeting of {n} bytes")
        if len(have) < _LEN.size + n:
            return
        sel.unregister(sock)
        del pending[sock]
        try:
            self._greet(sock, have[_LEN.size:], pid)
        except Exception as e:  # noqa: BLE001 - a bad greeting refuses one connection only
            self._refuse_socket(sock, f"pid {pid}", f"{type(e).__name__}: {e}")

    def _greet(self, sock: socket.socket, body: bytes, pid: Any) -> None:
        """Checks a whole ``HELLO`` body; the stream joins the served ones, or is refused."""
        n = len(body)
        magic, fmt, kind, nt, npr = _HELLO.unpack_from(body)
        if magic != MAGIC or fmt != FORMAT or kind != HELLO or _HELLO.size + nt + npr != n:
            return self._refuse_socket(sock, f"pid {pid}", "a malformed greeting")
        token, name = body[_HELLO.size:_HELLO.size + nt], body[_HELLO.size + nt:].decode(errors="replace")
        if not hmac.compare_digest(token, self.token.encode()):
            return self._refuse_socket(sock, f"pid {pid}", "missing or wrong job token")
        name, _, reply = name.partition("|")  # a replacement replica's own server address
        frag, _, rep = name.partition("/")
        if frag not in self._producers or not rep.isdigit() or int(rep) >= self._producers[frag]:
            return self._refuse_socket(sock, name, f"producer {name!r} sends on no boundary to this replica")
        producer = (frag, int(rep))
        with self._lock:
            old = self._conns.get(producer)
            self._conns[producer] = _Conn(sock, producer, self.max_message)  # a reconnecting producer replaces its old stream
        if old is not None:
            old.sock.close()
        self.mailbox.stream_opened(producer)
        if reply and self.on_rejoin is not None:
            self.on_rejoin(producer, reply)
        self.wake()

    @property
    def rejected(self) -> Any:
        """The most recent refusals, ``(producer, reason)`` each, oldest first."""
        return self.refusals.recent

    def _refuse_socket(self, sock: socket.socket, who: str, why: str, kind: str = "connections") -> None:
        self.refusals.add(kind, who, why)
        try:
            sock.setblocking(False)
            sock.send(length_prefixed(struct.pack("<4sBB", MAGIC, FORMAT, REFUSED)
                               + f"msrl boundary server of {self.fragment} replica {self.replica}: {why}".encode()))
        except OSError:
            pass
        sock.close()

    def _drop(self, conn: _Conn, why: str | None) -> None:
        with self._lock:
            current = self._conns.get(conn.producer) is conn
            if current:
                del self._conns[conn.producer]
        if current and why is None:  # it ended after its last whole frame: the producer's count is final
            self.mailbox.stream_ended(conn.producer)
        if why is not None:
            self._refuse_socket(conn.sock, f"{conn.producer[0]}/{conn.producer[1]}", why, "frames")
        else:
            conn.sock.close()

    # -- the replica's thread -------------------------------------------------------------
    def wake(self) -> None:
        """Ends a :meth:`pump` waiting in another thread (a value arrived by another way, a
        new connection, the mailbox closed)."""
        try:
            os.write(self._wake_w, b"w")
        except OSError:
            pass  # full (a wake is pending anyway) or closed

    def partial(self) -> bool:
        """Whether a producer's stream has a frame partly read."""
        with self._lock:
            return any(c.reader.buf for c in self._conns.values())

    def pump(self, timeout_s: float) -> None:
        """Waits up to ``timeout_s`` for bytes on any producer's stream and delivers every
        complete frame into the mailbox; writes credits the kernel could not take before.
        Called by the mailbox with its lock released, by one thread at a time."""
        with self._lock:
            conns = list(self._conns.values())
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        by_fd = {}
        for c in conns:
            by_fd[c.sock.fileno()] = c
            poller.register(c.sock, select.POLLIN | (select.POLLOUT if c.out else 0))
        for fd, ev in poller.poll(max(0.0, timeout_s) * 1000):
            if fd == self._wake_r:
                try:
                    os.read(self._wake_r, 4096)
                except OSError:
                    pass
                continue
            c = by_fd[fd]
            if c.out:
                with self._lock:  # credits are appended by other threads' takes
                    self._send_credits(c)
            if not ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                continue
            name = f"{c.producer[0]}/{c.producer[1]}"
            try:
                while True:
                    try:
                        data = c.sock.recv(c.reader.need())
                    except BlockingIOError:
                        break
                    if not data:
                        self._drop(c, None)  # the producer went away
                        break
                    for body in c.reader.feed(data):
                        deliver_frame(self.boundaries, self.fragment, self.mailbox, body, c.producer)
            except (TransportError, CodecError) as e:
                self._drop(c, f"bad frame from {name}: {e}")
            except ChannelClosed:
                return
            except OSError:
                self._drop(c, None)

    def _send_credits(self, c: _Conn) -> None:
        try:
            n = c.sock.send(c.out)
            del c.out[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            c.out.clear()

    def credit(self, boundary: str, producer: int) -> bool:
        """Returns one credit of ``boundary`` to its producer replica ``producer``; ``False``
        when that producer has no stream here (it streams over gRPC)."""
        tag = self._tags[boundary]
        with self._lock:
            c = self._conns.get((self.boundaries[tag].src, producer))
            if c is None:
                return False
            c.out += length_prefixed(CREDIT_FRAME.pack(MAGIC, FORMAT, CREDIT, tag, 1))
            self._send_credits(c)
        return True

    def stop(self) -> None:
        """Closes every stream and the listening socket, and removes its directory."""
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            c.sock.close()
        self.wake()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        else:
            try:
                os.unlink(self.path)
            except OSError:
                pass
