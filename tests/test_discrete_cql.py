"""Discrete CQL (msrl.algorithms.discrete_cql): its penalty against Kumar et al. 2020's Eq. 4
written per state, its loss against double DQN's Huber loss plus the penalty, the target network
copied on the interval, and (slow) the policy it learns from a noisy expert's dataset."""

import copy
import math
import pathlib

import gymnasium
import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict

from msrl.algorithms.discrete_cql import DiscreteCQLConfig, DiscreteCQLLearner, discrete_conservative_penalty
from msrl.api import BuildContext, EnvSpec

OBS = gymnasium.spaces.Box(-1.0, 1.0, (4,))
ACTIONS = gymnasium.spaces.Discrete(3)
CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def _learner(**hp):
    spec = EnvSpec("test", OBS, ACTIONS, num_envs=2)
    ctx = BuildContext(DiscreteCQLConfig(hidden_sizes=(8,), **hp), spec, replica=0, num_replicas=1, total_num_envs=2,
                       total_env_steps=0, seed=0, device=torch.device("cpu"))
    return DiscreteCQLLearner(ctx)


def _batch(B=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDict({"obs": torch.randn(B, 4, generator=g), "next_obs": torch.randn(B, 4, generator=g),
                       "action": torch.randint(0, 3, (B,), generator=g), "reward": torch.rand(B, generator=g),
                       "terminated": torch.rand(B, generator=g) < 0.3}, batch_size=(B,))


def test_the_penalty_is_the_log_sum_exp_of_each_states_values_less_the_datasets_action_value():
    q = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [5.0, -1.0, 2.0]])
    action = torch.tensor([2, 0, 1])
    expected = sum(math.log(sum(math.exp(v) for v in row)) - row[a] for row, a in zip(q.tolist(), action.tolist())) / 3
    assert float(discrete_conservative_penalty(q, action)) == pytest.approx(expected, rel=1e-6)
    # every action's value the same: the penalty is log(n), whatever the action
    assert float(discrete_conservative_penalty(torch.zeros(2, 3), torch.tensor([0, 2]))) == pytest.approx(math.log(3))


@pytest.mark.parametrize("alpha", [0.0, 1.0, 4.0])
def test_one_step_is_double_dqns_huber_step_plus_alpha_times_the_penalty(alpha):
    learner, batch = _learner(alpha=alpha, learning_rate=1e-2), _batch()
    q, target = learner.q_network, learner.target_network
    with torch.no_grad():  # the target network's copy differs from the online one: double DQN is visible
        for p in target.parameters():
            p.add_(0.1)
    reference = copy.deepcopy(q)
    with torch.no_grad():
        a_next = q(batch["next_obs"]).argmax(1)
        y = batch["reward"] + 0.99 * (~batch["terminated"]).float() * target(batch["next_obs"])[torch.arange(6), a_next]
    q_all = reference(batch["obs"])
    q_data = q_all[torch.arange(6), batch["action"]]
    loss = F.smooth_l1_loss(q_data, y) + alpha * (torch.logsumexp(q_all, 1) - q_data).mean()
    opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    loss.backward()
    opt.step()
    metrics = learner.learn(batch)
    assert float(metrics["losses/loss"]) == pytest.approx(float(loss.detach()), rel=1e-6)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(q.parameters(), reference.parameters()))


def test_the_target_network_is_copied_every_interval_and_not_between():
    learner = _learner(target_update_interval=3)
    for step in range(1, 7):
        learner.learn(_batch(seed=step))
        same = all(torch.equal(a, b) for a, b in zip(learner.q_network.parameters(), learner.target_network.parameters()))
        assert same == (step % 3 == 0), step
    state = learner.state_dict()
    other = _learner(target_update_interval=3)
    other.load_state_dict(state)
    assert other.gradient_steps == 6


@pytest.mark.slow
def test_learns_cartpole_from_a_noisy_experts_dataset(tmp_path):
    """The README's PPO (seed 1) as the expert, 100 of its episodes with epsilon 0.3 (a mean
    return near 340), then ``configs/discrete_cql_cartpole.yaml`` under ``single``
    (deterministic): a greedy evaluation of 475+ after its 5,000 gradient steps."""
    import msrl
    from msrl.run.collect import collect

    expert = msrl.train(CONFIGS / "ppo_cartpole.yaml", runs_dir=str(tmp_path / "runs"), train__progress=False, seed=1)
    collect([expert.run_dir], "msrl/cartpole/ppo-noisy-v0", 100, noise=0.3, seed=0, root=tmp_path / "root")
    r = msrl.train(CONFIGS / "discrete_cql_cartpole.yaml", runs_dir=str(tmp_path / "runs"), dataset__root=str(tmp_path / "root"),
                   train__progress=False)
    assert r.eval_mean >= 475, r.eval_returns
