"""The Ray runtime: every fragment replica a Ray actor in its own process, boundaries over
``torch.distributed`` (Gloo) with the codec, one placement-group bundle per replica.

Driver side (:class:`RayJob`): traces, probes and partitions the job once, reserves a placement
group (one bundle ``{"CPU": c}`` per replica, ``c`` the fragment's ``cluster.cpus_per_replica``;
PACK or SPREAD), starts one :class:`ReplicaActor` per
replica in its bundle, and sets up one Gloo process group across them (its rendezvous in Ray's
key-value store under the job's secret, :mod:`msrl.cluster.rendezvous`). Each actor builds its own :class:`~msrl.runtime.replica.Replica` --
components, envs, RNG -- from the job spec and its (fragment, replica index), with torch's and
OpenMP's thread counts set from its bundle's CPUs. From then on the driver only makes Ray calls:
``run(method, n)`` runs ``n`` iterations inside every replica, each waiting only at its boundaries,
and returns per-iteration records (the output fragment's metrics as floats, env steps, finished
episodes, the iteration's time); state dicts and evaluation weights come back the same way.
Per-iteration data between replicas never goes through Ray.

A replica that raises stops the job: the driver kills every actor (waking peers blocked at a
boundary) and re-raises the replica's :class:`~msrl.runtime.replica.FragmentError`.
"""

from __future__ import annotations

import glob
import logging
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from collections import Counter
from typing import Any, Mapping, Sequence

import cloudpickle
import torch

from msrl.api import EpisodeStats
from msrl.backend import env_frame_padding
from msrl.cluster.actor_manager import ReplicaGroup
from msrl.cluster.replacement import CAPACITY_NOTE_S, Replacements
from msrl.config import per_fragment
from msrl.errors import ConfigError, PlacementError
from msrl.runtime.codec import MAX_MESSAGE as CODEC_MAX_MESSAGE
from msrl.runtime.elastic import replaced_fragments
from msrl.runtime.host import ReplicaHost
from msrl.runtime.replica import ReplicaDied, check_losses, print_notices, replica_states
from msrl.runtime.shm import pid_alive

__all__ = ["RayJob", "ReplicaActor", "ReplicaDied", "PlacementError", "ClusterJoinError", "init_ray", "pid_alive",
           "cluster_stopped"]




#: the longest a restart's note waits for Ray to count a lost node out of the live ones
CAPACITY_SETTLE_S = 60.0

#: seconds a Ray that msrl starts on this machine waits for its GCS to come up (Ray's default: 30)
LOCAL_GCS_WAIT_S = 120
#: starts of a local Ray tried when its raylet does not register in time: Ray waits a fixed 30 s
#: for it (``ray._private.node``), which a busy 2-core machine has overrun once in a CI run
LOCAL_START_ATTEMPTS = 2
#: the words of Ray's exception when its raylet did not register within those 30 s
RAYLET_START_TIMEOUT = "timed out during startup"


def _total(bundles: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The CPUs (and GPUs, where any bundle has some) that ``bundles`` need in all."""
    return {k: sum(b.get(k, 0) for b in bundles) for k in ("CPU", "GPU") if k == "CPU" or any(b.get(k) for b in bundles)}


def _lacking(bundles: Sequence[Mapping[str, float]]) -> bool:
    """Whether the live nodes of the cluster have, in all, fewer CPUs/GPUs than ``bundles`` need."""
    import ray

    have = ray.cluster_resources()
    return any(v > have.get(k, 0) for k, v in _total(bundles).items())


def bundles_text(keys: Sequence[tuple[str, int]], bundles: Sequence[Mapping[str, float]]) -> str:
    """``"3 bundles of 2 CPU"`` where every replica's bundle is the same, else each fragment's:
    ``"3 bundles (actor: 1 CPU x2, learner: 2 CPU)"``."""
    if all(b == bundles[0] for b in bundles):
        return f"{len(bundles)} bundles of {_resources(bundles[0])}"
    per: dict[str, list] = {}
    for (fragment, _), b in zip(keys, bundles):
        per.setdefault(fragment, [b, 0])[1] += 1
    parts = [f"{f}: {_resources(b)}" + (f" x{n}" if n > 1 else "") for f, (b, n) in per.items()]
    return f"{len(bundles)} bundles ({', '.join(parts)})"


def _resources(res: Mapping[str, float]) -> str:
    """``{"CPU": 4.0, "GPU": 0.0, "memory": ...}`` as ``"4 CPU, 0 GPU"`` (CPUs and GPUs only)."""
    return ", ".join(f"{res.get(k, 0):g} {k}" for k in ("CPU", "GPU") if k == "CPU" or res.get(k))


def capacity_note(keys: Sequence[tuple[str, int]], bundles: Sequence[Mapping[str, float]], strategy: str,
                  timeout_s: float) -> str:
    """The one line a restarting job prints while the cluster cannot hold the ``bundles`` of its
    replicas ``keys``: what the job needs, the live nodes (addresses) and what they have and have
    free, how the job gets going again, and the key that bounds the wait."""
    import ray

    nodes = live_nodes()
    have = {k: sum(x.get("Resources", {}).get(k, 0) for x in nodes) for k in ("CPU", "GPU")}
    need = _total(bundles)
    n = len(bundles)
    try:
        head = ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - only for the message
        head = "HEAD:PORT"
    return (f"msrl: waiting for capacity: the job's {n} replicas need {bundles_text(keys, bundles)} "
            f"({strategy}), {_resources(need)} in all; the cluster's {len(nodes)} live node(s) "
            f"({', '.join(sorted(x.get('NodeManagerAddress', '?') for x in nodes))}) have {_resources(have)}, "
            f"{_resources(ray.available_resources())} free. The replicas start when nodes join "
            f"(ray start --address={head}) or resources free up, for up to cluster.capacity_timeout_s={timeout_s:g} s")


class ClusterJoinError(ConfigError):
    """``cluster.address`` names a Ray cluster this machine cannot join (unreachable, or token
    authentication without this machine holding the cluster's token), or Ray could not start on
    this machine: reported as one line (exit status 2) before anything is written."""


def _auth_token_available() -> bool:
    """Whether this machine holds a Ray authentication token: ``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH`` or Ray's default file ``~/.ray/auth_token`` (the sources Ray reads
    under ``RAY_AUTH_MODE=token``)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    return os.path.isfile(path)


def _report_ray() -> None:
    """Tells a supervising ``msrl train`` (:mod:`msrl.supervisor`) the pids of the GCS and the
    raylet of the Ray this driver started, and its log folder."""
    from msrl.supervisor import report

    try:
        from ray._private import worker as ray_worker

        node = ray_worker._global_node
        pids = {kind: [info.process.pid for info in infos] for kind, infos in node.all_processes.items()
                if kind in ("gcs_server", "raylet")}
        report(ray={"pids": pids, "logs_dir": node.get_logs_dir_path()})
    except Exception:  # noqa: BLE001 - another Ray layout: the supervisor knows less, nothing fails
        pass


def _tcp_refusal(host: str, port: int, timeout_s: float) -> OSError | None:
    """Why a TCP connection to ``host:port`` (brackets around an IPv6 host allowed) failed
    within ``timeout_s``, or ``None`` when something accepted it (the connection is closed)."""
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout_s):
            return None
    except OSError as e:
        return e


