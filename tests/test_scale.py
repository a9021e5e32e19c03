"""msrl at scale on a real multi-node Ray cluster (``cluster/local_cluster.py``): eight nodes, each
in a network namespace of its own with its own address, and jobs of 17-33 replicas over them
(``slow``; the default suite's multi-node smoke tests are in ``tests/test_multinode.py``).

What each test asks of the system, on one 2-core machine (the nodes declare 4 logical CPUs each and
the replicas ask half a CPU: the point is the system's behaviour at this many processes and nodes,
not speed):

* coarse with 32 actors, a node killed mid-run: every replica restarts from the checkpoint on the
  nodes left (the exact restart of a synchronous policy), each iteration is written once;
* ``async_learner`` with 32 actors: an actor SIGKILLed, then a whole node (several actors) killed:
  each lost actor is replaced alone, the learner's process never changes and its iteration count
  never goes back;
* ``multi_learner`` with 8 learners packed two to a node over 4 nodes (the all-reduce within each node
  through shared memory, across the nodes over Gloo among the node leaders), one of its nodes
  killed: the exact restart, and at the end every replica holds the same bits;
* central inference (``single_learner_fine``) with 16 env replicas: its lockstep collective, a node
  killed: the exact restart; with dynamic batching (``inference:``), an env replica SIGKILLed, then
  a node killed: each lost env replica replaced alone, the learner's process and iteration count
  never going back.
"""

from __future__ import annotations

import csv
import json
import os
import pathlib
import signal
import sys

import pytest
from procs import EVENT_TIMEOUT_S, popen, ray_log_lines, stop_tree, wait_for

pytest.importorskip("ray")

from msrl.cluster.local_cluster import LocalCluster, unavailable  # noqa: E402

WHY = unavailable()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(WHY is not None, reason=f"no multi-node cluster on this machine: {WHY}")]

ROOT = pathlib.Path(__file__).resolve().parents[1]
NODES = 8


@pytest.fixture(scope="module")
def eight_nodes():
    with LocalCluster(nodes=NODES, cpus=4) as c:
        yield c


@pytest.fixture
def cluster(eight_nodes):
    """The eight-node cluster, every node alive again after the test (a test kills one)."""
    yield eight_nodes
    for i in range(1, NODES):
        if not eight_nodes.node_pids(i):
            eight_nodes.restart_node(i)
    eight_nodes.wait_nodes(NODES)


def _start(tmp_path, cluster, name, config, *over):
    """``msrl train`` of ``config`` on ``cluster``, as a user starts it, left running; its output
    goes to a file the test reads while it runs. Returns ``(process, output file, run dir)``."""
    err = tmp_path / f"{name}.out"
    cmd = [sys.executable, "-m", "msrl.run.cli", "train", config, f"runs_dir={tmp_path / 'runs'}", f"name={name}",
           "runtime=ray", f"cluster.address={cluster.address}", "cluster.strategy=SPREAD", "cluster.cpus_per_replica=0.5",
           "train.eval_every=0", "train.progress=false", *over]
    with open(err, "w") as f:
        proc = popen(cmd, cwd=ROOT, env=cluster.client_env(), stdout=f, stderr=f, text=True)
    return proc, err, tmp_path / "runs" / name


def _rows(run_dir) -> list[dict]:
    path = run_dir / "metrics.csv"
    if not path.is_file():
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def _table(run_dir) -> list[dict]:
    return json.loads((run_dir / "replicas.json").read_text())


def _wait_rows(proc, run_dir, n: int) -> None:
    wait_for(lambda: len(_rows(run_dir)) >= n and (run_dir / "replicas.json").is_file(), f"{n} rows of the run",
             alive=proc)


def _node_without(cluster, table, fragment: str) -> int:
    """A worker node (index >= 1) holding replicas, none of them of ``fragment``; the one holding most."""
    held = {ip: [r for r in table if r["node"] == ip] for ip in cluster.node_ips[1:]}
    free = [ip for ip, rs in held.items() if rs and all(r["fragment"] != fragment for r in rs)]
    assert free, f"every worker node holds a replica of {fragment}: {table}"
    return cluster.node_ips.index(max(free, key=lambda ip: len(held[ip])))


def _finish(proc, err) -> str:
    try:
        proc.wait(timeout=EVENT_TIMEOUT_S)
    finally:
        stop_tree(proc)
    text = err.read_text()
    assert proc.returncode == 0, text[-4000:]
    assert not ray_log_lines(text), f"Ray's own log lines reached the terminal: {ray_log_lines(text)[:3]}"
    return text


