"""DreamerV3 (``algorithms/dreamerv3.py``): symlog and two-hot (Eq. 9-10), lambda-returns (Eq. 7),
the KL terms with free bits (Eq. 5), the replay of sequences, the world model learning a fixed
batch, the acting side's recurrent state, exact resume and bad input."""

import math

import pytest
import torch

import msrl
from msrl.advantages import lambda_returns
from msrl.algorithms import dreamerv3 as d
from msrl.api import BuildContext
from msrl.config import load_config
from msrl.envs import env_spec
from msrl.errors import ConfigError
from msrl.policy import load_policy
from msrl.rl.buffers import SequenceReplay
from msrl.rl.distributional import symexp, symlog, two_hot, two_hot_log_likelihood, two_hot_mean
from msrl.run.job import Job, JobSpec

CONFIG = "configs/dreamerv3_cartpole.yaml"
TINY = ["algorithm.hparams.model_size=nano", "algorithm.hparams.batch_size=2", "algorithm.hparams.batch_length=4",
        "algorithm.hparams.horizon=3", "algorithm.hparams.train_ratio=2", "algorithm.hparams.learning_starts=16",
        "algorithm.hparams.buffer_size=256", "env.num_envs=2", "train.progress=false", "eval.episodes=2",
        "train.eval_every=0"]


def test_symlog_and_symexp_are_inverse_and_compress_large_values():
    x = torch.tensor([-1e4, -3.0, -0.5, 0.0, 0.5, 3.0, 1e4])
    assert torch.allclose(symexp(symlog(x)), x, rtol=1e-5)
    assert torch.allclose(symlog(x), torch.sign(x) * torch.log(1 + x.abs()))


def test_two_hot_puts_its_weight_on_the_two_nearest_bins_and_decodes_back():
    bins = torch.linspace(-20.0, 20.0, 255)
    y = torch.tensor([-25.0, -3.3, 0.0, 0.07, 12.345, 25.0])
    enc = two_hot(y, bins)
    assert torch.allclose(enc.sum(-1), torch.ones(6)) and ((enc > 0).sum(-1) <= 2).all()
    assert torch.allclose((enc * bins).sum(-1), y.clamp(-20, 20), atol=1e-5)
    assert enc[0, 0] == 1 and enc[-1, -1] == 1  # outside the bins: the end bins
    logits = torch.log(enc.clamp(min=1e-30))
    assert torch.allclose(two_hot_mean(logits, bins), symexp(y.clamp(-20, 20)), rtol=1e-4)


def test_the_two_hot_log_likelihood_is_the_dense_cross_entropy_and_its_gradient():
    torch.manual_seed(0)
    bins = torch.linspace(-20.0, 20.0, 255)
    y = torch.cat([torch.randn(40) * 6, torch.tensor([-25.0, 25.0, 0.0, bins[3].item()])])
    logits = torch.randn(44, 255, requires_grad=True)
    dense = (two_hot(y, bins) * torch.log_softmax(logits, -1)).sum(-1)
    (g_dense,) = torch.autograd.grad(dense.sum(), logits)
    sparse = two_hot_log_likelihood(torch.log_softmax(logits, -1), y, bins)
    (g_sparse,) = torch.autograd.grad(sparse.sum(), logits)
    assert sparse.shape == (44,)
    assert torch.allclose(sparse, dense, rtol=1e-6, atol=1e-6)
    assert torch.allclose(g_sparse, g_dense, atol=1e-7)


def test_a_per_step_lambda_of_zero_stops_the_return_there():
    reward, cont, value = torch.ones(3, 1), torch.ones(3, 1), torch.tensor([[0.0], [10.0], [20.0], [30.0]])
    lam = torch.tensor([[1.0], [0.0], [1.0]])  # R_1 bootstraps from v_2 alone
    got = lambda_returns(reward, value, cont, 0.5, lam)
    r2 = 1 + 0.5 * 30
    r1 = 1 + 0.5 * 20
    assert torch.allclose(got[:, 0], torch.tensor([1 + 0.5 * r1, r1, r2]))
    assert torch.equal(lambda_returns(reward, value, cont, 0.5, 0.7),
                       lambda_returns(reward, value, cont, 0.5, torch.full((3, 1), 0.7)))


