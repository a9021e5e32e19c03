"""QMIX and VDN (``algorithms/qmix.py``): the mixers (QMIX's monotonicity, Eq. 5; VDN's sum), the
episode replay, the TD loss against PyMARL's written out, the two-step game of the QMIX paper
(where the decomposition matters: QMIX finds 8, VDN and independent learners 7), the recurrent
actor, evaluation, exact resume, Ray, and bad input."""

import pytest
import torch

import msrl
from msrl.algorithms import qmix as q
from msrl.api import BuildContext
from msrl.config import load_config
from msrl.envs import env_spec
from msrl.errors import ConfigError
from msrl.rl.buffers import EpisodeReplay

CONFIG = "configs/qmix_simple_spread.yaml"
SPREAD = {"N": 3, "max_cycles": 5, "continuous_actions": False}
TINY = ["algorithm.hparams.episode_limit=5", "algorithm.hparams.steps_per_iteration=5", "algorithm.hparams.batch_size=4",
        "algorithm.hparams.buffer_size=64", "algorithm.hparams.learning_starts=20", "algorithm.hparams.hidden_dim=8",
        "algorithm.hparams.mixing_embed_dim=4", "algorithm.hparams.hypernet_embed=8",
        "env.kwargs={N: 3, max_cycles: 5, continuous_actions: false}", "env.num_envs=2", "train.progress=false",
        "eval.episodes=2", "train.eval_every=0"]


def _ctx(n_envs=2, env="pettingzoo/mpe2.simple_spread_v3", kwargs=SPREAD, **hp):
    hparams = q.QMIXConfig(**{**dict(batch_size=2, buffer_size=4, episode_limit=3, hidden_dim=8, mixing_embed_dim=4,
                                     hypernet_embed=8), **hp})
    return BuildContext(hparams, env_spec(env, n_envs, env_kwargs=kwargs), 0, 1, n_envs, 1000, 0, torch.device("cpu"))


def test_qmix_is_monotonic_in_every_agents_value_and_vdn_is_the_sum():
    torch.manual_seed(0)
    mixer = q.QMixer(num_agents=3, state_dim=6, embed_dim=4, hypernet_embed=8)
    values = torch.randn(64, 3, requires_grad=True)
    total = mixer(values, torch.randn(64, 6))
    (grad,) = torch.autograd.grad(total.sum(), values)
    assert total.shape == (64,) and (grad >= 0).all() and (grad > 0).any()  # dQ_tot / dQ_i >= 0 (Eq. 5)
    assert torch.equal(q.VDNMixer()(values, None), values.sum(-1))


def _insert(buf, i, done, obs_dim=2):
    n = len(done)
    buf.insert(obs=torch.full((n, 2, obs_dim), float(i)), action=torch.full((n, 2), i % 2),
               reward=torch.full((n, 2), float(i)), terminated=torch.tensor(done), truncated=torch.zeros(n, dtype=torch.bool),
               final_obs=torch.full((n, 2, obs_dim), 100.0 + i))


def test_the_episode_replay_stores_whole_episodes_padded_with_their_final_observation():
    buf = EpisodeReplay(_ctx(episode_limit=3, buffer_size=4))
    _insert(buf, 0, [False, False])
    _insert(buf, 1, [True, False])  # env 0 ends after 2 steps
    assert buf.size == 1 and buf.t.tolist() == [0, 2]
    ep = buf.storage[0]
    assert ep["obs"][:, 0, 0].tolist() == [0.0, 1.0, 101.0, 0.0]  # the final observation at index n
    assert ep["filled"].tolist() == [True, True, False] and ep["terminated"].tolist() == [False, True, False]
    assert ep["reward"][:, 0].tolist() == [0.0, 1.0, 0.0] and ep["action"][:, 0].tolist() == [0, 1, 0]
    _insert(buf, 2, [False, True])  # env 1 ends at the limit; env 0's second episode runs on
    assert buf.size == 2 and buf.storage[1]["filled"].all() and buf.t.tolist() == [1, 0]
    twin = EpisodeReplay(_ctx(episode_limit=3, buffer_size=4))
    twin.load_state_dict(buf.state_dict())
    for b in (buf, twin):
        _insert(b, 3, [True, False])
    assert torch.equal(buf.storage["obs"], twin.storage["obs"]) and buf.size == twin.size == 3
    assert torch.equal(buf.storage[2]["obs"][:3, 0, 0], torch.tensor([2.0, 3.0, 103.0]))


def test_the_replay_says_what_to_raise_for_long_episodes_and_early_samples():
    buf = EpisodeReplay(_ctx(episode_limit=2, batch_size=2))
    _insert(buf, 0, [False, False])
    with pytest.raises(RuntimeError, match="holds 0 finished episodes, fewer than batch_size=2; raise "
                                           "algorithm.hparams.learning_starts"):
        buf.sample()
    with pytest.raises(ValueError, match=r"reached episode_limit=2 steps without ending; set algorithm.hparams.episode_limit"):
        _insert(buf, 1, [True, False])
    assert buf.size == 0 and buf.t.tolist() == [1, 1]  # nothing of the refused step was written
    with pytest.raises(KeyError, match="EpisodeReplay.insert takes exactly"):
        buf.insert(obs=torch.zeros(2, 2, 2))