def _iterations_once(rows) -> None:
    """Each iteration written once, in order, and the env steps never going back."""
    assert [int(r["iteration"]) for r in rows] == list(range(1, len(rows) + 1))
    steps = [int(r["env_steps"]) for r in rows]
    assert steps == sorted(steps), steps


def _restarted_exactly(cluster, proc, err, run_dir, total: int, at: int = 10) -> tuple[list[dict], str]:
    """Kills the worker node holding most replicas once ``at`` rows are written; the run restarts
    every replica from the checkpoint on the nodes left and finishes its ``total`` env steps.
    Returns the rows and the run's output."""
    _wait_rows(proc, run_dir, at)
    node = _node_without(cluster, _table(run_dir), "__none__")
    assert cluster.kill_node(node), "the node had no process to kill"
    text = _finish(proc, err)
    assert "restarting every replica from the checkpoint" in text, text[-4000:]
    assert "replaced it alone" not in text
    rows = _rows(run_dir)
    _iterations_once(rows)
    assert int(rows[-1]["env_steps"]) == total
    assert float(rows[-1]["faults/replica_restarts"]) >= 1
    assert cluster.node_ips[node] not in {r["node"] for r in _table(run_dir)}  # placed on the nodes left
    return rows, text


def test_coarse_with_32_actors_over_eight_nodes_restarts_exactly_when_a_node_is_lost(tmp_path, cluster):
    """PPO under synchronous coarse, 32 actors and the learner spread over 8 nodes; a node killed
    mid-run: every replica restarts from the checkpoint on the seven nodes left."""
    total = 64 * 16 * 40
    proc, err, run_dir = _start(tmp_path, cluster, "coarse", "configs/ppo_cartpole.yaml",
                                "distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=32",
                                "env.num_envs=64", f"train.total_env_steps={total}", "train.checkpoint_every=5",
                                "cluster.replica_timeout_s=60")
    _, text = _restarted_exactly(cluster, proc, err, run_dir, total)
    assert len({r["node"] for r in _table(run_dir)}) == NODES - 1
    joined = [line for line in text.splitlines() if "joined the Ray cluster" in line]
    # the restart's line counts the live nodes, not the lost one Ray has not yet marked dead
    assert "(8 node(s), 32 CPUs)" in joined[0] and "(7 node(s), 28 CPUs)" in joined[-1], joined


def _replaced_alone(tmp_path, cluster, name, config, fragment, total, *over) -> None:
    """Runs ``config`` (``fragment``'s replicas elastic) over the cluster: replica of ``fragment``
    on another node than the learner SIGKILLed, later a whole node (its replicas of ``fragment``
    with it) killed; each lost replica is replaced alone while the others run, the learner keeps
    its process, its iterations are written once each and never go back, the env steps are
    monotone, and the run finishes its budget of ``total`` env steps."""
    proc, err, run_dir = _start(tmp_path, cluster, name, config, f"train.total_env_steps={total}",
                                "cluster.replica_timeout_s=60", *over)
    try:
        _wait_rows(proc, run_dir, 8)
        before = _table(run_dir)
        learner = next(r for r in before if r["fragment"] == "learner")
        victim = next(r for r in before if r["fragment"] == fragment and r["node"] != learner["node"])
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for(lambda: "replaced it alone" in err.read_text(), f"the {fragment} replica's replacement", alive=proc)
        at = len(_rows(run_dir))
        _wait_rows(proc, run_dir, at + 5)
        table = _table(run_dir)
        node = _node_without(cluster, table, "learner")
        on_node = sorted(r["replica"] for r in table if r["node"] == cluster.node_ips[node])
        assert cluster.kill_node(node), "the node had no process to kill"
    except BaseException:
        stop_tree(proc)
        raise
    text = _finish(proc, err)
    assert "restarting every replica" not in text, text[-4000:]
    assert f"fragment {fragment} replica {victim['replica']} died; replaced it alone in " in text
    # each replica of the lost node (dead, or silent -- hung -- once its node is gone) replaced alone
    # at once, or, where Ray had not placed its bundle again within seconds, once it did, the job
    # running on without it meanwhile
    replaced = [line for line in text.splitlines() if "replaced it alone" in line or "its bundle placed again" in line]
    assert len(replaced) == 1 + len(on_node), text[-4000:]
    for r in on_node:
        assert any(f"fragment {fragment} replica {r} " in line for line in replaced), (r, replaced)
    after = _table(run_dir)
    assert next(r for r in after if r["fragment"] == "learner")["pid"] == learner["pid"]
    assert cluster.node_ips[node] not in {r["node"] for r in after}
    rows = _rows(run_dir)
    _iterations_once(rows)
    assert int(rows[-1]["env_steps"]) >= total
    assert float(rows[-1]["faults/replaced_replicas"]) == 1 + len(on_node)
    assert float(rows[-1]["faults/replica_restarts"]) == 0


