"""The ``unix`` link of :mod:`msrl.runtime.transports.links`: a synchronous boundary's buffers between two
replicas on one machine over a Unix stream socket, instead of Gloo's TCP pairs on loopback.

Design:

* **One server per process** (:class:`UnixLinkServer`), made before the process group's
  rendezvous (so every peer's exists once the rendezvous returns), bound in Linux's abstract
  namespace under a name derived from the job's secret token, the node and the rank: nothing on
  disk to leak.
* **One connection per direction.** A replica's first send to a peer connects to the peer's
  server and says who it is (``LINK`` + its rank); after that each buffer is one frame: ``tag``
  (the boundary's index) and byte count, then the bytes. One stream per direction keeps a tag's
  buffers in order, as Gloo does.
* **Reading never waits for the program.** Each accepted connection has a reader thread that
  reads frames as they come into per-``(peer, tag)`` queues; a receive takes the oldest frame of
  its queue and copies it into the buffer it was posted with (their byte sizes must agree: the
  endpoint's ``GROW`` protocol sees to it). So a send never waits on the receiver's program, only
  on the socket: no order of sends between two replicas can deadlock, and a send returns once its
  bytes are in the kernel (its work is done at once).
* **Only the job's replicas.** Any local process can connect to an abstract socket, so the server
  takes a connection's credentials from the kernel (``SO_PEERCRED``, which a client cannot forge):
  a connection counts only when it comes from the process of the rank it names. Anything else is
  closed and counted in :attr:`UnixLinkServer.rejected`.
* **Faults.** A receive waits at most ``timeout_s``; every 0.5 s of waiting it checks that the
  peer's process is alive (:class:`LinkError` naming it otherwise), and a connection that ended
  with its peer's process is a :class:`LinkError` too.

Linux only (abstract sockets, ``SO_PEERCRED``): :func:`available`.
"""

from __future__ import annotations

import collections
import socket
import struct
import sys
import threading
import time
from typing import Mapping

import torch

from msrl.errors import MsrlError
from msrl.runtime.transports.shm import pid_alive

__all__ = ["UnixLinkServer", "UnixLink", "LinkError", "available"]

#: a connection's first bytes: magic + the connecting replica's rank
_HELLO = struct.Struct("<4si")
_MAGIC = b"LINK"
#: a frame's header: boundary tag, byte count
_FRAME = struct.Struct("<iQ")
_CHECK_S = 0.5


class LinkError(MsrlError, ConnectionError):
    """A link's peer is gone (its process died, its connection ended) or broke the protocol."""


