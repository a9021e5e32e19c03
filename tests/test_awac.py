"""AWAC (msrl.algorithms.awac): its advantage weights and policy loss against Nair et al. 2020's
Eq. 13 written out, its policy's bounds, and its offline-then-online run: no env step before
``offline_steps`` iterations, then the env's transitions added to a replay buffer that starts
with the dataset's."""

import math
import pathlib

import gymnasium
import pytest
import torch

import msrl
from msrl.algorithms.awac import AWACConfig, AWACLearner, AWACPolicy, advantage_weights
from msrl.api import BuildContext, EnvSpec
from msrl.config import build_job_spec, load_config
from msrl.run.collect import collect
from msrl.run.job import Job

pytest.importorskip("minari")

OBS = gymnasium.spaces.Box(-1.0, 1.0, (3,))
ACTIONS = gymnasium.spaces.Box(-2.0, 2.0, (1,))
CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def test_weights_are_the_exponentiated_advantage_clipped():
    q = torch.tensor([1.0, 0.0, 10.0, -3.0])
    v = torch.tensor([0.0, 0.0, 0.0, -1.0])
    w = advantage_weights(q, v, awac_lambda=2.0, exp_adv_max=20.0)
    assert w.tolist() == pytest.approx([math.exp(0.5), 1.0, 20.0, math.exp(-1.0)])
    assert not w.requires_grad


def test_the_policys_mean_stays_in_the_bounds_and_its_samples_are_clipped_into_them():
    torch.manual_seed(0)
    policy = AWACPolicy(OBS, ACTIONS, (8,))
    with torch.no_grad():
        policy.mu[-1].bias.fill_(50.0)  # a saturated mean
        policy.log_std.fill_(3.0)  # beyond LOG_STD_MAX: clamped
    obs = torch.randn(64, 3)
    d = policy.distribution(obs)
    assert bool((d.mean <= 2.0).all()) and bool((d.mean >= -2.0).all())
    assert torch.allclose(d.stddev, torch.full_like(d.stddev, 2.0))  # half-range * exp(0)
    a = policy.sample(obs, torch.Generator().manual_seed(1))
    assert bool((a <= 2.0).all()) and bool((a >= -2.0).all()) and bool((a == 2.0).any())


def _learner():
    spec = EnvSpec("test", OBS, ACTIONS, num_envs=1)
    ctx = BuildContext(AWACConfig(hidden_sizes=(8,)), spec, replica=0, num_replicas=1, total_num_envs=1,
                       total_env_steps=0, seed=0, device=torch.device("cpu"))
    return AWACLearner(ctx)


