"""The endpoint between processes over ``torch.distributed``: the ops of
:class:`~msrl.runtime.endpoint.Endpoint` for fragment replicas that are processes (Ray actors).

Every fragment replica of a job is one rank of one process group (Gloo for CPU tensors). A
boundary's value travels as one :mod:`codec <msrl.runtime.transports.codec>` message (dtype + shape + raw
bytes, never pickle) by point-to-point messages tagged with the boundary's index, so two
boundaries between the same pair of replicas can never be confused; the pair's link
(:mod:`msrl.runtime.transports.links`: a Unix socket between host replicas of one machine, the process
group's Gloo/NCCL otherwise) carries them. Each (boundary, sender,
receiver) channel has a buffer size both ends know, so a value is one message, not a size and
then the bytes: the first value on a channel (or one larger than its buffers) is announced by a
control buffer ``b"GROW" | new size`` of the old size, and a smaller value rides padded in a
buffer of the channel's size (the codec's header says where the value ends):

==========  ================================================================================
op          messages (``R_s`` src replicas, ``R_d`` dst replicas)
==========  ================================================================================
send/recv   src replica ``i`` -> dst replica ``i``
gather      every src replica -> dst replica 0, which concatenates in replica order
scatter     src replica 0 splits along the env axis -> one shard to each dst replica
broadcast   src replica 0 -> every dst replica (one encoding, ``R_d`` sends)
allreduce   a collective of the fragment's own replicas (``dist.all_reduce``, or shared memory)
put/get     an asynchronous boundary: not torch.distributed but gRPC streams
            (:mod:`msrl.cluster.grpc_transport`, through the endpoint's ``asynchronous``)
==========  ================================================================================

Sends are non-blocking (``isend``): a replica never waits for its receiver unless the program
reads a value back, so no order of sends between two replicas can deadlock. A send's buffer is
kept until the send has left (:meth:`DistEndpoint.reap` forgets the oldest finished ones; the
runtime calls it after every iteration), and :meth:`DistEndpoint.flush` waits for every send (the
runtime calls it at the end of a chunk of iterations, before state is read or the process group
is left). A Gloo send only reports that it left once waited for, so on Gloo the buffers of a
chunk's sends are freed by its flush.
"""

from __future__ import annotations

import collections
import struct
import time
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from msrl.graph.fragmented import Boundary
from msrl.runtime.endpoint import Endpoint
from msrl.runtime.transports.codec import MAX_MESSAGE, CodecError, decode, decode_parts, encode, encode_parts, payload_size

__all__ = ["DistEndpoint", "grow_size"]

#: A channel's buffers start at this size (a control message); the first value grows them.
_CONTROL_BYTES = 16
#: A control buffer: magic + the channel's new buffer size (bytes).
_GROW = struct.Struct("<4sQ")
_GROW_MAGIC = b"GROW"


def grow_size(control: torch.Tensor, limit: int, boundary: str) -> int | None:
    """The new buffer size a channel's control buffer announces (``None``: ``control`` is not
    a control buffer but a message).

    Args:
        control: a received buffer, 1-D ``uint8``.
        limit: the largest buffer the channel may grow to (bytes; ``cluster.max_message_mb``).
        boundary: the boundary's name, for the message.

    Raises:
        CodecError: a control buffer announcing 0 bytes or more than ``limit``: nothing is
            allocated for it.
    """
    if control.numel() < _GROW.size or bytes(control[:4].numpy()) != _GROW_MAGIC:
        return None
    _, n = _GROW.unpack(control[:_GROW.size].numpy().tobytes())
    if not 0 < n <= limit:
        raise CodecError(f"malformed message on boundary {boundary}: a channel of {n} bytes (at most {limit}, "
                         "cluster.max_message_mb)")
    return n


