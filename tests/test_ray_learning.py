"""Acceptance: PPO solves CartPole-v1 on the Ray runtime under single_learner_coarse (2 actor
processes), multi_learner (2 replicas), coarse made asynchronous (2 actor processes rolling
out while the learner learns; 3 seeds) and single_learner_fine with dynamic batching (2 env
processes served by the central actor; 3 seeds), changing only the YAML's policy (slow)."""

import pytest

pytest.importorskip("ray")

from msrl.config import load_config  # noqa: E402
from msrl.run.training import train  # noqa: E402

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


OVERLAPPED = ["distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2",
              "distribution_policy.boundaries.trajectories=fifo", "distribution_policy.boundaries.weights=latest"]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_ppo_solves_cartpole_overlapped_on_ray(tmp_path, seed):
    """Overlapped on-policy training: actors act with the newest weights they have (a lag of
    about one update, logged), and PPO still reaches 475."""
    import csv

    import ray

    if ray.is_initialized():
        ray.shutdown()
    cfg = load_config("configs/ppo_cartpole.yaml", [*OVERLAPPED, "runtime=ray", f"runs_dir={tmp_path}", f"seed={seed}",
                                                     "train.progress=false", "train.eval_every=20000"])
    r = train(cfg)
    assert r.eval_mean >= 475 or r.time_to_threshold_s is not None, (r.eval_mean, r.steps_to_threshold)
    with open(r.run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    lags = [float(row["async/policy_lag_mean"]) for row in rows]
    assert all(0 <= x <= 3 for x in lags) and sum(lags) / len(lags) >= 0.5  # overlapped: mostly one update behind


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("policy", ["async_learner", "single"])
def test_impala_reaches_475_on_cartpole(tmp_path, policy, seed):
    """IMPALA (V-trace) under async_learner (2 actor processes on Ray, never waiting for the
    learner) and under single, chosen only in YAML: an evaluation reaches a mean return of 475."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    cfg = load_config("configs/impala_cartpole.yaml", [f"distribution_policy.name={policy}", f"seed={seed}",
                                                       f"runs_dir={tmp_path}", "train.progress=false",
                                                       "train.stop_at_return=475"])
    r = train(cfg)
    assert r.time_to_threshold_s is not None, (r.eval_mean, [m.get("eval/mean_return") for m in r.metrics()])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_impalas_shipped_config_ends_solved(tmp_path, seed):
    """The shipped config as it ships (async_learner, the whole budget): the final deterministic
    evaluation is at least 475, not a peak that decays (it ended at 379 with ent_coef 0 and a
    learning rate of 1e-3)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    r = train(load_config("configs/impala_cartpole.yaml", [f"seed={seed}", f"runs_dir={tmp_path}",
                                                           "train.progress=false"]))
    assert r.eval_mean >= 475, (r.eval_mean, [m.get("eval/mean_return") for m in r.metrics() if "eval/mean_return" in m])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_ppo_solves_cartpole_with_central_inference_on_ray(tmp_path, seed):
    """SEED-style: 2 env processes stream observations to the central actor + buffer + learner,
    which serves each one's request as it comes (max_batch=1); PPO reaches 475."""
    import csv

    import ray

    if ray.is_initialized():
        ray.shutdown()
    cfg = load_config("configs/ppo_cartpole.yaml", [
        "distribution_policy.name=single_learner_fine", "distribution_policy.inference.max_batch=1",
        "distribution_policy.inference.timeout_ms=1", "runtime=ray", f"runs_dir={tmp_path}", f"seed={seed}",
        "train.progress=false", "train.eval_every=20000"])
    r = train(cfg)
    assert r.eval_mean >= 475 or r.time_to_threshold_s is not None, (r.eval_mean, r.steps_to_threshold)
    with open(r.run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert all(float(row["inference/batch_mean"]) == 1.0 for row in rows)
