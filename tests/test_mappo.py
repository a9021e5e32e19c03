"""MAPPO: decentralised actors, a centralised critic; on PettingZoo's simple_spread and native Tag."""

from __future__ import annotations

import math

import gymnasium
import pytest
import torch

from msrl.algorithms import mappo
from msrl.policy import load_policy
from msrl.run.job import Job, JobSpec


def test_actor_is_decentralised_and_critic_centralised():
    torch.manual_seed(0)
    net = mappo.MAPPONet(gymnasium.spaces.Box(-1, 1, (4,)), gymnasium.spaces.Discrete(3), num_agents=3, hidden_sizes=(16,))
    obs = torch.randn(2, 3, 4)
    other = obs.clone()
    other[:, 2] += 1.0  # agent 2 sees something else
    la, lb = net.logits(obs)[0], net.logits(other)[0]
    assert torch.equal(la[:, :2], lb[:, :2]) and not torch.equal(la[:, 2], lb[:, 2])  # own observation only
    va, vb = net.value(obs), net.value(other)
    assert not torch.isclose(va[:, 0], vb[:, 0]).any()  # agent 0's value sees agent 2's observation
    same = obs[:, [1, 0, 2]]  # agent identity matters: swapping two agents' observations changes their actions
    assert not torch.equal(net.logits(same)[0][:, 0], la[:, 1])


@pytest.mark.parametrize("env_id,kwargs,policy", [
    ("pettingzoo/mpe2.simple_spread_v3", {"N": 3, "max_cycles": 10, "continuous_actions": False}, "single"),
    ("msrl/Tag-v0", {"num_taggers": 2, "num_runners": 3, "observe_self": True, "episode_length": 20}, "single"),
])
def test_mappo_trains_on_pettingzoo_and_native_tag(env_id, kwargs, policy):
    hp = mappo.MAPPOConfig(num_steps=10, update_epochs=2, num_minibatches=2, hidden_sizes=(16,))
    spec = JobSpec(mappo.ALGORITHM, hp, env_id, 4, load_policy(policy), seed=3, total_env_steps=1000, env_kwargs=kwargs)
    job = Job(spec)
    try:
        job.reset()
        metrics = [job.train_step() for _ in range(3)]
        assert all(math.isfinite(float(v)) for m in metrics for k, v in m.items() if k.startswith("losses/") and "kl" not in k)
        assert job.env_steps == 3 * 10 * 4
        assert job.pop_episode_stats().returns  # episodes of 10 / 20 steps finished
    finally:
        job.close()


def test_mappo_runs_on_tag_under_gpu_only_from_the_tag_config(tmp_path):
    """The Tag config (written for ma_ppo) with algorithm.name=mappo: kernels' host build, one fragment."""
    import pathlib

    from msrl.config import build_job_spec, load_config

    cfg = pathlib.Path(__file__).resolve().parents[1] / "configs" / "ma_ppo_tag.yaml"
    spec = build_job_spec(load_config(cfg, ["algorithm.name=mappo", "env.num_envs=4", "algorithm.hparams.num_steps=10",
                                            "env.kwargs.num_runners=3", "env.kwargs.episode_length=20"]))
    job = Job(spec)
    try:
        job.reset()
        metrics = [job.train_step() for _ in range(2)]
        assert all(math.isfinite(float(v)) for m in metrics for k, v in m.items() if k.startswith("losses/") and "kl" not in k)
        assert not job.fragment_graph.boundaries
    finally:
        job.close()