def test_async_learner_with_32_actors_replaces_a_killed_actor_and_a_lost_nodes_actors_alone(tmp_path, cluster):
    """IMPALA under async_learner, 32 actors over 8 nodes: an actor SIGKILLed, later a node
    killed; each lost actor replaced alone (:func:`_replaced_alone`)."""
    _replaced_alone(tmp_path, cluster, "async", "configs/impala_cartpole.yaml", "actor", 64 * 32 * 60,
                    "distribution_policy.replicas.actor=32", "env.num_envs=64")


def test_multi_learner_x8_packed_over_four_nodes_stays_bit_identical_through_a_node_loss(tmp_path, cluster):
    """multi_learner with 8 learners, two to a node (``PACK``, 2 of a node's 4 CPUs each), so the
    gradients are summed within each node through shared memory and across the 4 nodes over Gloo
    among their leaders; one of the nodes killed mid-run: the exact restart on the nodes left. The
    run learns, and at its end every replica's learner (weights and optimiser state) holds the
    same bits."""
    import torch

    from msrl.runtime.values import same_bits

    total = 16 * 16 * 100
    proc, err, run_dir = _start(tmp_path, cluster, "multi", "configs/ppo_cartpole.yaml",
                                "distribution_policy.name=multi_learner", "distribution_policy.replicas.main=8",
                                "env.num_envs=16", f"train.total_env_steps={total}", "train.checkpoint_every=10",
                                "cluster.strategy=PACK", "cluster.cpus_per_replica=2", "cluster.replica_timeout_s=60")
    _wait_rows(proc, run_dir, 2)
    per_node: dict = {}
    for r in _table(run_dir):
        per_node[r["node"]] = per_node.get(r["node"], 0) + 1
    assert sorted(per_node.values()) == [2, 2, 2, 2], per_node  # 8 learners over 4 nodes
    rows, _ = _restarted_exactly(cluster, proc, err, run_dir, total, at=20)
    state = torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=False)
    learners = {k: v["components"]["learner"] for k, v in state["job"]["replicas"].items()}
    assert len(learners) == 8 and learners["main/0"]
    for name, learner in learners.items():
        assert same_bits(learner, learners["main/0"]), f"{name} differs from main/0"
    recent = [float(r["charts/episodic_return"]) for r in rows[-5:] if r["charts/episodic_return"] not in ("", "nan")]
    assert recent and sum(recent) / len(recent) > 100  # it learns (random: ~22)


def test_central_inference_with_16_env_replicas_over_eight_nodes_restarts_exactly_when_a_node_is_lost(
        tmp_path, cluster):
    """PPO under single_learner_fine's lockstep collective (no ``inference:`` section: a synchronous
    policy): 16 env replicas step their envs and ask the learner's fragment for actions every
    step, over 8 nodes; a node killed mid-run: the exact restart."""
    total = 32 * 16 * 30
    proc, err, run_dir = _start(tmp_path, cluster, "fine", "configs/ppo_cartpole.yaml",
                                "distribution_policy.name=single_learner_fine", "distribution_policy.replicas.env=16",
                                "env.num_envs=32", f"train.total_env_steps={total}", "train.checkpoint_every=5",
                                "cluster.replica_timeout_s=60")
    _restarted_exactly(cluster, proc, err, run_dir, total)


def test_central_inference_with_16_env_replicas_replaces_a_killed_env_replica_and_a_lost_nodes_alone(
        tmp_path, cluster):
    """PPO under central inference with dynamic batching (``inference:``, lockstep batches of all 16
    env replicas), over 8 nodes: an env replica SIGKILLed, later a node killed; each lost env
    replica replaced alone, the server serving its replacement from the start of the iteration it
    was in (:func:`_replaced_alone`)."""
    _replaced_alone(tmp_path, cluster, "served", "configs/ppo_cartpole.yaml", "env", 32 * 16 * 40,
                    "distribution_policy.name=single_learner_fine", "distribution_policy.replicas.env=16",
                    "distribution_policy.inference.max_batch=16", "env.num_envs=32")