def test_the_replay_returns_stop_at_an_episodes_end_and_cut_off_at_a_terminal_row():
    """One window of 5 rows: rows 0-2 end an episode at a terminal row 2, row 3 is the next
    episode's first; the return of row 2 (whose successor is another episode's) carries no weight."""
    gamma, lam = 0.5, 0.5
    reward = torch.tensor([[0.0, 1.0, 2.0, 0.0, 3.0]])
    term = torch.tensor([[False, False, True, False, False]])
    first = torch.tensor([[True, False, False, True, False]])
    boot = torch.tensor([[10.0, 20.0, 30.0, 40.0, 50.0]])
    target, weight = d.replay_returns(reward, term, first, boot, gamma, lam)
    r3 = 3 + gamma * 50
    r1 = 2.0  # row 2 is terminal: no bootstrap past it
    r0 = 1 + gamma * ((1 - lam) * 20 + lam * r1)
    assert torch.allclose(target[weight > 0], torch.tensor([r0, r1, r3]))
    assert torch.equal(weight, torch.tensor([[1.0, 1.0, 0.0, 1.0]]))


def test_lambda_returns_are_eq_7():
    torch.manual_seed(0)
    H, N, gamma = 5, 3, 0.9
    reward, cont, value = torch.randn(H, N), (torch.rand(H, N) > 0.2).float(), torch.randn(H + 1, N)
    for lam in (0.0, 0.95, 1.0):
        got = lambda_returns(reward, value, cont, gamma, lam)
        want = torch.zeros(H, N)
        for i in range(H):  # the n-step returns mixed by lambda, written forward
            total, weight = torch.zeros(N), 0.0
            for n in range(1, H - i + 1):
                ret, disc = torch.zeros(N), torch.ones(N)
                for k in range(n):
                    ret = ret + disc * reward[i + k]
                    disc = disc * gamma * cont[i + k]
                ret = ret + disc * value[i + n]
                w = (1 - lam) * lam ** (n - 1) if n < H - i else lam ** (n - 1)
                total, weight = total + w * ret, weight + w
            want[i] = total / weight if weight else total
        assert torch.allclose(got, want, atol=1e-5), lam


def test_the_kl_terms_are_zero_for_equal_distributions_and_free_bits_clip_them():
    torch.manual_seed(0)
    logits = torch.randn(7, 4 * 4)
    assert torch.allclose(d._kl(logits, logits, 4, 4, 0.01), torch.zeros(7), atol=1e-6)
    other = torch.randn(7, 16) * 3
    kl = d._kl(logits, other, 4, 4, 0.01)
    p = d._unimix_probs(logits.view(7, 4, 4), 0.01)
    q = d._unimix_probs(other.view(7, 4, 4), 0.01)
    assert torch.allclose(kl, (p * (p / q).log()).sum((1, 2)), atol=1e-5) and (kl > 0).all()


def _ctx(n_envs=2, **hp):
    hparams = d.DreamerV3Config(**{**dict(model_size="nano", batch_size=3, batch_length=4, horizon=3,
                                          buffer_size=10 * n_envs), **hp})
    return BuildContext(hparams, env_spec("CartPole-v1", n_envs), 0, 1, n_envs, 1000, 0, torch.device("cpu"))


def _step(buf, i, done=(False, False), truncated=(False, False)):
    buf.insert(action=torch.tensor([1, 0]), reward=torch.tensor([1.0, 2.0]), terminated=torch.tensor(done),
               truncated=torch.tensor(truncated), final_obs=torch.full((2, 4), float(i)),
               next_obs=torch.full((2, 4), 100.0 + i))


def test_the_replay_keeps_each_envs_stream_with_episode_boundaries():
    buf = SequenceReplay(_ctx())
    buf.start(torch.zeros(2, 4))
    _step(buf, 1)
    _step(buf, 2, done=(True, False))  # env 0 ends: its final observation, then the next episode's first
    _step(buf, 3, truncated=(False, True))  # env 1 is cut off: not terminal, and a new first row
    rows = buf.storage[0, :5]
    assert rows["obs"][:, 0].tolist() == [0.0, 1.0, 2.0, 102.0, 3.0]
    assert rows["is_first"].tolist() == [True, False, False, True, False]
    assert rows["is_terminal"].tolist() == [False, False, True, False, False]
    assert rows["action"].tolist() == [0, 1, 1, 0, 1] and rows["reward"].tolist() == [0.0, 1.0, 1.0, 0.0, 1.0]
    env1 = buf.storage[1, :5]
    assert env1["is_first"].tolist() == [True, False, False, False, True] and not env1["is_terminal"].any()
    assert buf.count.tolist() == [5, 5]


