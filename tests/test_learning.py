"""PPO learns CartPole-v1 through the whole pipeline."""

import pathlib

import pytest

from msrl.config import load_config
from msrl.run.training import train

MAIN = pathlib.Path(__file__).resolve().parents[1] / "configs" / "ppo_cartpole.yaml"


@pytest.mark.parametrize("policy", ["single", "single_learner_coarse"])
def test_ppo_learns_cartpole_on_a_small_budget(tmp_path, policy):
    """A short run: far above a random policy's ~22 within 40k env steps."""
    cfg = load_config(MAIN, [f"runs_dir={tmp_path}", "train.progress=false", "train.eval_every=0",
                             "train.total_env_steps=40000", f"distribution_policy.name={policy}", "seed=2"])
    r = train(cfg)
    assert r.eval_mean >= 100, r.eval_returns


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("policy", ["single", "single_learner_coarse"])
def test_main_job_reaches_475(tmp_path, policy, seed):
    """The acceptance runs: the main job as configured (300k env steps, well within 500k)
    ends with a mean deterministic evaluation return >= 475 over 20 episodes."""
    cfg = load_config(MAIN, [f"runs_dir={tmp_path}", "train.progress=false", f"seed={seed}",
                             f"distribution_policy.name={policy}", "distribution_policy.replicas.actor=2"
                             if policy == "single_learner_coarse" else "eval.episodes=20"])
    assert cfg.train.total_env_steps <= 500_000 and cfg.eval.episodes == 20
    r = train(cfg)
    assert r.eval_mean >= 475, r.eval_returns
