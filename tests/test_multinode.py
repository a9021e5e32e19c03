"""A real multi-node Ray cluster on one machine (``cluster/local_cluster.py``): worker nodes in
network namespaces of their own, each with its own address, so what runs only between machines
runs: gRPC chosen because a consumer is on another node, Gloo on the nodes' addresses, placement
spreading replicas over nodes, a whole node's death.

Skipped where namespaces cannot be made (not root, no ``ip``). The fast suite keeps one 2-node
smoke test on four nodes (a coarse job, and an actor replaced alone); the rest is ``slow``
(and ``tests/test_scale.py``: eight nodes, 17-33 replicas).
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
from procs import ray_log_lines, run, tcp_listeners

pytest.importorskip("ray")

from msrl.cluster.local_cluster import LocalCluster, unavailable  # noqa: E402

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no multi-node cluster on this machine: {WHY}")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _train(tmp_path, cluster, name, *over, timeout=900, config="configs/ppo_cartpole.yaml"):
    """``msrl train`` of ``config`` (the README's CartPole PPO) on ``cluster``, as a user runs it."""
    cmd = [sys.executable, "-m", "msrl.run.cli", "train", config, f"runs_dir={tmp_path / 'runs'}",
           f"name={name}", "runtime=ray", f"cluster.address={cluster.address}", "cluster.strategy=SPREAD",
           "train.eval_every=0", "train.progress=false", *over]
    return run(cmd, cwd=ROOT, timeout=timeout, env=cluster.client_env())


def _replicas(tmp_path, name):
    return json.loads((tmp_path / "runs" / name / "replicas.json").read_text())


@pytest.fixture(scope="module")
def four_nodes():
    with LocalCluster(nodes=4, cpus=2) as c:
        yield c


def test_a_coarse_job_spreads_over_four_nodes_with_their_own_addresses(tmp_path, four_nodes):
    """The learner and three actors spread over the nodes: the trajectories and the weights cross
    between the nodes' addresses (Gloo), the job trains and its replicas name the nodes."""
    out = _train(tmp_path, four_nodes, "smoke", "distribution_policy.name=single_learner_coarse",
                 "distribution_policy.replicas.actor=3", "env.num_envs=12", "train.total_env_steps=5760")
    assert out.returncode == 0, out.stderr[-3000:]
    nodes = {r["node"] for r in _replicas(tmp_path, "smoke")}
    assert len(nodes) > 1 and nodes <= set(four_nodes.node_ips), nodes  # SPREAD is best effort
    assert "joined the Ray cluster at" in out.stderr and "(4 node(s), 8 CPUs)" in out.stderr


def test_an_actor_on_another_node_than_the_learner_is_replaced_alone_over_grpc(tmp_path, four_nodes):
    """IMPALA under async_learner with three actors spread over four nodes, an actor on a node the
    learner is not on SIGKILLed mid-run: it alone is started again and rejoins over gRPC (its
    greeting names its new server, the learner's stream reopens there with the newest weights);
    the learner and the other actors keep their processes, the learner's iterations never go
    back, the run finishes."""
    import csv
    import os
    import signal
    import threading
    import time

    run_dir = tmp_path / "runs" / "elastic"
    killed: list[dict] = []
    done = threading.Event()

    def kill_when_running() -> None:
        while not done.is_set():
            metrics, table = run_dir / "metrics.csv", run_dir / "replicas.json"
            if metrics.is_file() and metrics.read_text().count("\n") > 15 and table.is_file():
                replicas = json.loads(table.read_text())
                learner = next(r for r in replicas if r["fragment"] == "learner")
                victim = next(r for r in replicas if r["fragment"] == "actor" and r["node"] != learner["node"])
                killed.append({"victim": victim, "before": replicas})
                time.sleep(0.2)
                os.kill(victim["pid"], signal.SIGKILL)
                return
            time.sleep(0.05)

    t = threading.Thread(target=kill_when_running, daemon=True)
    t.start()
    try:
        out = _train(tmp_path, four_nodes, "elastic", "distribution_policy.replicas.actor=3", "env.num_envs=12",
                     "train.total_env_steps=19968", config="configs/impala_cartpole.yaml", timeout=1800)
    finally:
        done.set()
        t.join(30)
    assert out.returncode == 0, out.stderr[-3000:]
    assert killed, "no actor was killed"
    victim = killed[0]["victim"]
    assert f"fragment actor replica {victim['replica']} died; replaced it alone in " in out.stderr
    assert "restarting every replica" not in out.stderr
    before = {(r["fragment"], r["replica"]): r["pid"] for r in killed[0]["before"]}
    after = {(r["fragment"], r["replica"]): r["pid"] for r in _replicas(tmp_path, "elastic")}
    key = ("actor", victim["replica"])
    assert after[key] != before[key] and {k: v for k, v in after.items() if k != key} == {
        k: v for k, v in before.items() if k != key}
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["iteration"]) for r in rows] == list(range(1, len(rows) + 1))
    assert float(rows[-1]["faults/replaced_replicas"]) == 1 and float(rows[-1]["faults/replica_restarts"]) == 0


