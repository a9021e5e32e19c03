"""The spaces users bring: ``MultiDiscrete`` actions for the actor-critic algorithms (PPO, A2C,
IMPALA: independent Categoricals), ``Dict`` observations through gymnasium's
``FlattenObservation`` (``env.wrappers: [flatten_observation]``), on every env engine, learned
and checkpointed exactly; what is still refused, in one line."""

from __future__ import annotations

import csv

import engine_envs  # noqa: F401 - registers MatchTargets-v0 (Dict observations, MultiDiscrete([3, 4]) actions)
import gymnasium
import numpy as np
import pytest
import torch

ENV = "engine_envs:MatchTargets-v0"
CONFIGS = {"ppo": "configs/ppo_cartpole.yaml", "a2c": "configs/a2c_cartpole.yaml", "impala": "configs/impala_cartpole.yaml"}
#: each algorithm's settings for this task (its CartPole config's, where they fit a one-step task):
#: IMPALA's CartPole run makes one update per 512 steps at lr 5e-4 for a 500-step horizon
TUNED = {"impala": ["algorithm.hparams.learning_rate=0.003", "algorithm.hparams.gamma=0.9",
                    "algorithm.hparams.reward_scale=1.0", "env.num_envs=8", "algorithm.hparams.num_steps=16"]}


def test_multi_categorical_log_prob_and_entropy_are_the_sum_of_torchs_categoricals():
    from msrl.rl.distributions import multi_categorical_log_prob_entropy, sample_multi_categorical

    nvec = (3, 4, 2)
    logits = torch.randn(5, sum(nvec), generator=torch.Generator().manual_seed(0))
    action, log_prob = sample_multi_categorical(logits, nvec, torch.Generator().manual_seed(1))
    assert action.shape == (5, 3) and action.dtype == torch.int64
    parts = logits.split(list(nvec), -1)
    assert all(((0 <= action[:, j]) & (action[:, j] < n)).all() for j, n in enumerate(nvec))
    dists = [torch.distributions.Categorical(logits=p) for p in parts]
    want_lp = sum(d.log_prob(action[:, j]) for j, d in enumerate(dists))
    want_ent = sum(d.entropy() for d in dists)
    lp, ent = multi_categorical_log_prob_entropy(logits, nvec, action)
    assert torch.allclose(lp, want_lp, atol=1e-6) and torch.allclose(log_prob, want_lp, atol=1e-6)
    assert torch.allclose(ent, want_ent, atol=1e-6)
    mode, _ = sample_multi_categorical(logits, nvec, deterministic=True)
    assert torch.equal(mode, torch.stack([p.argmax(-1) for p in parts], -1))


@pytest.mark.parametrize("algo, engine, policy", [("ppo", "process", "single"), ("a2c", "sync", "single"),
                                                  ("impala", "sync", "single"),
                                                  ("ppo", "sync", "single_learner_coarse")])
def test_an_algorithm_learns_multi_discrete_actions_from_flattened_dict_observations(tmp_path, algo, engine, policy):
    """Each actor-critic algorithm on MatchTargets (Dict observations flattened, two-component
    MultiDiscrete actions; PPO also with its rollouts gathered from 2 actor replicas): its return
    rises from a random policy's 4.67 towards 16, and its deterministic evaluation answers both
    targets nearly always."""
    from msrl.config import load_config
    from msrl.run import train

    over = [f"runs_dir={tmp_path}", "name=spaces", f"env.id={ENV}", "env.wrappers=[flatten_observation]",
            f"env.engine={engine}", f"distribution_policy.name={policy}", "train.total_env_steps=40000",
            "train.progress=false", "train.eval_every=0", "eval.episodes=10", "runtime=local", *TUNED.get(algo, [])]
    result = train(load_config(CONFIGS[algo], over))
    with open(tmp_path / "spaces" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    returns = [float(r["charts/episodic_return"]) for r in rows[-10:] if r["charts/episodic_return"] not in ("", "nan")]
    assert returns and np.mean(returns) > 10.0, returns  # random: 4.67, perfect: 16
    assert result.eval_returns and result.eval_mean > 12.0


def test_a_flattened_dict_env_is_checkpointed_exactly_on_the_process_engine():
    """FlattenObservation holds a lambda (no pickle): the env snapshot makes the wrapper again
    around its restored env, and the restored envs step exactly as the saved ones."""
    from msrl.envs.engine import ProcessEnv

    env = ProcessEnv(ENV, 4, num_workers=2, wrappers=["flatten_observation"])
    try:
        env.reset(seed=3)
        acts = [torch.randint(0, 3, (4, 2), generator=torch.Generator().manual_seed(t)) for t in range(6)]
        for a in acts[:3]:
            env.step(a)
        state = env.state_dict()
        after = [env.step(a)[0] for a in acts[3:]]
        env.load_state_dict(state)
        again = [env.step(a)[0] for a in acts[3:]]
    finally:
        env.close()
    assert all(torch.equal(x, y) for x, y in zip(after, again))
    assert after[0].shape == (4, 3 + 4)  # one-hot of 3 and of Discrete(4)


def test_a_dict_observation_without_the_wrapper_is_one_config_error_naming_it(tmp_path):
    from msrl.config import ConfigError, build_job_spec, load_config

    with pytest.raises(ConfigError) as info:
        build_job_spec(load_config("configs/ppo_cartpole.yaml", [f"runs_dir={tmp_path}", f"env.id={ENV}"]))
    msg = str(info.value)
    assert "supports Box observations" in msg and "Dict observations" in msg
    assert "env.wrappers: [flatten_observation]" in msg and "\n" not in msg


def test_the_rollout_stores_multi_discrete_actions_as_int64_columns():
    from msrl.api import BuildContext, EnvSpec
    from msrl.rl.buffers import RolloutBuffer

    class _Hp:
        num_steps = 4

    spec = EnvSpec("x", gymnasium.spaces.Box(-1, 1, (5,), np.float32), gymnasium.spaces.MultiDiscrete([3, 4]), 2)
    buf = RolloutBuffer(BuildContext(hparams=_Hp(), env_spec=spec, replica=0, num_replicas=1, total_num_envs=2,
                                     total_env_steps=8, seed=0, device=torch.device("cpu")))
    assert buf.storage["action"].shape == (4, 2, 2) and buf.storage["action"].dtype == torch.int64