def test_the_policy_loss_is_the_advantage_weighted_log_likelihood_of_the_batchs_actions():
    from tensordict import TensorDict

    learner = _learner()
    g = torch.Generator().manual_seed(0)
    batch = TensorDict({"obs": torch.randn(5, 3, generator=g), "next_obs": torch.randn(5, 3, generator=g),
                        "action": torch.rand(5, 1, generator=g) * 4 - 2, "reward": torch.randn(5, generator=g),
                        "terminated": torch.zeros(5, dtype=torch.bool)}, batch_size=(5,))
    policy_before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    gen_state = learner.generator.get_state()
    metrics = learner.learn(batch)
    # again by hand, from the critics after their step and the generator where the policy's sample drew
    ref = AWACPolicy(OBS, ACTIONS, (8,))
    ref.load_state_dict(policy_before)
    gen = torch.Generator().set_state(gen_state)
    with torch.no_grad():
        ref.sample(batch["next_obs"], gen)  # the critics' target drew first
        a_pi = ref.sample(batch["obs"], gen)
        v = torch.min(learner.qf1(batch["obs"], a_pi), learner.qf2(batch["obs"], a_pi))
        q = torch.min(learner.qf1(batch["obs"], batch["action"]), learner.qf2(batch["obs"], batch["action"]))
        w = torch.exp(q - v).clamp(max=100.0)
        expected = -(ref.distribution(batch["obs"]).log_prob(batch["action"]).sum(-1) * w).mean()
    assert float(metrics["losses/actor_loss"]) == pytest.approx(float(expected), rel=1e-5)
    assert float(metrics["charts/advantage_weight"]) == pytest.approx(float(w.mean()), rel=1e-5)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A Minari root holding msrl/pendulum/tiny-v0 (3 noisy episodes of a briefly trained DDPG policy)."""
    base = tmp_path_factory.mktemp("awac")
    run = msrl.train(CONFIGS / "ddpg_pendulum.yaml", runs_dir=str(base / "runs"), train__total_env_steps=300,
                     algorithm__hparams__learning_starts=100, train__progress=False, train__eval_every=0,
                     eval__episodes=1)
    collect([run.run_dir], "msrl/pendulum/tiny-v0", 3, noise=0.5, seed=0, root=base / "root")
    return base / "root"


def test_the_env_is_stepped_from_offline_steps_on_into_the_buffer_that_holds_the_dataset(root):
    cfg = load_config(CONFIGS / "awac_pendulum.yaml", [
        "dataset.id=msrl/pendulum/tiny-v0", f"dataset.root={root}", "algorithm.hparams.batch_size=16",
        "algorithm.hparams.hidden_sizes=[16]", "algorithm.hparams.offline_steps=4", "algorithm.hparams.buffer_size=10",
        "env.num_envs=2", "train.total_gradient_steps=20", "train.progress=false"])
    job = Job(build_job_spec(cfg))
    try:
        job.reset()
        buffer = job.component("buffer")
        dataset_rows = {k: buffer.storage[k][:buffer.dataset_size].clone() for k in ("obs", "action", "reward")}
        assert buffer.size == buffer.dataset_size == buffer.total == 600  # 3 episodes of 200 steps
        job.run(4)
        assert job.env_steps == 0 and buffer.size == 600  # the offline phase: the dataset alone
        job.run(3)
        assert job.env_steps == 6 and buffer.size == 606  # 3 iterations of 2 envs
        job.run(5)
        assert job.env_steps == 16 and buffer.size == 610  # full: the dataset's oldest rows overwritten
        assert torch.equal(buffer.storage["obs"][6:600], dataset_rows["obs"][6:])
        assert not torch.equal(buffer.storage["obs"][:6], dataset_rows["obs"][:6])
    finally:
        job.close()


def test_the_summary_line_counts_gradient_steps_and_the_online_phases_env_steps(root, tmp_path, capsys):
    from msrl.run.cli import main

    assert main(["train", str(CONFIGS / "awac_pendulum.yaml"), "dataset.id=msrl/pendulum/tiny-v0", f"dataset.root={root}",
                 f"runs_dir={tmp_path}", "train.total_gradient_steps=10", "algorithm.hparams.offline_steps=6",
                 "algorithm.hparams.hidden_sizes=[16]", "train.progress=false", "eval.episodes=1"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert ": 10 iterations, 10 gradient steps (4 env steps online), " in line, line


@pytest.mark.slow
def test_learns_pendulum_offline_then_online_from_a_noisy_experts_dataset(tmp_path):
    """``configs/sac_pendulum.yaml`` (seed 1) as the expert, 100 of its episodes with Gaussian noise
    0.3, then ``configs/awac_pendulum.yaml`` under ``single`` (deterministic): 5,000 gradient steps
    offline, 5,000 iterations online, a final greedy evaluation of -200 or more."""
    expert = msrl.train(CONFIGS / "sac_pendulum.yaml", runs_dir=str(tmp_path / "runs"), train__progress=False, seed=1)
    collect([expert.run_dir], "msrl/pendulum/sac-noisy-v0", 100, noise=0.3, seed=0, root=tmp_path / "root")
    r = msrl.train(CONFIGS / "awac_pendulum.yaml", runs_dir=str(tmp_path / "runs"), dataset__root=str(tmp_path / "root"),
                   train__progress=False)
    assert r.env_steps == 5000 and r.eval_mean >= -200, r.eval_returns
