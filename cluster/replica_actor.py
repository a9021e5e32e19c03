"""The Ray actor of one fragment replica, in its own process: msrl's own process (its start-up,
:func:`msrl.runtime.startup.own_process`, runs before anything heavy is imported), a thin shell around
one :class:`~msrl.runtime.host.ReplicaHost` with the calls the driver makes on it (its boundary
servers, the process group, rejoining as a replacement, state and weights)."""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

__all__ = ["ReplicaActor", "uds_prefix"]


def uds_prefix(job_id: str) -> str:
    """The name prefix of the directories holding a job's Unix boundary sockets (under the temp
    directory of each node)."""
    return f"msrl-boundary-{job_id}-"


class ReplicaActor:
    """One fragment replica in its own process (wrapped by ``ray.remote`` in :class:`RayJob`).

    Args:
        algorithm_ref: how to import the algorithm's module in this process before the spec is
            unpickled (an algorithm file's path, a dotted module; ``None`` for built-ins).
        spec_bytes, fragment_graph_bytes: the cloudpickled :class:`~msrl.run.job.JobSpec` and
            :class:`~msrl.graph.fragmented.FragmentGraph`.
        fragment, replica: which replica.
        threads: torch intra-op (and OpenMP) threads: the bundle's CPUs.
        job_id: the job's random id, naming this replica's :class:`~msrl.cluster.watchdog.Heartbeat`.
        compiles: the job compiles a fragment (``distribution_policy.compile``): this process
            keeps plain torch (:func:`msrl.runtime.startup.own_process`).
    """

    def __init__(self, algorithm_ref: str | None, spec_bytes: bytes, fragment_graph_bytes: bytes,
                 fragment: str, replica: int, threads: int, job_id: str = "", compiles: bool = False) -> None:
        from msrl.runtime.startup import own_process

        own_process(compiles=compiles)  # first: before tensordict and the optimisers are imported
        import cloudpickle
        import torch

        from msrl.cluster.watchdog import Heartbeat
        from msrl.runtime.host import ReplicaHost

        self.host: Any = None
        self.mailbox: Any = None
        self.job_id = job_id
        self.heartbeat = Heartbeat(job_id, fragment, replica, self._progress, on_order=self._order) if job_id else None
        torch.set_num_threads(max(1, min(threads, os.cpu_count() or 1)))  # never more threads than the node's cores
        if algorithm_ref is not None:
            from msrl.registry import load_algorithm

            load_algorithm(algorithm_ref)  # registers a file's module before unpickling refers to it
        from msrl.errors import InputError
        from msrl.runtime.replica import Replica

        self.spec = cloudpickle.loads(spec_bytes)
        torch.set_float32_matmul_precision(self.spec.float32_matmul_precision)  # train.float32_matmul_precision
        self.fragment_graph = cloudpickle.loads(fragment_graph_bytes)
        self.fragment, self.index = fragment, replica
        self.comm: Any = None
        #: this replica's boundary servers by transport kind (:data:`msrl.runtime.transports.kinds.STREAM_KINDS`), and
        #: the kinds its streams may use (``cluster.boundary_transport``)
        self.servers: dict[str, Any] = {}
        self.transport_choice = "auto"
        #: bad input found while building this replica's components (a ``ConfigError`` of an
        #: algorithm's factory): raised by the driver's first call, :meth:`info`, as itself --
        #: not the death of a process whose constructor raised, which restarts would repeat
        self.build_error: Exception | None = None
        try:
            self.replica = Replica(self.spec, self.fragment_graph, fragment, replica)
        except InputError as e:
            self.build_error = e
            return
        output = next((fr.name for fr in self.fragment_graph.fragments
                       if any(n.kind.value == "output" and n.inputs for n in fr.programs["train_step"])), None)
        #: the replica as every runtime runs it (its records, its env-step count)
        self.host = ReplicaHost(self.replica, output=fragment == output and replica == 0, refused=self.refused)

    def _progress(self) -> dict[str, Any]:
        """The heartbeat's record: this replica's env steps so far, its mailbox's counts (after
        reading what arrived, :meth:`~msrl.runtime.asynchronous.Mailbox.poll`: an idle replica
        notes a lost producer's stream end too) and central inference's client states (read on
        the heartbeat's thread)."""
        host, mailbox = self.host, self.mailbox
        if mailbox is not None:
            mailbox.poll()
        server = self.replica.inference if host is not None else None
        return {"env_steps": host.env_steps if host is not None else 0,
                **(mailbox.counts() if mailbox is not None else {}),
                **({"clients": server.client_states(mailbox)} if server is not None else {})}

    def _order(self, order: Mapping[str, Any]) -> None:
        """An order of the driver read by the heartbeat thread (this replica busy in a chunk):
        ``{"seq", "absent", "redo"}`` -- :meth:`set_absent`, and for central inference's server
        the generation of each replaced client (:meth:`redo`)."""
        if "absent" in order:
            self.set_absent(int(order["seq"]), order["absent"])
        for name, generation in order.get("redo", {}).items():
            fragment, _, replica = name.partition("/")
            self.redo((fragment, int(replica)), int(generation))

    def redo(self, client: tuple[str, int], generation: int) -> bool:
        """Central inference's server: client replica ``client`` was lost and is replaced: what
        it sent is dropped and its served run starts again (:meth:`~msrl.runtime.asynchronous.Mailbox.redo`)
        under ``generation``. Returns whether it was applied (a newer generation)."""
        if self.mailbox is None:
            return False
        names = [b.name for b in self.fragment_graph.boundaries
                 if b.channel == "fifo" and b.src == client[0] and b.dst == self.fragment]
        return self.mailbox.redo(client, names, generation)

    def set_absent(self, seq: int, absent: Mapping[str, Sequence[int]]) -> bool:
        """The driver's order ``seq``: the producers of this replica's ``fifo`` boundaries that
        are lost and not replaced for want of capacity (:meth:`~msrl.runtime.asynchronous.Mailbox.set_absent`:
        their share is taken from the live producers' items). Returns whether it was applied
        (an older order than the last is not)."""
        return self.mailbox.set_absent(seq, absent) if self.mailbox is not None else False

    def start_boundary_server(self, token: str, timeout_s: float, tls: Any = None, max_message: int | None = None,
                              host: str | None = None, peers: Mapping[tuple[str, int], Mapping[str, Any]] | None = None,
                              transport: str = "auto") -> dict[str, str] | None:
        """Starts this replica's servers when it consumes an asynchronous boundary: for each
        of its producers' machines (``peers``: every replica's :meth:`info`; ``None``: all
        others) the server of the first kind of :data:`msrl.runtime.transports.kinds.STREAM_KINDS` that serves the
        pair (``transport="auto"``: a Unix socket for producers on this machine, gRPC bound to
        this node's address as Ray reports it, or ``host``, for producers on other machines; a
        kind's name: that kind for all). Returns their addresses by kind,
        ``{"unix": "unix:/path", "grpc": "host:port"}`` (``None``: it consumes none)."""
        import ray

        from msrl.cluster.grpc_transport import MAX_MESSAGE
        from msrl.runtime.asynchronous import Mailbox
        from msrl.runtime.transports.kinds import kinds_needed, stream_kinds_for

        boundaries = self.fragment_graph.boundaries
        self.transport_choice = transport
        capacity = {b.name: b.capacity for b in boundaries if b.channel == "fifo"}
        self.mailbox = Mailbox(capacity, timeout_s, device=self.spec.policy.fragment(self.fragment).device)
        sources = {b.src for b in boundaries if b.asynchronous and b.dst == self.fragment}
        if not sources:
            return None
        if peers is None:
            same_node = [False]
        else:
            here = peers[(self.fragment, self.index)]["node_id"]
            same_node = [p["node_id"] == here for k, p in peers.items() if k[0] in sources]
        for kind in kinds_needed(stream_kinds_for(transport), same_node):
            self.servers[kind.name] = kind.server(boundaries, self.fragment, self.index, self.mailbox, token,
                                                  max_message or MAX_MESSAGE, tls, host or ray.util.get_node_ip_address(),
                                                  uds_prefix(self.job_id))
        return {name: server.address for name, server in self.servers.items()}

    def init_process_group(self, rank: int, ranks: Mapping[tuple[str, int], int],
                           timeout_s: float, peers: Mapping[tuple[str, int], Mapping[str, Any]] | None = None,
                           intra_node: str = "shm", boundary_servers: Mapping[tuple[str, int], str] | None = None,
                           token: str = "", tls: Any = None, max_message: int | None = None,
                           elastic: Sequence[str] = (), sync_transport: str = "auto") -> None:
        """Joins the job's process group and builds this replica's endpoint, as
        :mod:`msrl.runtime.wiring` wires it (``rank`` is ``ranks[(fragment, replica)]``).

        ``peers`` maps every replica to its :meth:`info` (``pid``, ``node_id``, ``node``);
        ``intra_node``: ``cluster.intra_node``; ``boundary_servers`` maps every consumer of an
        asynchronous boundary to its servers' addresses (:meth:`start_boundary_server`), where
        this replica's ``put``s stream with the job's ``token``. Replicas of the ``elastic``
        fragments may be replaced alone (:meth:`rejoin`). ``sync_transport``: ``cluster.sync_transport``
        (the link per peer pair of the synchronous boundaries, :mod:`msrl.runtime.transports.links`). The rendezvous goes through Ray's
        key-value store under the job's secret ``token``
        (:class:`~msrl.cluster.rendezvous.RayStore`: no port opened for it).

        Raises:
            ValueError: no ``token``, or ``rank`` is not this replica's.
        """
        from msrl.cluster.rendezvous import RayStore
        from msrl.runtime import wiring
        from msrl.runtime.programs.backends import env_frame_padding

        key = (self.fragment, self.index)
        if ranks.get(key) != rank:
            raise ValueError(f"rank {rank} is not replica {key}'s ({ranks.get(key)})")
        if not token:
            raise ValueError("init_process_group needs the job's secret token (the rendezvous' key prefix)")
        groups = wiring.join(self.spec, key, ranks, peers, RayStore(token, timeout_s), timeout_s, intra_node, token,
                             sync_transport)
        asynchronous = wiring.stream_endpoint(self.fragment_graph, key, self.mailbox, self.servers, boundary_servers,
                                              peers, token, tls, max_message, timeout_s, elastic,
                                              choice=self.transport_choice)
        self.comm = wiring.endpoint(self.spec, self.fragment_graph, key, ranks, groups, asynchronous, max_message,
                                    env_frame_padding(self.spec))  # between processes: frame rollouts cross compact
        self.comm.inference = self.replica.inference  # central inference's server replica
        if self.replica.inference is not None:  # a lost client's run starts again for its replacement
            self.replica.inference.replaceable = self.replica.inference.plan.clients in elastic

    def rejoin(self, boundary_servers: Mapping[tuple[str, int], Mapping[str, str]],
               peers: Mapping[tuple[str, int], Mapping[str, Any]], own: Mapping[str, str] | None, token: str,
               tls: Any, max_message: int | None, timeout_s: float, elastic: Sequence[str],
               steps_offset: int) -> None:
        """Makes this replica the replacement of a lost one (:mod:`msrl.runtime.elastic`): opens
        its streams to every consumer greeting with its own servers' addresses ``own`` (each
        consumer reopens its streams to it there and sends it the newest slot values), then runs
        its ``reset`` program taking the values of synchronous boundaries from the slots that carry
        them again (fresh episodes, the learner's newest weights). No process group: every
        boundary of a replaceable fragment is asynchronous. ``steps_offset``: the env steps the
        lost replica's delivered iterations took (its count goes on from there)."""
        from msrl.runtime import wiring
        from msrl.runtime.elastic import SubstituteEndpoint, substitutes
        from msrl.runtime.programs.backends import env_frame_padding

        key = (self.fragment, self.index)
        asynchronous = wiring.stream_endpoint(self.fragment_graph, key, self.mailbox, self.servers, boundary_servers,
                                              peers, token, tls, max_message, timeout_s, elastic, own,
                                              self.transport_choice)
        self.comm = wiring.endpoint(self.spec, self.fragment_graph, key, {}, None, asynchronous, max_message,
                                    env_frame_padding(self.spec))
        asynchronous.transport.open_all()  # the greetings: the consumers learn where this replica listens
        self.host.steps_offset = steps_offset
        subs, _ = substitutes(self.fragment_graph, self.fragment)
        self.replica.run_method("reset", SubstituteEndpoint(self.comm, subs))

    def run(self, method: str, n: int) -> list[dict[str, Any]]:
        """Runs ``method`` ``n`` times; one record per iteration (:class:`~msrl.runtime.host.ReplicaHost`)."""
        return self.host.run(method, n, self.comm)

    def refused(self) -> dict[str, int]:
        """What this replica's servers refused since it started: ``connections`` and ``frames``
        (its boundary servers, :class:`~msrl.cluster.refusals.Refusals`), ``datagrams`` (its
        shared-memory all-reduce group: from processes outside the group)."""
        out = {"connections": 0, "frames": 0, "datagrams": 0}
        for server in self.servers.values():
            for kind, n in server.refusals.counts.items():
                out[kind] += n
        group = self.comm.local_group if self.comm is not None else None
        if group is not None:
            out["datagrams"] += group.rejected
        return out

    def comm_stats(self) -> dict[str, Any]:
        """This replica's totals so far: seconds per comm op (``op_s``), ``comm_s``, ``wait_s``,
        ``bytes_sent``, ``bytes_received``, and ``intra_node``: ``"shm"`` when this replica
        all-reduces through shared memory, else ``"gloo"`` (empty when the job has one replica);
        with asynchronous boundaries, ``async``: its transport's ``bytes_sent``, ``dropped``,
        ``reconnects``, and its servers' ``servers`` (addresses: ``host:port`` for gRPC,
        ``unix:/path`` for a Unix socket) and ``rejected`` (``(producer, reason)`` each)."""
        c = self.comm
        if c is None:
            return {}
        out = {"op_s": dict(c.op_s), "comm_s": c.comm_s, "wait_s": c.wait_s,
               "bytes_sent": c.bytes_sent, "bytes_received": c.bytes_received,
               "intra_node": "shm" if c.local_group is not None else "gloo"}
        if c.asynchronous is not None:
            t = c.asynchronous.transport
            servers = list(self.servers.values())
            out["async"] = {"bytes_sent": t.bytes_sent, "dropped": t.dropped, "reconnects": t.reconnects,
                            "servers": [x.address for x in servers],
                            "rejected": [r for x in servers for r in x.rejected]}
        return out

    def pid(self) -> int:
        """This replica's process id."""
        return os.getpid()

    def info(self) -> dict[str, Any]:
        """This replica's process id, node address, GPUs, its node's cores and its own torch
        (intra-op) threads; ``startup``: what msrl's start-up changed in this process
        (:func:`msrl.runtime.startup.owned_changes`), ``config_schema``: whether the process imported the
        config schema (:mod:`msrl.config`, pydantic's models: never, in a replica).

        Raises:
            InputError: the replica's components could not be built from the job's input.
        """
        if self.build_error is not None:
            raise self.build_error
        import sys

        import ray
        import torch

        from msrl.cluster.placement import node_cores
        from msrl.runtime.startup import owned_changes

        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "cores": node_cores(), "threads": torch.get_num_threads(),
                "startup": owned_changes(), "config_schema": "msrl.config" in sys.modules}

    def lower_priority(self, nice: int) -> int:
        """Raises this process's niceness by ``nice`` (every thread's: Linux keeps one per
        thread; threads and processes started later inherit it); returns the main thread's
        niceness after. Lowering one's own priority needs no privilege."""
        threads = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
        for tid in threads:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
            except (ProcessLookupError, PermissionError):
                pass  # a thread that ended meanwhile
        return os.getpriority(os.PRIO_PROCESS, 0)

    def priority(self) -> int:
        """This replica's niceness (its main thread's)."""
        return os.getpriority(os.PRIO_PROCESS, 0)

    def weights(self, role: str) -> dict[str, Any]:
        """``get_weights()`` of this replica's ``role`` component, on the CPU."""
        return {k: v.cpu() for k, v in self.replica.weights(role).items()}

    def state_dict(self) -> dict[str, Any]:
        """:meth:`Replica.state_dict` (its global generators' states included)."""
        return self.replica.state_dict()

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Restores :meth:`state_dict`'s output; ``None`` (a checkpoint taken while this replica
        was absent, lost for want of capacity) keeps the state it was built with: fresh
        episodes on the run's seeds for its shard, as a replacement starts."""
        if state is not None:
            self.replica.load_state_dict(state)

    def close(self) -> None:
        """Closes the envs, the boundary streams and server, and leaves the process group."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.replica.close()
        if self.comm is not None:
            self.comm.close()
        for server in self.servers.values():
            server.stop()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

