"""Native batched MuJoCo tasks (mjbatch physics, torch task logic) against gymnasium."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("mjbatch")

from msrl.envs.native import HalfCheetah, Hopper  # noqa: E402
from msrl.envs.native.check import check_mujoco  # noqa: E402


@pytest.mark.parametrize("env_id,steps,episodes", [
    ("msrl/HalfCheetah-v5", 1050, 2),   # past the 1,000-step truncation
    ("msrl/Hopper-v5", 400, 20),        # many unhealthy terminations
])
def test_step_by_step_equal_to_gymnasium(env_id, steps, episodes):
    report = check_mujoco(env_id, num_envs=2, steps=steps, seed=3)
    assert report.ok, report
    assert report.max_obs_diff == 0.0 and report.flag_mismatches == 0
    assert report.episodes >= episodes


@pytest.mark.parametrize("cls", [HalfCheetah, Hopper])
def test_reset_noise_has_gymnasiums_distribution(cls):
    env = cls(4000, num_threads=1)
    env.reset(seed=0)
    nq = env.model.nq
    dq = env.qpos - env.init_qpos
    dv = env.qvel - env.init_qvel
    scale = cls.NOISE
    assert dq.abs().max() <= scale and abs(dq.mean()) < 0.02 * scale
    assert dq.std().item() == pytest.approx(scale / 3 ** 0.5, rel=0.03)  # U(-s, s)
    expected_v = scale if cls is HalfCheetah else scale / 3 ** 0.5          # s N(0, 1) or U(-s, s)
    assert dv.std().item() == pytest.approx(expected_v, rel=0.03)
    assert nq == dq.shape[1]


def test_seeds_split_over_replicas_like_one_batch():
    whole = HalfCheetah(4, num_threads=1)
    halves = [HalfCheetah(2, num_threads=1), HalfCheetah(2, num_threads=1)]
    o = whole.reset(seed=7)
    assert torch.equal(o, torch.cat([halves[0].reset(seed=7), halves[1].reset(seed=9)]))
    assert not torch.equal(o, HalfCheetah(4, num_threads=1).reset(seed=8))


def test_state_dict_resumes_exactly():
    a, b = Hopper(3, num_threads=2), Hopper(3, num_threads=1)
    a.reset(seed=1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        a.step(torch.rand(3, 3, generator=gen) * 2 - 1)
    a.pop_episode_stats()
    b.reset(seed=5)
    b.load_state_dict(a.state_dict())
    for _ in range(300):
        act = torch.rand(3, 3, generator=gen) * 2 - 1
        x, y = a.step(act), b.step(act)
        assert all(torch.equal(p, q) for p, q in zip(x[:4], y[:4]))
        assert torch.equal(x[4]["final_obs"], y[4]["final_obs"])
    assert a.pop_episode_stats() == b.pop_episode_stats()


def test_bad_inputs():
    with pytest.raises(ValueError, match="no 'kernel' implementation"):
        HalfCheetah(2, impl="kernel")
    env = HalfCheetah(2, num_threads=1)
    env.reset(seed=0)
    with pytest.raises(ValueError, match=r"expected \(num_envs, nu\) = \(2, 6\)"):
        env.step(torch.zeros(2, 3))
