"""The one registry of what carries values between replica processes, per traffic class, and
the config's choices derived from it (``cluster.sync_transport``, ``cluster.boundary_transport``,
``cluster.intra_node``). Imports nothing heavy: the config schema reads its choices from here
before torch is loaded; each kind's module is imported when the kind is used.

=======================  =======  ==========================  =====================================
traffic                  kind     serves                      module
=======================  =======  ==========================  =====================================
synchronous boundary     ``unix``  replicas of one machine,   :mod:`msrl.runtime.transports.unix_link`
(one link per peer                 host tensors               (one Unix stream socket per direction)
pair: :data:`LINK_KINDS`) ``gloo`` any pair                   :mod:`msrl.runtime.transports.links`
                                                              (Gloo; NCCL for CUDA payloads)
asynchronous boundary    ``unix``  replicas of one machine    :mod:`msrl.cluster.uds_transport`, `uds_stream`
(fifo, latest, fresh:    ``grpc``  any pair                   :mod:`msrl.cluster.grpc_transport`
:data:`STREAM_KINDS`)
all-reduce of a          ``shm``   replicas of one machine    :mod:`msrl.runtime.transports.shm`
fragment's host tensors  ``gloo``  any                        ``torch.distributed`` (Gloo)
(:data:`ALL_REDUCE_KINDS`)
=======================  =======  ==========================  =====================================

Within each class the order is the preference: a pair is carried by the first kind that serves
it. A choice in the config names ``auto`` (every kind, in order) or one kind; a kind that does
not serve every pair is paired with the first one that does (a synchronous link must always
exist), and for asynchronous boundaries, whose servers are started per kind, only kinds that
serve every pair may be chosen alone. Adding a transport is its module and one line here.
"""

from __future__ import annotations

import dataclasses
import importlib
import socket
from typing import Any, Callable, Iterable, Mapping, Sequence

__all__ = ["Pair", "LinkKind", "LINK_KINDS", "SYNC_TRANSPORTS", "link_kinds_for", "StreamKind", "STREAM_KINDS",
           "BOUNDARY_TRANSPORTS", "stream_kinds_for", "kinds_needed", "pick", "open_stream", "ALL_REDUCE_KINDS",
           "INTRA_NODE"]


def _load(module: str, name: str) -> Any:
    """``module.name``, imported on first use: the registry names each kind's module as data, so
    that reading the choices imports nothing and no module the registry names imports it back."""
    return getattr(importlib.import_module(module), name)


# -- synchronous boundaries: one link per peer pair ------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Pair:
    """What both ends of a peer pair know of it.

    Attributes:
        same_node: both replicas run on one machine (one Ray node: one kernel, one network namespace).
        host_only: neither replica's fragment is on a CUDA device (no payload goes GPU to GPU).
    """

    same_node: bool
    host_only: bool


@dataclasses.dataclass(frozen=True)
class LinkKind:
    """One kind of link under synchronous boundaries.

    Attributes:
        name: its name (a value of ``cluster.sync_transport``).
        serves: whether it can carry a :class:`Pair`.
        make: ``make(context, peer rank) -> Link`` (:class:`msrl.runtime.transports.links.Link`);
            ``context`` is what :func:`msrl.runtime.transports.links.links` was given (``rank``,
            ``server``: this process's :class:`~msrl.runtime.transports.unix_link.UnixLinkServer`).
    """

    name: str
    serves: Callable[[Pair], bool]
    make: Callable[[Mapping[str, Any], int], Any]


def _unix_link(context: Mapping[str, Any], rank: int) -> Any:
    return _load("msrl.runtime.transports.unix_link", "UnixLink")(context["server"], rank)


def _unix_link_serves(pair: Pair) -> bool:
    return pair.same_node and pair.host_only and _load("msrl.runtime.transports.unix_link", "available")()


def _gloo_link(context: Mapping[str, Any], rank: int) -> Any:
    return _load("msrl.runtime.transports.links", "GlooLink")(rank)


#: every link kind, in the order they are tried for a pair
LINK_KINDS: tuple[LinkKind, ...] = (
    LinkKind("unix", _unix_link_serves, _unix_link),
    LinkKind("gloo", lambda pair: True, _gloo_link),
)
#: the values of ``cluster.sync_transport``
SYNC_TRANSPORTS: tuple[str, ...] = ("auto", *(k.name for k in LINK_KINDS))


