"""The replica mapping of every boundary pattern, written once (DESIGN.md §3): which dst replicas
a src replica's value goes to (whole or one shard), which src replicas a dst replica reads, and
how it combines what it read, as one table of :class:`Pattern` records (:data:`PATTERNS`).
Every endpoint -- in-process (:class:`msrl.runtime.channels.LocalEndpoint`), between processes
(:class:`msrl.runtime.transports.dist.DistEndpoint`) and on asynchronous boundaries
(:class:`msrl.runtime.asynchronous.AsyncEndpoint`) -- moves values by this table; only how a
value travels differs.

==========  ===============================  ========================  ===========================
pattern     src replica ``i`` sends          dst replica ``j`` reads   and returns
==========  ===============================  ========================  ===========================
send/recv   its value to dst ``i``           src ``j``                 it
gather      its value to dst ``i // g``      srcs ``j g .. j g + g-1`` their concatenation along
                                             in order                  the boundary's axis
reduce      its value to every dst           every src, 0 first        their sum leaf by leaf, in
                                                                       replica order (the mean:
                                                                       divided by the src count)
scatter     shard ``s`` of its value to dst  src ``j // g``            it
            ``i g + s``, for ``s < g``
broadcast   its value to dsts ``i g .. i g   src ``j // g``            it
            + g-1``
==========  ===============================  ========================  ===========================

``g`` is the group size: the src count over the dst count for a gather, the dst count over the
src count for a scatter or broadcast (the partitioner chooses them only where it divides). With
one dst (a gather) or one src (a scatter, a broadcast) ``g`` is every replica: the collectives
of one learner; otherwise each dst (or src) replica serves its own group, as Ape-X's replay
shards each take the transitions of their own actors.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
from tensordict import TensorDictBase

from msrl.graph import NodeKind

__all__ = ["Pattern", "PATTERNS", "pattern_of", "group_size", "deliveries", "sources", "combine", "shards", "concat", "split",
           "total"]


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


def total(values: Sequence[Any], mean: bool = False) -> Any:
    """The sum of replicas' partial values (``@returns("partial")``), leaf by leaf in the order
    given (replica 0 first: the same bits on every run and every transport), or their mean (the
    sum divided by ``len(values)``; integer tensors stay sums, a mean of counts being no
    integer; bool tensors combine by "or"). Tensors, TensorDicts and nested dicts/lists/tuples of them with the same structure;
    plain numbers sum as numbers. One value is returned as it is.

    Raises:
        ValueError: the values differ in structure (keys, lengths) or in a tensor's shape.
    """
    if len(values) == 1:
        return values[0]
    flat, spec = pytree.tree_flatten(values[0])
    acc = [x.clone() if isinstance(x, torch.Tensor) else x for x in flat]
    for r, v in enumerate(values[1:], start=1):
        leaves, other = pytree.tree_flatten(v)
        if other != spec:
            raise ValueError(f"replica {r}'s partial value has another structure than replica 0's: {other} vs {spec}")
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                if x.shape != acc[i].shape:
                    raise ValueError(f"replica {r}'s partial value has a tensor of shape {tuple(x.shape)} where replica "
                                     f"0's has {tuple(acc[i].shape)}")
                acc[i].add_(x.to(acc[i].device))
            else:
                acc[i] = acc[i] + x
    if mean:
        n = len(values)
        acc = [x.div_(n) if isinstance(x, torch.Tensor) and x.is_floating_point() else
               (x / n if not isinstance(x, torch.Tensor) else x) for x in acc]
    return pytree.tree_unflatten(acc, spec)


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


def _axis(boundary: Any) -> int:
    return boundary.axis if boundary.axis is not None else 0


@dataclasses.dataclass(frozen=True)
class Pattern:
    """One row of the table in the module docstring: how a boundary of this pattern maps its
    replicas (``boundary`` has ``src_replicas``, ``dst_replicas`` and ``axis``).

    Attributes:
        kind: the pattern (``send`` also stands for its ``recv`` side).
        deliveries: ``(boundary, src replica) -> [(dst replica, shard index or None)]``.
        sources: ``(boundary, dst replica) ->`` the src replicas it reads, in combine order.
        sharded: whether the src splits its value into one shard per dst replica.
        combine: ``(boundary, values read) ->`` what the dst replica gets.
    """

    kind: NodeKind
    deliveries: Callable[[Any, int], list[tuple[int, int | None]]]
    sources: Callable[[Any, int], list[int]]
    sharded: bool
    combine: Callable[[Any, list[Any]], Any]


def _one(boundary: Any, values: list[Any]) -> Any:
    return values[0]


def group_size(boundary: Any) -> int:
    """``g`` of the table above: replicas on the many side per replica on the few side (the
    src count over the dst count when more srcs, else the dst count over the src count).

    Raises:
        ValueError: neither count divides the other.
    """
    few, many = sorted((boundary.src_replicas, boundary.dst_replicas))
    if many % few:
        raise ValueError(f"boundary {getattr(boundary, 'name', '?')}: {boundary.src_replicas} src and "
                         f"{boundary.dst_replicas} dst replicas: neither count divides the other")
    return many // few


#: every pattern's replica mapping, by node kind
PATTERNS: dict[NodeKind, Pattern] = {p.kind: p for p in (
    Pattern(NodeKind.SEND, lambda b, r: [(r, None)], lambda b, r: [r], False, _one),
    Pattern(NodeKind.GATHER, lambda b, r: [(r // group_size(b), None)],
            lambda b, r: list(range(r * group_size(b), (r + 1) * group_size(b))), False,
            lambda b, values: concat(values, _axis(b))),
    Pattern(NodeKind.REDUCE, lambda b, r: [(d, None) for d in range(b.dst_replicas)],
            lambda b, r: list(range(b.src_replicas)), False, lambda b, values: total(values, b.reduce == "mean")),
    Pattern(NodeKind.SCATTER, lambda b, r: [(r * group_size(b) + s, s) for s in range(group_size(b))],
            lambda b, r: [r // group_size(b)], True, _one),
    Pattern(NodeKind.BROADCAST, lambda b, r: [(r * group_size(b) + s, None) for s in range(group_size(b))],
            lambda b, r: [r // group_size(b)], False, _one),
)}


def pattern_of(boundary: Any) -> Pattern:
    """The :class:`Pattern` of ``boundary`` (a ``recv`` side is its ``send``'s).

    Raises:
        ValueError: a pattern with no replica mapping (an all-reduce is not a boundary).
    """
    kind = NodeKind.SEND if boundary.pattern is NodeKind.RECV else boundary.pattern
    row = PATTERNS.get(kind)
    if row is None:
        raise ValueError(f"boundary {boundary.name}: pattern {kind.value} has no replica mapping")
    return row


def deliveries(boundary: Any, replica: int) -> list[tuple[int, int | None]]:
    """Src side: ``(dst replica, shard)`` for each value src replica ``replica`` sends on
    ``boundary`` (``shard``: the index into :func:`shards`, ``None``: the whole value).

    Raises:
        ValueError: a pattern with no replica mapping (an all-reduce is not a boundary).
    """
    return pattern_of(boundary).deliveries(boundary, replica)


def sources(boundary: Any, replica: int) -> list[int]:
    """Dst side: the src replicas whose values dst replica ``replica`` reads, in the order
    :func:`combine` takes them."""
    return pattern_of(boundary).sources(boundary, replica)


def shards(boundary: Any, value: Any) -> list[Any] | None:
    """The shards a scatter's src splits ``value`` into (views; one per dst replica of its
    group), or ``None`` for the other patterns (the whole value travels)."""
    if not pattern_of(boundary).sharded:
        return None
    return split(value, group_size(boundary), _axis(boundary))


def combine(boundary: Any, values: list[Any]) -> Any:
    """What dst replica gets from the values it read (in :func:`sources` order): a gather's
    concatenation along the boundary's axis, a reduce's sum (or mean), else the one value."""
    return pattern_of(boundary).combine(boundary, values)