def _check_reachable(address: str, timeout_s: float) -> None:
    """Opens (and closes) a TCP connection to a ``HOST:PORT`` cluster address within
    ``timeout_s``: a closed port or an unknown host is one line at once, where Ray's own join
    retries for minutes. Other forms (``auto``, ``ray://...``) are left to Ray.

    Raises:
        ClusterJoinError: nothing answers at the address within ``timeout_s``.
    """
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit() or not host:
        return
    host = host.strip("[]")
    e = _tcp_refusal(host, int(port), timeout_s)
    if e is not None:
        if isinstance(e, socket.gaierror):
            what = f"the host name {host!r} does not resolve ({e.strerror or e})"
        elif isinstance(e, ConnectionRefusedError):
            what = f"{host} refused the connection at once: nothing listens on port {port} there"
        elif isinstance(e, TimeoutError):
            what = f"nothing answered there within cluster.connect_timeout_s={timeout_s:g} s"
        else:
            what = f"the connection failed ({e.strerror or e})"
        raise ClusterJoinError(
            f"cannot join the Ray cluster at cluster.address={address}: {what}; check the address (HOST:PORT of the "
            "head's GCS, as `ray start --head` printed it), that the head runs, and that the port is reachable from here"
        ) from None
    if os.environ.get("RAY_USE_TLS", "0") in ("0", ""):  # Ray's GCS speaks gRPC: a handshake, bounded
        import grpc

        channel = grpc.insecure_channel(f"{host}:{port}")
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise ClusterJoinError(
                f"cannot join the Ray cluster at cluster.address={address}: something listens there but did not "
                f"answer as a Ray GCS (gRPC) within cluster.connect_timeout_s={timeout_s:g} s; check the port (the "
                "head's GCS port, 6379 unless `ray start --head --port` chose another)"
            ) from None
        finally:
            channel.close()


def init_ray(address: str | None, num_cpus: int, connect_timeout_s: float = 60.0) -> None:
    """Starts or joins Ray for a job.

    Without ``address`` (and no ``RAY_ADDRESS`` in the environment) a new Ray instance starts on
    this machine with ``num_cpus`` logical CPUs, even when another Ray cluster already runs here
    (``ray.init(address="local")``: never the address file of someone else's cluster), its
    workers at niceness 0 (Ray's own default is 15; ``RAY_worker_niceness`` in the environment
    is honoured). A joined cluster's workers run at the niceness its operator configured. With one,
    the driver joins that cluster; when this machine holds a Ray token and ``RAY_AUTH_MODE`` is
    unset, the token is presented (``RAY_AUTH_MODE=token``): Ray 2.59+ starts clusters with
    token authentication on, and a cluster without it accepts a client that presents one.

    Joining says so on stderr (``msrl: joined the Ray cluster at ADDRESS (N node(s), C CPUs)``).
    A join takes at most about ``connect_timeout_s`` (``cluster.connect_timeout_s``): a
    ``HOST:PORT`` where nothing listens is refused at once, and Ray's own attempts to reach its
    GCS are bounded by it (``RAY_gcs_server_port_wait_time_s``, unless set). A Ray this call
    starts waits up to :data:`LOCAL_GCS_WAIT_S` for its GCS (Ray's own default is 30 s), unless
    ``RAY_gcs_server_port_wait_time_s`` is set, and is started once more (saying so on stderr)
    when its raylet does not register within Ray's fixed 30 s (:data:`LOCAL_START_ATTEMPTS`).

    Raises:
        ClusterJoinError: Ray could not connect to ``address``; the message names the address,
            the likely causes and their fixes.
    """
    import ray

    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None:
        # replicas at the driver's niceness (Ray's default puts its workers at 15, where any
        # ordinary process on the machine starves them; cluster.learner_priority counts from here)
        system = {} if "RAY_worker_niceness" in os.environ else {"worker_niceness": 0}
        # Ray waits 30 s for its new GCS to write its port; a busy machine (CI, a laptop under
        # load) has taken longer, and the start failed with nothing wrong
        os.environ.setdefault("RAY_gcs_server_port_wait_time_s", str(LOCAL_GCS_WAIT_S))
        for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
            try:
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                         configure_logging=False, _system_config=system)
                break
            except Exception as e:  # noqa: BLE001 - Ray's own start failed (a timeout on a busy machine, ...)
                try:
                    ray.shutdown()  # what the failed start left running
                except Exception:  # noqa: BLE001 - nothing was left to stop
                    pass
                said = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
                if attempt < LOCAL_START_ATTEMPTS and RAYLET_START_TIMEOUT in str(e):
                    print(f"msrl: Ray's node did not register within Ray's 30 s ({said[:120]}); starting it once more",
                          file=sys.stderr, flush=True)
                    continue
                raise ClusterJoinError(
                    f"cannot start Ray on this machine ({type(e).__name__}: {said[:300]}); Ray's logs are under "
                    f"{os.path.join(tempfile.gettempdir(), 'ray', 'session_latest', 'logs')}; on a machine this busy, "
                    "try again, or run on fewer replicas (runtime=local runs them as threads)"
                ) from None
        _report_ray()
        return
    if "RAY_AUTH_MODE" not in os.environ:
        try:  # Ray reads RAY_AUTH_MODE once, at import: its own helper sets it and refreshes its config
            from ray._private.authentication.authentication_token_setup import (
                maybe_enable_token_auth_if_token_available,
            )
        except ImportError:  # pragma: no cover - another Ray layout: the variable, for its child processes
            if _auth_token_available():
                os.environ["RAY_AUTH_MODE"] = "token"
        else:
            maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    t0 = time.monotonic()
    _check_reachable(address, connect_timeout_s)
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", str(max(1, math.ceil(connect_timeout_s))))
    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, TimeoutError) as e:
        token = ("this machine presented the token it holds (RAY_AUTH_MODE=token): check that it is the cluster's"
                 if os.environ.get("RAY_AUTH_MODE") == "token" else
                 "this machine holds no Ray token: if the cluster uses token authentication (Ray's default), "
                 "copy the head's token (`ray get-auth-token` there) into ~/.ray/auth_token or RAY_AUTH_TOKEN here")
        raise ClusterJoinError(
            f"cannot join the Ray cluster at cluster.address={address} (no answer Ray accepted within "
            f"{time.monotonic() - t0:.0f} s: {str(e).strip()[:200]}); {token}; else check the address (HOST:PORT of the "
            "head's GCS, as `ray start --head` printed it) and that the port is reachable from here"
        ) from None
    nodes = live_nodes()
    print(f"msrl: joined the Ray cluster at {address} ({len(nodes)} node(s), "
          f"{sum(n.get('Resources', {}).get('CPU', 0) for n in nodes):g} CPUs)", file=sys.stderr)