class DistEndpoint(Endpoint):
    """One fragment replica's endpoint (:class:`~msrl.runtime.endpoint.Endpoint`: the ops generated
    code calls) over an initialised ``torch.distributed`` process group.

    Args:
        boundaries: every boundary of the job, in the same order in every process (the
            fragment graph's order); a boundary's position is its message tag.
        fragment, replica: who this endpoint is.
        ranks: ``(fragment, replica) -> rank`` for every replica of the job.
        fragment_group: the process group of this fragment's replicas (for ``allreduce``;
            ``None`` when the fragment has one replica).
        device: where received values go (the fragment's device).
        devices: fragment -> device of every fragment of the job. A boundary whose two ends
            are both on CUDA devices moves its tensors' bytes device to device (NCCL, through a
            ``"cpu:gloo,cuda:nccl"`` process group) and only the codec's header through the
            host (Gloo); any other boundary moves one host message.
        split_payload: send every value as a host header plus a separate payload message even
            on the CPU (the GPU protocol's logic, for tests on machines without GPUs).
        local_group: a :class:`~msrl.runtime.transports.shm.ShmGroup` of this fragment's replicas (all on
            this machine) that all-reduces host tensors in place of Gloo; ``None``: Gloo.
        asynchronous: this replica's :class:`~msrl.runtime.asynchronous.AsyncEndpoint` for the
            job's asynchronous boundaries (``put``/``get``; over gRPC between processes), or
            ``None`` when the job has none.
        max_message: the largest message (bytes) sent or received on a channel
            (``cluster.max_message_mb``): a receiver never allocates more for one value, a
            sender refuses a larger one with a :class:`~msrl.runtime.transports.codec.CodecError`.
        hierarchical: the fragment's replicas span several nodes and all-reduce host tensors
            hierarchically: summed within each node through ``local_group`` (when the node holds
            more than one), across nodes over Gloo among one leader per node
            (``leaders_group``, given to the leaders only), then the leader's total handed to its
            node's replicas through ``local_group`` again (the others add zeros): every replica
            ends with the same bits; one node's traffic leaves it once, not once per replica.
        links: peer rank -> the link per peer pair (:func:`msrl.runtime.transports.links.links`: a Unix
            socket to a replica on this machine, Gloo to one on another); ``None``: Gloo for all.
        link_server: this process's :class:`~msrl.runtime.transports.unix_link.UnixLinkServer` (closed with
            the endpoint), when a link uses it.
    """

    def __init__(
        self,
        boundaries: Sequence[Boundary],
        fragment: str,
        replica: int,
        ranks: Mapping[tuple[str, int], int],
        fragment_group: Any = None,
        device: torch.device | str = "cpu",
        devices: Mapping[str, torch.device | str] | None = None,
        split_payload: bool = False,
        local_group: Any = None,
        asynchronous: Any = None,
        max_message: int = MAX_MESSAGE,
        hierarchical: bool = False,
        leaders_group: Any = None,
        links: Mapping[int, Any] | None = None,
        link_server: Any = None,
    ) -> None:
        self.boundaries = {b.name: b for b in boundaries}
        #: peer rank -> the :class:`~msrl.runtime.transports.links.Link` that carries this replica's buffers
        #: to and from it (:mod:`msrl.runtime.transports.links`; a rank not named: :class:`~msrl.runtime.transports.links.GlooLink`)
        self.links: dict[int, Any] = dict(links or {})
        self.link_server = link_server
        self.max_message = max_message
        self.asynchronous = asynchronous
        #: the replica's :class:`~msrl.runtime.inference.InferenceServer` (central inference's
        #: server replica), set by its runtime
        self.inference: Any = None
        self.tags = {b.name: i for i, b in enumerate(boundaries)}
        self.fragment, self.replica = fragment, replica
        self.ranks = dict(ranks)
        self.fragment_group = fragment_group
        self.device = torch.device(device)
        self.devices = {f: torch.device(d) for f, d in (devices or {}).items()}
        self.split_payload = split_payload
        self.local_group = local_group
        self.hierarchical, self.leaders_group = hierarchical, leaders_group
        #: sends not known to have left, oldest first, with their buffers (kept alive)
        self._pending: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()
        #: (boundary, peer fragment, peer replica) -> the byte size of that channel's buffers
        self._capacity: dict[tuple[str, str, int], int] = {}
        #: bytes sent and received through this endpoint, and the seconds spent in its comm ops
        #: (encoding, sending, waiting for and decoding messages, all-reduces): the
        #: communication share of a replica's iteration time
        self.bytes_sent = 0
        self.bytes_received = 0
        self.comm_s = 0.0
        #: of ``comm_s``, the seconds spent waiting for a peer to send (blocked on a message's
        #: first bytes): ``comm_s - wait_s`` is the cost of moving values
        self.wait_s = 0.0
        #: ``comm_s`` by comm op (``send``, ``gather``, ..., ``flush``)
        self.op_s: dict[str, float] = {}

    # -- messages ---------------------------------------------------------------------------
    def _split(self, peer: str) -> bool:
        """Whether values to/from ``peer`` travel as a host header plus a payload message
        (both ends on CUDA: the payload goes GPU to GPU), the same answer at both ends."""
        if self.split_payload:
            return True
        return self.device.type == "cuda" and self.devices.get(peer, torch.device("cpu")).type == "cuda"

    def _prepare(self, value: Any, peer: str, key: tuple[str, str, int] | None = None) -> Any:
        """``value`` encoded for ``peer``: one host message, or ``(head, payload)``. With the
        channel ``key`` of its one receiver, the message is padded to the channel's buffer size
        as it is encoded (one copy, not two)."""
        if self._split(peer):
            return encode_parts(value, self.device if self.device.type == "cuda" else None)
        return encode(value, self._capacity.get(key, 0) if key is not None else 0)

    def _post_message(self, name: str, fragment: str, replica: int, message: Any) -> None:
        rank, tag = self.ranks[(fragment, replica)], self.tags[name]
        key = (name, fragment, replica)
        if isinstance(message, tuple):
            head, payload = message
            self._post_buffer(key, rank, tag, head)
            self._check_size(payload.numel(), name)
            if payload.numel():
                self._isend(payload, rank, tag)  # NCCL when it is a CUDA tensor
            self.bytes_sent += payload.numel()
        else:
            self._post_buffer(key, rank, tag, message)

    def _post_buffer(self, key: tuple[str, str, int], rank: int, tag: int, message: torch.Tensor) -> None:
        capacity = self._capacity.get(key, _CONTROL_BYTES)
        n = message.numel()
        self._check_size(n, key[0])
        if n > capacity:  # grow the channel: a control buffer of the old capacity names the new one
            control = torch.zeros(capacity, dtype=torch.uint8)
            control[:_GROW.size] = torch.frombuffer(bytearray(_GROW.pack(_GROW_MAGIC, n)), dtype=torch.uint8)
            self._isend(control, rank, tag)
            self._capacity[key] = capacity = n
        if n < capacity:  # a smaller message rides in a buffer of the channel's capacity
            message = torch.cat([message, torch.zeros(capacity - n, dtype=torch.uint8)])
        self._isend(message, rank, tag)
        self.bytes_sent += n

    def _check_size(self, n: int, boundary: str) -> None:
        if n > self.max_message:
            raise CodecError(f"a value of {n} bytes on boundary {boundary} is over the {self.max_message}-byte limit "
                             "of a message between processes: raise cluster.max_message_mb, or send less")

    def _link(self, rank: int) -> Any:
        link = self.links.get(rank)
        if link is None:
            from msrl.runtime.transports.links import GlooLink

            link = self.links[rank] = GlooLink(rank)
        return link

    def _isend(self, buffer: torch.Tensor, rank: int, tag: int) -> None:
        self._pending.append((self._link(rank).isend(buffer, tag), buffer))  # keeps the buffer alive

    def _take(self, boundary: Boundary, src_replica: int) -> Any:
        name, fragment, replica = boundary.name, boundary.src, src_replica
        rank, tag = self.ranks[(fragment, replica)], self.tags[name]
        buffer = self._take_buffers([((name, fragment, replica), rank)], tag)[0]
        if self._split(fragment):
            n = payload_size(buffer, self.max_message)
            payload = torch.empty(n, dtype=torch.uint8, device=self.device if self.device.type == "cuda" else "cpu")
            if n:
                self._link(rank).irecv(payload, tag).wait()
            self.bytes_received += n
            return decode_parts(buffer, payload, self.device)
        return decode(buffer, self.device, copy=False)  # a fresh buffer: its tensors are viewed in it

    def _take_all(self, boundary: Boundary, src_replicas: list[int]) -> list[Any]:
        """A gather's side at the consumer: one receive posted per source at once (as Gloo's own
        gather does), waited for together, then each decoded -- not one source's wait after
        another's (``python bench/bench_collectives.py``)."""
        if len(src_replicas) == 1 or self._split(boundary.src):
            return [self._take(boundary, s) for s in src_replicas]
        channels = [((boundary.name, boundary.src, s), self.ranks[(boundary.src, s)]) for s in src_replicas]
        return [decode(buffer, self.device, copy=False)  # fresh buffers: their tensors are viewed in them
                for buffer in self._take_buffers(channels, self.tags[boundary.name])]

    def flush_async(self) -> None:
        """Sends what the gRPC transport holds (``fifo`` items put since this replica last
        waited): called before anything that waits for a peer, and every iteration."""
        if self.asynchronous is not None:
            self.asynchronous.transport.flush()

    def _take_buffers(self, channels: list[tuple[tuple[str, str, int], int]], tag: int) -> list[torch.Tensor]:
        """The next message of each ``(channel key, src rank)`` on boundary tag ``tag``: a receive
        of the channel's buffer size posted for every one at once, waited for together (the wait
        counted in ``wait_s``); a message announcing a larger buffer (``GROW``) is followed by the
        value at the new size, received then. Returns fresh uint8 buffers, in ``channels`` order
        (pinned for a GPU consumer: the decoded tensors are copied to it once, without blocking).

        Raises:
            CodecError: a ``GROW`` over ``max_message``.
        """
        self.flush_async()
        pinned = self.device.type == "cuda"
        posted = []
        for key, rank in channels:
            buffer = torch.empty(self._capacity.get(key, _CONTROL_BYTES), dtype=torch.uint8, pin_memory=pinned)
            posted.append((key, rank, buffer, self._link(rank).irecv(buffer, tag)))
        t0 = time.perf_counter()
        for *_, work in posted:
            work.wait()  # waits for the peers to reach their side of the boundary
        self.wait_s += time.perf_counter() - t0
        out = []
        for key, rank, buffer, _ in posted:
            n = grow_size(buffer, self.max_message, key[0])
            if n is not None:
                self._capacity[key] = n
                buffer = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
                self._link(rank).irecv(buffer, tag).wait()
            self.bytes_received += buffer.numel()
            out.append(buffer)
        return out

    def reap(self) -> None:
        """Forgets the oldest sends while they have left (their buffers may be freed); never
        waits, and stops at the first one still in flight, so a call costs O(1) amortised. Sends
        what the gRPC transport holds (the runtime calls this after every iteration).

        A Gloo send reports completion only once waited for (``is_completed()`` stays false
        until ``wait()``), so on Gloo this frees nothing and :meth:`flush` frees the buffers;
        scanning every pending send here (as this did) cost O(pending) per call, ~200 us an
        iteration with a few hundred sends in flight."""
        self.flush_async()
        pending = self._pending
        while pending and pending[0][0].is_completed():
            pending.popleft()

    def flush(self) -> None:
        """Waits until every message this endpoint sent has left (its buffers are free)."""
        self.flush_async()
        with _Timer(self, "flush"):
            for work, _ in self._pending:
                work.wait()
            self._pending.clear()

    # -- the transport under the endpoint's ops ----------------------------------------------
    def _post(self, boundary: Boundary, routes: list[tuple[int, Any]]) -> None:
        """Encodes and posts each route's value; a value for several replicas is encoded once."""
        first = routes[0][1] if routes else None
        once = self._prepare(first, boundary.dst) if len(routes) > 1 and all(v is first for _, v in routes) else None
        for r, value in routes:
            message = once if once is not None else self._prepare(value, boundary.dst, (boundary.name, boundary.dst, r))
            self._post_message(boundary.name, boundary.dst, r, message)

    def _timed(self, op: str) -> "_Timer":
        return _Timer(self, op)

    def _fragment_size(self) -> int:
        return dist.get_world_size(self.fragment_group) if self.fragment_group is not None else 1

    def _reduce_flat(self, name: str, flat: torch.Tensor) -> torch.Tensor:
        """Sums with ``dist.all_reduce`` on the fragment's group (or through shared memory by
        ``local_group`` for a host tensor, hierarchically across nodes when ``hierarchical``),
        divided by the replica count."""
        self.flush_async()
        if self.hierarchical and flat.device.type == "cpu":
            if self.local_group is not None:
                self.local_group.allreduce_(flat)  # this node's sum
            if self.leaders_group is not None:
                dist.all_reduce(flat, group=self.leaders_group)  # every node's, at each leader
            if self.local_group is not None:
                if self.leaders_group is None:
                    flat.zero_()
                self.local_group.allreduce_(flat)  # the leader's total, to its node
        elif self.local_group is not None and flat.device.type == "cpu":
            self.local_group.allreduce_(flat)
        else:
            dist.all_reduce(flat, group=self.fragment_group)
        flat /= self._fragment_size()
        return flat

    def close(self) -> None:
        """Releases the shared-memory group and ends the gRPC streams, if any (the process group
        is the caller's)."""
        if self.local_group is not None:
            self.local_group.close()
            self.local_group = None
        if self.asynchronous is not None:
            self.asynchronous.transport.close()
        for link in self.links.values():
            if hasattr(link, "close"):
                link.close()
        if self.link_server is not None:
            self.link_server.close()
            self.link_server = None


class _Timer:
    """Adds the time spent inside to an endpoint's ``comm_s`` and to its op's ``op_s``; for
    ``put``/``get``, the time the asynchronous transport waited (a full queue's credits) or its
    mailbox waited (a value to arrive) to ``wait_s``."""

    def __init__(self, comm: DistEndpoint, op: str) -> None:
        self.comm, self.op = comm, op

    def _waited(self) -> float:
        a = self.comm.asynchronous
        if a is None or self.op not in ("put", "get"):
            return 0.0
        return a.transport.wait_s if self.op == "put" else a.mailbox.wait_s

    def __enter__(self) -> None:
        self.w0 = self._waited()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        dt = time.perf_counter() - self.t0
        self.comm.comm_s += dt
        self.comm.op_s[self.op] = self.comm.op_s.get(self.op, 0.0) + dt
        self.comm.wait_s += self._waited() - self.w0
