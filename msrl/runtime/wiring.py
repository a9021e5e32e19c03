"""How one replica process's endpoint is wired, from the fragment graph and its peers'
addresses (DESIGN.md §6; issue "At the scale msrl promises", item 1): the one place that decides,
per peer pair, what carries a value, used by the Ray replica (:class:`msrl.cluster.ray_runtime.
ReplicaActor`, a thin shell over it) for a first start and for a replacement alike.

Per peer pair:

==========================  ==================================  =================================
what                        on one machine                      between machines
==========================  ==================================  =================================
synchronous boundary        the first kind of                   Gloo point to point on the node's
                            :data:`~msrl.runtime.transports.   interface (NCCL for CUDA payloads)
                            registry.LINK_KINDS` that serves
                            the pair:
                            a Unix socket (host tensors)
all-reduce of a fragment    shared memory (:mod:`.shm`,         hierarchically: shared memory
(host tensors)              ``cluster.intra_node=shm``)         within each node, Gloo among one
                                                                leader per node
asynchronous boundary       the first kind of                   gRPC (a kind that serves pairs on
                            :data:`~msrl.runtime.transports.   other machines)
                            registry.STREAM_KINDS` that
                            serves the pair:
                            a Unix socket
==========================  ==================================  =================================

(A job's replicas in one process -- :class:`msrl.runtime.local.LocalRuntime` -- share a
:class:`msrl.runtime.channels.LocalHub` instead; each replica of either runtime is run by a
:class:`msrl.runtime.host.ReplicaHost`.)

``peers`` maps every replica ``(fragment, replica)`` to what it reported of itself
(:meth:`~msrl.cluster.replica_actor.ReplicaActor.info`): at least ``node_id`` (which machine),
``node`` (its IPv4 address) and ``pid``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
from datetime import timedelta
from typing import Any, Mapping, Sequence

import torch

from msrl.runtime.transports.codec import MAX_MESSAGE as CODEC_MAX_MESSAGE

__all__ = ["Groups", "interface_of", "node_leaders", "join", "endpoint", "stream_endpoint"]

Key = tuple[str, int]


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface holding IPv4 ``address`` (``None``: none
    does): where a replica's Gloo pairs listen on a cluster of several nodes."""
    import psutil  # a dependency of Ray's

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


def node_leaders(fragment: str, ranks: Mapping[Key, int], peers: Mapping[Key, Mapping[str, Any]] | None) -> list[Key]:
    """The first replica of ``fragment`` on each node (by ``peers[k]["node_id"]``), in replica
    order: the leaders of a hierarchical all-reduce (one node: a single leader; ``peers`` unknown:
    none)."""
    if peers is None:
        return []
    out, seen = [], set()
    for k in sorted(k for k in ranks if k[0] == fragment):
        if peers[k]["node_id"] not in seen:
            seen.add(peers[k]["node_id"])
            out.append(k)
    return out


@dataclasses.dataclass
class Groups:
    """What a replica's process-group join made for its endpoint.

    Attributes:
        fragment_group: the Gloo (or NCCL) group of its fragment's replicas (``None``: it has one).
        local_group: the :class:`~msrl.runtime.transports.shm.ShmGroup` of its fragment's replicas on this
            machine (``None``: the all-reduce goes over ``fragment_group``).
        hierarchical: its fragment all-reduces within each node, then among node leaders.
        leaders_group: the group of one replica per node (this replica is its node's leader), else ``None``.
        links: peer rank -> the link of the synchronous boundaries to it (:mod:`msrl.runtime.transports.links`).
        link_server: this process's :class:`~msrl.runtime.transports.unix_link.UnixLinkServer` (``None``: no Unix link).
    """

    fragment_group: Any = None
    local_group: Any = None
    hierarchical: bool = False
    leaders_group: Any = None
    links: dict = dataclasses.field(default_factory=dict)
    link_server: Any = None


