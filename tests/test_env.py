"""The gymnasium adapter: same-step autoreset with final observations, episode tracking."""

import gymnasium
import numpy as np
import pytest
import torch

from msrl.envs.gymnasium_env import GymnasiumEnv, UnknownEnvError


def test_matches_independent_gymnasium_envs_step_by_step():
    n, seed, steps = 3, 11, 400
    env = GymnasiumEnv("CartPole-v1", n)
    refs = [gymnasium.make("CartPole-v1") for _ in range(n)]
    obs = env.reset(seed=seed)
    ref_obs = [r.reset(seed=seed + i)[0] for i, r in enumerate(refs)]
    assert obs.dtype == torch.float32 and obs.shape == (n, 4)
    np.testing.assert_array_equal(obs.numpy(), np.stack(ref_obs))
    rng = np.random.default_rng(0)
    ref_returns, ref_lengths = [], []
    ep_ret, ep_len = np.zeros(n), np.zeros(n, dtype=int)
    for _ in range(steps):
        action = rng.integers(0, 2, size=n)
        obs, reward, term, trunc, info = env.step(torch.as_tensor(action))
        for i, r in enumerate(refs):
            o, rew, te, tr, _ = r.step(int(action[i]))
            ep_ret[i] += rew
            ep_len[i] += 1
            assert bool(term[i]) == te and bool(trunc[i]) == tr and float(reward[i]) == rew
            # the final observation is the last of the finished episode ...
            np.testing.assert_array_equal(info["final_obs"][i].numpy(), o)
            if te or tr:
                ref_returns.append(ep_ret[i])
                ref_lengths.append(ep_len[i])
                ep_ret[i], ep_len[i] = 0, 0
                o, _ = r.reset()
                # ... and the returned observation already starts the next one
                assert not np.array_equal(obs[i].numpy(), info["final_obs"][i].numpy())
            np.testing.assert_array_equal(obs[i].numpy(), o)
    stats = env.pop_episode_stats()
    assert sorted(stats.returns) == sorted(ref_returns) and len(stats.returns) > 10
    assert sorted(stats.lengths) == sorted(ref_lengths)
    assert env.pop_episode_stats().returns == []
    assert env.env_steps == n * steps
    env.close()


def test_continuous_actions_are_clipped_to_the_space():
    env = GymnasiumEnv("Pendulum-v1", 2)
    env.reset(seed=0)
    obs, reward, *_ = env.step(torch.tensor([[100.0], [-100.0]]))
    assert obs.shape == (2, 3) and reward.dtype == torch.float32
    env.close()


def test_state_dict_round_trip_continues_identically():
    a = GymnasiumEnv("CartPole-v1", 2)
    a.reset(seed=3)
    for _ in range(30):
        a.step(torch.ones(2, dtype=torch.int64))
    a.pop_episode_stats()  # finished episodes are reported per iteration, not checkpointed
    state = a.state_dict()
    b = GymnasiumEnv("CartPole-v1", 2)
    b.reset(seed=99)
    b.load_state_dict(state)
    for _ in range(40):
        x, y = a.step(torch.zeros(2, dtype=torch.int64)), b.step(torch.zeros(2, dtype=torch.int64))
        assert all(torch.equal(p, q) for p, q in zip(x[:4], y[:4]))
    assert a.pop_episode_stats() == b.pop_episode_stats()


def test_bad_inputs():
    with pytest.raises(UnknownEnvError, match="unknown env id 'CartPol-v1'. Did you mean 'CartPole-v1'"):
        GymnasiumEnv("CartPol-v1", 2)
    with pytest.raises(ValueError, match="num_envs must be >= 1"):
        GymnasiumEnv("CartPole-v1", 0)
    with pytest.raises(ValueError, match="unknown env wrapper 'frameskip'; valid: atari"):
        GymnasiumEnv("CartPole-v1", 1, wrappers=["frameskip"])
    with pytest.raises(ValueError, match="'atari' preprocesses ALE games"):
        GymnasiumEnv("CartPole-v1", 1, wrappers=["atari"])
    env = GymnasiumEnv("CartPole-v1", 2)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="action has leading size 3, expected num_envs=2"):
        env.step(torch.zeros(3, dtype=torch.int64))
    env.close()


def test_sync_engine_equals_gymnasiums_same_step_vector_env():
    import gymnasium
    import numpy as np
    from gymnasium.vector import AutoresetMode

    n, rng = 4, np.random.default_rng(0)
    ours = GymnasiumEnv("CartPole-v1", n)
    ref = gymnasium.make_vec("CartPole-v1", num_envs=n, vectorization_mode="sync",
                             vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP})
    assert np.array_equal(ours.reset(seed=5).numpy(), ref.reset(seed=5)[0].astype(np.float32))
    for _ in range(300):
        act = rng.integers(0, 2, n)
        o, r, te, tr, info = ours.step(torch.as_tensor(act))
        ro, rr, rte, rtr, rinfo = ref.step(act)
        assert np.array_equal(o.numpy(), ro.astype(np.float32)) and np.array_equal(r.numpy(), rr.astype(np.float32))
        assert np.array_equal(te.numpy(), rte) and np.array_equal(tr.numpy(), rtr)
        for i in np.flatnonzero(rte | rtr):
            assert np.array_equal(info["final_obs"][i].numpy(), rinfo["final_obs"][i].astype(np.float32))