# -- slow: every policy across three nodes ---------------------------------------------------

#: the metrics columns a deterministic policy reproduces bit for bit
DETERMINISTIC = ("iteration", "env_steps", "charts/episodic_return", "losses/value_loss", "losses/policy_loss",
                 "losses/approx_kl")


def _rows(tmp_path, name):
    import csv

    with open(tmp_path / "runs" / name / "metrics.csv") as f:
        return [{k: r[k] for k in DETERMINISTIC if k in r} for r in csv.DictReader(f)]


def _train_one_node(tmp_path, name, *over, timeout=900):
    """The same ``msrl train`` on a Ray of one node that the run starts itself."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    cmd = [sys.executable, "-m", "msrl.run.cli", "train", "configs/ppo_cartpole.yaml", f"runs_dir={tmp_path / 'runs'}",
           f"name={name}", "runtime=ray", "train.eval_every=0", "train.progress=false", *over]
    return run(cmd, cwd=ROOT, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def three_nodes():
    with LocalCluster(nodes=3, cpus=2, dashboard=True) as c:
        yield c


SYNC_POLICIES = {
    "coarse-x2": ["distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2"],
    "multi_learner-x3": ["distribution_policy.name=multi_learner", "distribution_policy.replicas.main=3",
                         "env.num_envs=6"],
    "fine-x2": ["distribution_policy.name=single_learner_fine", "distribution_policy.replicas.env=2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(SYNC_POLICIES))
def test_a_deterministic_policy_on_three_nodes_equals_one_node_bit_for_bit(tmp_path, three_nodes, policy):
    """Boundaries and all-reduces between the nodes' addresses (Gloo on each node's interface):
    the replicas spread over the three nodes, and the metrics equal the same job's on one node,
    iteration by iteration."""
    over = [*SYNC_POLICIES[policy], "train.total_env_steps=6144"]
    out = _train(tmp_path, three_nodes, "spread", *over)
    assert out.returncode == 0, out.stderr[-3000:]
    nodes = {r["node"] for r in _replicas(tmp_path, "spread")}
    assert nodes == set(three_nodes.node_ips), nodes
    # an all-reduce sums in its algorithm's order: across nodes Gloo's, on one node the shared-
    # memory group's (rank order) unless told to use Gloo there too -- the same sum, other bits
    one = _train_one_node(tmp_path, "one", *over, *(["cluster.intra_node=gloo"] if policy.startswith("multi") else []))
    assert one.returncode == 0, one.stderr[-3000:]
    assert _rows(tmp_path, "spread") == _rows(tmp_path, "one")


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(SYNC_POLICIES))
def test_a_synchronous_policy_on_three_nodes_trains_cartpole_to_475(tmp_path, three_nodes, policy):
    """Coarse (actors on other nodes than the learner), ``single_learner_fine`` (env replicas on
    other nodes than central inference) and ``multi_learner`` x3 (one replica per node, the
    gradients all-reduced between the nodes' addresses) train the README's CartPole PPO on three
    nodes until an evaluation's mean return reaches 475, within the config's budget."""
    out = _train(tmp_path, three_nodes, "trained", *SYNC_POLICIES[policy], "train.eval_every=10000",
                 "train.stop_at_return=475", timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    assert {r["node"] for r in _replicas(tmp_path, "trained")} == set(three_nodes.node_ips)
    evaluation = json.loads((tmp_path / "runs" / "trained" / "eval.json").read_text())
    assert evaluation["time_to_threshold_s"] is not None, evaluation  # an evaluation reached 475
    assert evaluation["steps_to_threshold"] <= 300_000, evaluation


#: policies with asynchronous boundaries: (config, overrides)
STREAMED = {
    "overlapped-coarse": ("configs/ppo_cartpole.yaml", [
        "distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2",
        "distribution_policy.boundaries.trajectories=fifo", "distribution_policy.boundaries.weights=latest"]),
    "async_learner": ("configs/impala_cartpole.yaml", ["distribution_policy.name=async_learner",
                                                       "distribution_policy.replicas.actor=2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("security", ["token", "tls"])
@pytest.mark.parametrize("policy", list(STREAMED))
def test_asynchronous_boundaries_stream_between_nodes_over_grpc_and_learn(tmp_path, three_nodes, policy, security):
    """Overlapped coarse (PPO) and async_learner (IMPALA) with their actors on other nodes than
    the learner: the trajectories and weights stream over gRPC between the nodes' addresses (the
    job's token on every stream; with ``cluster.tls_*`` over TLS), and the run learns clearly (an
    evaluation mean of 300, random play ~22). An asynchronous run's final return depends on
    timing (a busy machine ended one at 472.15): its 475 over seeds is
    ``bench/bench_learning.py impala``'s, not this test's."""
    import shutil
    import subprocess

    tls = []
    if security == "tls":
        if shutil.which("openssl") is None:
            pytest.skip("openssl is not installed")
        cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=msrl-test",
                        "-addext", "subjectAltName=DNS:msrl-test", "-keyout", str(key), "-out", str(cert)],
                       check=True, capture_output=True)
        tls = [f"cluster.tls_cert={cert}", f"cluster.tls_key={key}", "cluster.tls_server_name=msrl-test"]
    config, over = STREAMED[policy]
    out = _train(tmp_path, three_nodes, "overlapped", *over, "train.eval_every=20000", *tls, timeout=1800, config=config)
    assert out.returncode == 0, out.stderr[-3000:]
    table = _replicas(tmp_path, "overlapped")
    learner = {r["node"] for r in table if "learner" in r["roles"]}
    actors = {r["node"] for r in table if "actor" in r["roles"]}
    assert actors - learner, table  # an actor on another node than the learner: gRPC between nodes
    evaluation = json.loads((tmp_path / "runs" / "overlapped" / "eval.json").read_text())
    assert evaluation["mean_return"] >= 300 or evaluation["time_to_threshold_s"] is not None, evaluation


@pytest.mark.slow
def test_a_node_killed_mid_run_is_recovered_and_the_run_continues_exactly(tmp_path, three_nodes):
    """Every process of one worker node SIGKILLed mid-run (its raylet, its Ray workers, the
    replicas on it): the job notices, restarts its replicas on the nodes left from the last
    checkpoint, counts the restart and the dropped work, and its metrics equal an uninterrupted
    run's iteration by iteration. The node, started again, is used again."""
    import csv
    import threading
    import time

    over = [*SYNC_POLICIES["coarse-x2"], "train.total_env_steps=30720", "train.checkpoint_every=10",
            "cluster.replica_timeout_s=20"]
    whole = _train_one_node(tmp_path, "whole", *over)
    assert whole.returncode == 0, whole.stderr[-3000:]
    metrics = tmp_path / "runs" / "cut" / "metrics.csv"
    killed: list[int] = []
    done = threading.Event()

    def kill_when_running() -> None:
        while not done.is_set():
            if metrics.is_file() and metrics.read_text().count("\n") > 25:
                killed.extend(three_nodes.kill_node(2))
                return
            time.sleep(0.05)

    t = threading.Thread(target=kill_when_running, daemon=True)
    t.start()
    try:
        cut = _train(tmp_path, three_nodes, "cut", *over, timeout=1800)
    finally:
        done.set()
        t.join(30)
    assert killed, "the node was never killed"
    assert cut.returncode == 0, cut.stderr[-3000:]
    assert "restarting every replica from the checkpoint" in cut.stderr
    assert not ray_log_lines(cut.stderr), f"Ray's own log lines reached the terminal: {ray_log_lines(cut.stderr)[:3]}"
    assert _rows(tmp_path, "cut") == _rows(tmp_path, "whole")  # the restart continued exactly
    with open(metrics) as f:
        last = list(csv.DictReader(f))[-1]
    assert float(last["faults/replica_restarts"]) == 1 and float(last["faults/dropped_env_steps"]) >= 0
    assert three_nodes.node_ips[2] not in {r["node"] for r in _replicas(tmp_path, "cut")}  # placed on the nodes left
    three_nodes.restart_node(2)
    three_nodes.wait_nodes(3)
    again = _train(tmp_path, three_nodes, "again", *SYNC_POLICIES["coarse-x2"], "train.total_env_steps=2048")
    assert again.returncode == 0, again.stderr[-3000:]
    assert {r["node"] for r in _replicas(tmp_path, "again")} == set(three_nodes.node_ips)  # used again


