"""In-process channels: the comm ops' semantics for fragment replicas living in one process.

Every generated program talks to its replica's :class:`LocalComm` endpoint. The semantics are
those the Ray runtime implements over torch.distributed and gRPC; the replica mapping of each
pattern is written once, in :mod:`msrl.runtime.patterns`, which every endpoint uses:

==========  =====================================================================================
op          semantics (``R_s`` src replicas, ``R_d`` dst replicas)
==========  =====================================================================================
send/recv   ``R_s == R_d``: src replica ``i`` -> dst replica ``i``
gather      ``R_s -> 1``: the dst concatenates the replicas' shards along the env axis, replica 0
            first (so a gathered batch of ``R`` replicas x ``N/R`` envs lists envs in order)
scatter     ``1 -> R_d``: the src splits along the env axis into ``R_d`` equal shards
broadcast   ``1 -> R_d``: every dst replica receives the value
put/get     an asynchronous boundary (a ``fifo`` queue or a ``latest`` slot): the endpoint's
            :class:`~msrl.runtime.asynchronous.AsyncEndpoint` (see that module)
==========  =====================================================================================

A receiver always gets its own copy (as it would over a network): mutating it never changes
the sender's value. The copy is made on the receiving fragment's device (:func:`deliver`): a
value crosses a boundary onto its consumer's device whatever its producer's, moved once. When one
replica fails, :meth:`LocalHub.close` wakes every waiting peer with :class:`ChannelClosed`.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.utils._pytree as pytree
from tensordict import TensorDictBase

from msrl.errors import MsrlError
from msrl.partition import Boundary, boundary_end
from msrl.runtime.generators import BATON
from msrl.runtime.patterns import combine, concat, deliveries, shards, sources, split  # noqa: F401 - concat, split re-exported

__all__ = ["ChannelClosed", "LocalHub", "LocalComm", "Serving", "concat", "split", "copy_value", "deliver",
           "move_tensor", "tensor_leaves", "reduce_leaves", "payload_bytes"]

_POLL_S = 0.05


class ChannelClosed(MsrlError, RuntimeError):
    """A peer fragment replica failed or the job stopped while this one waited on a boundary."""


def copy_value(value: Any) -> Any:
    """A deep copy of tensors, TensorDicts and (nested) dicts/lists/tuples of them, each tensor
    on its own device (:func:`deliver` with no device)."""
    return deliver(value, None)


def move_tensor(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A copy of ``t`` the receiver owns, on ``device`` (``None``: ``t``'s own): the one copy
    of the delivery rule (see :func:`deliver`).

    CPU -> CUDA goes through pinned host memory and a non-blocking copy on the current stream
    (the consumer's kernels queue behind it: the producer's thread never waits for the DMA);
    CUDA -> CPU is a blocking copy (the CPU consumer reads it at once); CUDA -> CUDA a
    non-blocking device copy. Shape and dtype are kept.
    """
    if device is None or t.device == device:
        return t.clone()
    if device.type == "cuda" and t.device.type == "cpu":
        staged = t if t.is_pinned() else t.pin_memory()  # pinned staging: the DMA runs off the host thread
        return staged.to(device, non_blocking=True)
    return t.to(device, non_blocking=t.device.type == "cuda" and device.type == "cuda")


def deliver(value: Any, device: torch.device | str | None) -> Any:
    """``value`` as its receiver gets it: a copy the receiver owns (mutating it never changes
    the sender's value, as over a network), every tensor on ``device``, the consumer
    fragment's (``None``: each tensor stays on its own device).

    The delivery rule of every boundary (DESIGN.md §3): whatever the producer's device, the
    consumer gets its fragment's; each tensor is copied exactly once (a tensor already on
    ``device`` is cloned, one on another device moved: :func:`move_tensor`). Tensors,
    TensorDicts (their ``device`` set to ``device``) and (nested) dicts/lists/tuples of them;
    other leaves (numbers, strings, ``None``) are returned as they are.
    """
    to = torch.device(device) if device is not None else None
    return _deliver(value, to)


def _deliver(value: Any, to: torch.device | None) -> Any:
    if isinstance(value, torch.Tensor):
        return move_tensor(value, to)
    if isinstance(value, TensorDictBase):
        if to is None:
            return value.clone()
        return value.apply(lambda t: move_tensor(t, to), device=to)
    if isinstance(value, dict):
        return {k: _deliver(v, to) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_deliver(v, to) for v in value)
    return value


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors of a boundary value -- a tensor, a TensorDict, or (nested) dicts/lists/tuples of
    them -- in one fixed order (depth first, insertion order; a TensorDict's leaves as
    ``torch.utils._pytree`` lists them, tensordict registering it): the one walk the all-reduce
    and the byte counts share."""
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def reduce_leaves(value: Any, reduce_flat: Any) -> Any:
    """An all-reduce's flatten and copy-back, written once for every endpoint: the tensors of
    ``value`` (:func:`tensor_leaves`, one dtype) are concatenated into one flat buffer,
    ``reduce_flat(flat)`` returns the reduced buffer (the mean over the replicas), and its slices
    are copied back into ``value``'s tensors, which is returned."""
    tensors = tensor_leaves(value)
    if not tensors:
        return value
    flat = reduce_flat(torch.cat([t.detach().reshape(-1) for t in tensors]))
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return value


