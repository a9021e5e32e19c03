"""Host synchronisations inside an iteration, found on any device.

On a GPU every op that needs a value of the device on the host -- a tensor read as a Python
number (``.item()``, ``bool()``, ``float()``), an output whose shape depends on the data
(``nonzero``, boolean masking, ``unique``, ``masked_select``), a comparison answered on the host
(``equal``, ``is_nonzero``), a copy to the CPU -- stops the host until the device's queue has
drained: the launches of the iteration no longer overlap the GPU's work, and a CUDA graph cannot
hold it. :class:`HostSyncRecorder` is a ``TorchDispatchMode`` that sees every aten op the code
inside it dispatches, on whichever device it runs: on a CPU-only machine it finds the ops that
would sync a GPU (CI has no GPU), and it counts the ops of an iteration (what a GPU would launch).

Usage::

    with HostSyncRecorder() as rec:
        job.runtime.run("train_step")
    assert rec.syncs == [], rec.report()
    rec.ops_total / env_steps   # aten ops per env step

Dispatch modes are per thread: the recorder sees the thread that entered it (wrap a replica's
program, see :func:`recording_program`, to see a replica that runs in another thread).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections import Counter
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from msrl.device import in_host_side
from msrl.runtime.startup import lean_dispatch_mode

__all__ = ["HostSync", "HostSyncRecorder", "NO_KERNEL_OPS", "SYNC_OPS", "recording_program", "sync_reason"]

_local = threading.local()


_aten = torch.ops.aten

#: aten ops that synchronise the host with the device whatever their arguments -> why
SYNC_OPS: dict[Any, str] = {
    _aten._local_scalar_dense.default: "a tensor read as a Python number (.item(), bool(), int(), float())",
    _aten.is_nonzero.default: "a tensor's truth value read on the host (bool(), if tensor)",
    _aten.equal.default: "torch.equal answered on the host",
    _aten.nonzero.default: "nonzero: an output whose shape depends on the data",
    _aten.argwhere.default: "argwhere: an output whose shape depends on the data",
    _aten.masked_select.default: "masked_select: an output whose shape depends on the data",
    _aten._unique2.default: "unique: an output whose shape depends on the data",
    _aten.unique_dim.default: "unique: an output whose shape depends on the data",
    _aten.unique_consecutive.default: "unique_consecutive: an output whose shape depends on the data",
    _aten.allclose.default: "allclose answered on the host",
}

#: aten ops that launch no device kernel: views and metadata changes, allocations
NO_KERNEL_OPS = frozenset({
    "t", "view", "_unsafe_view", "_reshape_alias", "reshape", "detach", "alias", "expand", "as_strided", "unsqueeze",
    "squeeze", "permute", "transpose", "select", "slice", "split", "split_with_sizes", "unbind", "chunk", "narrow",
    "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_to_copy_view",
    "view_as_real", "view_as_complex", "unflatten", "flatten", "movedim", "diagonal", "set_", "resize_",
})

#: frames of msrl's own code allowed to read the host: the loss-finiteness check of
#: :meth:`msrl.api.Learner.apply_gradients`, which runs only for losses on the CPU, and the
#: generator watches (:meth:`msrl.runtime.generators.Baton.watch`, the capture probe's
#: ``_host_rngs``), which compare the CPU generator's state, a host tensor on every machine
CPU_ONLY_READS: tuple[tuple[str, str], ...] = (("msrl/api/roles.py", "apply_gradients"),
                                               ("msrl/runtime/generators.py", "watch"),
                                               ("msrl/runtime/programs/capture.py", "_host_rngs"))


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def sync_reason(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """Why the aten op ``func`` on ``args``/``kwargs`` synchronises the host with the device
    (``None``: it does not). Besides :data:`SYNC_OPS`: indexing with a boolean mask
    (``x[mask]``, ``x[mask] = v``), ``repeat_interleave`` without ``output_size``, and a copy
    from a CUDA tensor into host memory."""
    why = SYNC_OPS.get(func)
    if why is not None:
        return why
    packet = getattr(func, "overloadpacket", None)
    if packet in (_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(_is_mask(i) for i in indices or ()):
            return "boolean-mask indexing: an output whose shape depends on the data (x[mask])"
    if packet is _aten.repeat_interleave and func is _aten.repeat_interleave.Tensor:
        if kwargs.get("output_size") is None and (len(args) < 2 or args[-1] is None):
            return "repeat_interleave without output_size: an output whose shape depends on the data"
    if packet is _aten._to_copy and kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu":
        # on a GPU a copy to the host; on a CPU an explicit copy into host memory (``.to("cpu",
        # copy=True)``, as :func:`~msrl.device.read_host` makes): the same read
        return "a copy into host memory (a device-to-host read)"
    if packet is _aten.copy_ and isinstance(args[1], torch.Tensor) and args[1].device.type == "cuda" \
            and args[0].device.type == "cpu":
        return "a copy from the GPU into host memory"
    return None


@dataclasses.dataclass(frozen=True)
class HostSync:
    """One op that synchronised the host: ``op`` (aten name), ``why``, and ``where``: the
    innermost frame of code outside torch (``file:line in function``)."""

    op: str
    why: str
    where: str
    #: ``(path, function)`` of every frame of its stack, innermost first
    frames: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        return f"{self.op} at {self.where}: {self.why}"


@lean_dispatch_mode  # dispatches without importing TorchDynamo (msrl/runtime/startup.py)
class HostSyncRecorder(TorchDispatchMode):
    """Records every aten op dispatched inside it (on this thread) and every one that
    synchronises the host (see :func:`sync_reason`), with where it was called.

    Args:
        allow: ``(path suffix, function name)`` frames whose host reads are allowed (default:
            :data:`CPU_ONLY_READS`); a sync is allowed when any frame of its stack matches.

    Attributes:
        ops: aten op name -> calls (outside :func:`msrl.device.host_side` blocks).
        host_ops: the same inside :func:`msrl.device.host_side` blocks (work on values already read).
        syncs: the :class:`HostSync` of each sync not allowed, in order.
        allowed: the same for the allowed ones.
    """

    #: files of recorders (this one and subclasses, and msrl's dispatch shim) whose frames are never
    #: the place of a sync
    internal_files: tuple[str, ...] = ("msrl/runtime/programs/host_syncs.py", "msrl/runtime/startup.py")

    def __init__(self, allow: Sequence[tuple[str, str]] = CPU_ONLY_READS) -> None:
        super().__init__()
        self.allow = tuple(allow)
        self.ops: Counter[str] = Counter()
        self.host_ops: Counter[str] = Counter()
        self.syncs: list[HostSync] = []
        self.allowed: list[HostSync] = []

    def __enter__(self) -> "HostSyncRecorder":
        _local.recorders = [*getattr(_local, "recorders", []), self]
        _patch_methods(+1)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _patch_methods(-1)
            _local.recorders = getattr(_local, "recorders", [])[:-1]

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if in_host_side():
            self.host_ops[str(func.overloadpacket.__name__)] += 1
            return func(*args, **kwargs)
        self.ops[str(func.overloadpacket.__name__)] += 1
        why = sync_reason(func, args, kwargs)
        if why is not None:
            self._record(str(func.overloadpacket.__name__), why)
        return func(*args, **kwargs)

    def _record(self, op: str, why: str) -> None:
        frame = sys._getframe(2)
        where, allowed, frames = None, False, []
        while frame is not None:
            code = frame.f_code
            path = code.co_filename.replace("\\", "/")
            frames.append((path, code.co_name))
            if any(path.endswith(file) and code.co_name == fn for file, fn in self.allow):
                allowed = True
            if where is None and "/torch/" not in path and not path.endswith(self.internal_files):
                where = f"{path}:{frame.f_lineno} in {code.co_name}"
            frame = frame.f_back
        (self.allowed if allowed else self.syncs).append(HostSync(op, why, where or "?", tuple(frames)))

    @property
    def ops_total(self) -> int:
        """aten ops dispatched inside the recorder (views and allocations included)."""
        return sum(self.ops.values())

    @property
    def compute_ops(self) -> int:
        """The ops that launch work on a device (:attr:`ops` less :data:`NO_KERNEL_OPS`): about
        the kernels one iteration launches on a GPU."""
        return sum(n for op, n in self.ops.items() if op not in NO_KERNEL_OPS)

    def reads(self, frame: tuple[str, str]) -> list[HostSync]:
        """The allowed syncs made inside ``frame`` (``(path suffix, function name)``)."""
        file, fn = frame
        return [s for s in self.allowed if s.frames and any(f.endswith(file) and n == fn for f, n in s.frames)]

    def report(self, limit: int = 10) -> str:
        """The syncs not allowed, one per line (the first ``limit``), for an assertion message."""
        lines = [str(s) for s in self.syncs[:limit]]
        more = len(self.syncs) - limit
        return "\n".join(lines + ([f"... and {more} more"] if more > 0 else []))


#: Tensor methods that read a tensor on the host without dispatching an aten op on a CPU
#: (``.cpu()`` of a CPU tensor is the tensor itself; ``tolist``/``numpy`` read its memory):
#: on a GPU each is a device-to-host copy. Patched while a recorder is active; recorded only on
#: the thread that entered it.
HOST_METHODS: dict[str, str] = {
    "cpu": "Tensor.cpu(): a copy into host memory",
    "tolist": "Tensor.tolist(): the tensor read on the host",
    "numpy": "Tensor.numpy(): the tensor read on the host",
    "__array__": "numpy.asarray(tensor): the tensor read on the host",
}
_patched: dict[str, Any] = {}
_patch_lock = threading.Lock()
_patch_depth = 0


def _patch_methods(step: int) -> None:
    global _patch_depth
    with _patch_lock:
        _patch_depth += step
        if step > 0 and _patch_depth == 1:
            for name, why in HOST_METHODS.items():
                original = getattr(torch.Tensor, name)
                _patched[name] = original
                setattr(torch.Tensor, name, _recording_method(name, why, original))
        elif step < 0 and _patch_depth == 0:
            for name, original in _patched.items():
                setattr(torch.Tensor, name, original)
            _patched.clear()


def _recording_method(name: str, why: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        recorders = getattr(_local, "recorders", [])
        if recorders and not in_host_side() and not (name == "cpu" and self.device.type != "cpu"):
            recorders[-1]._record(f"Tensor.{name}", why)  # (.cpu() of a CUDA tensor dispatches _to_copy)
        return original(self, *args, **kwargs)

    return method


def recording_program(program: Any, recorder: HostSyncRecorder) -> Any:
    """``program`` (a :class:`~msrl.runtime.programs.codegen.Program`) whose ``fn`` runs inside ``recorder``,
    on whichever thread runs it: for a replica of the local runtime that runs in a worker thread."""
    fn: Callable[..., Any] = program.fn

    def recorded(*args: Any, **kwargs: Any) -> Any:
        with recorder:
            return fn(*args, **kwargs)

    return dataclasses.replace(program, fn=recorded)
