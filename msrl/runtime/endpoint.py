"""The endpoint: the one interface a generated fragment program talks through.

Code generation (:mod:`msrl.runtime.programs.codegen`, the backends' lowering rules) emits exactly these calls on
the program's ``comm`` argument, a fragment replica's :class:`Endpoint`:

=====================================  ==========================================================
generated call                         meaning
=====================================  ==========================================================
``comm.send(b, v)``/``comm.recv(b)``   boundary ``b`` (``send``, ``gather``, ``reduce``,
``comm.gather(b, v)``/``gather(b)``    ``scatter``, ``broadcast``): the src side passes its
``comm.reduce``, ``comm.scatter``,     value, the dst side gets what the pattern table
``comm.broadcast``                     (:mod:`msrl.runtime.patterns`) combines for it
``comm.put(b, v)``/``comm.get(b)``     an asynchronous boundary (``fifo`` queue, ``latest``
                                       slot): :class:`~msrl.runtime.asynchronous.AsyncEndpoint`
``with comm.allreduce_region(b, p,     an all-reduce region: what the call inside passes through
self.learner):``                       the learner's collective point ``p`` (its gradients, its
                                       running statistics) is averaged over the fragment's replicas
``comm.serve(self, fn)``               central inference: ``fn`` (the served region) runs once
                                       per client replica (:mod:`msrl.runtime.inference`)
=====================================  ==========================================================

Every op is written here once, over the pattern table. What differs between runtimes is only how
one value travels, which a transport's endpoint supplies by four methods: :meth:`Endpoint._post`
(a src replica's values to dst replicas), :meth:`Endpoint._take` (a dst replica's value from one
src replica), :meth:`Endpoint._reduce_flat` (the mean of one flat buffer over the fragment's
replicas) and :meth:`Endpoint._fragment_size`. The in-process transport is
:class:`msrl.runtime.channels.LocalEndpoint` (queues between threads), the one between processes
:class:`msrl.runtime.transports.dist.DistEndpoint` (torch.distributed, shared memory for host all-reduces);
asynchronous boundaries move over :class:`~msrl.runtime.asynchronous.AsyncTransport`\\ s
(in-process, Unix sockets, gRPC), peers, none a subclass of another.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, ContextManager, Mapping

import torch

from msrl.api import collective_scope
from msrl.graph import NodeKind
from msrl.graph.fragmented import Boundary, boundary_end
from msrl.runtime.frame_stacks import compact_value, rebuild_value
from msrl.runtime.patterns import combine, deliveries, shards, sources
from msrl.runtime.values import reduce_leaves, tensor_leaves

__all__ = ["Endpoint", "BOUNDARY_OPS"]

#: the node kinds a backend lowers to ``comm.<kind.value>(boundary[, value])`` calls
BOUNDARY_OPS = (NodeKind.SEND, NodeKind.RECV, NodeKind.GATHER, NodeKind.REDUCE, NodeKind.SCATTER, NodeKind.BROADCAST,
                NodeKind.PUT, NodeKind.GET)

#: the context of an op no one times (reusable: a ``nullcontext`` holds no state)
_UNTIMED = contextlib.nullcontext()


class Endpoint:
    """One fragment replica's endpoint (see the module docstring for the calls).

    Attributes (everything a runtime reads of an endpoint; a transport that does not account
    its traffic leaves the counters at 0):
        fragment, replica: whose endpoint this is.
        boundaries: every boundary of the job by name.
        asynchronous: the replica's :class:`~msrl.runtime.asynchronous.AsyncEndpoint` (``put``/
            ``get``), or ``None`` when the job has no asynchronous boundary.
        inference: the replica's :class:`~msrl.runtime.inference.InferenceServer` when it is
            central inference's server, else ``None``.
        comm_s: seconds spent in its comm ops so far (encoding, sending, waiting for and
            decoding values, all-reduces); wait_s: of them, seconds blocked until a peer reached
            its side of a boundary; op_s: ``comm_s`` by op (``send``, ``gather``, ..., ``flush``).
        bytes_sent, bytes_received: bytes of messages it sent and received.
        local_group: the shared-memory all-reduce group of its fragment's replicas on this
            machine (:class:`~msrl.runtime.transports.shm.ShmGroup`), or ``None``.
        frame_padding: how the job's env pads an episode's first frame stack
            (:func:`msrl.runtime.frame_stacks.frame_padding`) when its frame-stacked rollouts leave
            this endpoint in compact form -- the first stack, then each step's newest frame,
            checked bit for bit (:mod:`msrl.runtime.frame_stacks`); ``None``: values leave whole. A
            compact value is rebuilt where it arrives, whatever the receiver's setting.
    """

    fragment: str
    replica: int
    boundaries: Mapping[str, Boundary]
    asynchronous: Any = None
    inference: Any = None
    comm_s: float = 0.0
    wait_s: float = 0.0
    op_s: Mapping[str, float] = types.MappingProxyType({})  # an accounting transport's instance has its own
    bytes_sent: int = 0
    bytes_received: int = 0
    local_group: Any = None
    frame_padding: str | None = None

    def _outgoing(self, name: str, value: Any) -> Any:
        """``value`` as it leaves on boundary ``name``: compact when it is a frame-stacked rollout
        and this endpoint compacts (a boundary whose stacks once broke the padding: whole)."""
        if self.frame_padding is None:
            return value
        whole = self.__dict__.setdefault("_whole_boundaries", set())
        if name in whole:
            return value
        out, broken = compact_value(value, self.frame_padding)
        if broken:
            whole.add(name)
        return out

    # -- what a transport supplies ----------------------------------------------------------
    def _post(self, boundary: Boundary, routes: list[tuple[int, Any]]) -> None:
        """Sends each ``(dst replica, value)`` of a src replica's side of ``boundary``; one
        value object listed for several replicas (a broadcast) may be encoded once."""
        raise NotImplementedError

    def _take(self, boundary: Boundary, src_replica: int) -> Any:
        """The oldest value ``src_replica`` sent this replica on ``boundary``, waiting for it;
        the receiver's own copy, on this fragment's device."""
        raise NotImplementedError

    def _take_all(self, boundary: Boundary, src_replicas: list[int]) -> list[Any]:
        """:meth:`_take` from each of ``src_replicas``, in their order (a transport that can wait
        for several peers at once overrides it)."""
        return [self._take(boundary, s) for s in src_replicas]

    def _reduce_flat(self, name: str, flat: torch.Tensor) -> torch.Tensor:
        """The mean over this fragment's replicas of a flat buffer (every replica gets the same
        bits); ``name`` is the all-reduce's, for byte accounting."""
        raise NotImplementedError

    def _fragment_size(self) -> int:
        """This fragment's replica count."""
        raise NotImplementedError

    def _timed(self, op: str) -> ContextManager[None]:
        """A context the op ``op`` runs in (a transport that accounts its comm time times it)."""
        return _UNTIMED

    # -- the ops generated programs call ----------------------------------------------------
    def _boundary(self, name: str) -> Boundary:
        return boundary_end(self.boundaries, name, self.fragment)

    def _sync(self, op: str, name: str, value: Any) -> Any:
        """One side of synchronous boundary ``name``, by the pattern table: the src side posts
        (returns ``None``), the dst side takes from each of its sources and combines."""
        with self._timed(op):
            b = self._boundary(name)
            if self.fragment == b.src:
                parts = shards(b, value)
                sent: dict[int, Any] = {}  # one outgoing form per distinct value: a broadcast's is shared
                routes = []
                for r, part in deliveries(b, self.replica):
                    v = value if part is None else parts[part]
                    if id(v) not in sent:
                        sent[id(v)] = self._outgoing(name, v)
                    routes.append((r, sent[id(v)]))
                self._post(b, routes)
                return None
            return combine(b, [rebuild_value(v) for v in self._take_all(b, sources(b, self.replica))])

    def send(self, name: str, value: Any) -> None:
        """Src replica ``i`` -> dst replica ``i``."""
        self._sync("send", name, value)

    def recv(self, name: str) -> Any:
        """Receives what src replica ``i`` sent."""
        return self._sync("recv", name, None)

    def gather(self, name: str, value: Any = None) -> Any:
        """Src side (with ``value``): contribute a shard. Dst side: returns the shards
        concatenated along the boundary's axis, replica 0 first."""
        return self._sync("gather", name, value)

    def reduce(self, name: str, value: Any = None) -> Any:
        """Src side (with ``value``): contribute a partial value. Dst side: returns the sum of
        every src replica's (the mean when the boundary says so), summed in replica order."""
        return self._sync("reduce", name, value)

    def scatter(self, name: str, value: Any = None) -> Any:
        """Src side: split ``value`` over the dst replicas. Dst side: returns this replica's shard."""
        return self._sync("scatter", name, value)

    def broadcast(self, name: str, value: Any = None) -> Any:
        """Src side: send ``value`` to every dst replica. Dst side: returns it."""
        return self._sync("broadcast", name, value)

    def _async(self, name: str) -> Any:
        if self.asynchronous is None:
            raise KeyError(f"{name!r} is not an asynchronous boundary of this job")
        return self.asynchronous

    def put(self, name: str, value: Any) -> None:
        """Asynchronous boundary, src side: queue (``fifo``) or publish (``latest``) ``value``
        (:meth:`msrl.runtime.asynchronous.AsyncEndpoint.put`).

        Raises:
            KeyError: ``name`` is not an asynchronous boundary of the job.
        """
        with self._timed("put"):
            self._async(name).put(name, value)

    def get(self, name: str) -> Any:
        """Asynchronous boundary, dst side (:meth:`msrl.runtime.asynchronous.AsyncEndpoint.get`).

        Raises:
            KeyError: ``name`` is not an asynchronous boundary of the job.
        """
        with self._timed("get"):
            return self._async(name).get(name)

    def allreduce(self, name: str, value: Any = None) -> Any:
        """The mean over this fragment's replicas of ``value`` (a boundary value whose tensors
        share one dtype), written into ``value``'s tensors and returned; every replica passes a
        value of the same structure and shapes and ends with the same bits
        (:func:`~msrl.runtime.values.reduce_leaves` flattens and copies back)."""
        with self._timed("allreduce"):
            if self._fragment_size() == 1 or not tensor_leaves(value):
                return value
            return reduce_leaves(value, lambda flat: self._reduce_flat(name, flat))

    def allreduce_region(self, name: str, point: str, learner: Any) -> ContextManager[None]:
        """The ``allreduce`` region of collective ``name`` (:mod:`msrl.frontend.partition`): while its call
        runs, what ``learner`` passes through its collective point ``point``
        (:data:`msrl.api.COLLECTIVE_POINTS`: every gradient step's gradients at
        :meth:`~msrl.api.Learner.apply_gradients`, its running statistics at
        :meth:`~msrl.api.Learner.reduce_statistics`) is averaged over this fragment's replicas
        (:meth:`allreduce`). A ``contextvars`` scope (:func:`msrl.api.collective_scope`):
        nothing is set on the learner."""
        return collective_scope(learner, point, lambda tensors: self.allreduce(name, tensors))

    def serve(self, trainer: Any, fn: Any) -> Any:
        """Central inference (the server replica): runs ``fn`` once per client replica through
        this endpoint's :class:`~msrl.runtime.inference.InferenceServer`.

        Raises:
            RuntimeError: this replica serves no inference.
        """
        if self.inference is None:
            raise RuntimeError(f"fragment {self.fragment} replica {self.replica} serves no central inference")
        return self.inference.serve(trainer, fn, self)

    def reap(self) -> None:
        """Forgets the sends known to have left, never waiting (after every iteration;
        in-process: nothing to forget)."""

    def flush(self) -> None:
        """Waits until every value this endpoint sent has left (in-process: nothing to wait for)."""

    def close(self) -> None:
        """Releases what the transport holds (groups, streams; not the process group)."""
