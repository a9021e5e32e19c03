"""The Ray runtime: fragment replicas as processes, boundaries over Gloo with the codec.

One local Ray instance for the module (4 logical CPUs on the 2-core machine; one thread per
replica)."""

import pytest
import torch

ray = pytest.importorskip("ray")

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
