"""The registry of transports for asynchronous boundaries between processes: which one carries
the values of each (producer, consumer) pair of replicas.

Each entry is one module's server and stream (:class:`StreamKind`); the order of
:data:`STREAM_KINDS` is the preference: a pair is served by the first kind that serves pairs
like it (on one machine, or across machines) and that the consumer listens on. A consumer
starts the server of each kind its producers need (:func:`kinds_needed`); a producer opens a
stream of the kind :func:`pick` names for each consumer. Adding a transport is one module (a
server with ``address``, ``refusals``, ``rejected``, ``on_rejoin`` and ``stop()``; a stream with
``send_item``, ``send_latest``, ``flush``, ``close``) and one line here.

=========  =====================================  ==============================================
kind       serves                                 module
=========  =====================================  ==============================================
``unix``   replicas of one machine                :mod:`msrl.cluster.uds_transport` (Unix
                                                  sockets, written and read by the replicas'
                                                  own threads)
``grpc``   any pair (machines apart)              :mod:`msrl.cluster.grpc_transport`
=========  =====================================  ==============================================

Synchronous boundaries and all-reduces go over ``torch.distributed`` (Gloo, NCCL) and shared
memory (:mod:`msrl.runtime.shm`), chosen in :class:`~msrl.cluster.replica_actor.ReplicaActor`'s
``init_process_group``.
"""

from __future__ import annotations

import dataclasses
import socket
from typing import Any, Callable, Iterable, Mapping, Sequence

__all__ = ["StreamKind", "STREAM_KINDS", "kinds_for", "kinds_needed", "pick", "open_stream", "ProcessTransport"]


@dataclasses.dataclass(frozen=True)
class StreamKind:
    """One transport of asynchronous boundaries between processes.

    Attributes:
        name: its key in a consumer's server addresses (``"unix"``, ``"grpc"``) and in a
            producer's greeting (``StreamTransport.producer_name``).
        serves: ``serves(same_node)``: whether it carries a pair of replicas on one machine
            (``True``) or on two (``False``).
        available: whether this machine can use it.
        server: ``server(boundaries, fragment, replica, mailbox, token, max_message, tls, host,
            prefix)`` -> the consumer's server (its ``address``: what producers dial).
        stream: ``stream(transport, target)`` -> a producer's stream to the server at ``target``.
        scheme: the prefix of its addresses (``""``: any address no other kind claims).
    """

    name: str
    serves: Callable[[bool], bool]
    available: Callable[[], bool]
    server: Callable[..., Any]
    stream: Callable[[Any, str], Any]
    scheme: str = ""


def _uds_server(boundaries, fragment, replica, mailbox, token, max_message, tls, host, prefix):  # noqa: ANN001, ANN202
    from msrl.cluster.uds_transport import UdsServer

    return UdsServer(boundaries, fragment, replica, mailbox, token, max_message, prefix=prefix)


def _uds_stream(transport: Any, target: str) -> Any:
    from msrl.cluster.uds_transport import UdsStream

    return UdsStream(transport, target[len("unix:"):])


def _grpc_server(boundaries, fragment, replica, mailbox, token, max_message, tls, host, prefix):  # noqa: ANN001, ANN202
    from msrl.cluster.grpc_transport import BoundaryServer

    return BoundaryServer(boundaries, fragment, replica, mailbox, token, host=host, tls=tls, max_message=max_message)


def _grpc_stream(transport: Any, target: str) -> Any:
    from msrl.cluster.grpc_transport import _Stream

    return _Stream(transport, target)


#: the transports, most preferred first
STREAM_KINDS: tuple[StreamKind, ...] = (
    StreamKind("unix", lambda same_node: same_node, lambda: hasattr(socket, "AF_UNIX"), _uds_server, _uds_stream,
               scheme="unix:"),
    StreamKind("grpc", lambda same_node: True, lambda: True, _grpc_server, _grpc_stream),
)


def kinds_for(choice: str) -> list[StreamKind]:
    """The kinds a job may use under ``cluster.boundary_transport`` = ``choice`` (``auto``: every
    available one; else that kind alone).

    Raises:
        ValueError: ``choice`` names no kind.
    """
    if choice == "auto":
        return [k for k in STREAM_KINDS if k.available()]
    kinds = [k for k in STREAM_KINDS if k.name == choice]
    if not kinds:
        raise ValueError(f"cluster.boundary_transport must be auto or one of {', '.join(k.name for k in STREAM_KINDS)}, "
                         f"got {choice!r}")
    return kinds


def kinds_needed(kinds: Sequence[StreamKind], same_node: Iterable[bool]) -> list[StreamKind]:
    """The kinds a consumer serves for producers on its machine (``True``) or on others (``False``)."""
    out: list[StreamKind] = []
    for same in set(same_node):
        kind = next((k for k in kinds if k.serves(same)), None)
        if kind is not None and kind not in out:
            out.append(kind)
    return [k for k in kinds if k in out]


def pick(kinds: Sequence[StreamKind], addresses: dict[str, str], same_node: bool) -> str:
    """The address a producer dials at a consumer listening on ``addresses`` (kind -> address).

    Raises:
        KeyError: the consumer listens on no kind that serves the pair.
    """
    for k in kinds:
        if k.serves(same_node) and k.name in addresses:
            return addresses[k.name]
    raise KeyError(f"no transport serves this pair (same machine: {same_node}); the consumer listens on "
                   f"{sorted(addresses)}")


def open_stream(transport: Any, target: str) -> Any:
    """A producer's stream to ``target``, of the kind whose scheme it carries."""
    kind = next((k for k in STREAM_KINDS if k.scheme and target.startswith(k.scheme)), None)
    kind = kind or next(k for k in STREAM_KINDS if not k.scheme)
    return kind.stream(transport, target)


def ProcessTransport(boundaries: Sequence[Any], fragment: str, replica: int,  # noqa: N802
                     addresses: Mapping[tuple[str, int], str], token: str, **kwargs: Any) -> Any:
    """A producer replica's side of every asynchronous boundary between processes: a
    :class:`~msrl.cluster.frames.StreamTransport` whose stream to each consumer is of the kind its
    address names (:func:`open_stream`: a :class:`~msrl.cluster.uds_transport.UdsStream` to
    ``unix:/path``, same machine; a gRPC stream to ``host:port``). Arguments and errors are
    ``StreamTransport``'s (``tls`` applies to the gRPC streams)."""
    from msrl.cluster.frames import StreamTransport

    return StreamTransport(boundaries, fragment, replica, addresses, token, open_stream=open_stream, **kwargs)
