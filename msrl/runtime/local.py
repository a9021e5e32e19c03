"""The in-process runtime: every fragment replica of a job in one process.

A job with one fragment replica runs its program on the calling thread. Otherwise each
replica runs on its own thread (as each would in its own Ray actor), runs its iterations itself
and meets the others only at boundaries: synchronous ones through a
:class:`~msrl.runtime.channels.LocalHub` per traced method, asynchronous ones (``fifo`` queues,
``latest`` slots) through each replica's :class:`~msrl.runtime.asynchronous.Mailbox`. Hubs and
mailboxes live as long as the runtime, so a queue or a slot carries over from one :meth:`run`
to the next, as on Ray. Errors are re-raised as :class:`FragmentError` naming the fragment,
replica, node and user ``file:line``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

from msrl.graph.fragmented import FragmentGraph
from msrl.runtime.asynchronous import AsyncEndpoint, LocalTransport, Mailbox
from msrl.runtime.channels import ChannelClosed, LocalHub
from msrl.runtime.host import ReplicaHost
from msrl.runtime.replica import FragmentError, Replica, print_notices

__all__ = ["FragmentError", "LocalRuntime"]


class LocalRuntime:
    """Runs the fragment replicas of one job in this process.

    Args:
        fragment_graph: the partitioned job.
        replicas: ``(fragment, replica) -> Replica``.
        timeout_s: how long a replica waits on an asynchronous boundary before giving up.
        frame_padding: the job's frame padding (:func:`msrl.runtime.frame_stacks.frame_padding`):
            its frame-stacked rollouts cross in compact form where the job's fragments sit on
            more than one device (:attr:`frame_padding` says whether they do; a test may set it).
    """

    def __init__(self, fragment_graph: FragmentGraph, replicas: Mapping[tuple[str, int], Replica],
                 timeout_s: float = 600.0, frame_padding: str | None = None) -> None:
        self.fragment_graph = fragment_graph
        self.replicas = dict(replicas)
        self._keys = sorted(self.replicas)
        #: ``(fragment, replica) ->`` its :class:`~msrl.runtime.host.ReplicaHost` (records as on Ray)
        self.hosts = {key: ReplicaHost(rep, output=False) for key, rep in self.replicas.items()}
        self._fragment_replicas = {fr.name: fr.spec.replicas for fr in fragment_graph.fragments}
        self._pool = ThreadPoolExecutor(max_workers=len(self._keys)) if len(self._keys) > 1 else None
        from msrl.runtime.generators import BATON

        BATON.shared = self._pool is not None  # replicas as threads: draws could interleave
        self.timeout_s = timeout_s
        self._hubs: dict[str, LocalHub] = {}
        capacity = {b.name: b.capacity for b in fragment_graph.boundaries if b.channel == "fifo"}
        self._devices = {fr.name: fr.spec.device for fr in fragment_graph.fragments}
        self.mailboxes = {key: Mailbox(capacity, timeout_s, device=self._devices[key[0]]) for key in self._keys}
        transport = self.transport = LocalTransport(self.mailboxes)
        self.asynchronous = {key: AsyncEndpoint(fragment_graph.boundaries, key[0], key[1], self.mailboxes[key], transport)
                             for key in self._keys}
        # frame-stacked rollouts cross in compact form where a boundary moves them to another
        # device (actors on the CPU, a learner on a GPU): only the newest frames are copied
        self.frame_padding = frame_padding if len({str(d) for d in self._devices.values()}) > 1 else None
        for ep in self.asynchronous.values():
            ep.frame_padding = self.frame_padding
        # The fragment whose program returns the method's output (the fragment holding the
        # output node's value); replica 0's return value is the step's.
        self._output_fragment: dict[str, str] = {}
        for fr in fragment_graph.fragments:
            for method, g in fr.programs.items():
                if any(n.kind.value == "output" and n.inputs for n in g):
                    self._output_fragment[method] = fr.name

    def _hub(self, method: str) -> LocalHub:
        hub = self._hubs.get(method)
        if hub is None or hub.closed:  # a failed run closed it: the next run starts clean
            hub = self._hubs[method] = LocalHub([b for b in self.fragment_graph.boundaries if b.method == method],
                                                self._fragment_replicas, self._devices)
            hub.frame_padding = self.frame_padding
        return hub

    def run(self, method: str, n: int = 1) -> dict[tuple[str, int], list[dict[str, Any]]]:
        """Runs ``method``'s program ``n`` times on every replica, each replica on its own and
        waiting only at boundaries.

        Returns:
            ``(fragment, replica) ->`` one record per iteration: ``output`` (the program's return
            value), ``episodes`` (:class:`EpisodeStats` its envs finished), ``env_steps`` (its
            envs' total after it), ``time_s`` and ``policy_lags`` (recorded by its asynchronous
            ``get``s).

        Raises:
            FragmentError: a replica raised; the others are woken and stopped.
        """
        if self._pool is None:
            results = {self._keys[0]: self._run_one(method, n, self._keys[0], None)}
            print_notices(results[self._keys[0]])
            return results
        hub = self._hub(method)
        futures = {key: self._pool.submit(self._run_one, method, n, key, hub) for key in self._keys}
        results: dict[tuple[str, int], Any] = {}
        first_error: BaseException | None = None
        for key, fut in futures.items():
            try:
                results[key] = fut.result()
            except FragmentError as e:
                if first_error is None or isinstance(first_error.cause, ChannelClosed):  # type: ignore[union-attr]
                    first_error = e
        for key in sorted(results):
            print_notices(results[key])
        if first_error is not None:
            raise first_error
        return results

    def output(self, method: str, results: Mapping[tuple[str, int], list[dict[str, Any]]], i: int) -> Any:
        """Iteration ``i``'s output of :meth:`run`'s ``results``: replica 0's of the output fragment."""
        frag = self._output_fragment.get(method)
        if frag is None:
            return None
        return results[(frag, 0)][i]["output"] if (frag, 0) in results else results[self._keys[0]][i]["output"]

    def _run_one(self, method: str, n: int, key: tuple[str, int], hub: LocalHub | None) -> list[dict[str, Any]]:
        fragment, replica = key
        host = self.hosts[key]
        comm = hub.endpoint(fragment, replica, self.asynchronous[key], host.replica.inference) if hub is not None else None
        frag = self._output_fragment.get(method)
        output = (frag, 0) if frag is not None and (frag, 0) in self.replicas else self._keys[0]
        try:
            records = host.run(method, n, comm, output=key == output)
        except FragmentError as e:
            if hub is not None:
                why = f"fragment {fragment} replica {replica} failed: {type(e.cause).__name__}: {e.cause}"
                hub.close(why)
                for mailbox in self.mailboxes.values():
                    mailbox.close(why)
            raise
        return records

    def pop_boundary_bytes(self) -> dict[str, int]:
        """Boundary -> bytes of tensors that crossed it since the last call (synchronous and
        asynchronous boundaries, every replica's sends)."""
        out: dict[str, int] = {}
        for source in [*self._hubs.values(), self.transport]:
            for k, v in source.bytes.items():
                out[k] = out.get(k, 0) + v
            source.bytes.clear()
        return out

    def close(self) -> None:
        """Stops the worker threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
