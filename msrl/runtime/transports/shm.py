"""All-reduce through shared memory for the replicas of a fragment that share one machine.

Gloo moves a fragment's gradients between processes over TCP, through a worker thread and an
I/O thread in each process. On a machine whose cores the replicas keep busy, every all-reduce
then waits for those threads to be scheduled: on a busy 2-core machine a Gloo all-reduce of
the main job's gradients takes many times a Unix socket's round trip, and multi_learner with two
replicas spent a large share of its iteration in all-reduces (figures: ``bench/results/startup.md``,
"Figures behind the code"). :class:`ShmGroup` does the same collective the way NCCL's
and oneCCL's intra-node transports do: every replica writes its buffer into a slot of one
shared-memory segment, tells its peers with one datagram each, waits for theirs, and sums the
slots in rank order.

Design:

* **Segment.** Rank 0 creates it (``memfd_create``: no file name, nothing to leak) and hands the
  descriptor to its peers over their Unix sockets (``SCM_RIGHTS``). It holds two banks of
  ``world`` slots; call ``k`` uses bank ``k % 2``. A replica can only start call ``k + 2`` (and
  overwrite bank ``k % 2``) after every replica arrived at call ``k + 1``, i.e. after each
  finished reading call ``k``: one synchronisation per call suffices. A larger buffer than the
  segment holds makes rank 0 create a larger one (every replica sees the same sizes in the same
  order: they run one program).
* **Synchronisation.** Each replica binds a Unix datagram socket in Linux's abstract namespace
  (``\\0msrl-<uid>-<rank>``) and sends ``ARRV k`` to every peer after writing its slot.
  Datagrams between two sockets arrive in order and are never lost; one from a peer that is
  already a call ahead is kept for that call. Blocking receives sleep in the kernel: replicas
  sharing cores never spin against each other.
* **Result.** ``sum = slot_0 + slot_1 + ... + slot_{world-1}``, added in rank order by every
  replica: the same bits on every replica (the invariant multi_learner needs: all replicas hold
  bitwise-identical parameters after every update).
* **Only the group.** Any local process can send a datagram to an abstract socket, so every
  socket takes its senders' credentials from the kernel (``SO_PASSCRED``: ``SCM_CREDENTIALS``
  on each datagram, which a sender cannot forge): a message counts only when it comes from the
  process of the rank it names (with ``pids``; else from a process of this user). Anything
  else is dropped, its descriptors closed, and counted in :attr:`ShmGroup.rejected`.
* **Faults.** A receive waits at most ``timeout_s`` in all; every 0.5 s of waiting it checks
  that the peers' processes are alive and raises :class:`ShmGroupError` naming a dead one.

Linux only (abstract sockets, ``memfd_create``); :func:`available` says whether it can be used.
"""

from __future__ import annotations

import array
import mmap
import os
import socket
import struct
import sys
import time
from typing import Callable, Sequence

import torch

from msrl.errors import MsrlError

__all__ = ["ShmGroup", "ShmGroupError", "available", "pid_alive"]

#: message: kind, sender's rank, call number (ARRV) or segment generation (SEGM), bytes (the
#: sender's buffer for ARRV, the segment's for SEGM)
_MSG = struct.Struct("<4siqq")
_ARRIVE, _SEGMENT = b"ARRV", b"SEGM"
#: ``struct ucred``: the sender's pid, uid, gid (``SCM_CREDENTIALS``)
_UCRED = struct.Struct("iII")
#: room for the ancillary data of one datagram: one descriptor and the sender's credentials
_ANCILLARY = socket.CMSG_SPACE(array.array("i").itemsize) + socket.CMSG_SPACE(_UCRED.size)
#: slot offsets are multiples of this (cache line; any dtype's alignment)
_ALIGN = 64
#: seconds between liveness checks of the peers while waiting
_POLL_S = 0.5


class ShmGroupError(MsrlError, RuntimeError):
    """A peer of a :class:`ShmGroup` died, did not arrive within the timeout, or sent a
    malformed message."""


