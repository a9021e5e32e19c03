"""msrl's A2C update is Stable-Baselines3's: the same weights, SB3's own rollouts, and the
parameters after each update agree to float32 rounding (the bench compares the two systems'
times, so it must compare the same algorithm)."""

import pytest
import torch
from tensordict import TensorDict

sb3 = pytest.importorskip("stable_baselines3")

from msrl.advantages import gae  # noqa: E402
from msrl.algorithms.a2c import A2CConfig, A2CLearner  # noqa: E402
from msrl.api import BuildContext, EnvSpec  # noqa: E402

# msrl's ActorCritic modules -> SB3's ActorCriticPolicy modules (separate 64-64 tanh MLPs)
MODULES = {"actor.0": "mlp_extractor.policy_net.0", "actor.2": "mlp_extractor.policy_net.2", "actor.4": "action_net",
           "critic.0": "mlp_extractor.value_net.0", "critic.2": "mlp_extractor.value_net.2", "critic.4": "value_net"}


def _sb3_key(key: str) -> str:
    module, param = key.rsplit(".", 1)
    return f"{MODULES[module]}.{param}"


def test_a2c_updates_match_stable_baselines3():
    from stable_baselines3.common.callbacks import CallbackList
    from stable_baselines3.common.env_util import make_vec_env

    torch.manual_seed(0)
    venv = make_vec_env("CartPole-v1", n_envs=8, seed=3)
    model = sb3.A2C("MlpPolicy", venv, ent_coef=0.0, seed=3, device="cpu")  # rl-zoo's CartPole setting
    spec = EnvSpec("CartPole-v1", venv.observation_space, venv.action_space, 8)
    learner = A2CLearner(BuildContext(A2CConfig(), spec, 0, 1, 8, 200_000, 3, torch.device("cpu")))
    ours = learner.net.state_dict()
    assert {_sb3_key(k) for k in ours} <= set(model.policy.state_dict())
    with torch.no_grad():  # SB3's initial weights and (empty) RMSprop state
        theirs = model.policy.state_dict()
        for k, v in ours.items():
            v.copy_(theirs[_sb3_key(k)])
    learner.optimizer.load_state_dict(model.policy.optimizer.state_dict())
    model._setup_learn(10_000, None)
    callback = CallbackList([])
    callback.init_callback(model)
    episodes_ended = 0
    for update in range(20):
        model.collect_rollouts(model.env, callback, model.rollout_buffer, n_rollout_steps=5)
        rb = model.rollout_buffer
        obs = torch.as_tensor(rb.observations).float()
        T, N = obs.shape[:2]
        next_obs = torch.cat([obs[1:], torch.as_tensor(model._last_obs).float()[None]])
        # CartPole-v1 does not truncate within 100 steps: every episode end is a termination
        # (SB3 marks it by the next step's episode start; its next observation is a reset one)
        terminated = torch.cat([torch.as_tensor(rb.episode_starts[1:]),
                                torch.as_tensor(model._last_episode_starts)[None]]).bool()
        episodes_ended += int(terminated.sum())
        batch = TensorDict(
            {"obs": obs, "action": torch.as_tensor(rb.actions).long().squeeze(-1),
             "log_prob": torch.as_tensor(rb.log_probs).float(), "value": torch.as_tensor(rb.values).float(),
             "reward": torch.as_tensor(rb.rewards).float(), "terminated": terminated,
             "truncated": torch.zeros_like(terminated), "next_obs": next_obs},
            batch_size=[T, N],
        )
        with torch.no_grad():
            next_values = learner.net.value(next_obs.flatten(0, 1)).view(T, N)
        advantages, returns = gae(batch["reward"], batch["value"], next_values, terminated,
                                  torch.zeros_like(terminated), 0.99, 1.0)
        torch.testing.assert_close(advantages, torch.as_tensor(rb.advantages), rtol=0, atol=1e-5)
        torch.testing.assert_close(returns, torch.as_tensor(rb.returns), rtol=0, atol=1e-5)
        learner.learn(batch)
        model.train()
        theirs = model.policy.state_dict()
        for k, v in learner.net.state_dict().items():
            torch.testing.assert_close(v, theirs[_sb3_key(k)], rtol=0, atol=1e-6, msg=f"update {update}: {k} differs")
    assert episodes_ended > 0  # the updates crossed episode ends
