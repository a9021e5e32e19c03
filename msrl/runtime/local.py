"""The in-process runtime: every fragment replica of a job in one process.

A job with one fragment replica runs its program on the calling thread. Otherwise each
replica runs on its own thread (as each would in its own Ray actor), and the replicas meet at
boundaries through a :class:`~msrl.channels.LocalHub`. Errors are re-raised as
:class:`FragmentError` naming the fragment, replica, node and user ``file:line``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

from msrl.channels import ChannelClosed, LocalHub
from msrl.partition import FragmentGraph
from msrl.runtime.replica import FragmentError, Replica

__all__ = ["FragmentError", "LocalRuntime"]


class LocalRuntime:
    """Runs the fragment replicas of one job in this process.

    Args:
        fragment_graph: the partitioned job.
        replicas: ``(fragment, replica) -> Replica``.
    """

    def __init__(self, fragment_graph: FragmentGraph, replicas: Mapping[tuple[str, int], Replica]) -> None:
        self.fragment_graph = fragment_graph
        self.replicas = dict(replicas)
        self._keys = sorted(self.replicas)
        self._fragment_replicas = {fr.name: fr.spec.replicas for fr in fragment_graph.fragments}
        self._pool = ThreadPoolExecutor(max_workers=len(self._keys)) if len(self._keys) > 1 else None
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
            return self.replicas[self._keys[0]].run_method(method, None)
        hub = LocalHub([b for b in self.fragment_graph.boundaries if b.method == method], self._fragment_replicas)
        futures = {key: self._pool.submit(self._run_one, method, key, hub) for key in self._keys}
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

    def _run_one(self, method: str, key: tuple[str, int], hub: LocalHub) -> Any:
        fragment, replica = key
        comm = hub.endpoint(fragment, replica)
        learner = self.replicas[key].trainer.components.get("learner")
        if learner is not None and self._fragment_replicas[fragment] > 1:
            # multi_learner: the replicas' gradients are averaged at the gradient step
            learner.gradient_hook = lambda grads: comm.allreduce("gradients", grads)
        try:
            return self.replicas[key].run_method(method, comm)
        except FragmentError as e:
            hub.close(f"fragment {fragment} replica {replica} failed: {type(e.cause).__name__}: {e.cause}")
            raise

    def close(self) -> None:
        """Stops the worker threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
