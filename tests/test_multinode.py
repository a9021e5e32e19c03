"""A real multi-node Ray cluster on one machine (``cluster/local_cluster.py``): worker nodes in
network namespaces of their own, each with its own address, so what runs only between machines
runs: gRPC chosen because a consumer is on another node, Gloo on the nodes' addresses, placement
spreading replicas over nodes, a whole node's death.

Skipped where namespaces cannot be made (not root, no ``ip``). The fast suite keeps one 2-node
smoke test; the rest is ``slow``.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
from procs import run

pytest.importorskip("ray")

from msrl.cluster.local_cluster import LocalCluster, unavailable  # noqa: E402

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no multi-node cluster on this machine: {WHY}")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _train(tmp_path, cluster, name, *over, timeout=900):
    """``msrl train`` of the README's CartPole PPO on ``cluster``, as a user runs it."""
    cmd = [sys.executable, "-m", "msrl.cli", "train", "configs/ppo_cartpole.yaml", f"runs_dir={tmp_path / 'runs'}",
           f"name={name}", "runtime=ray", f"cluster.address={cluster.address}", "cluster.strategy=SPREAD",
           "train.eval_every=0", "train.progress=false", *over]
    return run(cmd, cwd=ROOT, timeout=timeout, env=cluster.client_env())


def _replicas(tmp_path, name):
    return json.loads((tmp_path / "runs" / name / "replicas.json").read_text())


@pytest.fixture(scope="module")
def two_nodes():
    with LocalCluster(nodes=2, cpus=2) as c:
        yield c


def test_a_coarse_job_spreads_over_two_nodes_with_their_own_addresses(tmp_path, two_nodes):
    """The learner and an actor on different nodes: the trajectory and the weights cross between
    the nodes' addresses (Gloo), the job trains and its replicas name both nodes."""
    out = _train(tmp_path, two_nodes, "smoke", "distribution_policy.name=single_learner_coarse",
                 "distribution_policy.replicas.actor=1", "train.total_env_steps=5120")
    assert out.returncode == 0, out.stderr[-3000:]
    nodes = {r["node"] for r in _replicas(tmp_path, "smoke")}
    assert nodes == set(two_nodes.node_ips), nodes
    assert "joined the Ray cluster at" in out.stderr and "(2 node(s), 4 CPUs)" in out.stderr