def _serves_every_pair(kind: LinkKind) -> bool:
    return all(kind.serves(Pair(same, host)) for same in (True, False) for host in (True, False))


def link_kinds_for(choice: str) -> tuple[LinkKind, ...]:
    """The link kinds ``cluster.sync_transport=choice`` allows: every one (``auto``), or that one
    followed by the first kind that serves every pair (so every pair has a link).

    Raises:
        ValueError: ``choice`` is not one of :data:`SYNC_TRANSPORTS`.
    """
    if choice == "auto":
        return LINK_KINDS
    chosen = [k for k in LINK_KINDS if k.name == choice]
    if not chosen:
        raise ValueError(f"cluster.sync_transport must be one of {', '.join(SYNC_TRANSPORTS)}, got {choice!r}")
    if _serves_every_pair(chosen[0]):
        return (chosen[0],)
    return (chosen[0], next(k for k in LINK_KINDS if _serves_every_pair(k)))


# -- asynchronous boundaries: one stream per producer, one server per consumer and kind -----------

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
            prefix)`` -> the consumer's server (its ``address``: what producers dial; a server has
            ``address``, ``refusals``, ``rejected``, ``on_rejoin`` and ``stop()``).
        stream: ``stream(transport, target)`` -> a producer's stream to the server at ``target``
            (``send_item``, ``send_latest``, ``flush``, ``close``).
        scheme: the prefix of its addresses (``""``: any address no other kind claims).
    """

    name: str
    serves: Callable[[bool], bool]
    available: Callable[[], bool]
    server: Callable[..., Any]
    stream: Callable[[Any, str], Any]
    scheme: str = ""


def _uds_server(boundaries, fragment, replica, mailbox, token, max_message, tls, host, prefix):  # noqa: ANN001, ANN202
    return _load("msrl.cluster.uds_transport", "UdsServer")(boundaries, fragment, replica, mailbox, token, max_message, prefix=prefix)


def _uds_stream(transport: Any, target: str) -> Any:
    return _load("msrl.cluster.uds_stream", "UdsStream")(transport, target[len("unix:"):])


def _grpc_server(boundaries, fragment, replica, mailbox, token, max_message, tls, host, prefix):  # noqa: ANN001, ANN202
    server = _load("msrl.cluster.grpc_transport", "BoundaryServer")
    return server(boundaries, fragment, replica, mailbox, token, host=host, tls=tls, max_message=max_message)


def _grpc_stream(transport: Any, target: str) -> Any:
    return _load("msrl.cluster.grpc_transport", "_Stream")(transport, target)


#: the transports of asynchronous boundaries, most preferred first
STREAM_KINDS: tuple[StreamKind, ...] = (
    StreamKind("unix", lambda same_node: same_node, lambda: hasattr(socket, "AF_UNIX"), _uds_server, _uds_stream,
               scheme="unix:"),
    StreamKind("grpc", lambda same_node: True, lambda: True, _grpc_server, _grpc_stream),
)
#: the values of ``cluster.boundary_transport``: ``auto`` or a kind that serves every pair
BOUNDARY_TRANSPORTS: tuple[str, ...] = ("auto", *(k.name for k in STREAM_KINDS if k.serves(True) and k.serves(False)))


def stream_kinds_for(choice: str) -> list[StreamKind]:
    """The kinds a job may use under ``cluster.boundary_transport=choice`` (``auto``: every
    available one; else that kind alone).

    Raises:
        ValueError: ``choice`` is not one of :data:`BOUNDARY_TRANSPORTS`.
    """
    if choice == "auto":
        return [k for k in STREAM_KINDS if k.available()]
    if choice not in BOUNDARY_TRANSPORTS:
        raise ValueError(f"cluster.boundary_transport must be one of {', '.join(BOUNDARY_TRANSPORTS)}, got {choice!r}")
    return [k for k in STREAM_KINDS if k.name == choice]


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


# -- all-reduce of a fragment's host tensors among its replicas on one machine ---------------------

#: the kinds, most preferred first: ``shm`` (shared memory, Linux: :mod:`msrl.runtime.transports.shm`;
#: Gloo where unavailable or across machines) and ``gloo`` (TCP through Gloo)
ALL_REDUCE_KINDS: tuple[str, ...] = ("shm", "gloo")
#: the values of ``cluster.intra_node``
INTRA_NODE: tuple[str, ...] = ALL_REDUCE_KINDS
