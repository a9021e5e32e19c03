"""Running statistics for observation and reward normalization, and PPO's use of them."""

from __future__ import annotations

import pytest
import torch

from msrl.algorithms import ppo
from msrl.normalization import RewardScaler, RunningMeanStd
from msrl.policy import load_policy
from msrl.run.job import Job, JobSpec


def test_batched_updates_give_the_moments_of_all_samples():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 3, generator=gen, dtype=torch.float64) * torch.tensor([1.0, 5.0, 0.1]) + 3.0
    rms = RunningMeanStd((3,), epsilon=0.0 + 1e-300)
    for chunk in x.split(137):
        rms.update(chunk)
    assert torch.allclose(rms.mean, x.mean(0), atol=1e-12)
    assert torch.allclose(rms.var, x.var(0, unbiased=False), rtol=1e-10)
    y = rms.normalize(x.float(), clip=2.0)
    assert y.abs().max() <= 2.0 and abs(float(y.mean())) < 0.05


def test_reduced_update_over_two_replicas_equals_one_update_of_both_batches():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(50, 2, generator=gen), torch.randn(50, 2, generator=gen) * 3 + 1
    whole = RunningMeanStd((2,))
    whole.update(torch.cat([a, b]))
    # the two replicas' moments averaged, as the learners' gradient hook does under multi_learner
    moments = {}

    def capture(ts, key):
        moments[key] = [t.clone() for t in ts]

    ra, rb = RunningMeanStd((2,)), RunningMeanStd((2,))
    ra.update(a, lambda ts: capture(ts, "a"), replicas=2)
    rb.update(b, lambda ts: capture(ts, "b"), replicas=2)
    for r, x in ((ra, a), (rb, b)):
        r.__init__((2,))

        def mean(ts):
            for t, p, q in zip(ts, moments["a"], moments["b"]):
                t.copy_((p + q) / 2)
        r.update(x, mean, replicas=2)
    for r in (ra, rb):
        assert torch.allclose(r.mean, whole.mean) and torch.allclose(r.var, whole.var) and r.count == whole.count


def test_reward_scaler_divides_by_the_std_of_every_discounted_return_so_far():
    gamma, gen = 0.9, torch.Generator().manual_seed(1)
    rollouts = [torch.randn(5, 3, generator=gen) * 4 for _ in range(2)]
    terminated = [torch.zeros(5, 3, dtype=torch.bool) for _ in range(2)]
    terminated[0][2, 1] = True  # env 1's step 2 ends an episode: G restarts there (G_2 = r_2)
    scaler = RewardScaler(gamma, clip=1.5)
    g, returns = torch.zeros(3, dtype=torch.float64), []
    for reward, term in zip(rollouts, terminated):
        for t in range(5):  # the closed form: G_t = gamma (1 - d_t) G_{t-1} + r_t, carried across rollouts
            g = gamma * (~term[t]).double() * g + reward[t].double()
            returns.append(g.clone())
        scaled = scaler(reward, term)
        seen = torch.stack(returns).flatten()
        n = seen.numel()
        var = (1.0 * 1e-4 + seen.var(unbiased=False) * n + seen.mean() ** 2 * 1e-4 * n / (n + 1e-4)) / (n + 1e-4)
        expected = (reward / torch.sqrt(var + 1e-8).float()).clamp(-1.5, 1.5)
        assert scaled.dtype == torch.float32
        assert torch.allclose(scaled, expected, rtol=1e-5, atol=1e-6)
    assert (scaled.abs() == 1.5).any()  # the clip binds
    assert torch.equal(scaler.discounted_return, g)


def test_ppo_normalizes_with_the_learners_statistics_and_ships_them_to_the_actor():
    hp = ppo.PPOConfig(num_steps=16, num_minibatches=2, update_epochs=1, hidden_sizes=(8,), normalize_obs=True,
                       normalize_reward=True)
    job = Job(JobSpec(ppo.ALGORITHM, hp, "Pendulum-v1", 4, load_policy("single"), seed=3, total_env_steps=10_000))
    try:
        job.reset()
        actor, learner = job.component("actor"), job.component("learner")
        assert float(actor.net.obs_rms.count) == pytest.approx(1e-4)  # nothing seen yet: identity-ish
        job.train_step()
        stats = learner.net.obs_rms
        assert float(stats.count) == pytest.approx(64 + 1e-4)  # one rollout of 16 steps x 4 envs
        assert torch.equal(actor.net.obs_rms.mean, stats.mean) and torch.equal(actor.net.obs_rms.var, stats.var)
        assert not torch.allclose(stats.mean, torch.zeros(3, dtype=torch.float64))
        assert float(learner.reward_scaler.return_rms.count) == pytest.approx(64 + 1e-4)
        state = learner.state_dict()
        assert "return_rms" in state and state["discounted_return"].shape == (4,)
    finally:
        job.close()


def test_normalization_options_are_rejected_where_they_do_nothing():
    from msrl.algorithms import mappo

    with pytest.raises(ValueError, match="mappo does not normalize"):
        mappo.MAPPOConfig(normalize_obs=True)