def _reference_loss(learner, batch, gamma):
    """PyMARL's QLearner loss written out step by step (double Q, masked mean of squared TD)."""
    obs, act = batch["obs"], batch["action"]
    B, L = act.shape[:2]
    num, den = 0.0, 0.0
    for b in range(B):
        h = torch.zeros(obs.shape[2], learner.agent.hidden_dim)
        ht = h.clone()
        qs, tqs = [], []
        for t in range(L + 1):
            qv, h = learner.agent(obs[b, t][None], h[None])
            tq, ht = learner.target_agent(obs[b, t][None], ht[None])
            h, ht = h[0], ht[0]
            qs.append(qv[0])
            tqs.append(tq[0])
        for t in range(L):
            if not batch["filled"][b, t]:
                continue
            chosen = qs[t].gather(-1, act[b, t][:, None]).squeeze(-1)
            next_q = tqs[t + 1].gather(-1, qs[t + 1].argmax(-1, keepdim=True)).squeeze(-1)
            s, s2 = obs[b, t].flatten(), obs[b, t + 1].flatten()
            q_tot = learner.mixer(chosen[None], s[None])[0]
            y = batch["reward"][b, t].sum() + gamma * (1.0 - float(batch["terminated"][b, t])) * \
                learner.target_mixer(next_q[None], s2[None])[0]
            num, den = num + (q_tot - y.detach()) ** 2, den + 1
    return num / den


def test_the_td_loss_is_pymarls_written_out():
    ctx = _ctx(batch_size=3, episode_limit=4, standardise_rewards=False)
    learner = q.QMIXLearner(ctx)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in learner.target_agent.parameters():
            p.add_(0.1 * torch.randn_like(p))  # the target differs from the online network
    B, L, A, D = 3, 4, 3, 18
    batch = {"obs": torch.randn(B, L + 1, A, D), "action": torch.randint(5, (B, L, A)), "reward": torch.randn(B, L, A),
             "terminated": torch.tensor([[False, False, True, False]] * B),
             "filled": torch.tensor([[True, True, True, False], [True, True, True, True], [True, False, False, False]])}
    from tensordict import TensorDict

    td = TensorDict(batch, batch_size=[B])
    expected = _reference_loss(learner, td, learner.hp.gamma)
    got = learner.learn(td)["losses/td_loss"]
    assert torch.allclose(got, expected.detach(), rtol=1e-5, atol=1e-6)


TWO_STEP = ["env.id=pettingzoo/two_step_game", "env.kwargs={}", "algorithm.hparams.episode_limit=2",
            "algorithm.hparams.steps_per_iteration=2", "algorithm.hparams.learning_starts=64",
            "algorithm.hparams.start_e=1.0", "algorithm.hparams.end_e=1.0", "algorithm.hparams.hidden_dim=32",
            "algorithm.hparams.target_network_frequency=200", "algorithm.hparams.buffer_size=500",
            "algorithm.hparams.gradient_steps=4", "train.total_env_steps=8000", "train.eval_every=0", "eval.episodes=2",
            "train.progress=false"]


@pytest.mark.parametrize("mixer, greedy_return", [("qmix", 8.0), ("vdn", 7.0), ("none", 7.0)])
def test_on_the_two_step_game_only_qmix_finds_the_optimum(tmp_path, mixer, greedy_return):
    """Rashid et al. 2018, Section 6.1 and Table 1: from uniformly random play, QMIX's monotonic
    mixing represents game 2B's payoffs and chooses it (8); VDN's sum and independent learners
    cannot, and settle for 2A's 7."""
    r = msrl.train(load_config(CONFIG, [*TWO_STEP, f"algorithm.hparams.mixer={mixer}", f"runs_dir={tmp_path}"]))
    assert r.eval_returns == [greedy_return, greedy_return]


def test_the_actor_carries_gru_states_and_a_zero_state_starts_an_episode():
    actor = q.QMIXActor(_ctx())
    obs = torch.randn(2, 3, 18)
    state = actor.initial_state(obs)
    assert state.shape == (2, 3, 8) and not state.any()
    a1, s1 = actor.act(obs, state, deterministic=True)
    a2, _ = actor.act(obs, s1, deterministic=True)
    assert a1.shape == (2, 3) and a1.dtype == torch.int64 and s1.abs().sum() > 0
    ended = actor.end_episodes(s1, torch.tensor([True, False]), torch.tensor([False, False]))
    assert not ended[0].any() and torch.equal(ended[1], s1[1])
    explored, _ = actor.act(obs, state, epsilon=1.0)
    assert explored.shape == (2, 3) and ((explored >= 0) & (explored < 5)).all()


