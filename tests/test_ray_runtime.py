"""The Ray runtime: fragment replicas as processes, boundaries over Gloo with the codec.

One local Ray instance for the module (4 logical CPUs on the 2-core machine; one thread per
replica)."""

import os
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from msrl.cluster.ray_runtime import pid_alive  # noqa: E402
from msrl.job import Job  # noqa: E402


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def _learner_weights_local(job):
    return {k: v.clone() for k, v in job.component("learner").get_weights().items()}


def test_coarse_on_ray_equals_the_local_runtime_bitwise(ray_local, spec_factory):
    from msrl.cluster.ray_runtime import RayJob

    spec = spec_factory("single_learner_coarse")
    local = Job(spec)
    local.reset()
    local_metrics = [local.train_step() for _ in range(3)]
    remote = RayJob(spec)
    try:
        pids = remote.pids()
        assert len(set(pids)) == 3 and os.getpid() not in pids  # one process per replica
        remote.reset()
        records = remote.run(3)
        assert [r["output"] for r in records] == local_metrics
        assert remote.env_steps == local.env_steps == 3 * 16 * 4
        w_remote, w_local = remote.weights("learner"), _learner_weights_local(local)
        assert w_remote.keys() == w_local.keys()
        assert all(torch.equal(w_remote[k], w_local[k]) for k in w_local)
        assert sorted(remote.pop_episode_stats().returns) == sorted(local.pop_episode_stats().returns)
    finally:
        remote.close()
        local.close()
    deadline = time.time() + 20
    while any(pid_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(pid_alive(p) for p in pids), "a replica process outlived its job"


def test_multi_learner_on_ray_keeps_replicas_identical_and_equals_local(ray_local, spec_factory):
    from msrl.cluster.ray_runtime import RayJob

    spec = spec_factory("multi_learner", num_envs=4)
    local = Job(spec)
    local.reset()
    for _ in range(2):
        local.train_step()
    remote = RayJob(spec)
    try:
        remote.reset()
        remote.run(2)
        w0, w1 = remote.weights("learner", 0), remote.weights("learner", 1)
        assert all(torch.equal(w0[k], w1[k]) for k in w0)
        w_local = local.component("learner").get_weights()
        assert all(torch.equal(w0[k], w_local[k]) for k in w0)
    finally:
        remote.close()
        local.close()


EXPLODING = """
import dataclasses
from msrl.algorithms.ppo import ALGORITHM as PPO, PPOLearner

class ExplodingLearner(PPOLearner):
    calls = 0

    def learn(self, batch):
        self.calls += 1
        if self.calls >= 2:
            raise RuntimeError("learner exploded")
        return super().learn(batch)

ALGORITHM = dataclasses.replace(PPO, name="exploding", components={**PPO.components, "learner": ExplodingLearner})
"""


def test_a_failing_replica_stops_the_job_with_its_node(ray_local, spec_factory, tmp_path):
    import dataclasses

    from msrl.cluster.ray_runtime import RayJob
    from msrl.job import load_algorithm
    from msrl.runtime.replica import FragmentError

    path = tmp_path / "exploding.py"
    path.write_text(EXPLODING)
    spec = dataclasses.replace(spec_factory("single_learner_coarse", num_envs=4), algorithm=load_algorithm(str(path)))
    remote = RayJob(spec, algorithm_ref=str(path))  # each process imports the algorithm file
    try:
        remote.reset()
        with pytest.raises(FragmentError) as info:
            remote.run(3)
        e = info.value
        assert (e.fragment, e.replica) == ("learner", 0)
        assert "learner exploded" in str(e) and "call learner.learn(trajectory)" in str(e)
        assert remote.actors == []  # every replica process was stopped
    finally:
        remote.close()