def live_nodes(timeout_s: float = 1.0) -> list[dict[str, Any]]:
    """The Ray cluster's nodes that are alive: those Ray reports alive (``ray.nodes()``) whose
    raylet accepts a TCP connection within ``timeout_s`` (asked of every node at once). Ray marks a
    lost node dead only once its health checks fail, ~15-30 s after; a restart right after a
    node's loss would otherwise count it."""
    import concurrent.futures

    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    if not alive:
        return []

    def answers(n: dict[str, Any]) -> bool:
        host, port = n.get("NodeManagerAddress"), n.get("NodeManagerPort")
        return not host or not port or _tcp_refusal(host, int(port), timeout_s) is None

    with concurrent.futures.ThreadPoolExecutor(min(32, len(alive))) as pool:
        return [n for n, ok in zip(alive, pool.map(answers, alive)) if ok]


def cluster_stopped() -> str | None:
    """Why the Ray cluster this driver is connected to has stopped, in a few words, or ``None``
    while it runs (or when this driver holds no Ray). A Ray this driver started is looked at
    through its own processes (the GCS and this node's raylet, by pid); a joined cluster
    through its GCS address (nothing answering there)."""
    import ray

    if not ray.is_initialized():
        return None
    try:
        from ray._private import worker as ray_worker
    except ImportError:  # pragma: no cover - another Ray layout: not looked at
        return None
    node = getattr(ray_worker, "_global_node", None)
    if node is None:
        return None
    if getattr(node, "head", False) and getattr(node, "all_processes", None):
        dead = [(kind, p) for kind, p in node.dead_processes() if kind in ("gcs_server", "raylet")]
        if dead:
            return ", ".join(f"its {kind} (pid {p.pid}) exited with status {p.returncode}" for kind, p in dead)
        return None
    try:
        address = node.gcs_address
    except AssertionError:
        return None
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return None
    e = _tcp_refusal(host, int(port), 10.0)
    return None if e is None else f"its GCS at {address} does not answer: {e.strerror or e}"


def uds_prefix(job_id: str) -> str:
    """The name prefix of the directories holding a job's Unix boundary sockets (under the temp
    directory of each node)."""
    return f"msrl-boundary-{job_id}-"


#: the niceness producer-only replicas get under ``cluster.learner_priority`` (of -20..19; a
#: niceness-10 thread weighs ~1/10 of a niceness-0 one in Linux's fair scheduler)
PRODUCER_NICE = 10


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def producer_only_fragments(fragment_graph: Any) -> set[str]:
    """The fragments that put on some ``fifo`` boundary and take from none, nor read a ``fresh``
    slot (the actors of overlapped coarse and of ``async_learner``: a ``latest`` slot they read
    never makes them wait): their consumers wait on them, they wait on nobody but their queue's
    credits."""
    fifo = [b for b in fragment_graph.boundaries if b.asynchronous and b.channel == "fifo"]
    fresh = {b.dst for b in fragment_graph.boundaries if b.channel == "fresh"}
    return {b.src for b in fifo} - {b.dst for b in fifo} - fresh


def producers_to_lower(keys: Sequence[tuple[str, int]], peers: Mapping[tuple[str, int], Mapping[str, Any]],
                       producers: set[str], mode: str) -> list[tuple[str, int]]:
    """The replicas ``cluster.learner_priority`` runs at :data:`PRODUCER_NICE`: with ``mode``
    ``"on"`` every replica of a ``producers`` fragment; ``"auto"`` those on a machine where the
    job's replicas (``peers[k]["node_id"]``) outnumber its cores (``peers[k]["cores"]``); ``"off"``
    none. With three busy processes on two cores, an overlapped learner otherwise gets ~2/3 of
    a core while its actors roll out, and the actors wait on its credits
    (``python bench/bench_overlap_floor.py``: the hand-written overlapped x2 loop runs 1.30x
    ``single`` with its actors at niceness 10, 1.11x without)."""
    if mode == "off":
        return []
    per_node = Counter(peers[k]["node_id"] for k in keys)
    return [k for k in keys if k[0] in producers
            and (mode == "on" or per_node[peers[k]["node_id"]] > peers[k]["cores"])]


