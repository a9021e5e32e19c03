"""A real multi-node Ray cluster on one machine: every worker node in a network namespace of its own.

Each worker node is a Linux network namespace with one end of a veth pair; the other ends hang
on a bridge in the root namespace that holds the head's address, on a private ``/24`` made for
this cluster (``10.211.<k>.0/24``, ``k`` unused on the machine). The head runs in the root
namespace bound to ``10.211.<k>.1``; worker node ``i`` runs ``ray start --address=HEAD
--node-ip-address=10.211.<k>.<i+1>`` inside its namespace, with its own temp dir. To Ray and to
msrl they are separate machines with separate network stacks (loopback, abstract Unix sockets,
interfaces); they share the file system and the kernel. Traffic stays on the bridge: no route
leaves the subnet.

Everything is torn down by what the cluster made: every process of the head's and the nodes'
sessions (each ``ray start`` leads a session of its own; Ray's workers and agents stay in it
whatever process group they take), every process inside its namespaces (``ip netns pids``), the
namespaces, the bridge and its temp dirs -- by :meth:`LocalCluster.stop`, by SIGTERM, SIGINT or
SIGHUP to ``python -m msrl.cluster.local_cluster``, and when the cluster's owner dies without
stopping it (a SIGKILLed test) by its janitor: a small process started with the cluster, in a
session of its own, that waits for its owner's end on a pipe and tears down what the owner made.
A cluster whose janitor died too is swept by the next one (:func:`sweep_stale`: names carry the
owner's pid).

Needs root and ``ip`` (iproute2); :func:`unavailable` says why not where it cannot run.

    sudo python -m msrl.cluster.local_cluster --nodes 3 --cpus 2   # prints the address; Ctrl-C stops it
    export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=/tmp/msrl-cluster-.../auth_token   # as it prints
    msrl train configs/ppo_cartpole.yaml runtime=ray cluster.address=10.211.7.1:6379 \\
        distribution_policy.name=single_learner_coarse distribution_policy.replicas.actor=2 cluster.strategy=SPREAD
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import pathlib
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

from msrl.runtime.transports.shm import pid_alive

__all__ = ["LocalCluster", "unavailable", "sweep_stale"]

#: every name this module makes starts with it (namespaces ``msrl-<pid>-n<i>``, links ``m<pid>...``)
PREFIX = "msrl-"
#: how long a node may take to join the cluster (seconds): generous, for a machine other jobs keep
#: busy (eight nodes starting on two busy cores have taken over 120 s)
JOIN_TIMEOUT_S = 600.0


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
    return out


def unavailable() -> str | None:
    """Why a namespaced cluster cannot be made on this machine (``None``: it can)."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "no `ip` command (install iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _netns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []


def _kill_netns(ns: str, timeout_s: float = 10.0) -> None:
    """SIGKILLs every process inside namespace ``ns`` until none is left (or ``timeout_s``)."""
    _kill_until_none(lambda: _netns_pids(ns), timeout_s)


def _kill_until_none(pids_of: Callable[[], list[int]], timeout_s: float) -> None:
    """SIGKILLs the processes ``pids_of()`` lists until it lists none (or ``timeout_s``): a dying
    parent's children, reparented meanwhile, are found on the next look."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = pids_of()
        if not pids or time.monotonic() > deadline:
            return
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _session_pids(sids: Sequence[int]) -> list[int]:
    """The processes of this machine whose session id is one of ``sids`` (``/proc``)."""
    want, out = set(sids), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) in want:  # state, ppid, pgrp, session
            out.append(int(entry))
    return out


def _kill_sessions(sids: Sequence[int], timeout_s: float = 10.0) -> None:
    """SIGKILLs every process of the sessions ``sids`` until none is left (or ``timeout_s``)."""
    if sids:
        _kill_until_none(lambda: [p for p in _session_pids(sids) if p != os.getpid()], timeout_s)


def teardown(state: dict[str, Any]) -> None:
    """Removes what a cluster made (idempotent): the processes of its ``sessions`` and of its
    ``namespaces``, the namespaces, its ``bridge``, its ``root`` temp dir."""
    for ns in state.get("namespaces", []):
        _kill_netns(ns)
    _kill_sessions(state.get("sessions", []))
    for ns in state.get("namespaces", []):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    if state.get("bridge"):
        subprocess.run(["ip", "link", "del", state["bridge"]], capture_output=True)
    if state.get("root"):
        shutil.rmtree(state["root"], ignore_errors=True)


def janitor() -> int:  # pragma: no cover - its own process (tests/test_local_cluster.py)
    """``python -m msrl.cluster.local_cluster --janitor``: reads the cluster's state as JSON
    lines on stdin (each replacing the last) until its owner closes it or dies, then tears it
    down (:func:`teardown`)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the owner's process group's signals: the owner answers them
    state: dict[str, Any] = {}
    for line in sys.stdin:
        if line.strip():
            state = json.loads(line)
    teardown(state)
    return 0


def sweep_stale() -> list[str]:
    """Deletes the namespaces and bridges of clusters whose owner process is gone (their names
    carry its pid); returns what it deleted."""
    gone = []
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        ns = line.split()[0] if line.split() else ""
        if ns.startswith(PREFIX) and ns.split("-")[1].isdigit() and not pid_alive(int(ns.split("-")[1])):
            _kill_netns(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            gone.append(ns)
    links = subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], capture_output=True, text=True).stdout
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        owner = re.fullmatch(r"m(\d+)(?:k\d+)?b", name)
        if owner is not None and not pid_alive(int(owner.group(1))):
            subprocess.run(["ip", "link", "del", name], capture_output=True)
            gone.append(name)
    return gone


