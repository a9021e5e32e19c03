"""The in-process runtime: every fragment replica of a job in one process.

A job with one fragment replica runs its program on the calling thread. Otherwise each
replica runs on its own thread (as each would in its own Ray actor), and the replicas meet at
boundaries through a :class:`~msrl.channels.LocalHub`. Errors are re-raised as
:class:`FragmentError` naming the fragment, replica, node and user ``file:line``.
"""

from __future__ import annotations

import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

from msrl.api import Trainer
from msrl.channels import ChannelClosed, LocalHub
from msrl.codegen import Program
from msrl.partition import FragmentGraph

__all__ = ["FragmentError", "LocalRuntime"]


class FragmentError(RuntimeError):
    """An exception raised inside a fragment program.

    Attributes:
        fragment, replica: where; ``node``: the FDG node (``None`` if not mapped); ``cause``:
        the original exception (also ``__cause__``).
    """

    def __init__(self, fragment: str, replica: int, method: str, node: Any, cause: BaseException) -> None:
        self.fragment, self.replica, self.method, self.node, self.cause = fragment, replica, method, node, cause
        where = f"{node.describe()} at {node.where()}" if node is not None else "(outside any node)"
        super().__init__(
            f"fragment {fragment} replica {replica}, {method}: {type(cause).__name__}: {cause}\n  in {where}"
        )


class LocalRuntime:
    """Runs fragment programs of one job in this process.

    Args:
        fragment_graph: the partitioned job.
        programs: ``(fragment, method) -> Program``.
        trainers: ``(fragment, replica) -> Trainer`` holding that fragment's components.
    """

    def __init__(
        self,
        fragment_graph: FragmentGraph,
        programs: Mapping[tuple[str, str], Program],
        trainers: Mapping[tuple[str, int], Trainer],
    ) -> None:
        self.fragment_graph = fragment_graph
        self.programs = dict(programs)
        self.trainers = dict(trainers)
        self._replicas = list(self.trainers)
        self._pool = ThreadPoolExecutor(max_workers=len(self._replicas)) if len(self._replicas) > 1 else None
        # The fragment whose program returns the method's output (the fragment holding the
        # output node's value); replica 0's return value is the step's.
        self._output_fragment: dict[str, str] = {}
        for fr in fragment_graph.fragments:
            for method, g in fr.programs.items():
                if any(n.kind.value == "output" and n.inputs for n in g):
                    self._output_fragment[method] = fr.name

    def run(self, method: str) -> Any:
        """Runs ``method``'s program on every replica once; returns the step's output.

        Raises:
            FragmentError: a replica raised; the others are woken and stopped.
        """
        if self._pool is None:
            key = self._replicas[0]
            return self._run_one(method, key, None)
        hub = LocalHub([b for b in self.fragment_graph.boundaries if b.method == method])
        futures = {key: self._pool.submit(self._run_one, method, key, hub) for key in self._replicas}
        results: dict[tuple[str, int], Any] = {}
        first_error: BaseException | None = None
        for key, fut in futures.items():
            try:
                results[key] = fut.result()
            except FragmentError as e:
                if first_error is None or isinstance(first_error.cause, ChannelClosed):  # type: ignore[union-attr]
                    first_error = e
        if first_error is not None:
            raise first_error
        out_frag = self._output_fragment.get(method)
        return results.get((out_frag, 0)) if out_frag else None

    def _run_one(self, method: str, key: tuple[str, int], hub: LocalHub | None) -> Any:
        fragment, replica = key
        program = self.programs[(fragment, method)]
        comm = hub.endpoint(fragment, replica) if hub is not None else None
        try:
            return program.fn(self.trainers[key], comm)
        except BaseException as e:  # noqa: BLE001 - re-raised with the node that failed
            if hub is not None:
                hub.close(f"fragment {fragment} replica {replica} failed: {type(e).__name__}: {e}")
            node = None
            for frame, lineno in traceback.walk_tb(sys.exc_info()[2]):
                if frame.f_code.co_filename == program.filename:
                    node = program.node_at(lineno)
            raise FragmentError(fragment, replica, method, node, e) from e

    def close(self) -> None:
        """Stops the worker threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
