"""DQN's batched replay path against the step-by-step one it replaces, and the learner's
gradient clipping against torch's: bitwise, not within a tolerance."""

from __future__ import annotations

import gymnasium as gym
import pytest
import torch

from msrl.algorithms.dqn import DQNConfig, DQNLearner, ReplayBuffer
from msrl.api import BuildContext, EnvSpec
from msrl.api.roles import _clip_grad_norm


def _ctx(**hparams) -> BuildContext:
    env = gym.make("CartPole-v1")
    spec = EnvSpec("CartPole-v1", env.observation_space, env.action_space, 4)
    env.close()
    return BuildContext(DQNConfig(**hparams), spec, 0, 1, 4, 100_000, 3, torch.device("cpu"))


def _filled(ctx: BuildContext) -> ReplayBuffer:
    buffer = ReplayBuffer(ctx)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        buffer.insert(obs=torch.randn(4, 4, generator=g), action=torch.randint(2, (4,), generator=g),
                      reward=torch.rand(4, generator=g), next_obs=torch.randn(4, 4, generator=g),
                      terminated=torch.rand(4, generator=g) < 0.05)
    return buffer


def test_sample_many_draws_the_minibatches_sample_draws_in_turn():
    ctx = _ctx()
    many = _filled(ctx).sample_many(8)
    one_by_one = _filled(ctx)
    assert many.batch_size == (8, ctx.hparams.batch_size)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_batches must be a positive int"):
            one_by_one.sample_many(bad)
    for k in range(8):
        batch = one_by_one.sample()
        for key in ReplayBuffer.KEYS:
            assert torch.equal(many[k][key], batch[key]), (k, key)


@pytest.mark.parametrize("double_q", [False, True])
def test_learning_on_k_minibatches_at_once_equals_k_steps_in_turn(double_q):
    ctx = _ctx(double_q=double_q)
    batches = _filled(ctx).sample_many(8)
    torch.manual_seed(1)
    at_once = DQNLearner(ctx)
    torch.manual_seed(1)
    in_turn = DQNLearner(ctx)
    metrics = at_once.learn(batches)
    steps = [in_turn.learn(batches[k]) for k in range(8)]
    for a, b in zip(at_once.q.parameters(), in_turn.q.parameters()):
        assert torch.equal(a, b)
    for (name, a), (_, b) in zip(at_once.optimizer.state_dict()["state"].items(), in_turn.optimizer.state_dict()["state"].items()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"]), name
    assert torch.allclose(metrics["losses/td_loss"], torch.stack([s["losses/td_loss"] for s in steps]).mean())


@pytest.mark.parametrize("scale", [1e-3, 1.0, 100.0])  # no clipping, clipping, clipping hard
def test_clip_grad_norm_is_bitwise_torchs(scale):
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 4), (64,), (64, 64), (64,), (2, 64), (2,)]
    ours = [torch.zeros(s, requires_grad=True) for s in shapes]
    theirs = [torch.zeros(s, requires_grad=True) for s in shapes]
    for p, q in zip(ours, theirs):
        p.grad = torch.randn(p.shape, generator=g) * scale
        q.grad = p.grad.clone()
    ours.append(torch.zeros(3, requires_grad=True))  # a parameter without a gradient is skipped
    theirs.append(torch.zeros(3, requires_grad=True))
    norm = _clip_grad_norm(ours, 10.0)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 10.0, foreach=True)
    assert torch.equal(norm, expected)
    for p, q in zip(ours, theirs):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
