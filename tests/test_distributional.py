"""C51's projection (msrl.rl.distributional) against Algorithm 1 of Bellemare et al. 2017 written
as its loops, and the properties a projection must have."""

import math

import pytest
import torch

from msrl.rl.distributional import categorical_projection, categorical_support


def _algorithm_1(next_pmf, reward, not_done, gamma, v_min, v_max, n_atoms):
    """The paper's Algorithm 1, one sample and one atom at a time."""
    dz = (v_max - v_min) / (n_atoms - 1)
    z = [v_min + i * dz for i in range(n_atoms)]
    m = [0.0] * n_atoms
    for j in range(n_atoms):
        tz = min(max(reward + gamma * not_done * z[j], v_min), v_max)
        b = (tz - v_min) / dz
        lo, up = math.floor(b), math.ceil(b)
        if lo == up:
            m[lo] += next_pmf[j]
        else:
            m[lo] += next_pmf[j] * (up - b)
            m[up] += next_pmf[j] * (b - lo)
    return m


def test_the_projection_is_algorithm_1_and_keeps_the_mass():
    g = torch.Generator().manual_seed(0)
    support = categorical_support(-10.0, 10.0, 21)
    pmfs = torch.softmax(torch.randn(64, 21, generator=g), -1)
    rewards = torch.randn(64, generator=g) * 5
    not_done = (torch.rand(64, generator=g) > 0.2).float()
    out = categorical_projection(pmfs, rewards, not_done, 0.9, support)
    assert torch.allclose(out.sum(-1), torch.ones(64), atol=1e-5)
    for i in range(64):
        ref = _algorithm_1(pmfs[i].tolist(), float(rewards[i]), float(not_done[i]), 0.9, -10.0, 10.0, 21)
        assert torch.allclose(out[i], torch.tensor(ref), atol=1e-5), i


def test_a_terminal_transition_puts_the_reward_on_its_atoms():
    support = categorical_support(-2.0, 2.0, 5)  # atoms -2, -1, 0, 1, 2
    pmf = torch.full((2, 5), 0.2)
    out = categorical_projection(pmf, torch.tensor([1.0, 0.5]), torch.zeros(2), 0.99, support)
    assert out[0].tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]  # exactly on an atom: all of it there
    assert torch.allclose(out[1], torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0]))  # halfway: split


def test_the_support_refuses_what_is_not_one():
    with pytest.raises(ValueError, match="at least 2 atoms"):
        categorical_support(0.0, 1.0, 1)
    with pytest.raises(ValueError, match="v_min < v_max"):
        categorical_support(1.0, 1.0, 11)


@pytest.mark.parametrize("double_q", [False, True])
def test_c51s_next_action_is_the_targets_or_with_double_q_the_online_networks(double_q):
    """The learner's loss is the cross-entropy to the projection of ``Z_target(s', a*)`` with
    ``a*`` the target network's argmax (Algorithm 1) or, with ``double_q``, the online network's
    (Double DQN's rule, Tianshou's C51); the two networks disagree on some ``a*`` here, so the
    test tells the rules apart."""
    import gymnasium as gym

    from msrl.algorithms.c51 import C51Config, C51Learner
    from msrl.api import BuildContext, EnvSpec

    env = gym.make("CartPole-v1")
    spec = EnvSpec("CartPole-v1", env.observation_space, env.action_space, 1)
    env.close()
    ctx = BuildContext(C51Config(double_q=double_q, n_atoms=11, v_min=-10.0, v_max=10.0), spec, 0, 1, 1, 10_000, 3,
                       torch.device("cpu"))
    learner = C51Learner(ctx)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in learner.target.parameters():
            p.add_(torch.randn(p.shape, generator=g))
    from tensordict import TensorDict

    n = 64
    batch = TensorDict({"obs": torch.randn(n, 4, generator=g), "action": torch.randint(2, (n,), generator=g),
                        "reward": torch.rand(n, generator=g), "next_obs": torch.randn(n, 4, generator=g),
                        "terminated": torch.rand(n, generator=g) < 0.1}, batch_size=[n])
    with torch.no_grad():
        online_a = learner.net.q(batch["next_obs"]).argmax(-1)
        target_a = learner.target.q(batch["next_obs"]).argmax(-1)
        assert (online_a != target_a).any()
        next_a = online_a if double_q else target_a
        next_pmf = learner.target(batch["next_obs"])[torch.arange(n), next_a]
        target = categorical_projection(next_pmf, batch["reward"], 1.0 - batch["terminated"].float(), 0.99,
                                        learner.target.support)
        pmf = learner.net(batch["obs"])[torch.arange(n), batch["action"]]
        expected = -(target * pmf.clamp(1e-5, 1.0 - 1e-5).log()).sum(-1).mean()
    assert torch.equal(learner.learn(batch)["losses/loss"], expected)
