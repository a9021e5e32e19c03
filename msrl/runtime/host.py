"""The replica host: one fragment replica as every runtime runs it -- its
:class:`~msrl.runtime.replica.Replica`, its endpoint, and the record of each iteration -- on a
thread of one process (:mod:`msrl.runtime.local`) or in a Ray actor's process
(:class:`msrl.cluster.replica_actor.ReplicaActor`, a thin shell around one host).

A runtime gives a host its endpoint (the thread runtime: a hub's per method; the Ray actor: one
over torch.distributed and the asynchronous streams) and asks it to run ``n`` iterations; the
host runs them pipelined (:func:`~msrl.runtime.replica.pipelined_records`) and returns one
record per iteration, the same fields under both runtimes:

==================  ==============================================================================
field               what
==================  ==============================================================================
``output``          the program's return value as floats (the output replica's; ``None`` elsewhere)
``episodes``        the :class:`~msrl.api.EpisodeStats` its envs finished in the iteration
``env_steps``       its envs' total after it (a replacement's counted on from the lost replica's)
``time_s``          from its launch to the next one's (see ``pipelined_records``)
``notices``         its capture's notices (printed by the runtime)
``policy_lags``     what its asynchronous ``get`` s recorded
``inference``       central inference's batch statistics (its server replica), else ``None``
``comm_s``          its endpoint's seconds moving values in the iteration (:attr:`Endpoint.comm_s`)
``wait_s``          its endpoint's seconds blocked on a peer in the iteration
``refused``         what its servers refused so far (``connections``, ``frames``, ``datagrams``)
==================  ==============================================================================
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import numpy as np
import torch

from msrl.runtime.replica import Replica, pipelined_records

__all__ = ["ReplicaHost", "NO_REFUSALS", "denormals_flushed", "flushed_denormals", "torch_threads"]

#: the ``refused`` field of a replica without servers
NO_REFUSALS = {"connections": 0, "frames": 0, "datagrams": 0}


def denormals_flushed() -> bool:
    """Whether this thread's CPU arithmetic reads and writes denormal floats as 0 (x86's FTZ and
    DAZ modes, which ``torch.set_flush_denormal`` sets per thread): a float32 of 1e-39 times one
    comes back 0. NumPy's scalars, not a tensor: no torch op, so no host read in a
    ``gpu_only`` iteration's count (:mod:`msrl.runtime.programs.host_syncs`)."""
    return float(np.float32(1e-39) * np.float32(1.0)) == 0.0


@contextlib.contextmanager
def flushed_denormals(on: bool) -> Iterator[None]:
    """Runs the block with this thread's denormal flushing ``on`` (``torch.set_flush_denormal``)
    and puts the thread's own mode back after it, also when the block raises. Arithmetic on
    denormal floats (below 1.2e-38 in float32) takes a slow path on x86 CPUs: a 64-filter
    AlphaZero tower whose weight decay had taken 2,428 weights below it ran its forward 3.9x as
    long (``train.flush_denormal``; ``bench/results/runtime.md``). A CPU without the modes (torch
    returns False) runs the block unchanged; the GPU is unaffected."""
    before = denormals_flushed()
    if on == before or not torch.set_flush_denormal(on):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(before)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Runs the block with torch's intra-op threads at ``n`` (``torch.set_num_threads``, a
    process-wide setting) and the process's own count back after it, also when the block raises:
    a run's ``train.torch_threads`` holds for the run, and a caller's notebook keeps its threads.

    Raises:
        RuntimeError: ``n`` < 1 (torch's own check).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


#: torch's per-backend float32 matmul settings (torch 2.9 and later), which
#: ``torch.set_float32_matmul_precision`` writes: the CUDA one and oneDNN's (the CPU's: ``medium``
#: computes float32 products in bfloat16 where oneDNN has it, as on AMX)
_MATMUL_BACKENDS = tuple(b.matmul for b in (torch.backends.cuda, torch.backends.mkldnn)
                         if hasattr(b.matmul, "fp32_precision"))


@contextlib.contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    """Runs the block with float32 matrix products at ``precision`` (``highest``, ``high`` or
    ``medium``: ``torch.set_float32_matmul_precision``, a process-wide setting) and the process's
    own settings back after it, also when the block raises: torch's legacy one where it is
    readable (``torch.get_float32_matmul_precision`` raises once a caller used the per-backend
    API) and each backend's own (torch 2.9 and later).

    Raises:
        RuntimeError: ``precision`` is not one of the three (torch's own check).
    """
    try:
        legacy: str | None = torch.get_float32_matmul_precision()
    except RuntimeError:  # (a caller on the per-backend API)
        legacy = None
    backends = tuple(m.fp32_precision for m in _MATMUL_BACKENDS)
    try:
        torch.set_float32_matmul_precision(precision)
        yield
    finally:
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy)
        for m, value in zip(_MATMUL_BACKENDS, backends):
            m.fp32_precision = value


