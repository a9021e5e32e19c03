"""The replica mapping of every boundary pattern, written once (DESIGN.md §3): which dst replicas
a src replica's value goes to (whole or one shard), which src replicas a dst replica reads, and
how it combines what it read. Every endpoint -- in-process (:class:`msrl.channels.LocalEndpoint`),
between processes (:class:`msrl.runtime.dist.DistEndpoint`) and on asynchronous boundaries
(:class:`msrl.runtime.asynchronous.AsyncEndpoint`) -- moves values by this table; only how a
value travels differs.

==========  ===============================  ========================  ===========================
pattern     src replica ``i`` sends          dst replica ``j`` reads   and returns
==========  ===============================  ========================  ===========================
send/recv   its value to dst ``i``           src ``j``                 it
gather      its value to dst 0               every src, 0 first        their concatenation along
                                                                       the boundary's axis
scatter     (replica 0) shard ``r`` of its   src 0                     it
            value to dst ``r``, for every r
broadcast   (replica 0) its value to every   src 0                     it
            dst
==========  ===============================  ========================  ===========================
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from tensordict import TensorDictBase

from msrl.graph import NodeKind

__all__ = ["deliveries", "sources", "combine", "shards", "concat", "split"]


def concat(values: Sequence[Any], axis: int) -> Any:
    """Concatenates replicas' shards along ``axis`` (tensors, TensorDicts, nested containers).

    Raises:
        TypeError: a leaf that is neither a tensor nor a TensorDict.
    """
    first = values[0]
    if isinstance(first, (torch.Tensor, TensorDictBase)):
        return torch.cat(list(values), dim=axis)
    if isinstance(first, dict):
        return {k: concat([v[k] for v in values], axis) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(concat([v[i] for v in values], axis) for i in range(len(first)))
    raise TypeError(f"cannot concatenate {type(first).__name__} values along the env axis")


def split(value: Any, parts: int, axis: int) -> list[Any]:
    """Splits ``value`` into ``parts`` equal shards along ``axis``: views of ``value`` (the
    transport that delivers a shard makes the receiver's copy, :func:`deliver` or a codec).

    Raises:
        ValueError: the axis size is not divisible by ``parts``.
    """
    if isinstance(value, (torch.Tensor, TensorDictBase)):
        size = value.shape[axis] if isinstance(value, torch.Tensor) else value.batch_size[axis]
        if size % parts:
            raise ValueError(f"cannot scatter {size} envs over {parts} replicas")
        return list(torch.chunk(value, parts, dim=axis))
    if isinstance(value, dict):
        shards = {k: split(v, parts, axis) for k, v in value.items()}
        return [{k: s[i] for k, s in shards.items()} for i in range(parts)]
    if isinstance(value, (list, tuple)):
        shards_l = [split(v, parts, axis) for v in value]
        return [type(value)(s[i] for s in shards_l) for i in range(parts)]
    raise TypeError(f"cannot scatter a {type(value).__name__} along the env axis")


def _pattern(boundary: Any) -> NodeKind:
    p = boundary.pattern
    return NodeKind.SEND if p is NodeKind.RECV else p


def deliveries(boundary: Any, replica: int) -> list[tuple[int, int | None]]:
    """Src side: ``(dst replica, shard)`` for each value src replica ``replica`` sends on
    ``boundary`` (``shard``: the index into :func:`shards`, ``None``: the whole value).

    Raises:
        ValueError: a pattern with no replica mapping (an all-reduce is not a boundary).
    """
    p = _pattern(boundary)
    if p is NodeKind.SEND:
        return [(replica, None)]
    if p is NodeKind.GATHER:
        return [(0, None)]
    if p is NodeKind.SCATTER:
        return [(r, r) for r in range(boundary.dst_replicas)] if replica == 0 else []
    if p is NodeKind.BROADCAST:
        return [(r, None) for r in range(boundary.dst_replicas)] if replica == 0 else []
    raise ValueError(f"boundary {boundary.name}: pattern {p.value} has no replica mapping")


def sources(boundary: Any, replica: int) -> list[int]:
    """Dst side: the src replicas whose values dst replica ``replica`` reads, in the order
    :func:`combine` takes them."""
    p = _pattern(boundary)
    if p is NodeKind.GATHER:
        return list(range(boundary.src_replicas))
    if p is NodeKind.SEND:
        return [replica]
    return [0]


def shards(boundary: Any, value: Any) -> list[Any] | None:
    """The shards a scatter's src splits ``value`` into (views; one per dst replica), or
    ``None`` for the other patterns (the whole value travels)."""
    if _pattern(boundary) is not NodeKind.SCATTER:
        return None
    return split(value, boundary.dst_replicas, boundary.axis if boundary.axis is not None else 0)


def combine(boundary: Any, values: list[Any]) -> Any:
    """What dst replica gets from the values it read (in :func:`sources` order): a gather's
    concatenation along the boundary's axis, else the one value."""
    if _pattern(boundary) is NodeKind.GATHER:
        return concat(values, boundary.axis if boundary.axis is not None else 0)
    return values[0]