def available() -> bool:
    """Whether this platform has what :class:`ShmGroup` needs (Linux: abstract Unix sockets,
    ``memfd_create``, ``SCM_RIGHTS``)."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create") and hasattr(socket, "recv_fds")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (signal 0; another user's process counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ShmGroup:
    """A sum all-reduce over ``world`` processes of one machine (see the module docstring).

    Every process constructs one with the same ``uid`` and ``world`` and its own ``rank``; all
    must have constructed theirs (bound their sockets) before any calls :meth:`allreduce_`
    (pass ``barrier``, e.g. a Gloo barrier, to make the constructor wait for that).

    Args:
        uid: a name unique to this group on this machine while it lives (e.g. the job's
            rendezvous address and the fragment's name); at most ~80 characters.
        rank: this process's rank, ``0 <= rank < world``.
        world: the number of processes.
        pids: every rank's process id (for naming a dead peer); ``None`` skips the check.
        timeout_s: the longest one call waits for its peers.
        barrier: called once after this process bound its socket; must return only when every
            rank has done so.

    Raises:
        ValueError: ``rank`` outside ``[0, world)``, ``world < 1``, or ``pids`` of another length.
        RuntimeError: not :func:`available`, or the socket name is taken (another live group
            with this ``uid``).
    """

    def __init__(self, uid: str, rank: int, world: int, pids: Sequence[int] | None = None,
                 timeout_s: float = 1800.0, barrier: Callable[[], None] | None = None) -> None:
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"ShmGroup: rank {rank} of world {world}; need world >= 1 and 0 <= rank < world")
        if pids is not None and len(pids) != world:
            raise ValueError(f"ShmGroup: {len(pids)} pids for a world of {world}")
        if not available():
            raise RuntimeError(f"ShmGroup needs Linux (abstract Unix sockets, memfd_create); this is {sys.platform}")
        self.uid, self.rank, self.world = uid, rank, world
        self.pids = list(pids) if pids is not None else None
        self.timeout_s = timeout_s
        self._addr = [b"\0msrl-" + f"{uid}-{r}".encode() for r in range(world)]
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(self._addr[rank])
        except OSError as e:
            self._sock.close()
            raise RuntimeError(f"ShmGroup {uid!r}: rank {rank}'s socket name is taken ({e}); is another group "
                               "with this uid alive?") from None
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # every datagram: its sender's pid
        self._sock.settimeout(_POLL_S)
        #: datagrams dropped because they did not come from this group's processes
        self.rejected = 0
        self._calls = 0
        self._arrived: dict[int, dict[int, int]] = {}  # call -> {peer: its buffer's bytes}
        self._segments: dict[int, tuple[int, int]] = {}  # generation -> (size, fd) received, not mapped yet
        self._generation = 0
        self._mmap: mmap.mmap | None = None
        self._segment: torch.Tensor | None = None  # uint8 view of the whole segment
        self._slot_bytes = 0
        if barrier is not None:
            barrier()

    # -- messages ---------------------------------------------------------------------------
    def _send(self, peer: int, msg: bytes, fd: int | None = None) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                if fd is None:
                    self._sock.sendto(msg, self._addr[peer])
                else:
                    # socket.send_fds ignores its address argument on Python 3.11
                    self._sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))],
                                       0, self._addr[peer])
                return
            except (TimeoutError, BlockingIOError):  # the peer's queue is full: it is behind
                self._check(deadline, f"sending to rank {peer}")
            except (ConnectionRefusedError, FileNotFoundError):
                raise ShmGroupError(f"ShmGroup {self.uid!r}: rank {peer} has no socket (its process ended "
                                    "or it never joined)") from None

    def _check(self, deadline: float, doing: str) -> None:
        if self.pids is not None:
            for r, pid in enumerate(self.pids):
                if r != self.rank and not pid_alive(pid):
                    raise ShmGroupError(f"ShmGroup {self.uid!r}: rank {r} (pid {pid}) died while rank "
                                        f"{self.rank} was {doing}")
        if time.monotonic() > deadline:
            raise ShmGroupError(f"ShmGroup {self.uid!r}: rank {self.rank} waited more than {self.timeout_s:g} s "
                                f"{doing}")

    def _receive(self) -> tuple[bytes, list[int], tuple[int, int, int] | None]:
        """One datagram: its bytes, the descriptors it carried, its sender's ``(pid, uid, gid)``."""
        data, ancillary, _, _ = self._sock.recvmsg(_MSG.size, _ANCILLARY)
        fds: list[int] = []
        cred = None
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", payload[:len(payload) - len(payload) % 4]))
            elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= _UCRED.size:
                cred = _UCRED.unpack(payload[:_UCRED.size])
        return data, fds, cred

    def _from_group(self, data: bytes, cred: tuple[int, int, int] | None) -> bool:
        """Whether a datagram comes from the process of the rank it names (any process of this
        user when the group knows no pids)."""
        if cred is None or cred[1] != os.getuid():
            return False
        if self.pids is None:
            return True
        if len(data) != _MSG.size:
            return False
        sender = _MSG.unpack(data)[1]
        return 0 <= sender < self.world and sender != self.rank and cred[0] == self.pids[sender]

    def _pump(self, deadline: float, doing: str) -> None:
        """Receives one message of the group and files it (blocks; checks peers every 0.5 s);
        drops those of other processes."""
        while True:
            try:
                data, fds, cred = self._receive()
            except TimeoutError:
                self._check(deadline, doing)
                continue
            if self._from_group(data, cred):
                break
            for fd in fds:
                os.close(fd)
            self.rejected += 1
        if len(data) != _MSG.size:
            raise ShmGroupError(f"ShmGroup {self.uid!r}: malformed message of {len(data)} bytes")
        kind, sender, n, size = _MSG.unpack(data)
        if kind == _ARRIVE and 0 <= sender < self.world:
            self._arrived.setdefault(n, {})[sender] = size
        elif kind == _SEGMENT and len(fds) == 1:
            self._segments[n] = (size, fds[0])
        else:
            for fd in fds:
                os.close(fd)
            raise ShmGroupError(f"ShmGroup {self.uid!r}: malformed message {kind!r} with {len(fds)} descriptors")

    # -- the segment ------------------------------------------------------------------------
    def _map(self, fd: int, size: int, slot_bytes: int) -> None:
        try:
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._segment = None  # drop the old segment's view before its map
        self._mmap = mm
        self._segment = torch.frombuffer(mm, dtype=torch.uint8)
        self._slot_bytes = slot_bytes

    def _ensure(self, nbytes: int) -> None:
        """Makes the segment hold two banks of ``nbytes`` slots (collectively: every rank asks
        for the same sizes in the same order)."""
        if nbytes <= self._slot_bytes:
            return
        slot = -(-nbytes // _ALIGN) * _ALIGN
        size = 2 * self.world * slot
        self._generation += 1
        gen = self._generation
        if self.rank == 0:
            fd = os.memfd_create(f"msrl-{self.uid}", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                for peer in range(1, self.world):
                    self._send(peer, _MSG.pack(_SEGMENT, 0, gen, size), fd)
            except BaseException:
                os.close(fd)
                raise
            self._map(fd, size, slot)
            return
        deadline = time.monotonic() + self.timeout_s
        while gen not in self._segments:
            self._pump(deadline, "waiting for rank 0's shared-memory segment")
        got, fd = self._segments.pop(gen)
        if got != size:
            os.close(fd)
            raise ShmGroupError(f"ShmGroup {self.uid!r}: rank 0 made a segment of {got} bytes where rank "
                                f"{self.rank} needs {size}: the ranks all-reduce buffers of different sizes")
        self._map(fd, size, slot)

    def _slot(self, bank: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        assert self._segment is not None
        start = (bank * self.world + rank) * self._slot_bytes
        nbytes = like.numel() * like.element_size()
        return self._segment[start:start + nbytes].view(like.dtype).view(like.shape)

    # -- the collective ---------------------------------------------------------------------
    def allreduce_(self, flat: torch.Tensor) -> torch.Tensor:
        """Sums ``flat`` over the group, in place: afterwards every rank's ``flat`` holds
        ``sum_r flat_r`` added in rank order (bitwise the same on every rank).

        Args:
            flat: a contiguous 1-D CPU tensor; every rank passes one of the same size and dtype.

        Returns:
            ``flat``.

        Raises:
            ValueError: ``flat`` is not a contiguous 1-D CPU tensor.
            ShmGroupError: a peer died, did not arrive within ``timeout_s``, or passed a buffer
                of another size.
        """
        if flat.device.type != "cpu" or flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError(f"ShmGroup.allreduce_ takes a contiguous 1-D CPU tensor, got shape {tuple(flat.shape)} "
                             f"on {flat.device}")
        if self.world == 1:
            return flat
        self._ensure(flat.numel() * flat.element_size())
        call, bank = self._calls, self._calls % 2
        self._calls += 1
        self._slot(bank, self.rank, flat).copy_(flat)
        nbytes = flat.numel() * flat.element_size()
        msg = _MSG.pack(_ARRIVE, self.rank, call, nbytes)
        for peer in range(self.world):
            if peer != self.rank:
                self._send(peer, msg)
        deadline = time.monotonic() + self.timeout_s
        while len(self._arrived.get(call, ())) < self.world - 1:
            self._pump(deadline, f"waiting for its peers at all-reduce {call}")
        for peer, size in self._arrived.pop(call).items():
            if size != nbytes:
                raise ShmGroupError(f"ShmGroup {self.uid!r}: all-reduce {call}: rank {peer} passed {size} bytes, rank "
                                    f"{self.rank} {nbytes}: the ranks all-reduce buffers of different sizes")
        flat.copy_(self._slot(bank, 0, flat))
        for r in range(1, self.world):
            flat.add_(self._slot(bank, r, flat))
        return flat

    def close(self) -> None:
        """Closes the socket and unmaps the segment (idempotent)."""
        self._segment = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a view is still referenced somewhere; the GC unmaps it
                pass
            self._mmap = None
        for size_fd in self._segments.values():
            os.close(size_fd[1])
        self._segments.clear()
        self._sock.close()