class ReplicaHost:
    """One replica, run by any runtime (see the module docstring).

    Args:
        replica: the replica (its trainer, programs, generators).
        output: whether it returns the iteration's output (replica 0 of the output fragment).
        refused: returns its servers' refusal counts (the Ray actor's boundary servers);
            ``None``: it has none.

    Attributes:
        comm: its :class:`~msrl.runtime.endpoint.Endpoint` (``None``: a job of one replica).
        steps_offset: env steps before its own process's (a replacement's: the lost replica's
            delivered ones, :mod:`msrl.runtime.elastic`).
    """

    def __init__(self, replica: Replica, output: bool, refused: Callable[[], dict[str, int]] | None = None) -> None:
        self.replica, self.output = replica, output
        self.refused = refused or (lambda: dict(NO_REFUSALS))
        self.comm: Any = None
        self.steps_offset = 0

    @property
    def env_steps(self) -> int:
        """Its envs' steps so far (with :attr:`steps_offset`)."""
        return self.steps_offset + self.replica.env_steps

    def run(self, method: str, n: int, comm: Any = None, output: bool | None = None) -> list[dict[str, Any]]:
        """Runs ``method`` ``n`` times through ``comm`` (default :attr:`comm`); one record per
        iteration (see the module docstring); ``output``: whether this replica returns the
        method's output (default: :attr:`output`). Runs them with the job's denormal mode on this
        thread (``train.flush_denormal``: :func:`flushed_denormals`). Sends what the endpoint
        holds before it returns (:meth:`~msrl.runtime.endpoint.Endpoint.flush`).

        Raises:
            FragmentError: the program raised (naming fragment, replica, node, ``file:line``).
        """
        comm = self.comm if comm is None else comm
        replica, output = self.replica, self.output if output is None else output

        def iteration() -> tuple[Any, dict[str, Any]]:
            c0, w0 = (comm.comm_s - comm.wait_s, comm.wait_s) if comm is not None else (0.0, 0.0)
            out = replica.run_method(method, comm)
            if comm is not None:
                comm.reap()
            comm_s = (comm.comm_s - comm.wait_s - c0) if comm is not None else 0.0
            wait_s = (comm.wait_s - w0) if comm is not None else 0.0
            asynchronous = comm.asynchronous if comm is not None else None
            return replica.start_read_iteration(out, output=output), {
                "env_steps": self.env_steps,
                "notices": replica.pop_notices(),
                "comm_s": comm_s,
                "wait_s": wait_s,
                "policy_lags": asynchronous.pop_lags() if asynchronous is not None else [],
                "inference": replica.inference.pop_stats() if replica.inference is not None else None,
                "refused": self.refused(),
            }

        with flushed_denormals(replica.flush_denormal):  # this thread's mode, for the job's iterations
            records = pipelined_records(n, iteration, keep_output=output)
        if comm is not None:
            comm.flush()
        return records