def test_windows_are_consecutive_rows_of_one_env_in_order_after_wrapping():
    buf = SequenceReplay(_ctx())
    buf.start(torch.zeros(2, 4))
    for i in range(1, 25):  # 25 rows per env in 10 slots: the oldest overwritten
        _step(buf, i)
    batch = buf.sample()
    assert batch.batch_size == torch.Size([3, 4])
    first = batch["obs"][:, :, 0]
    assert ((first[:, 1:] - first[:, :-1]) == 1).all()  # consecutive steps
    assert (first >= 15).all()  # only the newest 10 rows of each env remain
    twin = SequenceReplay(_ctx())
    twin.load_state_dict(buf.state_dict())
    assert all(torch.equal(buf.sample()[k], twin.sample()[k]) for k in SequenceReplay.KEYS)


def test_sampling_before_any_env_holds_a_window_says_what_to_raise():
    buf = SequenceReplay(_ctx())
    buf.start(torch.zeros(2, 4))
    with pytest.raises(RuntimeError, match="learning_starts to at least batch_length x env.num_envs"):
        buf.sample()


def test_the_world_model_learns_a_fixed_batch():
    """A real check of the model and its loss: 150 updates on one batch of a deterministic
    stream lower the decoder's, the reward's and the continue head's losses."""
    torch.manual_seed(0)
    ctx = _ctx(batch_size=4, batch_length=8, model_size="micro", world_model_lr=1e-3)
    learner, buf = d.DreamerV3Learner(ctx), SequenceReplay(ctx)
    buf.start(torch.zeros(2, 4))
    for i in range(1, 9):
        _step(buf, i % 5, done=(i % 5 == 4, False))
    batch = buf.sample()
    first = learner.learn(batch)
    for _ in range(150):
        last = learner.learn(batch)
    for k in ("losses/decoder", "losses/reward", "losses/continue"):
        assert float(last[k]) < 0.5 * float(first[k]), (k, float(first[k]), float(last[k]))
    assert all(math.isfinite(float(v)) for v in last.values())


def test_the_replay_value_loss_trains_the_critic_alone():
    """``replay_value_scale`` adds the critic's loss on replayed states: the same world-model and
    actor step as without it, a different critic, and the loss reported."""
    torch.manual_seed(0)
    learners = []
    for scale in (0.0, 0.3):
        ctx = _ctx(batch_size=2, batch_length=6, model_size="nano", replay_value_scale=scale)
        learner, buf = d.DreamerV3Learner(ctx), SequenceReplay(ctx)
        buf.start(torch.zeros(2, 4))
        for i in range(1, 9):
            _step(buf, i % 5, done=(i % 5 == 4, False))
        out = learner.learn(buf.sample())
        assert ("losses/replay_value" in out) == (scale > 0)
        learners.append(learner.model.state_dict())
    off, on = learners
    assert all(torch.equal(off[k], on[k]) for k in off if not k.startswith("critic."))
    assert not all(torch.equal(off[k], on[k]) for k in off if k.startswith("critic."))


def test_the_actor_carries_its_model_state_and_a_zero_state_starts_an_episode():
    actor = d.DreamerV3Actor(_ctx())
    obs = torch.randn(2, 4)
    state = actor.initial_state(obs)
    m = actor.model
    assert state.shape == (2, m.state_size + 2) and not state.any()
    action, state = actor.act(obs, state)
    assert action.shape == (2,) and state[:, -2:].argmax(-1).tolist() == action.tolist()
    ended = actor.end_episodes(state, torch.tensor([True, False]), torch.tensor([False, False]))
    assert not ended[0].any() and torch.equal(ended[1], state[1])
    # deterministic: the most probable action of the actor head at the posterior state
    gen = torch.Generator().manual_seed(5)
    actor.generator.set_state(gen.get_state())
    greedy, after = actor.act(obs, actor.initial_state(obs), deterministic=True)
    h, z = after[:, :m.gru_units], after[:, m.gru_units:m.state_size]
    assert torch.equal(greedy, m.policy(torch.cat([h, z], -1)).argmax(-1))


def test_too_few_replayed_steps_for_one_update_is_one_line():
    with pytest.raises(ConfigError, match=r"steps_per_iteration x env.num_envs x train_ratio = 8 replayed steps"):
        d.DreamerV3Learner(_ctx(train_ratio=1, steps_per_iteration=4, batch_size=3, batch_length=4, n_envs=2))
    with pytest.raises(ValueError, match="model_size: 'XXL' is not one of nano"):
        d.DreamerV3Config(model_size="XXL")


