"""Placement on a simulated cluster (``ray.cluster_utils.Cluster``: several Ray nodes with
declared GPUs on this machine; fragments use CPU tensors). Slow: every replica is a process.

The default is 4 nodes x 2 GPUs (8 replicas, ~1 min); ``MSRL_SIM_CLUSTER=8x8`` runs the
64-replica acceptance case: 64 replica processes (~275 MB private memory each) and 8 raylets.
On the 2-core, 24 GiB dev machine it passed both tests in 507 s with 20.2 GB of memory in use
at the peak (2026-11-22):

    MSRL_SIM_CLUSTER=8x8 python -m pytest -m slow tests/test_ray_cluster.py
"""

import os

import pytest
import torch

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

NODES, GPUS = (int(x) for x in os.environ.get("MSRL_SIM_CLUSTER", "4x2").split("x"))


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": GPUS, "num_gpus": GPUS,
                                                     "_system_config": {"worker_niceness": 0}})
    for _ in range(NODES - 1):
        c.add_node(num_cpus=GPUS, num_gpus=GPUS)
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def _spec(spec_factory, policy, replicas):
    import dataclasses

    spec = spec_factory(policy, num_envs=replicas if policy == "multi_learner" else replicas - 1)
    frag = "main" if policy == "multi_learner" else "actor"
    return dataclasses.replace(spec, policy=spec.policy.with_overrides(replicas={frag: replicas if frag == "main" else replicas - 1}))


@pytest.mark.parametrize("policy", ["multi_learner", "single_learner_coarse"])
def test_one_bundle_per_declared_gpu_and_identical_weights(cluster, spec_factory, policy):
    from msrl.cluster.options import RayOptions
    from msrl.run.driver import ray_job

    n = NODES * GPUS
    job = ray_job(_spec(spec_factory, policy, n), RayOptions(gpus_per_replica=1, strategy="SPREAD"))
    try:
        table = job.replica_table()
        assert len(table) == n
        placed = {(r["node_id"], g) for r in table for g in r["gpus"]}
        assert len(placed) == n  # every replica holds its own declared GPU
        assert len({r["node_id"] for r in table}) == NODES  # spread over every node
        job.reset()
        job.run(1)
        if policy == "multi_learner":
            w = [job.weights("learner", r) for r in range(n)]
        else:  # the actors' copies of the learner's weights after the broadcast
            w = [job.weights("actor", r) for r in range(n - 1)] + [job.weights("learner")]
        for other in w[1:]:
            assert all(torch.equal(w[0][k], other[k]) for k in w[0])
    finally:
        job.close()
