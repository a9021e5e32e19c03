"""Working with device memory without stopping the host: what components and native envs
use, written below the runtimes so that no library code imports ``msrl.runtime``.

- :func:`read_host`, :func:`start_read` (:class:`HostRead`): device tensors into host memory
  with one copy per device (on a GPU one host sync for all of an iteration's values);
- :func:`host_side`: marks work on values already in host memory (a host-sync recorder counts
  it apart);
- :func:`record_foreign`: work on tensors that torch does not see (a native kernel's host
  launch), which capture's CPU tape records and replays;
- :func:`native_bfloat16`: whether a device computes bfloat16 in hardware (a precision that is
  faster there and slower where it is emulated).

The runtime plugs into two of them (:func:`set_foreign_recorder`, :func:`register_packer`); a
library caller only calls them.
"""

from __future__ import annotations

import contextlib
import math
import platform
import threading
from typing import Any, Callable, Iterator

import numpy as np
import torch

__all__ = ["read_host", "start_read", "HostRead", "host_side", "in_host_side", "record_foreign",
           "set_foreign_recorder", "register_packer", "native_bfloat16"]

_local = threading.local()
#: packs a captured program's replayed outputs into one flat tensor (capture registers it)
_packer: Callable[[list[torch.Tensor]], torch.Tensor] | None = None


def register_packer(packer: Callable[[list[torch.Tensor]], torch.Tensor]) -> None:
    """Sets what :func:`start_read` with ``static=True`` packs with (``msrl.runtime.programs.capture``'s
    replayed concatenation)."""
    global _packer
    _packer = packer


def set_foreign_recorder(record: Callable[[tuple[Any, ...]], None] | None) -> None:
    """Sets (or with ``None`` clears) this thread's recorder of :func:`record_foreign` work.

    Raises:
        RuntimeError: a recorder is set on this thread already.
    """
    if record is not None and getattr(_local, "foreign", None) is not None:
        raise RuntimeError("a Tape is already recording on this thread")
    _local.foreign = record


def record_foreign(fn: Callable[..., Any], *args: Any) -> None:
    """Runs ``fn(*args)``, work on tensors that torch does not see (a native kernel's host
    launch), and records it with this thread's recorder, if any (capture's CPU tape while it records): a replay
    calls it again with the same arguments (keep them valid: tensors by address, numbers by
    value). On a GPU the kernels go to torch's stream, where a CUDA graph captures them
    without this."""
    fn(*args)
    record = getattr(_local, "foreign", None)
    if record is not None:
        record(("foreign", fn, args, None))


@contextlib.contextmanager
def host_side() -> Iterator[None]:
    """Marks a block that works on tensors already in host memory (after the iteration's one
    read, :func:`read_host`): a :class:`HostSyncRecorder` counts its ops
    apart (``host_ops``) and records no sync in it. On a CPU-only machine the recorder cannot
    tell host tensors from device ones; the block says so."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth


def in_host_side() -> bool:
    """Whether this thread is inside :func:`host_side`."""
    return getattr(_local, "depth", 0) > 0


def native_bfloat16(device: torch.device | str) -> bool:
    """Whether ``device`` computes bfloat16 convolutions and matrix products in hardware: a CUDA
    device of compute capability 8.0 or later (``torch.cuda.is_bf16_supported`` without
    emulation); an x86 CPU with AVX512_BF16 or AMX instructions (cpuinfo's flags, as torch reads
    them); another CPU where oneDNN has bfloat16 kernels (an ARM CPU with its BF16 extension).
    False elsewhere, where bfloat16 is emulated: oneDNN converts on every product, on an AMD
    EPYC (Zen 4) limited to AVX-512 without BF16 a 64x3 residual tower's search ran 2.3x slower
    than in float32, limited to AVX2 25.8x slower (bench/RESULTS.md#alphazero-bf16-emulated).

    Raises:
        RuntimeError: ``device`` is not a device string torch reads (torch's own check).
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False
        try:
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
        except TypeError:  # (torch before 2.3: no emulation counted)
            return bool(torch.cuda.is_bf16_supported())
    if device.type != "cpu":
        return False
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86"):
        flags = getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None)
        return any(bool(f()) for f in flags if f is not None)
    check = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


def read_host(tensors: list[torch.Tensor | list[torch.Tensor]], scalars: int = 0, static: bool = False) -> list[Any]:
    """The ``tensors`` in host memory, read with one copy per device: on a GPU one
    device-to-host copy (one host sync) for all of them, instead of one per tensor.

    The tensors of a device are flattened and concatenated as float64 on it (one ``cat``,
    promoting every dtype), copied to the host (``.to("cpu", copy=True)``: on a CPU an explicit
    copy, the read a :class:`~msrl.runtime.programs.host_syncs.HostSyncRecorder` counts), then split and
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
            (the packer capture registers, :func:`register_packer`; on a GPU one graph launch), same values.

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
                if _packer is None:
                    raise RuntimeError("start_read(static=True) reads a captured program's outputs; no capture is loaded")
                dev_flat = _packer(parts)
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
