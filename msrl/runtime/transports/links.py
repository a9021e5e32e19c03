"""The point-to-point links under a job's synchronous boundaries, one per peer pair, of the kinds
of :data:`msrl.runtime.transports.kinds.LINK_KINDS` (the one registry of transports).

A :class:`~msrl.runtime.transports.dist.DistEndpoint` moves every synchronous value as fixed-size ``uint8``
buffers tagged with the boundary's index (its ``GROW`` protocol keeps both ends agreeing on the
sizes); a link is what moves one buffer to one peer rank:

==========  ===============================================  ====================================
kind        serves a pair                                    module
==========  ===============================================  ====================================
``unix``    both replicas on one machine, host tensors       :mod:`msrl.runtime.transports.unix_link`: one
            (``cluster.sync_transport=auto``)                Unix stream socket per direction, no
                                                             TCP stack, no Gloo threads
``gloo``    any (the process group's ``isend``/``irecv``:    this module (:class:`GlooLink`)
            Gloo on the host, NCCL for CUDA payloads)
==========  ===============================================  ====================================

The first kind of :data:`~msrl.runtime.transports.kinds.LINK_KINDS` that serves a pair carries
it, at both ends (they see the same facts: both replicas' node and devices). Adding a kind is its
module and one line in the registry.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

import torch

from msrl.runtime.transports.kinds import LinkKind, Pair

__all__ = ["Link", "GlooLink", "plan", "links"]

Key = tuple[str, int]


class Work(Protocol):
    """A posted send or receive (``torch.distributed``'s ``Work`` shape)."""

    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


class Link(Protocol):
    """Moves ``uint8`` buffers to and from one peer rank, tagged (a boundary's index): buffers of
    one tag between two ranks arrive in the order they were sent, each into a receive posted
    with that tag and the same byte size."""

    name: str

    def isend(self, buffer: torch.Tensor, tag: int) -> Work:
        """Posts ``buffer`` (``uint8``, kept alive by the caller until the work completes) to the
        peer under ``tag``; returns the work to wait on."""
        ...

    def irecv(self, buffer: torch.Tensor, tag: int) -> Work:
        """Posts a receive into ``buffer`` (``uint8``, the sender's byte size) under ``tag``;
        returns the work to wait on."""
        ...


class GlooLink:
    """The process group's point to point to ``rank``: Gloo for host buffers, NCCL for CUDA ones
    (a ``"cpu:gloo,cuda:nccl"`` group).

    Args:
        rank: the peer's rank in the default process group.
    """

    name = "gloo"

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def isend(self, buffer: torch.Tensor, tag: int) -> Work:
        """Posts ``buffer`` (kept alive by the caller until the work completes)."""
        import torch.distributed as dist

        return dist.isend(buffer, self.rank, tag=tag)

    def irecv(self, buffer: torch.Tensor, tag: int) -> Work:
        """Posts a receive into ``buffer`` (``numel`` bytes, the sender's buffer size)."""
        import torch.distributed as dist

        return dist.irecv(buffer, self.rank, tag=tag)


def plan(key: Key, ranks: Mapping[Key, int], peers: Mapping[Key, Mapping[str, Any]] | None,
         devices: Mapping[str, torch.device], kinds: tuple[LinkKind, ...]) -> dict[int, LinkKind]:
    """The kind of replica ``key``'s link to every other rank: the first of ``kinds`` that serves
    the pair (``peers``: every replica's ``node_id``; unknown: no pair is on one node). Both
    ends of a pair get the same answer."""
    out: dict[int, LinkKind] = {}
    for other, rank in ranks.items():
        if other == key:
            continue
        pair = Pair(same_node=peers is not None and peers[other]["node_id"] == peers[key]["node_id"],
                    host_only=devices[key[0]].type != "cuda" and devices[other[0]].type != "cuda")
        out[rank] = next(k for k in kinds if k.serves(pair))
    return out


def links(planned: Mapping[int, LinkKind], context: Mapping[str, Any]) -> dict[int, Link]:
    """The links :func:`plan` chose, made (``context``: what their kinds' ``make`` needs)."""
    return {rank: kind.make(context, rank) for rank, kind in planned.items()}
