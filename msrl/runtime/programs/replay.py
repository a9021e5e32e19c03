"""What records a captured iteration and replays it: :class:`Tape` on the CPU (every aten op and
native-kernel launch of the iteration, re-run in order on the same tensors) and
:class:`CudaGraph` on a GPU (``torch.cuda.CUDAGraph`` with the replica's generators registered).
Used by :mod:`msrl.runtime.programs.capture` and :mod:`msrl.runtime.programs.packing`."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from msrl.device import set_foreign_recorder
from msrl.errors import MsrlError
from msrl.runtime.startup import lean_dispatch_mode

__all__ = ["Tape", "CudaGraph", "NotCapturable"]


class NotCapturable(MsrlError, RuntimeError):
    """Why a program cannot be captured: one line naming the op or attribute and where (the
    program then runs eagerly: :attr:`msrl.runtime.programs.capture.CapturedProgram.status`)."""

def _schema_kind(func: Any) -> str:
    """``view`` (every output aliases an input, nothing written), ``write`` (mutates an
    argument or writes an ``out=``), ``meta`` (a profiler marker) or ``compute``."""
    if func.namespace == "profiler":
        return "meta"
    schema = func._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "write"
    rets = schema.returns
    if rets and all(r.alias_info is not None for r in rets):
        return "view"
    return "compute"


def _fresh_outputs(func: Any, out: Any) -> list[torch.Tensor]:
    """The tensors of an op's outputs that alias no input (what a replay must copy back)."""
    rets = func._schema.returns
    groups = [out] if len(rets) == 1 else list(out) if isinstance(out, (tuple, list)) else [out]
    fresh = []
    for r, g in zip(rets, groups):
        if r.alias_info is None:
            fresh += [t for t in tree_flatten(g)[0] if isinstance(t, torch.Tensor)]
    return fresh


_ALLOC = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


def _freeze(x: Any) -> Any:
    """Lists and dicts in an op's arguments copied (the caller may reuse them), leaves kept."""
    return tree_map(lambda v: v, x)


@lean_dispatch_mode  # dispatches without importing TorchDynamo (msrl/runtime/startup.py)
class Tape(TorchDispatchMode):
    """The CPU stand-in of a CUDA graph: records the aten ops (and :func:`msrl.device.record_foreign`
    calls) of the code run inside it, on this thread, and :meth:`replay` re-runs them in order
    on the same tensors, without the Python that issued them.

    A replayed op that computes fresh outputs writes them into the tensors the recording
    returned (which later ops and the caller hold); views are not re-run (they alias memory
    that the replay updates in place); allocations are not re-run; in-place ops and random
    draws re-run on their tensors and generators. An op that returns a Python value (a host
    read) is recorded as nothing: the probe refuses programs with such reads, except the
    CPU-only checks :data:`~msrl.runtime.programs.host_syncs.CPU_ONLY_READS`, which a replay skips as a
    CUDA graph would.
    """

    def __init__(self) -> None:
        super().__init__()
        #: ``(kind, func, args, outputs)`` in order
        self.steps: list[tuple[str, Any, Any, Any]] = []

    def __enter__(self) -> "Tape":
        set_foreign_recorder(self.steps.append)  # (raises when a Tape already records on this thread)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            set_foreign_recorder(None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = _schema_kind(func)
        if kind in ("view", "meta") or func.overloadpacket.__name__ in _ALLOC:
            return out
        fresh = _fresh_outputs(func, out)
        if kind == "compute" and not fresh:
            return out  # a host read (vetted by the probe) or a metadata query: nothing to replay
        self.steps.append((kind, func, (_freeze(tuple(args)), _freeze(dict(kwargs))), fresh))
        return out

    def replay(self) -> None:
        """Re-runs the recorded ops in order (no autograd, no Python of the recorded code).

        Raises:
            RuntimeError: an op's output changed shape (a data-dependent shape, which a CUDA
                graph cannot hold either).
        """
        with torch.no_grad():
            for kind, func, call, outs in self.steps:
                if kind == "foreign":
                    func(*call)
                    continue
                args, kwargs = call
                res = func(*args, **kwargs)
                for dst, src in zip(outs, _fresh_outputs(func, res)):
                    if dst.shape != src.shape:
                        raise RuntimeError(f"{func} returned shape {tuple(src.shape)} on replay, "
                                           f"{tuple(dst.shape)} when captured: a data-dependent shape")
                    dst.copy_(src)


class CudaGraph:
    """A CUDA graph of the captured iteration (``torch.cuda.CUDAGraph``), with the CUDA
    generators the iteration draws from registered (``register_generator_state``)."""

    def __init__(self, generators: list[torch.Generator]) -> None:
        self.graph = torch.cuda.CUDAGraph()
        # other threads (the driver, other replicas) may use CUDA meanwhile: only this thread's
        # unsafe calls end the capture
        register = getattr(self.graph, "register_generator_state", None)
        custom = [g for g in generators if g.device.type == "cuda"]
        if custom and register is None:
            raise NotCapturable(f"torch {torch.__version__} cannot capture draws from a torch.Generator of the "
                                "program's own (CUDAGraph.register_generator_state is missing)")
        for g in custom:
            register(g)

    def capture(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` once under CUDA-graph capture (this thread's unsafe calls end it) and
        returns its result: tensors in the graph's memory pool, refreshed by each :meth:`replay`."""
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            out = fn()
        self.graph.replay()  # capture records without running: this runs the captured iteration
        return out

    def replay(self) -> None:
        """Launches the captured graph once on the current stream (asynchronous to the host)."""
        self.graph.replay()
