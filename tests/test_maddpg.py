"""MADDPG (``algorithms/maddpg.py``): the Gumbel-softmax, the critics' targets written out, learning
a one-step cooperative game with Box and with Discrete actions, MPE's simple_adversary (unequal
observations padded), exact resume, Ray, and bad input."""

import math

import pytest
import torch
from tensordict import TensorDict

import msrl
from msrl.algorithms import maddpg as m
from msrl.api import BuildContext
from msrl.config import load_config
from msrl.envs import env_spec
from msrl.envs.single_env import make_single_env
from msrl.errors import ConfigError

CONFIG = "configs/maddpg_simple_spread.yaml"
TINY = ["algorithm.hparams.learning_starts=20", "algorithm.hparams.batch_size=8", "algorithm.hparams.buffer_size=256",
        "algorithm.hparams.hidden_sizes=[8, 8]", "algorithm.hparams.steps_per_iteration=5",
        "algorithm.hparams.gradient_steps=1", "env.kwargs={N: 3, max_cycles: 5, continuous_actions: true}",
        "env.num_envs=2", "train.progress=false", "eval.episodes=2", "train.eval_every=0"]


def test_the_gumbel_softmax_is_a_relaxed_sample_of_the_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([0.0, 1.0, 2.0]).log_softmax(-1).expand(20000, 3).clone().requires_grad_(True)
    y = m.gumbel_softmax(logits, 1.0, g)
    assert torch.allclose(y.sum(-1), torch.ones(20000)) and (y > 0).all()
    freq = torch.bincount(y.argmax(-1), minlength=3).float() / 20000  # its argmax: a softmax sample
    assert torch.allclose(freq, torch.softmax(logits[0].detach(), -1), atol=0.015)
    (grad,) = torch.autograd.grad(y[:, 2].sum(), logits)
    assert grad.abs().sum() > 0  # differentiable in the logits


def _ctx(**hp):
    hparams = m.MADDPGConfig(**{**dict(batch_size=4, hidden_sizes=(8,), gamma=0.9), **hp})
    spec = env_spec("pettingzoo/mpe2.simple_spread_v3", 2, env_kwargs={"N": 3, "continuous_actions": True})
    return BuildContext(hparams, spec, 0, 1, 2, 1000, 0, torch.device("cpu"))


def test_each_critic_regresses_on_its_own_agents_target_written_out():
    learner = m.MADDPGLearner(_ctx())
    torch.manual_seed(3)
    B, A, D = 4, 3, 18
    batch = TensorDict({"obs": torch.randn(B, A, D), "next_obs": torch.randn(B, A, D), "action": torch.rand(B, A, 5),
                        "reward": torch.randn(B, A), "terminated": torch.tensor([False, True, False, False])}, [B])
    expected = 0.0
    with torch.no_grad():
        for i in range(A):
            mu = torch.cat([torch.tanh(learner.policy_target.one(j, batch["next_obs"][:, j])) * 0.5 + 0.5
                            for j in range(A)], -1)  # mu'_j(o'_j), squashed into [0, 1]
            y = batch["reward"][:, i] + 0.9 * (1.0 - batch["terminated"].float()) * \
                learner.critic_target.one(i, torch.cat([batch["next_obs"].flatten(1), mu], -1)).squeeze(-1)
            q = learner.critic.one(i, torch.cat([batch["obs"].flatten(1), batch["action"].flatten(1)], -1)).squeeze(-1)
            expected += ((q - y) ** 2).mean()
    got = learner.learn(batch)["losses/critic_loss"]
    assert torch.allclose(got, torch.as_tensor(expected), rtol=1e-5)


@pytest.mark.parametrize("mode", ["replayed", "current"])
def test_the_actor_loss_written_out(mode):
    """``replayed``: each actor up its own critic with the others' replayed actions (Eq. 6);
    ``current``: every critic on every actor's current actions (TorchRL's loss)."""
    import copy

    learner = m.MADDPGLearner(_ctx(actor_actions=mode, policy_regularization=0.0))
    torch.manual_seed(4)
    B, A, D = 4, 3, 18
    batch = TensorDict({"obs": torch.randn(B, A, D), "next_obs": torch.randn(B, A, D), "action": torch.rand(B, A, 5),
                        "reward": torch.randn(B, A), "terminated": torch.zeros(B, dtype=torch.bool)}, [B])
    policy = copy.deepcopy(learner.policy)  # the actors the loss sees (the critics step first)
    got = learner.learn(batch)["losses/actor_loss"]
    x, expected = batch["obs"].flatten(1), 0.0
    with torch.no_grad():
        mu = torch.tanh(policy(batch["obs"])) * 0.5 + 0.5  # (B, A, 5) in [0, 1]
        for i in range(A):
            actions = mu if mode == "current" else torch.cat([batch["action"][:, :i], mu[:, i:i + 1],
                                                             batch["action"][:, i + 1:]], 1)
            expected -= learner.critic.one(i, torch.cat([x, actions.flatten(1)], -1)).mean()
    assert torch.allclose(got, torch.as_tensor(expected), rtol=1e-5)