class ReplicaActor:
    """One fragment replica in its own process (wrapped by ``ray.remote`` in :class:`RayJob`).

    Args:
        algorithm_ref: how to import the algorithm's module in this process before the spec is
            unpickled (an algorithm file's path, a dotted module; ``None`` for built-ins).
        spec_bytes, fragment_graph_bytes: the cloudpickled :class:`~msrl.job.JobSpec` and
            :class:`~msrl.partition.FragmentGraph`.
        fragment, replica: which replica.
        threads: torch intra-op (and OpenMP) threads: the bundle's CPUs.
        job_id: the job's random id, naming this replica's :class:`~msrl.cluster.watchdog.Heartbeat`.
    """

    def __init__(self, algorithm_ref: str | None, spec_bytes: bytes, fragment_graph_bytes: bytes,
                 fragment: str, replica: int, threads: int, job_id: str = "") -> None:
        from msrl.cluster.watchdog import Heartbeat

        self.host: Any = None
        self.mailbox: Any = None
        self.job_id = job_id
        self.heartbeat = Heartbeat(job_id, fragment, replica, self._progress, on_order=self._order) if job_id else None
        torch.set_num_threads(max(1, min(threads, os.cpu_count() or 1)))  # never more threads than the node's cores
        if algorithm_ref is not None:
            from msrl.job import load_algorithm

            load_algorithm(algorithm_ref)  # registers a file's module before unpickling refers to it
        from msrl.runtime.replica import Replica

        self.spec = cloudpickle.loads(spec_bytes)
        torch.set_float32_matmul_precision(self.spec.float32_matmul_precision)  # train.float32_matmul_precision
        self.fragment_graph = cloudpickle.loads(fragment_graph_bytes)
        self.fragment, self.index = fragment, replica
        self.replica = Replica(self.spec, self.fragment_graph, fragment, replica)
        self.comm: Any = None
        #: this replica's boundary servers by transport kind (:mod:`msrl.cluster.transports`), and
        #: the kinds its streams may use (``cluster.boundary_transport``)
        self.servers: dict[str, Any] = {}
        self.transport_choice = "auto"
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
        others) the server of the first kind of :mod:`msrl.cluster.transports` that serves the
        pair (``transport="auto"``: a Unix socket for producers on this machine, gRPC bound to
        this node's address as Ray reports it, or ``host``, for producers on other machines; a
        kind's name: that kind for all). Returns their addresses by kind,
        ``{"unix": "unix:/path", "grpc": "host:port"}`` (``None``: it consumes none)."""
        import ray

        from msrl.cluster.grpc_transport import MAX_MESSAGE
        from msrl.cluster.transports import kinds_for, kinds_needed
        from msrl.runtime.asynchronous import Mailbox

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
        for kind in kinds_needed(kinds_for(transport), same_node):
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
        (the link per peer pair of the synchronous boundaries, :mod:`msrl.runtime.links`). The rendezvous goes through Ray's
        key-value store under the job's secret ``token``
        (:class:`~msrl.cluster.rendezvous.RayStore`: no port opened for it).

        Raises:
            ValueError: no ``token``, or ``rank`` is not this replica's.
        """
        from msrl.cluster.rendezvous import RayStore
        from msrl.runtime import wiring

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
        (intra-op) threads."""
        import ray

        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "cores": _cores(), "threads": torch.get_num_threads()}

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

    def weights(self, role: str) -> dict[str, torch.Tensor]:
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


class _DropTokenNote(logging.Filter):
    """Drops Ray's note that token authentication is on (msrl's own default: the user's terminal
    keeps msrl's lines); the warning that it is *off* still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def _quiet_token_note() -> None:
    """Keeps Ray's own notes off the user's terminal where msrl says the same itself: the note
    that token authentication is on, and the lines Ray's daemons send the driver (``(raylet) A
    worker died or was killed``, ``(raylet) WARNING: 24 PYTHON worker processes have been
    started``, a lost node's state dumps: :func:`_without_daemon_lines`; msrl names a dead
    replica and what it does about it, :class:`ReplicaDied`)."""
    log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DropTokenNote) for f in log.filters):
        log.addFilter(_DropTokenNote())
    try:
        import ray._private.worker as ray_worker
    except ImportError:  # pragma: no cover - another Ray layout: its lines stay
        return
    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "_msrl_filtered", False):
        return
    ray_worker.print_to_stdstream = _without_daemon_lines(original)


def _without_daemon_lines(print_to_stdstream: Any) -> Any:
    """Ray's driver-side printer, dropping what Ray's own daemons (the raylet, the GCS, the
    autoscaler: a name where a worker's pid would be) send the driver's terminal: worker-death
    reports, "N PYTHON worker processes have been started" warnings, a lost node's state dumps.
    They stay in Ray's log folder; what msrl must act on it says in its own line (a replica's
    death, a hang, the cluster gone)."""

    def filtered(data: dict, ignore_prefix: bool) -> None:
        if isinstance(data.get("pid"), str) and not data.get("pid", "").isdigit():
            return  # a daemon's lines
        print_to_stdstream(data, ignore_prefix)

    filtered._msrl_filtered = True  # type: ignore[attr-defined]
    return filtered


def _line_up(records: Sequence[dict[str, Any]], n: int) -> list[dict[str, Any] | None]:
    """A replica's records of a chunk of ``n`` iterations lined up with the chunk's: a
    replacement that ran its last iterations only is ``None`` before them; a replica that ran more
    (it also did an absent replica's share) has its extra records folded into its last (env steps
    and counters as of the end; episodes, lags and seconds summed)."""
    records = list(records)
    if len(records) <= n:
        return [None] * (n - len(records)) + records
    head, rest = records[:n - 1], records[n - 1:]
    last = dict(rest[-1])
    episodes = EpisodeStats([], [])
    for r in rest:
        episodes.merge(r["episodes"])
    last["episodes"] = episodes
    last["policy_lags"] = [lag for r in rest for lag in r["policy_lags"]]
    for k in ("time_s", "comm_s", "wait_s"):
        last[k] = sum(r[k] for r in rest)
    last["output"] = next((r["output"] for r in rest if r["output"] is not None), None)
    return head + [last]


