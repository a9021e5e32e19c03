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
(:mod:`msrl.runtime.codec`, which bounds what a decoder accepts).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch
import torch.utils._pytree as pytree
from tensordict import TensorDictBase

__all__ = ["tensor_leaves", "map_tensors", "payload_bytes", "describe_value", "move_tensor", "deliver", "copy_value", "read_host",
           "start_read", "HostRead", "reduce_leaves"]


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors of a boundary value in one fixed order (depth first, insertion order; a
    TensorDict's leaves as ``torch.utils._pytree`` lists them): the order the all-reduce, the
    byte counts and the probe share."""
    if isinstance(value, torch.Tensor):  # the common case, without a tree walk (~1 us, not ~5)
        return [value]
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


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


def read_host(tensors: list[torch.Tensor | list[torch.Tensor]], scalars: int = 0, static: bool = False) -> list[Any]:
    """The ``tensors`` in host memory, read with one copy per device: on a GPU one
    device-to-host copy (one host sync) for all of them, instead of one per tensor.

    The tensors of a device are flattened and concatenated as float64 on it (one ``cat``,
    promoting every dtype), copied to the host (``.to("cpu", copy=True)``: on a CPU an explicit
    copy, the read a :class:`~msrl.runtime.host_syncs.HostSyncRecorder` counts), then split and
    cast back to each tensor's shape and dtype. Exact for floating dtypes up to float64 and for
    integers and booleans below 2**53 in magnitude (returns, lengths, counts, flags).
    :func:`start_read` then :meth:`HostRead.result`.

    Args:
        tensors: any shapes, dtypes and devices; an item that is a list of tensors of one
            shape, dtype and device (each step's finished episodes) is read as their stack
            ``(len, *shape)``, without stacking them on the device.
        scalars: the first ``scalars`` items are tensors of one element each (metrics) and come
            back as Python floats (one ``tolist`` of their part, no per-tensor op).
        static: the tensors are a captured program's replayed outputs (the same tensors each
            iteration): the concatenation is itself captured and replayed
            (:func:`msrl.runtime.capture.packed`; on a GPU one graph launch), same values.

    Returns:
        one value per item, in order: a float for each of the first ``scalars``, then a CPU
        tensor of the item's shape (a list's: its stack's) and dtype.
    """
    return start_read(tensors, scalars, static).result()


class HostRead:
    """A read of device tensors into host memory, started by :func:`start_read`: on a GPU,
    after a replayed iteration, the copy runs while the host goes on (into page-locked memory,
    behind the iteration on its stream); :meth:`result` waits for it and unpacks."""

    def __init__(self, layout: list[tuple[tuple[int, ...], torch.dtype]], scalars: int,
                 flats: list[tuple[list[int], torch.Tensor, Any]]) -> None:
        #: each item's host shape (a list's: its stack's) and dtype
        self._layout, self._scalars, self._flats = layout, scalars, flats
        self._out: list[Any] | None = None

    def result(self) -> list[Any]:
        """The values (see :func:`read_host`), once the copies are done (waits for them; a
        second call returns the same list)."""
        from msrl.runtime.host_syncs import host_side

        if self._out is not None:
            return self._out
        layout, scalars = self._layout, self._scalars
        out: list[Any] = [None] * len(layout)
        for idx, flat, done in self._flats:
            if done is not None:
                done.synchronize()
            # the host copy unpacked with NumPy (~1 us an op; torch's slicing and casts ~5-10 us
            # each: half the host's work of a replayed GPU iteration); every value is exact in
            # float64, so each cast back is exact (bfloat16, which NumPy lacks, is cast by torch)
            with host_side():
                arr = flat.numpy()
            head = [i for i in idx if i < scalars]
            if head:
                for i, v in zip(head, arr[:len(head)].tolist()):
                    out[i] = v
            at = len(head)
            for i in idx[len(head):]:
                shape, dtype = layout[i]
                size = math.prod(shape)
                part = arr[at:at + size].reshape(shape)
                at += size
                np_dtype = _NUMPY_DTYPES.get(dtype)
                if np_dtype is None:
                    out[i] = torch.from_numpy(part).to(dtype)
                else:
                    out[i] = torch.from_numpy(part if np_dtype == np.float64 else part.astype(np_dtype))
        self._flats, self._out = [], out
        return out


#: torch dtypes NumPy holds exactly (the others are cast back by torch)
_NUMPY_DTYPES = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
                 torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
                 torch.uint8: np.uint8, torch.bool: np.bool_}


def start_read(tensors: list[torch.Tensor | list[torch.Tensor]], scalars: int = 0, static: bool = False) -> HostRead:
    """Starts :func:`read_host`'s read (same arguments); :meth:`HostRead.result` finishes it.

    With ``static`` on a GPU the packed values are copied into page-locked host memory without
    waiting (``non_blocking``, a CUDA event recorded behind the copy): the caller can launch the
    next iteration before it unpacks this one, and the GPU does not wait for the host between
    the two. Otherwise the copy is made here, as :func:`read_host` always did.
    """
    items = [t if isinstance(t, list) else [t] for t in tensors]
    by_device: dict[torch.device, list[int]] = {}
    for i, group in enumerate(items):
        by_device.setdefault(group[0].device, []).append(i)
    flats = []
    for idx in by_device.values():
        parts = [t for i in idx for t in items[i]]
        done = None
        with torch.no_grad():
            if static:
                from msrl.runtime.capture import packed

                dev_flat = packed(parts)
                if dev_flat.device.type == "cuda":
                    flat = torch.empty(dev_flat.shape, dtype=dev_flat.dtype, pin_memory=True)
                    flat.copy_(dev_flat, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record()
                else:
                    flat = dev_flat.to("cpu", copy=True)
            else:  # a leading empty float64 piece makes the one cat promote every dtype to float64
                pieces = [torch.empty(0, dtype=torch.float64, device=parts[0].device)]
                flat = torch.cat(pieces + [t.reshape(-1) for t in parts]).to("cpu", copy=True)
        flats.append((idx, flat, done))
    layout = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else ((len(t), *t[0].shape), t[0].dtype)
              for t in tensors]
    return HostRead(layout, scalars, flats)