def test_a_run_evaluates_the_team_and_resumes_exactly(tmp_path):
    straight = msrl.train(load_config(CONFIG, [*TINY, f"runs_dir={tmp_path / 'a'}", "train.total_env_steps=80"]))
    assert len(straight.eval_returns) == 2 and all(r < 0 for r in straight.eval_returns)  # MPE pays distances
    first = msrl.train(load_config(CONFIG, [*TINY, f"runs_dir={tmp_path / 'b'}", "train.total_env_steps=40",
                                            "train.checkpoint_every=1"]))
    resumed = msrl.train(resume=first.run_dir, train__total_env_steps=80)
    a, b = (torch.load(r.run_dir / "checkpoints" / "latest.pt", weights_only=False)["actor_weights"]
            for r in (straight, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_coarse_on_ray_processes_learns_what_threads_learn_bitwise(tmp_path):
    """Two actor replicas as Ray processes (each its envs, GRU states and episode shard), the
    learner with the mixer in a third: the weights two threads of one process end with."""
    common = [*TINY, "distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2",
              "env.num_envs=4", "algorithm.hparams.learning_starts=40", "train.total_env_steps=120",
              "train.checkpoint_every=3"]
    ray = msrl.train(load_config(CONFIG, [*common, "runtime=ray", f"runs_dir={tmp_path / 'ray'}"]))
    local = msrl.train(load_config(CONFIG, [*common, "runtime=local", f"runs_dir={tmp_path / 'local'}"]))
    assert ray.env_steps == local.env_steps == 120
    a, b = (torch.load(r.run_dir / "checkpoints" / "latest.pt", weights_only=False)["actor_weights"] for r in (local, ray))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match="mixer"):
        msrl.train(load_config(CONFIG, [*TINY, "algorithm.hparams.mixer=qtran"]))
    with pytest.raises(ConfigError, match="qmix is multi-agent"):
        msrl.train(load_config(CONFIG, [*TINY, "env.id=CartPole-v1", "env.kwargs={}"]))
    with pytest.raises(ConfigError, match=r"learning_starts=20: the first update would find fewer than batch_size=4 "
                                          r"finished episodes in a replay shard of 2 envs .* at least 40"):
        msrl.train(load_config(CONFIG, [*TINY, "distribution_policy.name=single_learner_coarse",
                                        "distribution_policy.replicas.actor=2", "env.num_envs=4"]))


def test_soft_target_updates_follow_every_step_and_hard_copies_wait_for_their_turn():
    """``target_update_tau``: after each gradient step ``theta' <- tau theta + (1 - tau) theta'``
    (EPyMARL's target_update_interval_or_tau <= 1); without it the targets change only when copied."""
    from tensordict import TensorDict

    B, L, A, D = 2, 3, 3, 18
    batch = TensorDict({"obs": torch.randn(B, L + 1, A, D), "action": torch.randint(5, (B, L, A)),
                        "reward": torch.randn(B, L, A), "terminated": torch.zeros(B, L, dtype=torch.bool),
                        "filled": torch.ones(B, L, dtype=torch.bool)}, batch_size=[B])
    soft = q.QMIXLearner(_ctx(episode_limit=3, target_update_tau=0.25))
    before = {k: v.clone() for k, v in soft.target_mixer.state_dict().items()}
    soft.learn(batch)
    soft.update_target()  # (a no-op with soft updates)
    for k, v in soft.target_mixer.state_dict().items():
        assert torch.allclose(v, 0.75 * before[k] + 0.25 * soft.mixer.state_dict()[k], atol=1e-6)
    hard = q.QMIXLearner(_ctx(episode_limit=3))
    before = {k: v.clone() for k, v in hard.target_agent.state_dict().items()}
    hard.learn(batch)
    assert all(torch.equal(before[k], v) for k, v in hard.target_agent.state_dict().items())
    hard.update_target()
    assert all(torch.equal(hard.agent.state_dict()[k], v) for k, v in hard.target_agent.state_dict().items())


def test_without_bootstrapping_at_the_time_limit_an_episodes_last_step_is_terminal():
    """``bootstrap_at_time_limit: false`` (EPyMARL's runner on MPE): the TD target of every
    episode's last filled step is its reward alone, as if the episode had terminated there."""
    from tensordict import TensorDict

    B, L, A, D = 2, 3, 3, 18
    torch.manual_seed(4)
    base = {"obs": torch.randn(B, L + 1, A, D), "action": torch.randint(5, (B, L, A)), "reward": torch.randn(B, L, A),
            "filled": torch.tensor([[True, True, True], [True, True, False]])}
    cut = TensorDict({**base, "terminated": torch.zeros(B, L, dtype=torch.bool)}, batch_size=[B])
    ended = TensorDict({**base, "terminated": torch.tensor([[False, False, True], [False, True, False]])}, batch_size=[B])
    finite = q.QMIXLearner(_ctx(episode_limit=3, bootstrap_at_time_limit=False)).learn(cut)["losses/td_loss"]
    terminal = q.QMIXLearner(_ctx(episode_limit=3)).learn(ended)["losses/td_loss"]
    bootstrapped = q.QMIXLearner(_ctx(episode_limit=3)).learn(cut)["losses/td_loss"]
    assert torch.equal(finite, terminal) and not torch.equal(finite, bootstrapped)
