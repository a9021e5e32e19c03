"""Ray itself: starting it on this machine or joining a cluster (``cluster.address``), the
live nodes, whether the cluster stopped, and keeping Ray's own notes off the user's terminal
where msrl says the same in its own line."""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
import tempfile
import time
from typing import Any, Callable

from msrl.errors import ConfigError

__all__ = ["ClusterJoinError", "init_ray", "live_nodes", "cluster_stopped", "LOCAL_GCS_WAIT_S", "LOCAL_START_ATTEMPTS",
           "quiet_ray_notes"]


#: seconds a Ray that msrl starts on this machine waits for its GCS to come up (Ray's default: 30)
LOCAL_GCS_WAIT_S = 120


#: starts of a local Ray tried when its raylet does not register in time: Ray waits a fixed 30 s
#: for it (``ray._private.node``), which a busy 2-core machine has overrun once in a CI run
LOCAL_START_ATTEMPTS = 2


#: the words of Ray's exception when its raylet did not register within those 30 s
RAYLET_START_TIMEOUT = "timed out during startup"


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


def _started_ray(on_started: Callable[[dict[str, Any]], None] | None) -> None:
    """Passes ``on_started`` the pids of the GCS and the raylet of the Ray this process started,
    and its log folder (``{"pids": {"gcs_server": [...], "raylet": [...]}, "logs_dir": ...}``):
    what a supervising ``msrl train`` stops when this driver dies (the run layer passes it)."""
    if on_started is None:
        return
    try:
        from ray._private import worker as ray_worker

        node = ray_worker._global_node
        pids = {kind: [info.process.pid for info in infos] for kind, infos in node.all_processes.items()
                if kind in ("gcs_server", "raylet")}
        facts = {"pids": pids, "logs_dir": node.get_logs_dir_path()}
    except Exception:  # noqa: BLE001 - another Ray layout: the supervisor knows less, nothing fails
        return
    on_started(facts)


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


def init_ray(address: str | None, num_cpus: int, connect_timeout_s: float = 60.0,
             on_started: Callable[[dict[str, Any]], None] | None = None) -> None:
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
        _started_ray(on_started)
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


class _DropTokenNote(logging.Filter):
    """Drops Ray's note that token authentication is on (msrl's own default: the user's terminal
    keeps msrl's lines); the warning that it is *off* still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def quiet_ray_notes() -> None:
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

