"""PettingZoo parallel envs behind the multi-agent Environment contract, on both engines."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("mpe2")

from msrl.envs import env_spec, make_env  # noqa: E402
from msrl.envs.single_env import UnknownEnvError  # noqa: E402

SPREAD = "pettingzoo/mpe2.simple_spread_v3"
KW = {"N": 3, "max_cycles": 25, "continuous_actions": False}


def test_spec_is_one_agents_spaces_with_the_agent_count():
    spec = env_spec(SPREAD, 4, KW)
    assert spec.num_agents == 3 and spec.observation_space.shape == (18,) and spec.action_space.n == 5


@pytest.mark.parametrize("engine", ["sync", "process"])
def test_steps_agent_stacked_tensors_and_ends_episodes_for_all_agents(engine):
    env = make_env(SPREAD, 4, engine=engine, env_kwargs=KW, num_workers=2 if engine == "process" else None)
    try:
        obs = env.reset(seed=0)
        assert obs.shape == (4, 3, 18) and obs.dtype == torch.float32
        for t in range(60):
            obs, reward, term, trunc, info = env.step(torch.randint(0, 5, (4, 3)))
            assert reward.shape == (4, 3) and term.shape == (4,) and info["final_obs"].shape == (4, 3, 18)
            assert trunc.all() == ((t + 1) % 25 == 0) and not term.any()  # max_cycles: all truncated together
        stats = env.pop_episode_stats()
        assert len(stats.returns) == 8 and stats.lengths == [25] * 8
    finally:
        env.close()


def test_process_engine_equals_sync_engine_and_snapshots_exactly():
    a = make_env(SPREAD, 3, engine="sync", env_kwargs=KW)
    b = make_env(SPREAD, 3, engine="process", env_kwargs=KW, num_workers=3)
    try:
        assert torch.equal(a.reset(seed=4), b.reset(seed=4))
        rng = np.random.default_rng(0)
        for _ in range(30):
            act = torch.as_tensor(rng.integers(0, 5, (3, 3)))
            x, y = a.step(act), b.step(act)
            assert all(torch.equal(p, q) for p, q in zip(x[:4], y[:4]))
        state = b.state_dict()
        after = [b.step(act) for _ in range(30)]
        b.load_state_dict(state)
        for x in after:
            assert all(torch.equal(p, q) for p, q in zip(x[:4], b.step(act)[:4]))
        assert a.pop_episode_stats().returns == b.pop_episode_stats().returns[:3]  # the first 25 steps' episodes
    finally:
        a.close()
        b.close()


def test_bad_ids():
    with pytest.raises(UnknownEnvError, match="cannot import PettingZoo env module 'mpe2.no_such_env'"):
        env_spec("pettingzoo/mpe2.no_such_env", 1)
    with pytest.raises(UnknownEnvError, match=r"module 'numpy' has neither parallel_env\(\) nor env\(\)"):
        env_spec("pettingzoo/numpy", 1)