def _take_subnet() -> tuple[int, int]:
    """Takes a ``k`` such that no interface of this machine has an address in ``10.211.k.0/24``
    and no other live cluster holds it; returns ``(k, fd)``: the subnet is this process's while
    ``fd`` (an exclusive ``flock`` on ``<tmp>/msrl-subnets/k<k>.lock``) is open.

    The lock closes a race the address check alone leaves open: two clusters started at once (two
    test workers) both saw ``k`` free, both put ``10.211.k.1`` on their bridges, and no worker node
    of either could reach its head. A dead owner's lock is released by the kernel; its bridge, until
    its janitor removes it, still keeps ``k`` taken by the address check.

    Raises:
        RuntimeError: every ``k`` in 1..254 is in use.
    """
    locks = pathlib.Path(tempfile.gettempdir()) / "msrl-subnets"
    locks.mkdir(mode=0o700, exist_ok=True)
    for k in range(1, 255):
        fd = os.open(locks / f"k{k}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
        if f" 10.211.{k}." not in used:
            return k, fd
        os.close(fd)
    raise RuntimeError("every 10.211.k.0/24 is in use on this machine")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class LocalCluster:
    """A head and ``nodes - 1`` worker nodes, each worker node in its own network namespace.

    Args:
        nodes: Ray nodes in all, the head included (>= 1).
        cpus: CPUs each node declares (``--num-cpus``).
        gpus: GPUs each node declares (``--num-gpus``; none are real: placement only).
        die_with_parent: the nodes' Ray processes get SIGKILL when this process dies (tests);
            ``False`` for a cluster that outlives its starter.
        dashboard: run the head's dashboard (the Ray Jobs API ``msrl launch`` submits to) on
            ``HEAD_IP:<free port>`` (:attr:`dashboard_address`).

    Attributes:
        address: the head's GCS address, ``10.211.<k>.1:<port>``.
        node_ips: every node's address, the head's first.

    Raises:
        RuntimeError: :func:`unavailable` says why, or a node did not join in time.
    """

    def __init__(self, nodes: int = 3, cpus: int = 2, gpus: int = 0, die_with_parent: bool = True,
                 dashboard: bool = False) -> None:
        if nodes < 1:
            raise ValueError(f"nodes must be at least 1, got {nodes}")
        why = unavailable()
        if why is not None:
            raise RuntimeError(f"cannot make a multi-node cluster on this machine: {why}")
        sweep_stale()
        self.nodes, self.cpus, self.gpus = nodes, cpus, gpus
        self.die_with_parent, self.dashboard = die_with_parent, dashboard
        self.owner = os.getpid()
        self.k, self._subnet_lock = _take_subnet()
        # names carry the owner's pid (for sweep_stale) and the subnet (two clusters of one process)
        self.bridge = f"m{self.owner}k{self.k}b"
        self.namespaces = [f"{PREFIX}{self.owner}-k{self.k}n{i}" for i in range(1, nodes)]
        self.node_ips = [f"10.211.{self.k}.{i + 1}" for i in range(nodes)]
        self.root = pathlib.Path(tempfile.mkdtemp(prefix=f"msrl-cluster-{self.owner}-"))
        #: the cluster's Ray authentication token (``RAY_AUTH_MODE=token``): every node and every
        #: client of this cluster reads it from this file (:meth:`client_env`)
        self.token_path = self.root / "auth_token"
        self.token_path.write_text(secrets.token_hex(32))
        self.token_path.chmod(0o600)
        self.procs: list[subprocess.Popen | None] = []
        self.address = ""
        self.dashboard_address: str | None = None
        self._janitor: subprocess.Popen | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        """Makes the network and starts the head and every worker node; returns once every node
        has joined. On failure, tears down what it made and raises."""
        try:
            self._janitor = subprocess.Popen([sys.executable, "-m", "msrl.cluster.local_cluster", "--janitor"],
                                             stdin=subprocess.PIPE, text=True, start_new_session=True)
            self._tell_janitor()
            self._network()
            self._start_head()
            self._tell_janitor()
            for i in range(1, self.nodes):
                self.procs.append(self._start_node(i))
                self._tell_janitor()
            self.wait_nodes(self.nodes, restart_exited=True)
        except BaseException:
            self.stop()
            raise

    def _state(self) -> dict[str, Any]:
        """What :func:`teardown` removes of this cluster."""
        sessions = [p.pid for p in [getattr(self, "head", None), *self.procs] if p is not None]
        return {"sessions": sessions, "namespaces": self.namespaces, "bridge": self.bridge, "root": str(self.root)}

    def _tell_janitor(self) -> None:
        if self._janitor is not None and self._janitor.poll() is None:
            try:
                self._janitor.stdin.write(json.dumps(self._state()) + "\n")
                self._janitor.stdin.flush()
            except OSError:
                pass

    def _network(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.node_ips[0]}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, ns in enumerate(self.namespaces, start=1):
            _ip("netns", "add", ns)
            host = f"m{self.owner}k{self.k}h{i}"  # at most 15 characters (IFNAMSIZ)
            _ip("link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", host, "master", self.bridge, "up")
            _ip("addr", "add", f"{self.node_ips[i]}/24", "dev", "eth0", netns=ns)
            _ip("link", "set", "eth0", "up", netns=ns)
            _ip("link", "set", "lo", "up", netns=ns)

    def client_env(self) -> dict[str, str]:
        """The environment of a process that joins this cluster (a driver, ``msrl train``): this
        process's, without its own ``RAY_*`` settings, with the cluster's token."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        return {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path),
                "RAY_USAGE_STATS_ENABLED": "0"}

    def _env(self) -> dict[str, str]:
        return {**self.client_env(), "RAY_worker_niceness": "0"}

    def _ray(self) -> str:
        return str(pathlib.Path(sys.executable).with_name("ray"))

    def _popen(self, cmd: list[str], log: pathlib.Path) -> subprocess.Popen:
        return subprocess.Popen(cmd, env=self._env(), stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent if self.die_with_parent else None, start_new_session=True)

    def _start_head(self) -> None:
        ip = self.node_ips[0]
        port = _free_port(ip)
        self.address = f"{ip}:{port}"
        cmd = [self._ray(), "start", "--head", f"--node-ip-address={ip}", f"--port={port}", f"--num-cpus={self.cpus}",
               f"--num-gpus={self.gpus}", f"--temp-dir={self.root / 'head'}", "--disable-usage-stats", "--block"]
        if self.dashboard:
            dport = _free_port(ip)
            self.dashboard_address = f"http://{ip}:{dport}"
            cmd += ["--include-dashboard=true", f"--dashboard-host={ip}", f"--dashboard-port={dport}",
                    # the job agent on a free port (Ray's default, 52365, may be another Ray's here)
                    f"--dashboard-agent-listen-port={_free_port(ip)}"]
        else:
            cmd += ["--include-dashboard=false"]
        self.head = self._popen(cmd, self.root / "head.log")
        self._wait_port(ip, port, self.head, "the head's GCS")

    def _start_node(self, i: int) -> subprocess.Popen:
        ns = self.namespaces[i - 1]
        cmd = ["ip", "netns", "exec", ns, self._ray(), "start", f"--address={self.address}",
               f"--node-ip-address={self.node_ips[i]}", f"--num-cpus={self.cpus}", f"--num-gpus={self.gpus}",
               f"--temp-dir={self.root / f'node{i}'}", "--disable-usage-stats", "--block"]
        return self._popen(cmd, self.root / f"node{i}.log")

    def _wait_port(self, host: str, port: int, proc: subprocess.Popen, what: str) -> None:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited ({proc.returncode}) before listening on {host}:{port}: "
                                   f"see {self.root}")
            try:
                with socket.create_connection((host, port), timeout=1.0):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"{what} did not listen on {host}:{port} within {JOIN_TIMEOUT_S:g} s")

    def alive_nodes(self) -> list[str]:
        """The addresses of the nodes Ray calls alive (asked of the head's GCS)."""
        code = ("import json, ray; ray.init(address=%r, log_to_driver=False); "
                "print('msrl-nodes', json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))") % self.address
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=self._env(),
                             timeout=JOIN_TIMEOUT_S)
        # (Ray may print its own notes on stdout too, e.g. of a raylet's lagging heartbeats)
        lines = [line for line in out.stdout.splitlines() if line.startswith("msrl-nodes ")]
        return json.loads(lines[-1].split(" ", 1)[1]) if out.returncode == 0 and lines else []

    def wait_nodes(self, n: int, timeout_s: float = JOIN_TIMEOUT_S, restart_exited: bool = False) -> list[str]:
        """Waits until exactly ``n`` nodes are alive; returns their addresses. ``restart_exited``
        (a start): a worker node whose ``ray start --block`` exited before the node joined is
        started again, twice at most (its raylet has crashed in its start-up now and then on a
        busy machine: Ray 2.60), saying so on stderr.

        Raises:
            RuntimeError: they were not within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        alive: list[str] = []
        restarts = [0] * len(self.procs)
        while time.monotonic() < deadline:
            alive = self.alive_nodes()
            if len(alive) == n:
                return alive
            for k, proc in enumerate(self.procs if restart_exited else []):
                i = k + 1
                if proc is not None and proc.poll() is not None and self.node_ips[i] not in alive and restarts[k] < 2:
                    restarts[k] += 1
                    print(f"local_cluster: node {i} ({self.node_ips[i]}) exited ({proc.returncode}) before joining; "
                          f"starting it again ({restarts[k]} of 2)", file=sys.stderr, flush=True)
                    shutil.rmtree(self.root / f"node{i}", ignore_errors=True)
                    self.procs[k] = self._start_node(i)
                    self._tell_janitor()
            time.sleep(1.0)
        missing = [i for i in range(1, self.nodes) if self.node_ips[i] not in alive]
        tails = []
        for i in missing:  # what each missing node's `ray start` said last (its logs go with the teardown)
            log = self.root / f"node{i}.log"
            lines = log.read_text(errors="replace").strip().splitlines()[-3:] if log.is_file() else []
            tails.append(f"node {i}: " + (" | ".join(lines) if lines else "no output"))
        raise RuntimeError(f"{n} nodes were not alive within {timeout_s:g} s (alive: {alive}); logs in {self.root}"
                           + ("; " + "; ".join(tails) if tails else ""))

    # -- faults ------------------------------------------------------------------------------
    def node_pids(self, i: int) -> list[int]:
        """Every process of worker node ``i`` (``1 <= i < nodes``): those in its namespace."""
        return _netns_pids(self.namespaces[i - 1])

    def kill_node(self, i: int) -> list[int]:
        """SIGKILLs every process of worker node ``i`` (its raylet, its workers, the replicas
        on it) at once, as a machine that loses power; returns their pids."""
        pids = self.node_pids(i)
        _kill_netns(self.namespaces[i - 1])
        proc = self.procs[i - 1]
        if proc is not None:
            proc.wait(timeout=30)
        return pids

    def restart_node(self, i: int) -> None:
        """Starts worker node ``i`` again (after :meth:`kill_node`), with a fresh temp dir, once
        the head's GCS has marked the lost one dead (a raylet started on its address before then
        has crashed in its start-up here, now and then: Ray 2.60).

        Raises:
            RuntimeError: the GCS still called the lost node alive after ``JOIN_TIMEOUT_S``.
        """
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while self.node_ips[i] in self.alive_nodes():
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {i} ({self.node_ips[i]}) was still alive to the GCS {JOIN_TIMEOUT_S:g} s "
                                   f"after it was killed; logs in {self.root}")
            time.sleep(1.0)
        shutil.rmtree(self.root / f"node{i}", ignore_errors=True)
        self.procs[i - 1] = self._start_node(i)
        self._tell_janitor()

    # -- teardown ----------------------------------------------------------------------------
    def stop(self) -> None:
        """Stops every process the cluster started and deletes its namespaces, bridge and temp
        dirs (idempotent)."""
        for ns in self.namespaces:
            _kill_netns(ns)
        for proc in [*self.procs, getattr(self, "head", None)]:
            if proc is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: the head's whole tree
                except ProcessLookupError:
                    pass
                proc.wait(timeout=30)
        teardown(self._state())  # what killpg missed: workers and agents in process groups of their own
        if self._janitor is not None:
            try:
                self._janitor.stdin.close()  # nothing left for it: it exits
                self._janitor.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
            self._janitor = None
        if self._subnet_lock is not None:
            os.close(self._subnet_lock)  # torn down: the subnet is free for another cluster
            self._subnet_lock = None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m msrl.cluster.local_cluster``: starts a cluster, prints its address, and keeps
    it until Ctrl-C, SIGTERM or SIGHUP (then tears it down)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=3, help="Ray nodes, the head included")
    p.add_argument("--cpus", type=int, default=2, help="CPUs each node declares")
    p.add_argument("--gpus", type=int, default=0, help="GPUs each node declares (placement only)")
    p.add_argument("--dashboard", action="store_true", help="run the head's dashboard (Ray Jobs: msrl launch)")
    p.add_argument("--janitor", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.janitor:
        return janitor()
    why = unavailable()
    if why is not None:
        print(f"local_cluster: {why}", file=sys.stderr)
        return 2
    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # SIGTERM and SIGHUP stop it as Ctrl-C does: torn down

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    cluster = LocalCluster(args.nodes, args.cpus, args.gpus, die_with_parent=True, dashboard=args.dashboard)
    with cluster:
        print(f"cluster up: {args.nodes} nodes {cluster.node_ips}; address {cluster.address}"
              + (f"; dashboard {cluster.dashboard_address}" if cluster.dashboard_address else ""), flush=True)
        print(f"  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={cluster.token_path}", flush=True)
        print(f"  msrl train CONFIG runtime=ray cluster.address={cluster.address} cluster.strategy=SPREAD", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
