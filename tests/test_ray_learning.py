"""Acceptance: PPO solves CartPole-v1 on the Ray runtime under single_learner_coarse (2 actor
processes) and multi_learner (2 replicas), changing only the YAML's policy (slow)."""

import pytest

pytest.importorskip("ray")

from msrl.config import load_config  # noqa: E402
from msrl.run import train  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("policy", [
    ["distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2"],
    ["distribution_policy.name=multi_learner", "distribution_policy.replicas.main=2"],
], ids=["single_learner_coarse-x2", "multi_learner-x2"])
def test_ppo_solves_cartpole_on_ray(tmp_path, policy):
    import ray

    if ray.is_initialized():
        ray.shutdown()
    cfg = load_config("configs/ppo_cartpole.yaml", [*policy, "runtime=ray", f"runs_dir={tmp_path}",
                                                     "train.progress=false", "train.eval_every=20000"])
    r = train(cfg)
    assert r.eval_mean >= 475 or r.time_to_threshold_s is not None, (r.eval_mean, r.steps_to_threshold)