class RayJob(Replacements):
    """A job whose fragment replicas are Ray actors (see the module docstring): a
    :class:`~msrl.runtime.interface.JobRuntime`, as :class:`msrl.job.Job` is (what
    :func:`msrl.run.train` uses).

    Args:
        spec: the job.
        algorithm_ref: ``algorithm.name`` of the config when the algorithm is loaded from a file
            or module (so each process can import it); ``None`` for built-ins.
        address: a Ray cluster's address (``None``: the running Ray instance of this process, or
            a new local one; see :func:`init_ray`).
        cpus_per_replica: the CPUs of each replica's bundle (its torch/OpenMP threads): one number
            for every fragment, or fragment name -> CPUs (a fragment not named: 1).
        gpus_per_replica: the GPUs of each replica's bundle (``ray.get_gpu_ids()`` in the
            replica): one number, or fragment name -> GPUs (a fragment not named: 0).
        strategy: the placement group's strategy (``"PACK"`` or ``"SPREAD"``).
        probe: as for :class:`msrl.job.Job`.
        timeout_s: how long a replica waits at a boundary before the process group gives up.
        placement_timeout_s: how long to wait for the placement group to be placed.
        intra_node: ``"shm"``: a fragment whose replicas share one machine all-reduces host
            tensors through shared memory (:mod:`msrl.runtime.shm`); ``"gloo"``: through Gloo.
        tls: a :class:`~msrl.cluster.grpc_transport.TlsConfig` for the gRPC streams of
            asynchronous boundaries (``None``: plain TCP, still token-checked).
        max_message: the largest message of a boundary (bytes; a Gloo channel's buffer, a gRPC
            frame; default :data:`~msrl.runtime.codec.MAX_MESSAGE`).
        replica_timeout_s: seconds without a heartbeat after which a replica is hung
            (:class:`~msrl.cluster.watchdog.ReplicaHung`, raised like a death); ``None``: the
            watchdog never calls a replica hung (``cluster.watchdog: off``).
        boundary_transport: asynchronous boundaries between replicas of one machine over Unix
            sockets and between machines over gRPC (``"auto"``), or all over gRPC (``"grpc"``).
        sync_transport: synchronous boundaries per peer pair (:mod:`msrl.runtime.links`): a Unix
            socket between host replicas of one machine and Gloo otherwise (``"auto"``, or
            ``"unix"``), or Gloo for all (``"gloo"``).
        learner_priority: ``"on"``: the replicas of producer-only fragments (see
            :func:`producer_only_fragments`) run at niceness :data:`PRODUCER_NICE`; ``"auto"``:
            those on a machine where the job's replicas outnumber the cores; ``"off"``: none.
        connect_timeout_s: the longest a join of ``address`` may take (seconds).
        capacity_timeout_s: ``None`` (a first start): a cluster without the resources for the
            bundles is a :class:`PlacementError` at once, one that has them but cannot place
            them within ``placement_timeout_s`` one then. A number (a restart after a replica's
            or a node's death): the job waits up to that many seconds for the cluster to hold
            its bundles again (nodes joining, resources freed), saying once on stderr what it
            waits for and once when it is placed; then :class:`PlacementError`.
        on_replica_loss: ``cluster.on_replica_loss`` (:mod:`msrl.runtime.elastic`): which lost
            replicas are replaced alone.
        replacement_timeout_s: how long a replacement waits for its bundle to be placed (its node
            lost), saying so once; then every replica restarts (``cluster.capacity_timeout_s``).

    Raises:
        TraceError, PartitionError, ValueError: as :class:`msrl.job.Job`; ``ValueError`` for a
        strategy other than PACK/SPREAD, or a per-fragment ``cpus_per_replica``/``gpus_per_replica``
        naming a fragment the policy lacks; :class:`PlacementError` when the cluster cannot hold
        the bundles, or a fragment on a CUDA device would get no GPU (``gpus_per_replica`` 0 for it);
        :class:`ReplicaDied` when a replica cannot start.

    A replica that dies (or hangs) while the job runs is a :class:`ReplicaDied`
    (:class:`~msrl.cluster.watchdog.ReplicaHung`) from the call that met it, after every
    replica is killed; its ``env_steps`` is the job's env steps when it happened, from the
    replicas' last heartbeats.
    """

    #: a replica's death restarts the job from its last checkpoint (processes under a watchdog)
    restarts_replicas = True
    #: a failed :meth:`run` leaves ``iteration`` where the call began
    iterations_exact = False

    def __init__(self, spec: Any, algorithm_ref: str | None = None, address: str | None = None,
                 cpus_per_replica: float | Mapping[str, float] = 1.0, strategy: str = "PACK", probe: bool = True,
                 gpus_per_replica: float | Mapping[str, float] = 0.0,
                 timeout_s: float = 600.0, placement_timeout_s: float = 60.0, intra_node: str = "shm",
                 tls: Any = None, max_message: int | None = None, replica_timeout_s: float | None = 30.0,
                 boundary_transport: str = "auto", learner_priority: str = "auto", sync_transport: str = "auto",
                 connect_timeout_s: float = 60.0, capacity_timeout_s: float | None = None,
                 on_replica_loss: str = "auto", replacement_timeout_s: float = 600.0) -> None:
        import secrets

        import ray

        from msrl.job import compile_job

        if strategy not in ("PACK", "SPREAD"):
            raise ValueError(f"cluster.strategy must be PACK or SPREAD, got {strategy!r}")
        if intra_node not in ("shm", "gloo"):
            raise ValueError(f"cluster.intra_node must be shm or gloo, got {intra_node!r}")
        from msrl.runtime.links import kinds_for

        kinds_for(sync_transport)  # a ValueError naming the values, before Ray starts
        if boundary_transport not in ("auto", "grpc"):
            raise ValueError(f"cluster.boundary_transport must be auto or grpc, got {boundary_transport!r}")
        if learner_priority not in ("auto", "on", "off"):
            raise ValueError(f"cluster.learner_priority must be auto, on or off, got {learner_priority!r}")
        names = [f.name for f in spec.policy.fragments]
        cpus = per_fragment(cpus_per_replica, names, "cluster.cpus_per_replica", 1.0)
        gpus = per_fragment(gpus_per_replica, names, "cluster.gpus_per_replica", 0.0)
        cuda = sorted({f.name for f in spec.policy.fragments if torch.device(f.device).type == "cuda" and gpus[f.name] <= 0})
        if cuda:
            given = "=0" if not isinstance(gpus_per_replica, Mapping) else f" gives them none ({gpus_per_replica})"
            raise PlacementError(
                f"fragment(s) {', '.join(cuda)} hold CUDA tensors but cluster.gpus_per_replica{given}: a replica "
                "process sees no GPU without one in its bundle; set cluster.gpus_per_replica (e.g. 1, or "
                f"{{{cuda[0]}: 1}} for those fragments alone) or the fragments' device to cpu"
            )
        self.iteration = 0
        self._env_steps = 0
        #: (fragment, replica) -> that replica's env steps after the last finished chunk
        self._replica_steps: dict[tuple[str, int], int] = {}
        self.job_id = secrets.token_hex(8)
        self._stats = EpisodeStats([], [])
        self._eval_actor: Any = None
        self.spec = spec
        compiled = compile_job(spec, probe, max_message or CODEC_MAX_MESSAGE)
        self.graphs, self.fragment_graph = compiled.graphs, compiled.fragment_graph
        #: the fragments whose lost replicas are replaced alone (cluster.on_replica_loss)
        self.elastic = replaced_fragments(on_replica_loss, self.fragment_graph)
        #: the job's iteration when its replica processes started (a replacement's consumer
        #: counts the items it received from then on)
        self._start_iteration = 0
        self._faults: dict[str, int] = {}
        self._rejoin_args: tuple = ()
        self._init_replacements(replacement_timeout_s)
        self.keys = [(f.name, r) for f in spec.policy.fragments for r in range(f.replicas)]
        #: the one owner of the replica actors and their health
        self.replicas = ReplicaGroup(self.keys, {f.name: f.roles for f in spec.policy.fragments}, self._count_lost)
        self.replicas.absent = self._absent  # the same dict: the group's probes skip them
        #: each replica's placement-group bundle, in the order of ``keys``
        self.bundles = [{"CPU": cpus[f], **({"GPU": gpus[f]} if gpus[f] else {})} for f, _ in self.keys]
        need = sum(b["CPU"] for b in self.bundles)
        self._started_ray = not ray.is_initialized()
        _quiet_token_note()  # (a Ray this process started before, too: the bench, a notebook's)
        if self._started_ray:
            # on this machine: declare at least the CPUs the bundles ask for (one thread each
            # when they outnumber the cores; they then share cores, never spin on them)
            init_ray(address, max(os.cpu_count() or 1, math.ceil(need)), connect_timeout_s)
        try:
            threads = {f: max(1, int(math.floor(c))) for f, c in cpus.items()}
            self.placement_group = self._place(self.bundles, strategy, placement_timeout_s, capacity_timeout_s)
            spec_bytes, fg_bytes = cloudpickle.dumps(spec), cloudpickle.dumps(self.fragment_graph)

            def options(key: tuple[str, int]) -> dict[str, Any]:
                n = str(threads[key[0]])
                # one thread: a threaded actor (max_concurrency > 1) runs methods off the main thread
                # and cost coarse PPO ~7% of its env steps/s here (GIL hand-offs)
                return {"num_cpus": cpus[key[0]], "num_gpus": gpus[key[0]], "max_concurrency": 1,
                        "runtime_env": {"env_vars": {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}}}

            self.replicas.start(ReplicaActor, self.placement_group, options,
                                lambda key: (algorithm_ref, spec_bytes, fg_bytes, *key, threads[key[0]], self.job_id))
            ranks = {k: i for i, k in enumerate(self.keys)}
            peers = dict(zip(self.keys, self.replicas.call("info")))
            self.replicas.locate(peers, ray.get_runtime_context().get_node_id())
            lower = self._to_lower(self.keys, peers, learner_priority)
            self.replicas.call_each("lower_priority", [(PRODUCER_NICE,)] * len(lower), lower)
            servers: dict[tuple[str, int], str] = {}
            # the job's secret: the rendezvous' key prefix, every boundary stream's token, the
            # shared-memory sockets' names; handed to the replicas through Ray only
            token = secrets.token_urlsafe(32)
            self._token = token
            if any(b.asynchronous for b in self.fragment_graph.boundaries):
                addresses = self.replicas.call("start_boundary_server", token, timeout_s, tls, max_message, None, peers,
                                               boundary_transport)
                servers = {k: addr for k, addr in zip(self.keys, addresses) if addr is not None}
            if len(self.keys) > 1:
                self.replicas.call_each("init_process_group", [(ranks[k], ranks, timeout_s, peers, intra_node, servers, token,
                                                                tls, max_message, sorted(self.elastic), sync_transport)
                                                               for k in self.keys])
            self._rejoin_args = (servers, token, tls, max_message, timeout_s, boundary_transport, learner_priority)
            self._has_env = [k[0] == spec.policy.fragment_of_role("env") for k in self.keys]
            self.replicas.watch(self.job_id, replica_timeout_s)
        except BaseException as e:
            # a failed start stops what it started: its replicas (killed already where a replica
            # died) and the Ray it started; whether the cluster itself had stopped is asked first
            if isinstance(e, ReplicaDied):
                e.cluster_stopped = cluster_stopped()  # type: ignore[attr-defined]
            self.kill()
            if self._started_ray and ray.is_initialized():
                ray.shutdown()
            raise

    def _place(self, bundles: Sequence[dict[str, float]], strategy: str, placement_timeout_s: float,
               capacity_timeout_s: float | None) -> Any:
        """Reserves and returns the placement group of ``bundles`` (one per replica, in the order
        of ``keys``; see ``capacity_timeout_s`` in the class docstring for how long it waits).

        Raises:
            PlacementError: the cluster lacks the resources (first start), or the group was not
                placed in time (the message names the free resources and the key that bounds the wait).
        """
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        n = len(bundles)
        if capacity_timeout_s is None:
            for res, need in _total(bundles).items():
                have = ray.cluster_resources().get(res, 0)
                if need > have:
                    key = {"CPU": "cpus_per_replica", "GPU": "gpus_per_replica"}[res]
                    per = {f"{b.get(res, 0):g}" for b in bundles}
                    each = f"x cluster.{key}={per.pop()}" if len(per) == 1 else f"({bundles_text(self.keys, bundles)}, cluster.{key})"
                    raise PlacementError(f"{n} replicas {each} need {need:g} {res}s; the Ray cluster has {have:g}")
        deadline = placement_timeout_s if capacity_timeout_s is None else capacity_timeout_s
        group = placement_group([dict(b) for b in bundles], strategy=strategy)
        t0 = time.monotonic()
        try:
            if capacity_timeout_s is None or capacity_timeout_s <= CAPACITY_NOTE_S:
                ray.get(group.ready(), timeout=deadline)
            else:
                ready = group.ready()
                try:
                    ray.get(ready, timeout=CAPACITY_NOTE_S)
                except ray.exceptions.GetTimeoutError:
                    # Ray marks a lost node dead only once its health checks fail (~15-30 s after):
                    # until the live nodes are too small, or CAPACITY_SETTLE_S, the note would
                    # count the lost node as live; placed before then, there is nothing to say
                    while not _lacking(bundles) and time.monotonic() - t0 < min(CAPACITY_SETTLE_S, deadline):
                        try:
                            ray.get(ready, timeout=1.0)
                            return group
                        except ray.exceptions.GetTimeoutError:
                            pass
                    print(capacity_note(self.keys, bundles, strategy, capacity_timeout_s), file=sys.stderr, flush=True)
                    ray.get(ready, timeout=max(0.1, deadline - (time.monotonic() - t0)))
                    print(f"msrl: the cluster holds the job's {n} replicas again after {time.monotonic() - t0:.1f} s "
                          "of waiting; starting them", file=sys.stderr, flush=True)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            key = ("cluster.capacity_timeout_s" if capacity_timeout_s is not None else "the placement timeout")
            raise PlacementError(
                f"the placement group of {bundles_text(self.keys, bundles)} ({strategy}) was not placed within {deadline:g} s "
                f"({key}); the cluster's free resources: {_resources(ray.available_resources())}"
            ) from None
        return group

    # -- running ----------------------------------------------------------------------------
    @property
    def actors(self) -> list[Any]:
        """The replica actors, in replica order (see :class:`~msrl.cluster.actor_manager.ReplicaGroup`)."""
        return self.replicas.actors

    @property
    def watchdog(self) -> Any:
        """The replicas' heartbeat :class:`~msrl.cluster.watchdog.Watchdog` (``None`` before they start)."""
        return self.replicas.watchdog

    def _count_lost(self, cause: ReplicaDied) -> None:
        """Sets ``cause.env_steps``: the job's env steps when the replica was lost (the running
        chunk's included, from the replicas' last heartbeats), read while the others live."""
        if self.watchdog is None:
            return
        from msrl.cluster.watchdog import PERIOD_S

        time.sleep(1.5 * PERIOD_S)  # the live replicas, stuck at a boundary, report their final counts
        beats = self.watchdog.env_steps()
        reached = {k: max(self._replica_steps.get(k, 0), beats.get(k, 0))
                   for k, env in zip(self.keys, self._has_env) if env}
        dead = (cause.fragment, cause.replica)
        if dead in reached:  # its own last heartbeat may be up to a period old: as far as its peers got
            ahead = [reached[k] - self._replica_steps.get(k, 0) for k in reached if k != dead]
            reached[dead] = max(reached[dead], self._replica_steps.get(dead, 0) + max(ahead, default=0))
        cause.env_steps = max(self._env_steps, sum(reached.values()))

    def run(self, n: int, method: str = "train_step") -> list[dict[str, Any]]:
        """Runs ``n`` iterations in every replica, each replica free between its boundaries;
        returns one record per iteration: ``output`` (metrics as floats), ``env_steps`` (the
        job's total after it), ``episodes`` (the :class:`EpisodeStats` finished in it, replica 0
        first), ``time_s`` (the slowest replica's iteration time), ``policy_lags`` (learner version
        minus acting version of what asynchronous boundaries delivered), ``comm_share`` (the replicas'
        time moving values -- encoding, sending, receiving, decoding, all-reduce -- over their
        iteration time, summed over replicas) and ``wait_share`` (likewise, time blocked until a
        peer reached its side of a boundary). Episodes are also kept for :meth:`pop_episode_stats`.

        Raises:
            FragmentError: a replica raised (the job is stopped).
            ReplicaDied: a replica's process died.
            FloatingPointError: a ``*_loss`` metric is not finite.
        """
        if method == "train_step":
            end = self.iteration - self._start_iteration + n  # the consumers' iterations at the chunk's end
            if self._absent:
                self._settle_absent(end - n)
            per_replica = self._call_all("run", (method, n), end, lambda key, owed: ("run", method, owed),
                                         counts=self._chunk_counts(n) if self._absent else None)
        else:
            per_replica = self.replicas.call("run", method, n, skip=self._absent)
        per_replica = [recs or [] for recs in per_replica]  # an absent replica ran nothing
        for recs in per_replica:  # the replicas' notices (a capture, or why not), printed here
            print_notices(recs)
        # a replacement ran the chunk's last iterations only: its rows line up with theirs; a
        # replica that also did an absent one's share ran more: its last row holds the rest
        per_replica = [_line_up(recs, n) for recs in per_replica]
        faults, self._faults = self._faults, {}
        records = []
        for i in range(n):
            rows = [recs[i] if recs[i] is not None else self._idle_row(k) for k, recs in zip(self.keys, per_replica)]
            out = next((r["output"] for r in rows if r["output"] is not None), None)
            episodes = EpisodeStats([], [])
            for row, has_env in zip(rows, self._has_env):
                if has_env:
                    episodes.merge(row["episodes"])
            self._stats.merge(episodes)
            if method == "train_step":
                self.iteration += 1
            self._env_steps = sum(r["env_steps"] for r in rows)
            self._replica_steps = {k: r["env_steps"] for k, r in zip(self.keys, rows)}
            check_losses(out, self.iteration)
            busy = sum(r["time_s"] for r in rows)
            records.append({"output": out, "env_steps": self._env_steps, "episodes": episodes,
                            "policy_lags": [lag for r in rows for lag in r["policy_lags"]],
                            "inference": next((r["inference"] for r in rows if r.get("inference")), None),
                            "time_s": max(r["time_s"] for r in rows),
                            "comm_share": sum(r["comm_s"] for r in rows) / busy if busy > 0 else 0.0,
                            "wait_share": sum(r["wait_s"] for r in rows) / busy if busy > 0 else 0.0,
                            "refused": {k: sum(r["refused"][k] for r in rows) for k in rows[0]["refused"]},
                            "faults": faults if i == 0 else {}})
        return records

    def _idle_row(self, key: tuple[str, int]) -> dict[str, Any]:
        """The record of an iteration replica ``key`` did not run in this chunk (a replacement
        started after it): nothing finished, its env steps where the replacement started."""
        return {"output": None, "env_steps": self._replica_steps.get(key, 0), "episodes": EpisodeStats([], []),
                "policy_lags": [], "inference": None, "time_s": 0.0, "comm_s": 0.0, "wait_s": 0.0,
                "refused": {"connections": 0, "frames": 0, "datagrams": 0}}

    def _call_all(self, method: str, args: Sequence[Any] = (), end: int | None = None,
                  again: Any = None, counts: Mapping[tuple[str, int], int] | None = None) -> list[Any]:
        """``method(*args)`` on every replica, their results in replica order; a replica of an
        elastic fragment lost meanwhile is replaced alone (:meth:`_replace`) and ``again(key,
        owed)`` -- a method and its arguments (default: the same call) -- is what its replacement
        runs instead. ``end``: the consumers' iterations when the call ends (default: now,
        between chunks). ``counts``: for a chunk, the iterations each replica runs (``again(key,
        count)``; 0: none, an absent replica). An absent replica is not called: its result is
        ``None``."""
        if not self.elastic:
            return self.replicas.call(method, *args)
        end = self.iteration - self._start_iteration if end is None else end
        again = again or (lambda key, owed: (method, *args))
        replace = lambda cause: self._replace(cause, end, again, [] if counts is not None else None)  # noqa: E731
        if counts is None:
            return self.replicas.call(method, *args, replace=replace, skip=self._absent)
        futures = [self.replicas.submit(k, *again(k, counts[k])) if counts[k] > 0 else None for k in self.keys]
        return self.replicas.wait(futures, replace=replace)

    def _to_lower(self, keys: Sequence[tuple[str, int]], peers: Mapping[tuple[str, int], Mapping[str, Any]],
                  priority: str) -> list[tuple[str, int]]:
        """The replicas among ``keys`` whose priority ``cluster.learner_priority`` = ``priority``
        lowers (:func:`producers_to_lower`; ``peers``: every replica's ``info()``), by
        :data:`PRODUCER_NICE` (``ReplicaActor.lower_priority``)."""
        return producers_to_lower(keys, peers, producer_only_fragments(self.fragment_graph), priority)

    def _lower_replacement(self, key: tuple[str, int], peers: Mapping[tuple[str, int], Mapping[str, Any]],
                           priority: str) -> None:
        """Lowers replacement ``key``'s priority where :meth:`_to_lower` says so.

        Raises:
            ray.exceptions.RayActorError: the replacement died meanwhile.
        """
        import ray

        if self._to_lower([key], peers, priority):
            ray.get(self.replicas.submit(key, "lower_priority", PRODUCER_NICE))

    def _bundle_unplaced(self, key: tuple[str, int]) -> bool:
        """Whether replica ``key``'s placement-group bundle has no live node now (its node lost,
        not yet placed again); ``False`` when Ray does not say."""
        from ray.util.placement_group import placement_group_table

        try:
            table = placement_group_table(self.placement_group)
            node = table.get("bundles_to_node_id", {}).get(self.keys.index(key))
            live = {n.get("NodeID") for n in live_nodes()}
            return table.get("state") != "CREATED" or node is None or node not in live
        except Exception:  # noqa: BLE001 - only for the message
            return False

    def reset(self) -> None:
        """Runs every replica's ``reset`` program."""
        self.run(1, "reset")

    def train_step(self) -> dict[str, float] | None:
        """One iteration on every replica; the learner's metrics."""
        return self.run(1)[0]["output"]

    @property
    def env_steps(self) -> int:
        """Env steps taken so far, over every env replica."""
        return self._env_steps

    def pop_episode_stats(self) -> EpisodeStats:
        """Episodes finished since the last call, replica 0 first within each iteration."""
        out, self._stats = self._stats, EpisodeStats([], [])
        return out

    def weights(self, role: str, replica: int = 0) -> dict[str, torch.Tensor]:
        """``get_weights()`` of replica ``replica`` of the fragment holding ``role``. Of an elastic
        fragment, a replica lost meanwhile is replaced alone (or left absent for want of room) as
        in a chunk, and while the asked one is absent the next live replica answers."""
        frag = self.spec.policy.fragment(self.spec.policy.fragment_of_role(role))
        if frag.name not in self.elastic:
            return self.replicas.call_one((frag.name, replica), "weights", role)
        end = self.iteration - self._start_iteration
        for _ in range(frag.replicas + 1):
            live = [r for r in range(frag.replicas) if (frag.name, r) not in self._absent]
            if not live:
                break
            r = min((r for r in live if r >= replica), default=live[0])
            futures: list[Any] = [None] * len(self.keys)
            i = self.keys.index((frag.name, r))
            futures[i] = self.replicas.submit((frag.name, r), "weights", role)
            got = self.replicas.wait(futures, replace=lambda cause: self._replace(
                cause, end, lambda key, owed: ("weights", role)))[i]
            if got is not None:
                return got
        raise ReplicaDied(f"no replica of fragment {frag.name} is left to give the {role}'s weights", frag.name, replica,
                          tuple(frag.roles))

    def eval_actor(self) -> Any:
        """An actor built on the driver (CPU) holding the job's current policy weights."""
        if self._eval_actor is None:
            from msrl.runtime.replica import build_standalone_actor

            self._eval_actor, _ = build_standalone_actor(self.spec)
        self._eval_actor.set_weights(self.weights("actor"))
        return self._eval_actor

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every replica's state (from its process) and the iteration count."""
        states = self._call_all("state_dict")
        return {"iteration": self.iteration, "env_steps": self._env_steps,
                "replicas": {f"{f}/{r}": s for (f, r), s in zip(self.keys, states)}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output into every replica.

        Raises:
            KeyError: the checkpoint's replicas differ from this job's.
        """
        self.replicas.call_each("load_state_dict", [(s,) for s in replica_states(state, self.keys)])
        self.iteration = int(state["iteration"])
        self._start_iteration = self.iteration
        self._env_steps = int(state.get("env_steps", 0))
        self._replica_steps = {}  # each replica's count: from its first chunk on

    def kill(self) -> None:
        """Kills every replica process and frees the placement group (no process left behind)."""
        from ray.util.placement_group import remove_placement_group

        self.replicas.kill()
        try:
            remove_placement_group(self.placement_group)
        except Exception:  # noqa: BLE001 - none placed yet, or already removed
            pass
        # the socket directories of this node's replicas (a killed one's are still there)
        for d in glob.glob(os.path.join(tempfile.gettempdir(), uds_prefix(self.job_id) + "*")):
            shutil.rmtree(d, ignore_errors=True)

    def comm_stats(self) -> list[dict[str, Any]]:
        """Every replica's :meth:`ReplicaActor.comm_stats`, in replica order (``{}`` for an
        absent one: lost, not yet replaced for want of room)."""
        return [s or {} for s in self._call_all("comm_stats")]

    def pids(self) -> list[int]:
        """The replicas' process ids, in replica order (an absent replica's: its lost process's)."""
        return [p if p is not None else self.replicas.peers.get(k, {}).get("pid") for k, p in
                zip(self.keys, self._call_all("pid"))]

    def replica_table(self) -> list[dict[str, Any]]:
        """One row per replica: ``fragment``, ``replica``, ``roles``, ``pid`` and ``node`` (IP);
        an absent replica (lost, not yet replaced for want of room) has its lost process's, and
        ``absent: true``."""
        info = self._call_all("info")
        return [{"fragment": f, "replica": r, "roles": list(self.spec.policy.fragment(f).roles),
                 **(i if i is not None else {**self.replicas.peers.get((f, r), {}), "absent": True})}
                for (f, r), i in zip(self.keys, info)]

    def close(self) -> None:
        """Closes every replica (envs, process group), ends their processes, and stops Ray
        when this job started it. With the cluster itself gone (:func:`cluster_stopped`) nothing
        is asked of it: the replicas are killed and Ray shut down at once, where each call to a
        stopped GCS would wait out its own timeout."""
        import ray

        stopped = cluster_stopped() is not None
        if not stopped:
            self.replicas.close(timeout_s=30.0, skip=self._absent)
        self.kill()
        if self.watchdog is not None and ray.is_initialized() and not stopped:
            from msrl.cluster.rendezvous import RayStore

            self.watchdog.clear()
            RayStore(self._token, 0.0).clear()  # the rendezvous' keys
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