MATCH = ["env.id=pettingzoo/matching_game", "algorithm.hparams.steps_per_iteration=1", "algorithm.hparams.learning_starts=64",
         "algorithm.hparams.batch_size=64", "algorithm.hparams.hidden_sizes=[16, 16]", "algorithm.hparams.gradient_steps=1",
         "env.num_envs=8", "train.total_env_steps=4000", "train.eval_every=0", "eval.episodes=2", "train.progress=false",
         "algorithm.hparams.actor_actions=replayed"]  # the paper's loss (the config's is a team's option)


def test_two_agents_learn_each_its_own_continuous_action(tmp_path):
    """Each paid ``-(a_0 - 0.3)^2 - (a_1 - 0.7)^2``: the agents find their own targets."""
    r = msrl.train(load_config(CONFIG, [*MATCH, "env.kwargs={continuous: true}", f"runs_dir={tmp_path}"]))
    assert all(x > -0.01 for x in r.eval_returns), r.eval_returns  # two agents' rewards: each within 0.07


def test_two_agents_coordinate_on_the_better_discrete_equilibrium(tmp_path):
    """Both paid 1 for (2, 2), 0.5 for (0, 0): the Gumbel-softmax actors find (2, 2)."""
    r = msrl.train(load_config(CONFIG, [*MATCH, "env.kwargs={continuous: false}", f"runs_dir={tmp_path}"]))
    assert r.eval_returns == [2.0, 2.0]


def test_unequal_observations_are_padded_and_a_run_resumes_exactly(tmp_path):
    env = make_single_env("pettingzoo/mpe2.simple_adversary_v3", {"continuous_actions": True}, ["pad_observations"])
    obs, _ = env.reset(seed=0)
    assert obs.shape == (3, 10) and (obs[0, 8:] == 0).all() and env.observation_space.shape == (3, 10)
    with pytest.raises(ValueError, match=r"different observation spaces .* \(env.wrappers: \[pad_observations\]"):
        make_single_env("pettingzoo/mpe2.simple_adversary_v3", {}, [])
    cfg = ["env.id=pettingzoo/mpe2.simple_adversary_v3", "env.wrappers=[pad_observations]",
           "env.kwargs={N: 2, max_cycles: 5, continuous_actions: true}", *TINY[:-5], "env.num_envs=2", "train.progress=false",
           "eval.episodes=2", "train.eval_every=0"]
    straight = msrl.train(load_config(CONFIG, [*cfg, f"runs_dir={tmp_path / 'a'}", "train.total_env_steps=60"]))
    first = msrl.train(load_config(CONFIG, [*cfg, f"runs_dir={tmp_path / 'b'}", "train.total_env_steps=30",
                                            "train.checkpoint_every=1"]))
    resumed = msrl.train(resume=first.run_dir, train__total_env_steps=60)
    a, b = (torch.load(r.run_dir / "checkpoints" / "latest.pt", weights_only=False)["actor_weights"]
            for r in (straight, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a) and all(math.isfinite(x) for x in straight.eval_returns)


def test_coarse_on_ray_processes_learns_what_threads_learn_bitwise(tmp_path):
    """Two actor replicas as Ray processes (each its envs and replay shard), the critics and
    actors learning in a third: the weights two threads of one process end with."""
    common = [*TINY, "distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2",
              "env.num_envs=4", "train.total_env_steps=120", "train.checkpoint_every=3"]
    ray = msrl.train(load_config(CONFIG, [*common, "runtime=ray", f"runs_dir={tmp_path / 'ray'}"]))
    local = msrl.train(load_config(CONFIG, [*common, "runtime=local", f"runs_dir={tmp_path / 'local'}"]))
    assert ray.env_steps == local.env_steps == 120
    a, b = (torch.load(r.run_dir / "checkpoints" / "latest.pt", weights_only=False)["actor_weights"] for r in (local, ray))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bad_input_is_one_line():
    with pytest.raises(ConfigError, match="maddpg is multi-agent"):
        msrl.train(load_config(CONFIG, [*TINY, "env.id=Pendulum-v1", "env.kwargs={}"]))
    with pytest.raises(ConfigError, match="env.wrappers \\['atari'\\] apply to gymnasium envs, not the PettingZoo env"):
        msrl.train(load_config(CONFIG, [*TINY, "env.wrappers=[atari]"]))