def available() -> bool:
    """Whether this platform has what the link needs (Linux: abstract Unix sockets, ``SO_PEERCRED``)."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_PEERCRED")


def _address(uid: str, rank: int) -> str:
    return f"\0msrl-link-{uid}-{rank}"


class UnixLinkServer:
    """This replica's end of every ``unix`` link: where its same-machine peers connect to send,
    and where its receives take what they sent.

    Args:
        uid: names the sockets (the job's secret, hashed, and the node: two jobs or two nodes
            sharing one kernel never meet).
        rank: this replica's rank.
        pids: peer rank -> its process id: only that process may send as that rank.
        timeout_s: how long a receive waits for its frame.
    """

    def __init__(self, uid: str, rank: int, pids: Mapping[int, int], timeout_s: float = 600.0) -> None:
        self.uid, self.rank, self.pids, self.timeout_s = uid, rank, dict(pids), timeout_s
        #: ``(pid, reason)`` of every connection refused
        self.rejected: list[tuple[int, str]] = []
        self._cond = threading.Condition()
        self._frames: dict[tuple[int, int], collections.deque[bytearray]] = collections.defaultdict(collections.deque)
        self._ended: set[int] = set()
        self._closed = False
        self._conns: list[socket.socket] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(_address(uid, rank))
        self._sock.listen(64)
        threading.Thread(target=self._accept, name="msrl-link-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), name="msrl-link-read", daemon=True).start()

    @staticmethod
    def _read(conn: socket.socket, view: memoryview) -> bool:
        got = 0
        while got < len(view):
            n = conn.recv_into(view[got:])
            if n == 0:
                return False
            got += n
        return True

    def _serve(self, conn: socket.socket) -> None:
        """One connection: checks who it is, then reads its frames until it ends."""
        pid, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        hello = bytearray(_HELLO.size)
        magic, rank = (b"", -1)
        if self._read(conn, memoryview(hello)):
            magic, rank = _HELLO.unpack(hello)
        if magic != _MAGIC or rank not in self.pids or self.pids[rank] != pid:
            self.rejected.append((pid, "not a replica of this job" if magic == _MAGIC else "not a link greeting"))
            conn.close()
            return
        with self._cond:
            self._conns.append(conn)
        header = bytearray(_FRAME.size)
        try:
            while self._read(conn, memoryview(header)):
                tag, n = _FRAME.unpack(header)
                data = bytearray(n)
                if n and not self._read(conn, memoryview(data)):
                    break
                with self._cond:
                    self._frames[(rank, tag)].append(data)
                    self._cond.notify_all()
        except OSError:
            pass
        with self._cond:
            self._ended.add(rank)
            self._cond.notify_all()

    def take(self, rank: int, tag: int, buffer: torch.Tensor) -> None:
        """Copies the oldest frame of ``(rank, tag)`` into ``buffer`` (1-D ``uint8``, on the
        host), waiting for it.

        Raises:
            LinkError: the peer's process is gone, its connection ended with nothing left to
                take, or the frame's size differs from ``buffer``'s.
            TimeoutError: no frame within ``timeout_s``.
        """
        deadline = time.monotonic() + self.timeout_s
        with self._cond:  # the queue made under the lock: a reader thread may make it at once
            queue = self._frames[(rank, tag)]
            while not queue:
                if self._closed:
                    raise LinkError(f"the link from rank {rank} was closed")
                if rank in self._ended:
                    raise LinkError(f"the link from rank {rank} ended (its process, pid {self.pids.get(rank)}, "
                                    f"{'exited' if not pid_alive(self.pids.get(rank, 0)) else 'closed it'})")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"nothing arrived from rank {rank} (tag {tag}) within {self.timeout_s:g} s")
                self._cond.wait(min(_CHECK_S, left))
                if not queue and not pid_alive(self.pids.get(rank, 0)):
                    raise LinkError(f"the process of rank {rank} (pid {self.pids.get(rank)}) died")
            data = queue.popleft()
        if len(data) != buffer.numel():
            raise LinkError(f"a frame of {len(data)} bytes from rank {rank} (tag {tag}) for a receive of "
                            f"{buffer.numel()}: the two ends disagree on the channel's size")
        if data:
            buffer.copy_(torch.frombuffer(data, dtype=torch.uint8))

    def close(self) -> None:
        """Stops serving: the listening socket and every connection closed, waiting receives woken."""
        with self._cond:
            self._closed = True
            conns, self._conns = self._conns, []
            self._cond.notify_all()
        for s in (self._sock, *conns):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


class _Done:
    """A send's work: its bytes are in the kernel when it is made."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Receive:
    def __init__(self, server: UnixLinkServer, rank: int, tag: int, buffer: torch.Tensor) -> None:
        self.server, self.rank, self.tag, self.buffer, self.done = server, rank, tag, buffer, False

    def wait(self) -> bool:
        if not self.done:
            self.server.take(self.rank, self.tag, self.buffer)
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


class UnixLink:
    """A :class:`~msrl.runtime.transports.links.Link` to one same-machine peer rank over Unix stream
    sockets: sends on a connection to the peer's :class:`UnixLinkServer` (made at the first
    send), receives from this process's ``server``.

    Args:
        server: this process's :class:`UnixLinkServer`.
        rank: the peer's rank.
    """

    name = "unix"

    def __init__(self, server: UnixLinkServer, rank: int) -> None:
        self.server, self.rank = server, rank
        self._sock: socket.socket | None = None

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + self.server.timeout_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(_address(self.server.uid, self.rank))
                break
            except (ConnectionRefusedError, FileNotFoundError):
                sock.close()
                if time.monotonic() > deadline:
                    raise LinkError(f"rank {self.rank}'s link server did not answer within {self.server.timeout_s:g} s") from None
                time.sleep(0.05)
        sock.sendall(_HELLO.pack(_MAGIC, self.server.rank))
        return sock

    def isend(self, buffer: torch.Tensor, tag: int) -> _Done:
        """Writes ``buffer`` (1-D ``uint8`` on the host) as one frame; returns once its bytes are
        in the kernel (the peer's reader thread drains them whatever its program does).

        Raises:
            LinkError: the peer's server is gone.
        """
        if self._sock is None:
            self._sock = self._connect()
        try:
            self._sock.sendall(_FRAME.pack(tag, buffer.numel()))
            if buffer.numel():
                self._sock.sendall(memoryview(buffer.numpy()))
        except OSError as e:
            raise LinkError(f"the link to rank {self.rank} broke ({e})") from None
        return _Done()

    def irecv(self, buffer: torch.Tensor, tag: int) -> _Receive:
        """A receive of the next frame with ``tag`` from the peer into ``buffer``, done at ``wait()``."""
        return _Receive(self.server, self.rank, tag, buffer)

    def close(self) -> None:
        """Closes the sending connection (the peer's reader sees it end)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