def join(spec: Any, key: Key, ranks: Mapping[Key, int], peers: Mapping[Key, Mapping[str, Any]] | None, store: Any,
         timeout_s: float, intra_node: str = "shm", token: str = "", sync_transport: str = "auto") -> Groups:
    """Joins the job's process group (rank ``ranks[key]`` of ``len(ranks)``, the rendezvous
    through ``store``) and makes every fragment's group, in one order on every rank.

    Gloo for host tensors, NCCL as well when a fragment holds CUDA tensors. On one machine
    Gloo's pairs listen on loopback only (``GLOO_SOCKET_IFNAME=lo`` unless the environment names
    an interface), on several on the interface holding this node's address (:func:`interface_of`).
    With ``intra_node="shm"`` a CPU fragment's replicas on one machine all-reduce through a
    :class:`~msrl.runtime.transports.shm.ShmGroup` named after the job's secret ``token``, hierarchically
    when they span several machines. The synchronous boundaries' link to each peer is the first
    kind of :data:`msrl.runtime.transports.links.LINK_KINDS` that ``sync_transport`` allows and that serves
    the pair (a Unix socket on one machine, Gloo otherwise); the Unix links' server is made before
    the rendezvous, so that every peer's listens once the rendezvous returns.

    Raises:
        ValueError: no ``token``, or ``sync_transport`` unknown.
        RuntimeError: the rendezvous or a group's creation failed (``torch.distributed``'s).
    """
    import torch.distributed as dist

    from msrl.runtime.transports import shm

    if not token:
        raise ValueError("a replica's process group needs the job's secret token")
    devices = {f.name: torch.device(f.device) for f in spec.policy.fragments}
    backend = "cpu:gloo,cuda:nccl" if any(d.type == "cuda" for d in devices.values()) else "gloo"
    fragment = key[0]
    own_device = devices[fragment]
    if own_device.type == "cuda":
        torch.cuda.set_device(own_device)  # this process's GPU (Ray's CUDA_VISIBLE_DEVICES)
    if peers is not None and len({p["node_id"] for p in peers.values()}) == 1:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: nothing listens beyond loopback
    elif peers is not None:
        # several machines: Gloo's pairs listen on (and advertise) this node's own address, not
        # whatever the host name resolves to (often 127.0.0.1, unreachable from another node)
        ifname = interface_of(peers[key]["node"])
        if ifname is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
    from msrl.runtime.transports import links as link_kinds
    from msrl.runtime.transports.kinds import link_kinds_for

    kinds = link_kinds_for(sync_transport)
    uid = hashlib.sha256(token.encode()).hexdigest()[:32]  # the job's secret names its sockets
    node = hashlib.sha256(peers[key]["node_id"].encode()).hexdigest()[:8] if peers is not None else "0"  # nodes sharing a kernel
    context: dict[str, Any] = {"rank": ranks[key]}
    planned = link_kinds.plan(key, ranks, peers, devices, kinds)
    unix = {r: peers[k]["pid"] for k, r in ranks.items() if r in planned and planned[r].name == "unix"}
    if unix:
        from msrl.runtime.transports.unix_link import UnixLinkServer

        context["server"] = UnixLinkServer(f"{uid}:{node}", ranks[key], unix, timeout_s)
    links = link_kinds.links(planned, context)
    dist.init_process_group(backend, store=store, rank=ranks[key], world_size=len(ranks),
                            timeout=timedelta(seconds=timeout_s))
    shm_ok = intra_node == "shm" and shm.available() and peers is not None
    groups, leaders = {}, {}
    for fr in sorted({f for f, _ in ranks}):  # every rank makes every group, in one order
        groups[fr] = dist.new_group(sorted(r for (f, _), r in ranks.items() if f == fr))
        if shm_ok and devices[fr].type == "cpu" and len(node_leaders(fr, ranks, peers)) > 1:
            leaders[fr] = dist.new_group(sorted(ranks[k] for k in node_leaders(fr, ranks, peers)))
    replicas = [k for k in ranks if k[0] == fragment]
    out = Groups(fragment_group=groups[fragment] if len(replicas) > 1 else None, hierarchical=fragment in leaders,
                 links=links, link_server=context.get("server"))
    if out.hierarchical and key in node_leaders(fragment, ranks, peers):
        out.leaders_group = leaders[fragment]
    # the fragment's replicas on this machine (all of them, or when hierarchical, this node's)
    mates = sorted(k for k in replicas if peers is None or peers[k]["node_id"] == peers[key]["node_id"])
    if out.fragment_group is not None and shm_ok and own_device.type == "cpu" and (
            out.hierarchical or len(mates) == len(replicas)):
        if len(mates) > 1:
            out.local_group = shm.ShmGroup(f"{uid}:{fragment}:{node}", mates.index(key), len(mates),
                                           pids=[peers[k]["pid"] for k in mates], timeout_s=timeout_s,
                                           barrier=lambda: dist.barrier(group=out.fragment_group))
        else:
            dist.barrier(group=out.fragment_group)  # the one the other nodes' groups make
    return out