def payload_bytes(value: Any) -> int:
    """The bytes of the tensors (TensorDicts included) a value holds: what crossing a boundary
    moves, headers aside (the tensors of :func:`tensor_leaves`)."""
    return sum(t.numel() * t.element_size() for t in tensor_leaves(value))


class LocalHub:
    """The queues of every boundary of a job whose fragment replicas share one process.

    Args:
        boundaries: from :class:`msrl.partition.FragmentGraph`.
        fragment_replicas: fragment -> its replica count (for ``allreduce`` among a fragment's
            replicas; fragments not listed have one).
        devices: fragment -> the device its values are delivered on (fragments not listed: each
            tensor stays on its producer's device).
    """

    def __init__(self, boundaries: Sequence[Boundary], fragment_replicas: Mapping[str, int] | None = None,
                 devices: Mapping[str, torch.device | str] | None = None) -> None:
        self.boundaries = {b.name: b for b in boundaries}
        self.fragment_replicas = dict(fragment_replicas or {})
        self.devices = {f: torch.device(d) for f, d in (devices or {}).items()}
        self._reduce_cond = threading.Condition()
        self._reduce_parts: dict[str, dict[int, torch.Tensor]] = {}
        self._reduce_done: dict[str, tuple[int, torch.Tensor]] = {}
        self._reduce_round: dict[str, int] = {}
        #: (boundary, src replica, dst replica) -> what src sent dst, in order
        self._queues: dict[tuple[str, int, int], queue.Queue] = {}
        for b in boundaries:
            for s in range(b.src_replicas):
                for r in range(b.dst_replicas):
                    self._queues[(b.name, s, r)] = queue.Queue()
        self._closed = threading.Event()
        self._reason = ""
        #: boundary -> bytes of tensors that crossed it (every replica's sends)
        self.bytes: dict[str, int] = {}
        self._bytes_lock = threading.Lock()

    def endpoint(self, fragment: str, replica: int, asynchronous: Any = None, inference: Any = None) -> "LocalComm":
        """The endpoint generated programs of ``fragment`` replica ``replica`` call
        (``asynchronous``: its :class:`~msrl.runtime.asynchronous.AsyncEndpoint`, for ``put``/``get``;
        ``inference``: its :class:`~msrl.runtime.inference.InferenceServer`, for ``serve``)."""
        return LocalComm(self, fragment, replica, asynchronous, inference)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed.is_set()

    def close(self, reason: str) -> None:
        """Wakes every waiting replica with :class:`ChannelClosed` (``reason`` in its message)."""
        self._reason = reason
        self._closed.set()
        with self._reduce_cond:
            self._reduce_cond.notify_all()

    def _allreduce(self, fragment: str, replica: int, flat: torch.Tensor) -> torch.Tensor:
        """The mean of every replica's ``flat`` (summed in replica order), once all arrived."""
        n = self.fragment_replicas.get(fragment, 1)
        with BATON.released(), self._reduce_cond:  # the other replicas (threads) run meanwhile
            round_ = self._reduce_round.get(fragment, 0)
            parts = self._reduce_parts.setdefault(fragment, {})
            parts[replica] = flat
            if len(parts) == n:
                total = parts[0].clone()
                for r in range(1, n):
                    total += parts[r]
                self._reduce_done[fragment] = (round_, total / n)
                self._reduce_parts[fragment] = {}
                self._reduce_round[fragment] = round_ + 1
                self._reduce_cond.notify_all()
            while self._reduce_done.get(fragment, (-1, None))[0] != round_:
                if self._closed.is_set():
                    raise ChannelClosed(f"allreduce of fragment {fragment}: {self._reason}")
                self._reduce_cond.wait(_POLL_S)
            return self._reduce_done[fragment][1].clone()

    def _put(self, boundary: str, src: int, dst: int, value: Any) -> None:
        """Delivers ``value`` from src replica ``src`` to dst replica ``dst`` (a copy on the dst
        fragment's device, :func:`deliver`)."""
        n = payload_bytes(value)
        with self._bytes_lock:
            self.bytes[boundary] = self.bytes.get(boundary, 0) + n
        self._queues[(boundary, src, dst)].put(deliver(value, self.devices.get(self.boundaries[boundary].dst)))

    def _get(self, boundary: str, src: int, dst: int) -> Any:
        """The oldest value src replica ``src`` sent dst replica ``dst``, waiting for it."""
        q = self._queues[(boundary, src, dst)]
        try:
            return q.get_nowait()
        except queue.Empty:
            pass
        with BATON.released():  # the other replicas (threads) run meanwhile
            while True:
                if self._closed.is_set():
                    raise ChannelClosed(f"boundary {boundary}: {self._reason}")
                try:
                    return q.get(timeout=_POLL_S)
                except queue.Empty:
                    continue