def test_a_run_evaluates_with_its_recurrent_actor_and_resumes_exactly(tmp_path):
    straight = msrl.train(load_config(CONFIG, [*TINY, f"runs_dir={tmp_path / 'a'}", "train.total_env_steps=64"]))
    assert len(straight.eval_returns) == 2 and all(r >= 8 for r in straight.eval_returns)
    first = msrl.train(load_config(CONFIG, [*TINY, f"runs_dir={tmp_path / 'b'}", "train.total_env_steps=32",
                                            "train.checkpoint_every=1"]))
    resumed = msrl.train(resume=first.run_dir, train__total_env_steps=64)
    a, b = (torch.load(r.run_dir / "checkpoints" / "latest.pt", weights_only=False)["actor_weights"]
            for r in (straight, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_under_async_learner_the_actors_collect_while_the_learner_imagines():
    """RLlib's layout: actor replicas stepping their envs into their own replay shards while
    the learner trains on what they sent; every env step taken, losses finite."""
    hp = d.DreamerV3Config(model_size="nano", batch_size=2, batch_length=4, horizon=3, train_ratio=2,
                           steps_per_iteration=4, learning_starts=16, buffer_size=256)
    pol = load_policy("async_learner").with_overrides(replicas={"actor": 2})
    job = Job(JobSpec(d.ALGORITHM, hp, "CartPole-v1", 4, pol, seed=3, total_env_steps=1000))
    try:
        job.reset()
        records = job.run(6)
        losses = [float(v) for r in records for k, v in (r["output"] or {}).items() if k.startswith("losses/")]
        assert losses and all(math.isfinite(x) for x in losses)
        assert job.env_steps == len(records) * 16
    finally:
        job.close()


def test_coarse_on_ray_processes_learns_what_threads_learn_bitwise(tmp_path):
    """Two actor replicas as Ray processes (each its envs, its recurrent states and its replay
    shard), the learner imagining in a third: the weights two threads of one process end with."""
    common = [*TINY, "distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2",
              "env.num_envs=4", "train.total_env_steps=96", "train.checkpoint_every=6"]
    ray = msrl.train(load_config(CONFIG, [*common, "runtime=ray", f"runs_dir={tmp_path / 'ray'}"]))
    local = msrl.train(load_config(CONFIG, [*common, "runtime=local", f"runs_dir={tmp_path / 'local'}"]))
    assert ray.env_steps == local.env_steps == 96
    a, b = (torch.load(r.run_dir / "checkpoints" / "latest.pt", weights_only=False)["actor_weights"] for r in (local, ray))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_frames_go_through_the_cnn_and_the_replay_keeps_them_as_uint8():
    """Pong from pixels (``atari64``: one 64x64 grayscale frame a step): the replay stores the
    frames as the env gives them, the CNN encodes them, the transposed CNN learns to draw them."""
    pytest.importorskip("ale_py")
    hp = d.DreamerV3Config(model_size="nano", batch_size=2, batch_length=4, horizon=2, train_ratio=2,
                           steps_per_iteration=4, learning_starts=8, buffer_size=64, world_model_lr=3e-3)
    job = Job(JobSpec(d.ALGORITHM, hp, "ALE/Pong-v5", 1, load_policy("single"), seed=2, total_env_steps=1000,
                      env_wrappers=("atari64",)))
    try:
        job.reset()
        metrics = [job.train_step() for _ in range(4)]
        buffer, learner = job.component("buffer"), job.component("learner")
        assert buffer.storage["obs"].dtype == torch.uint8 and buffer.storage["obs"].shape[2:] == (1, 64, 64)
        assert learner.model.image and all(math.isfinite(float(v)) for m in metrics for v in m.values())
        batch = buffer.sample()
        first = float(learner.world_model_loss(batch)[1]["losses/decoder"].detach())
        for _ in range(40):
            learner.learn(batch)
        assert float(learner.world_model_loss(batch)[1]["losses/decoder"].detach()) < 0.5 * first
    finally:
        job.close()


@pytest.mark.slow
def test_the_cartpole_config_learns(tmp_path):
    """A learning run (about 20 minutes of one core): the config as shipped, under ``single``
    (deterministic), stops early on a greedy evaluation of 10 episodes >= 300 within 8k env
    steps (a random policy: ~22; seed 1 evaluated 53.2, 361.1, 120.5 and 438.2 at 2k-8k)."""
    cfg = load_config(CONFIG, [f"runs_dir={tmp_path}", "train.progress=false", "train.total_env_steps=8000",
                               "train.stop_at_return=300"])
    assert cfg.distribution_policy.name == "single" and cfg.train.eval_every == 2000
    r = msrl.train(cfg)
    assert r.steps_to_threshold is not None, r.eval_returns
