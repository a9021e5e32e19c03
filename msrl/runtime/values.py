"""The boundary value: what crosses a boundary, and the one walk over it every part of msrl uses.

A boundary value is a tensor, a :class:`~tensordict.TensorDict`, or (nested) dicts/lists/tuples
of them, with other leaves (numbers, strings, ``None``) carried as they are. It is one
``torch.utils._pytree`` tree (tensordict registers ``TensorDict`` as a pytree node), so every
question about a value -- its tensors in a fixed order, their bytes, a copy on another device,
an all-reduce's flatten and copy-back, the probe's description -- is answered by one walk
(:func:`tensor_leaves`, :func:`map_tensors`) instead of one hand-written walker per use.
Concatenating and splitting replicas' shards along a boundary's axis is
:func:`msrl.runtime.patterns.concat`/:func:`~msrl.runtime.patterns.split` (a TensorDict is
concatenated as one, along its batch dimensions); encoding for a network is the codec's
(:mod:`msrl.runtime.transports.codec`, which bounds what a decoder accepts).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from tensordict import TensorDictBase

__all__ = ["tensor_leaves", "map_tensors", "payload_bytes", "describe_value", "move_tensor", "deliver", "copy_value",
           "reduce_leaves", "same_bits"]


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors of a boundary value in one fixed order (depth first, insertion order; a
    TensorDict's leaves as ``torch.utils._pytree`` lists them): the order the all-reduce, the
    byte counts and the probe share."""
    if isinstance(value, torch.Tensor):  # the common case, without a tree walk (~1 us, not ~5)
        return [value]
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def same_bits(a: Any, b: Any) -> bool:
    """Whether two nested states (dicts, lists, tuples of tensors and plain values: a component's
    ``state_dict``, an optimiser's) have the same structure and every tensor the same dtype, shape
    and bits (``torch.equal``) and every other leaf the same value: how replicas of one learner are
    checked bit-identical."""
    leaves_a, spec_a = pytree.tree_flatten(a)
    leaves_b, spec_b = pytree.tree_flatten(b)
    if spec_a != spec_b:
        return False
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                    and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device | None = None) -> Any:
    """``value`` with every tensor replaced by ``fn(tensor)``, the containers rebuilt (a
    TensorDict keeps its batch size; its ``device`` becomes ``device`` when one is given, else
    stays); other leaves are kept as they are."""

    # the tree's structure walked directly: pytree.tree_map's flatten and unflatten cost ~8-15 us
    # a value, on every delivery of every boundary (central inference's per-step values: ~15% of
    # its env steps/s, bench/bench_seam_ab.py)
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, TensorDictBase):
        return value.apply(fn, device=device) if device is not None else value.apply(fn)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(map_tensors(v, fn, device) for v in value)
    if isinstance(value, tuple):  # a namedtuple
        return type(value)(*(map_tensors(v, fn, device) for v in value))
    return value


def payload_bytes(value: Any) -> int:
    """The bytes of the tensors a value holds (TensorDicts included): what crossing a boundary
    moves, headers aside."""
    if isinstance(value, torch.Tensor):  # the common case, without building a list
        return value.numel() * value.element_size()
    return sum(t.numel() * t.element_size() for t in tensor_leaves(value))


def describe_value(value: Any) -> dict[str, Any]:
    """``type``, ``shape`` (a tuple; for a container, its members' shapes in its structure),
    ``dtype`` (a tensor's, else ``None``) and ``nbytes`` (:func:`payload_bytes`) of a value, as
    ``msrl graph`` and the probe report it."""

    def shape(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return tuple(x.shape)
        if isinstance(x, TensorDictBase):
            return tuple(x.batch_size)
        if isinstance(x, dict):
            return {k: shape(v) for k, v in x.items()}
        if isinstance(x, (tuple, list)):
            return tuple(shape(v) for v in x)
        return None

    kind = "Tensor" if isinstance(value, torch.Tensor) else "TensorDict" if isinstance(value, TensorDictBase) \
        else type(value).__name__
    dtype = str(value.dtype).replace("torch.", "") if isinstance(value, torch.Tensor) else None
    return {"type": kind, "shape": shape(value), "dtype": dtype, "nbytes": payload_bytes(value)}


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
    ``device`` is cloned, one on another device moved: :func:`move_tensor`). A TensorDict's
    ``device`` becomes ``device``; other leaves are returned as they are.
    """
    to = device if device is None or isinstance(device, torch.device) else torch.device(device)
    if isinstance(value, torch.Tensor):  # the common case: one tensor, no closure, no walk
        return move_tensor(value, to)
    if isinstance(value, TensorDictBase) and (to is None or value.device == to):
        return value.clone()  # already there: TensorDict's own copy (half the time of an apply)
    return map_tensors(value, lambda t: move_tensor(t, to), to)


def copy_value(value: Any) -> Any:
    """A deep copy of a boundary value, each tensor on its own device (:func:`deliver` with no
    device)."""
    return deliver(value, None)


def reduce_leaves(value: Any, reduce_flat: Callable[[torch.Tensor], torch.Tensor]) -> Any:
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