def endpoint(spec: Any, fragment_graph: Any, key: Key, ranks: Mapping[Key, int], groups: Groups | None,
             asynchronous: Any = None, max_message: int | None = None, frame_padding: str | None = None) -> Any:
    """The replica's :class:`~msrl.runtime.transports.dist.DistEndpoint`: its synchronous boundaries over the
    process group :func:`join` made (``groups``; ``None`` with empty ``ranks``: a replacement,
    every boundary of it asynchronous), its asynchronous ones over ``asynchronous``
    (:func:`stream_endpoint`). With ``frame_padding`` (the job's:
    :func:`msrl.runtime.programs.backends.env_frame_padding`) both send its frame-stacked rollouts in compact form."""
    from msrl.runtime.transports.dist import DistEndpoint

    devices = {f.name: torch.device(f.device) for f in spec.policy.fragments}
    groups = groups or Groups()
    if asynchronous is not None:
        asynchronous.frame_padding = frame_padding
    out = DistEndpoint(fragment_graph.boundaries, key[0], key[1], ranks, groups.fragment_group, devices[key[0]],
                       devices, local_group=groups.local_group, asynchronous=asynchronous,
                       max_message=max_message or CODEC_MAX_MESSAGE, hierarchical=groups.hierarchical,
                       leaders_group=groups.leaders_group, links=groups.links, link_server=groups.link_server)
    out.frame_padding = frame_padding
    return out


def stream_endpoint(fragment_graph: Any, key: Key, mailbox: Any, servers: Mapping[str, Any],
                    boundary_servers: Mapping[Key, Mapping[str, str]] | None,
                    peers: Mapping[Key, Mapping[str, Any]] | None, token: str, tls: Any, max_message: int | None,
                    timeout_s: float, elastic: Sequence[str] = (), reply: Mapping[str, str] | None = None,
                    choice: str = "auto") -> Any:
    """The replica's :class:`~msrl.runtime.asynchronous.AsyncEndpoint` over a
    :class:`~msrl.cluster.streams.ProcessTransport` to its consumers' servers (``None``
    without any), each pair over the kind :func:`msrl.runtime.transports.kinds.pick` names (on this
    machine a Unix socket, on another gRPC; ``choice``: ``cluster.boundary_transport``).

    Args:
        mailbox: this replica's :class:`~msrl.runtime.asynchronous.Mailbox` (what it consumes).
        servers: this replica's own boundary servers by kind.
        boundary_servers: every consumer's server addresses by kind.
        elastic: fragments whose replicas may be replaced: a broken stream to one is not
            reconnected; a replacement's greeting reopens it, through ``servers``' ``on_rejoin``.
        reply: this replica's own server addresses, named in its greetings when it is a replacement.
    """
    if not boundary_servers:
        return None
    from msrl.cluster.grpc_transport import MAX_MESSAGE
    from msrl.cluster.streams import ProcessTransport
    from msrl.runtime.asynchronous import AsyncEndpoint
    from msrl.runtime.transports.kinds import pick, stream_kinds_for

    here = peers[key]["node_id"] if peers is not None else None
    kinds = stream_kinds_for(choice)
    consumers = {b.dst for b in fragment_graph.boundaries if b.asynchronous and b.src == key[0]}
    addresses = {k: pick(kinds, dict(a), peers is not None and peers[k]["node_id"] == here)
                 for k, a in boundary_servers.items() if k[0] in consumers}  # (others may not serve this pair)
    transport = ProcessTransport(fragment_graph.boundaries, key[0], key[1], addresses, token, tls=tls,
                                 timeout_s=timeout_s, max_message=max_message or MAX_MESSAGE,
                                 hold=True)  # the endpoint flushes before it waits and every iteration
    transport.elastic = {k for k in addresses if k[0] in elastic}
    transport.reply = dict(reply or {})
    if transport.elastic:  # a replacement's greeting reopens this replica's streams to it
        for server in servers.values():
            server.on_rejoin = transport.rejoin
    return AsyncEndpoint(fragment_graph.boundaries, key[0], key[1], mailbox, transport)