class Serving:
    """The ops every runtime's endpoint shares on top of its own ``allreduce``: ``serve``
    (central inference; ``inference`` is the replica's
    :class:`~msrl.runtime.inference.InferenceServer` or ``None``) and ``allreduce_gradients``
    (the gradient all-reduce region)."""

    fragment: str
    replica: int
    inference: Any = None

    def allreduce(self, name: str, value: Any = None) -> Any:  # pragma: no cover - every endpoint has its own
        raise NotImplementedError

    @contextlib.contextmanager
    def allreduce_gradients(self, name: str, learner: Any) -> Iterator[None]:
        """The ``allreduce`` region of boundary ``name`` (:mod:`msrl.partition`): while its call
        runs, every gradient step ``learner`` takes (:meth:`msrl.api.Learner.apply_gradients`, and
        whatever else reduces through its ``gradient_hook``, e.g. running normalisation
        statistics) averages the gradients over this fragment's replicas first (:meth:`allreduce`:
        every replica ends with the same bits); the hook is restored after the call."""
        saved = learner.gradient_hook
        learner.gradient_hook = lambda grads: self.allreduce(name, grads)
        try:
            yield
        finally:
            learner.gradient_hook = saved

    def serve(self, trainer: Any, fn: Any) -> Any:
        """Central inference (the server replica): runs ``fn`` once per client replica through
        this endpoint's :class:`~msrl.runtime.inference.InferenceServer`.

        Raises:
            RuntimeError: this replica serves no inference.
        """
        if self.inference is None:
            raise RuntimeError(f"fragment {self.fragment} replica {self.replica} serves no central inference")
        return self.inference.serve(trainer, fn, self)


class LocalComm(Serving):
    """One fragment replica's endpoint; generated code calls ``comm.<op>(boundary[, value])``:
    with a value on the src side, without on the dst side (which returns the value). Which
    replicas a value goes to and comes from is :mod:`msrl.runtime.patterns`' table."""

    def __init__(self, hub: LocalHub, fragment: str, replica: int, asynchronous: Any = None,
                 inference: Any = None) -> None:
        self.hub, self.fragment, self.replica = hub, fragment, replica
        self.asynchronous = asynchronous
        self.inference = inference

    def _boundary(self, name: str) -> Boundary:
        return boundary_end(self.hub.boundaries, name, self.fragment)

    def _op(self, name: str, value: Any) -> Any:
        """One side of a synchronous boundary, by the pattern table: the src side sends
        (returns ``None``), the dst side reads and combines."""
        b = self._boundary(name)
        if self.fragment == b.src:
            parts = shards(b, value)
            for r, part in deliveries(b, self.replica):
                self.hub._put(name, self.replica, r, value if part is None else parts[part])
            return None
        return combine(b, [self.hub._get(name, s, self.replica) for s in sources(b, self.replica)])

    def send(self, name: str, value: Any) -> None:
        """Src replica ``i`` -> dst replica ``i``."""
        self._op(name, value)

    def recv(self, name: str) -> Any:
        """Receives what src replica ``i`` sent."""
        return self._op(name, None)

    def gather(self, name: str, value: Any = None) -> Any:
        """Src side (with ``value``): contribute a shard. Dst side: returns the shards
        concatenated along the boundary's axis, replica 0 first."""
        return self._op(name, value)

    def scatter(self, name: str, value: Any = None) -> Any:
        """Src side: split ``value`` over the dst replicas. Dst side: returns this replica's shard."""
        return self._op(name, value)

    def broadcast(self, name: str, value: Any = None) -> Any:
        """Src side: send ``value`` to every dst replica. Dst side: returns it."""
        return self._op(name, value)

    def put(self, name: str, value: Any) -> None:
        """Asynchronous boundary, src side: queue or publish ``value`` (see
        :meth:`msrl.runtime.asynchronous.AsyncEndpoint.put`)."""
        self._boundary(name)
        self.asynchronous.put(name, value)

    def get(self, name: str) -> Any:
        """Asynchronous boundary, dst side (see :meth:`msrl.runtime.asynchronous.AsyncEndpoint.get`)."""
        self._boundary(name)
        return self.asynchronous.get(name)

    def allreduce(self, name: str, value: Any = None) -> Any:
        """The mean over this fragment's replicas of ``value`` (a tensor, or a list/tuple/dict
        of tensors of one dtype), written into ``value``'s tensors and returned; every replica
        gets the same bits."""
        if self.hub.fragment_replicas.get(self.fragment, 1) == 1:
            return value

        def reduce_flat(flat: torch.Tensor) -> torch.Tensor:
            with self.hub._bytes_lock:  # what this replica contributes, as a send counts what it sends
                self.hub.bytes[name] = self.hub.bytes.get(name, 0) + flat.numel() * flat.element_size()
            return self.hub._allreduce(self.fragment, self.replica, flat)

        return reduce_leaves(value, reduce_flat)

    def flush(self) -> None:
        """Nothing to wait for: in-process puts complete at once."""