@pytest.mark.slow
def test_msrl_launch_runs_on_the_cluster_and_a_dead_head_is_one_line(tmp_path, three_nodes):
    """``msrl launch CONFIG --address http://HEAD:PORT`` against the cluster's head (a client
    holding the cluster's token): the job runs on the cluster (its replicas over the nodes), and its
    run directory and metrics come back; against a head that is not there, one line naming the
    address."""
    env = {k: v for k, v in three_nodes.client_env().items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "msrl.run.cli", "launch", "configs/ppo_cartpole.yaml",
           "distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2", "runtime=ray",
           "cluster.strategy=SPREAD", "train.total_env_steps=2048", "train.eval_every=0", "train.progress=false",
           f"runs_dir={tmp_path}"]
    out = run([*cmd, "--address", three_nodes.dashboard_address], cwd=ROOT, env=env, timeout=900)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:])
    assert "SUCCEEDED" in out.stdout and "2048 env steps" in out.stdout
    run_dir = tmp_path / "ppo_cartpole"
    assert (run_dir / "metrics.csv").read_text().count("\n") >= 8
    nodes = {r["node"] for r in json.loads((run_dir / "replicas.json").read_text())}
    assert nodes == set(three_nodes.node_ips), nodes
    dead = f"http://{three_nodes.node_ips[0]}:1"
    out = run([*cmd, "--address", dead], cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 2
    err = [line for line in out.stderr.splitlines() if line.startswith("msrl:")]
    assert len(err) == 1 and dead in err[0], out.stderr[-2000:]


def _listeners(pid: int) -> set[str]:
    """The IPv4 addresses (dotted) process ``pid`` listens on over TCP, in its own namespace."""
    import socket
    import struct

    return {socket.inet_ntoa(struct.pack("<I", int(a, 16))) for a in tcp_listeners(pid) if len(a) == 8}


STRANGER = """
import sys, grpc
from msrl.cluster.grpc_transport import METHOD
channel = grpc.insecure_channel(sys.argv[1])
call = channel.stream_stream(METHOD, request_serializer=None, response_deserializer=None)(
    iter([b"x" * 64]), metadata=[("msrl-token", "not-the-job-token"), ("msrl-producer", "actor/0")], timeout=30)
try:
    for _ in call:
        pass
    print("OK")
except grpc.RpcError as e:
    print(e.code().name)
"""


#: the driver side of the no-open-doors check, run as its own process (a client holding the
#: cluster's token): it starts an overlapped coarse job spread over the nodes, reads every
#: replica's TCP listeners, has a stranger in another node's namespace dial a boundary server,
#: and prints what it saw as JSON
DOORS = """
import dataclasses, json, subprocess, sys
sys.path.insert(0, "tests")
from conftest import ppo_spec
from test_multinode import STRANGER, _listeners
from msrl.cluster.options import RayOptions
from msrl.cluster.ray_runtime import RayJob
from msrl.run.driver import ray_job
address, namespace = sys.argv[1], sys.argv[2]
spec = ppo_spec("single_learner_coarse")
spec = dataclasses.replace(spec, policy=spec.policy.with_overrides(
    replicas={"actor": 2}, boundaries={"trajectories": "fifo", "weights": "latest"}))
job = ray_job(spec, RayOptions(address=address, strategy="SPREAD"))
try:
    job.reset()
    job.run(2)
    table = job.replica_table()
    listeners = {str(r["pid"]): sorted(_listeners(r["pid"])) for r in table}
    servers = [a for st in job.comm_stats() for a in st.get("async", {}).get("servers", []) if not a.startswith("unix:")]
    before = job.run(1)[-1]["refused"]["connections"]
    stranger = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", STRANGER, servers[0]],
                              capture_output=True, text=True, timeout=120)
    after = job.run(1)[-1]["refused"]["connections"]
    later = [r["output"] is not None for r in job.run(2)]
finally:
    job.close()
print(json.dumps({"table": table, "listeners": listeners, "servers": servers, "before": before,
                  "stranger": stranger.stdout.strip() or stranger.stderr[-1000:], "after": after, "later": later}))
"""


@pytest.mark.slow
def test_no_open_doors_between_nodes(tmp_path, three_nodes):
    """Across nodes every msrl listener is on its node's own address (or loopback): Gloo's pairs
    and the gRPC boundary servers, never all interfaces (Ray's own worker server aside). A process
    in another node's namespace that dials a boundary server without the job's token is refused
    (UNAUTHENTICATED), the refusal is counted, and the run goes on unaffected."""
    out = run([sys.executable, "-c", DOORS, three_nodes.address, three_nodes.namespaces[0]], cwd=ROOT,
              env=three_nodes.client_env(), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert {r["node"] for r in seen["table"]} == set(three_nodes.node_ips)
    for row in seen["table"]:
        others = set(seen["listeners"][str(row["pid"])]) - {row["node"], "127.0.0.1"}
        assert len(others) <= 1 and others <= {"0.0.0.0"}, (row, others)  # at most Ray's worker server
    assert seen["servers"] and all(a.rsplit(":", 1)[0] in three_nodes.node_ips for a in seen["servers"])
    assert seen["before"] == 0 and seen["stranger"] == "UNAUTHENTICATED" and seen["after"] == 1, seen
    assert all(seen["later"])  # the run unaffected


#: a job that needs all three nodes: a learner and 2 actors of 2 CPUs each, one per node
WHOLE_NODES = [*SYNC_POLICIES["coarse-x2"], "cluster.cpus_per_replica=2", "train.checkpoint_every=10",
               "cluster.replica_timeout_s=20"]


def _train_streamed(tmp_path, cluster, name, *over):
    """``msrl train`` as :func:`_train` does, started and left running; its stderr goes to a file
    the test reads while it runs. Returns ``(process, stderr file)``."""
    from procs import popen

    err = tmp_path / f"{name}.stderr"
    cmd = [sys.executable, "-m", "msrl.run.cli", "train", "configs/ppo_cartpole.yaml", f"runs_dir={tmp_path / 'runs'}",
           f"name={name}", "runtime=ray", f"cluster.address={cluster.address}", "cluster.strategy=SPREAD",
           "train.eval_every=0", "train.progress=false", *over]
    with open(err, "w") as f:
        return popen(cmd, cwd=ROOT, env=cluster.client_env(), stdout=f, stderr=f, text=True), err


def _rows_at_least(tmp_path, name, n):
    m = tmp_path / "runs" / name / "metrics.csv"
    return m.is_file() and m.read_text().count("\n") > n


@pytest.mark.slow
def test_a_node_lost_without_room_left_waits_for_capacity_and_continues_exactly_when_it_returns(tmp_path, three_nodes):
    """A job whose replicas fill all three nodes loses one: its restart cannot be placed on the
    two nodes left, so it says once what it waits for (the bundles, the live nodes, the key that
    bounds the wait) and waits; the node started again, the replicas are placed (on it too) and
    the run continues from its checkpoint, its metrics equal to an uninterrupted run's."""
    from procs import EVENT_TIMEOUT_S, stop_tree, wait_for

    over = [*WHOLE_NODES, "train.total_env_steps=30720"]
    whole = _train_one_node(tmp_path, "whole", *over)
    assert whole.returncode == 0, whole.stderr[-3000:]
    proc, err = _train_streamed(tmp_path, three_nodes, "cut", *over)
    try:
        wait_for(lambda: _rows_at_least(tmp_path, "cut", 25), "25 rows of the run", alive=proc)
        assert three_nodes.kill_node(2), "the node had no process to kill"
        wait_for(lambda: "msrl: waiting for capacity" in err.read_text(), "the job waiting for capacity", alive=proc)
        three_nodes.restart_node(2)
        proc.wait(timeout=EVENT_TIMEOUT_S)
    finally:
        stop_tree(proc)
        if len(three_nodes.alive_nodes()) < 3:
            three_nodes.restart_node(2)
        three_nodes.wait_nodes(3)
    text = err.read_text()
    assert proc.returncode == 0, text[-3000:]
    note = next(line for line in text.splitlines() if line.startswith("msrl: waiting for capacity"))
    assert "the job's 3 replicas need 3 bundles of 2 CPU (SPREAD), 6 CPU in all" in note, note
    assert "2 live node(s)" in note and three_nodes.node_ips[2] not in note.split("live node(s)")[1].split(")")[0], note
    assert "cluster.capacity_timeout_s=600 s" in note, note
    assert "the cluster holds the job's 3 replicas again after" in text
    assert _rows(tmp_path, "cut") == _rows(tmp_path, "whole")  # continued exactly
    assert {r["node"] for r in _replicas(tmp_path, "cut")} == set(three_nodes.node_ips)  # the node used again


@pytest.mark.slow
def test_a_node_lost_for_longer_than_capacity_timeout_stops_the_run_with_its_checkpoint(tmp_path, three_nodes):
    """The same loss with the node never coming back: after ``cluster.capacity_timeout_s`` the
    run stops (exit status 1) in one line naming the placement and the ``--resume`` command, its
    checkpoint kept; with the node back, ``--resume`` finishes the run."""
    from procs import EVENT_TIMEOUT_S, stop_tree, wait_for

    over = [*WHOLE_NODES, "train.total_env_steps=30720", "cluster.capacity_timeout_s=15"]
    proc, err = _train_streamed(tmp_path, three_nodes, "cut", *over)
    try:
        wait_for(lambda: _rows_at_least(tmp_path, "cut", 25), "25 rows of the run", alive=proc)
        assert three_nodes.kill_node(2), "the node had no process to kill"
        proc.wait(timeout=EVENT_TIMEOUT_S)
    finally:
        stop_tree(proc)
        if len(three_nodes.alive_nodes()) < 3:
            three_nodes.restart_node(2)
    text = err.read_text()
    assert proc.returncode == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    last = [line for line in text.splitlines() if line.startswith("msrl:")][-1]
    run_dir = tmp_path / "runs" / "cut"
    assert "the restart could not place the job's replicas" in text and "cluster.capacity_timeout_s" in text, text[-3000:]
    assert f"continue with: msrl train --resume {run_dir}" in text, text[-3000:]
    assert (run_dir / "checkpoints" / "latest.pt").is_file(), last
    three_nodes.wait_nodes(3)
    out = run([sys.executable, "-m", "msrl.run.cli", "train", "--resume", str(run_dir)], cwd=ROOT,
              env=three_nodes.client_env(), timeout=EVENT_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _rows(tmp_path, "cut")[-1]["env_steps"] == "30720"


@pytest.mark.slow
def test_multi_learner_over_three_nodes_all_reduces_hierarchically_and_keeps_every_replica_bit_identical(
        tmp_path, three_nodes):
    """multi_learner x6 over three nodes (about two replicas a node): the gradients summed within each
    node through shared memory, across the nodes over Gloo among one leader per node, the total
    handed back within each node; the run learns, and at its end every replica's learner (weights
    and optimiser state) holds the same bits."""
    import torch

    from msrl.runtime.values import same_bits

    out = _train(tmp_path, three_nodes, "hier", "distribution_policy.name=multi_learner",
                 "distribution_policy.replicas.main=6", "env.num_envs=12", "train.total_env_steps=30720")
    assert out.returncode == 0, out.stderr[-3000:]
    per_node: dict = {}
    for r in _replicas(tmp_path, "hier"):
        per_node[r["node"]] = per_node.get(r["node"], 0) + 1
    # SPREAD is best effort: what the hierarchical path needs is several nodes, one holding several replicas
    assert len(per_node) > 1 and max(per_node.values()) > 1, per_node
    state = torch.load(tmp_path / "runs" / "hier" / "checkpoints" / "latest.pt", weights_only=False)
    learners = {k: v["components"]["learner"] for k, v in state["job"]["replicas"].items()}
    assert len(learners) == 6 and learners["main/0"]
    for name, learner in learners.items():
        assert same_bits(learner, learners["main/0"]), f"{name} differs from main/0"
    rows = _rows(tmp_path, "hier")
    recent = [float(r["charts/episodic_return"]) for r in rows[-5:] if r["charts/episodic_return"] not in ("", "nan")]
    assert recent and sum(recent) / len(recent) > 100  # it learns (random: ~22)


@pytest.mark.slow
def test_actors_lost_with_their_node_and_no_room_left_are_done_without_until_it_returns(tmp_path, three_nodes):
    """IMPALA under async_learner with five actors and the learner filling all three nodes; the
    node of two actors (not the learner's) killed: no node has room for their replacements, so the
    job runs on with three actors doing the lost ones' share -- it says so, and the learner's
    iterations go on while the node is down; the node started again, the two are replaced between
    chunks and the run goes on: every iteration once, in order, the env steps never going back, no
    restart. (The run is long enough for any machine; it is stopped with Ctrl-C, as a user stops it.)"""
    import csv
    import os
    import signal

    from procs import EVENT_TIMEOUT_S, stop_tree, wait_for

    run_dir = tmp_path / "runs" / "thin"
    cmd = ["distribution_policy.replicas.actor=5", "env.num_envs=10", "cluster.cpus_per_replica=1",
           "train.total_env_steps=3200000", "train.checkpoint_every=5", "cluster.replica_timeout_s=20"]
    err = tmp_path / "thin.stderr"
    from procs import popen

    argv = [sys.executable, "-m", "msrl.run.cli", "train", "configs/impala_cartpole.yaml", f"runs_dir={tmp_path / 'runs'}",
            "name=thin", "runtime=ray", f"cluster.address={three_nodes.address}", "cluster.strategy=SPREAD",
            "train.eval_every=0", "train.progress=false", *cmd]
    with open(err, "w") as f:
        proc = popen(argv, cwd=ROOT, env=three_nodes.client_env(), stdout=f, stderr=f, text=True)

    def rows():
        m = run_dir / "metrics.csv"
        if not m.is_file():
            return []
        with open(m) as f:
            return list(csv.DictReader(f))

    try:
        wait_for(lambda: len(rows()) >= 10 and (run_dir / "replicas.json").is_file(), "10 rows of the run", alive=proc)
        table = json.loads((run_dir / "replicas.json").read_text())
        learner = next(r for r in table if r["fragment"] == "learner")
        node = next(i for i in (1, 2) if three_nodes.node_ips[i] != learner["node"])
        lost = sorted(r["replica"] for r in table if r["node"] == three_nodes.node_ips[node])
        assert len(lost) == 2 and all(r["fragment"] == "actor" for r in table if r["node"] == three_nodes.node_ips[node])
        assert three_nodes.kill_node(node), "the node had no process to kill"
        wait_for(lambda: err.read_text().count("running on with") == 2, "the job running on without both", alive=proc)
        at = len(rows())
        wait_for(lambda: len(rows()) >= at + 10, "10 iterations without the lost node", alive=proc)
        three_nodes.restart_node(node)
        wait_for(lambda: err.read_text().count("msrl: its bundle placed again") == 2, "both replaced", alive=proc)
        at = len(rows())
        wait_for(lambda: len(rows()) >= at + 10, "10 iterations with both back", alive=proc)
        os.kill(proc.pid, signal.SIGINT)  # the run is long enough for any machine: stopped as a user stops it
        proc.wait(timeout=EVENT_TIMEOUT_S)
    finally:
        stop_tree(proc)
        if len(three_nodes.alive_nodes()) < 3:
            for i in (1, 2):
                if not three_nodes.node_pids(i):
                    three_nodes.restart_node(i)
        three_nodes.wait_nodes(3)
    text = err.read_text()
    assert proc.returncode == 130, text[-4000:]  # stopped by the SIGINT, its checkpoint kept
    assert "restarting every replica" not in text and "waiting for capacity" not in text, text[-4000:]
    said = [line for line in text.splitlines() if "running on with" in line]
    assert {int(line.split("fragment actor replica ")[1].split()[0]) for line in said} == set(lost), said
    assert "running on with 4 of 5 actor replicas" in said[0] and "running on with 3 of 5 actor replicas" in said[1], said
    back = [line for line in text.splitlines() if line.startswith("msrl: its bundle placed again")]
    assert len(back) == 2, text[-4000:]
    assert not ray_log_lines(text)
    got = rows()
    assert [int(r["iteration"]) for r in got] == list(range(1, len(got) + 1))  # never back, each once
    steps = [int(r["env_steps"]) for r in got]
    # the env steps the replicas took: never going back, never more than the iterations' (320 each);
    # a lost actor's rollout in flight is dropped and counted
    assert steps == sorted(steps) and steps[-1] <= 320 * len(got), steps[-5:]
    assert steps[-1] + float(got[-1]["faults/dropped_env_steps"]) >= 320 * (len(got) - 2)
    last = got[-1]
    assert float(last["faults/absent_replicas"]) == 2 and float(last["faults/replaced_replicas"]) == 2
    assert float(last["faults/replica_restarts"]) == 0
    after = {r["replica"]: r for r in json.loads((run_dir / "replicas.json").read_text()) if r["fragment"] == "actor"}
    assert all(not after[r].get("absent") for r in lost) and {after[r]["node"] for r in lost} == {three_nodes.node_ips[node]}
