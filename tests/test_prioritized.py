"""Prioritized replay (Schaul et al. 2016): the sum tree's sums and draws, the buffer's
priorities and importance-sampling scale, its checkpoint, and TD errors flowing back to the
replay shard that drew each sample when the replay is split over actor replicas."""

from __future__ import annotations

import dataclasses

import gymnasium
import numpy as np
import pytest
import torch

from msrl.rl.sum_tree import SumTree


def test_the_tree_sums_every_level_and_the_last_write_of_a_slot_wins():
    tree = SumTree(5)
    assert tree.leaves == 8 and tree.depth == 3
    tree.set(torch.tensor([0, 1, 2, 3, 4]), torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert tree.total.item() == 15.0 and tree.tree[2].item() == 10.0 and tree.tree[3].item() == 5.0
    tree.set(torch.tensor([1, 3, 1]), torch.tensor([7.0, 0.0, 0.5]))  # slot 1 twice: 0.5 wins
    assert torch.equal(tree.get(torch.arange(5)), torch.tensor([1.0, 0.5, 3.0, 0.0, 5.0], dtype=torch.float64))
    assert tree.total.item() == 9.5
    with pytest.raises(ValueError, match="out of"):
        tree.set(torch.tensor([5]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="finite and >= 0"):
        tree.set(torch.tensor([0]), torch.tensor([-1.0]))


def test_find_maps_each_mass_to_its_slot_interval_exactly():
    tree = SumTree(4)
    tree.set(torch.arange(4), torch.tensor([1.0, 0.0, 2.0, 1.0]))
    mass = torch.tensor([0.0, 0.999, 1.0, 2.5, 2.999, 3.0, 3.999])
    assert tree.find(mass, 4).tolist() == [0, 0, 2, 2, 2, 3, 3]  # slot 1 (priority 0) is never found
    assert tree.find(torch.tensor([3.999]), 3).tolist() == [2]  # clamped to the stored rows


def test_draws_follow_the_priorities():
    tree = SumTree(6)
    p = torch.tensor([1.0, 2.0, 0.0, 4.0, 8.0, 1.0])
    tree.set(torch.arange(6), p)
    g = torch.Generator().manual_seed(0)
    draws = tree.sample((4000, 16), 6, g).flatten()
    freq = torch.bincount(draws, minlength=6).double() / draws.numel()
    assert torch.allclose(freq, (p / p.sum()).double(), atol=0.01), freq
    assert freq[2] == 0
    with pytest.raises(RuntimeError, match="every priority"):
        SumTree(3).sample((2,), 3, g)


def _ctx(hp, num_envs=2):
    from msrl.api import BuildContext, EnvSpec

    spec = EnvSpec("x", gymnasium.spaces.Box(-1, 1, (3,), np.float32), gymnasium.spaces.Discrete(2), num_envs)
    return BuildContext(hparams=hp, env_spec=spec, replica=0, num_replicas=1, total_num_envs=num_envs,
                        total_env_steps=1000, seed=3, device=torch.device("cpu"))


@dataclasses.dataclass
class _Hp:
    buffer_size: int = 8
    batch_size: int = 4
    per_alpha: float = 1.0
    per_eps: float = 0.0


def _insert(buf, n, start=0):
    for t in range(n):
        v = float(start + t)
        buf.insert(obs=torch.full((2, 3), v), action=torch.zeros(2, dtype=torch.int64), reward=torch.full((2,), v),
                   next_obs=torch.full((2, 3), v), terminated=torch.zeros(2, dtype=torch.bool))


def test_the_buffer_gives_new_rows_the_top_priority_and_draws_by_td_error():
    from msrl.rl.buffers import PrioritizedReplayBuffer

    buf = PrioritizedReplayBuffer(_ctx(_Hp()))
    _insert(buf, 2)  # 4 rows, priority 1 each
    s = buf.sample_many(3)
    assert s.batch_size == (3, 4) and s["index"].dtype == torch.int64
    assert torch.allclose(s["scale"], torch.ones(3, 4))  # N P(i) = 4 * 1/4
    buf.update_priorities(torch.tensor([0, 1, 2, 3]), torch.tensor([0.0, 0.0, 3.0, -1.0]))
    draws = buf.sample_many(200)["index"].flatten()
    assert set(draws.tolist()) == {2, 3} and (draws == 2).sum() > 2 * (draws == 3).sum()
    s = buf.sample()
    assert torch.allclose(s["scale"], 4 * torch.where(s["index"] == 2, 0.75, 0.25).float())
    _insert(buf, 1, start=5)  # rows 4, 5: the largest priority so far (3)
    assert buf.tree.get(torch.tensor([4, 5])).tolist() == [3.0, 3.0]
    with pytest.raises(ValueError, match="differ"):
        buf.update_priorities(torch.tensor([0]), torch.tensor([1.0, 2.0]))


def test_a_restored_buffer_draws_what_the_saved_one_would():
    from msrl.rl.buffers import PrioritizedReplayBuffer

    a = PrioritizedReplayBuffer(_ctx(_Hp(per_alpha=0.6, per_eps=1e-6)))
    _insert(a, 3)
    a.update_priorities(torch.tensor([0, 2, 5]), torch.tensor([0.5, 2.0, 1.0]))
    b = PrioritizedReplayBuffer(_ctx(_Hp(per_alpha=0.6, per_eps=1e-6)))
    b.load_state_dict(a.state_dict())
    x, y = a.sample_many(5), b.sample_many(5)
    assert torch.equal(x["index"], y["index"]) and torch.equal(x["scale"], y["scale"]) and torch.equal(x["obs"], y["obs"])


def test_uniform_replay_has_no_priorities_to_update():
    from msrl.rl.buffers import ReplayBuffer

    with pytest.raises(TypeError, match="prioritized_replay=true"):
        ReplayBuffer(_ctx(_Hp())).update_priorities(torch.tensor([0]), torch.tensor([1.0]))


def test_td_errors_go_back_to_the_replay_shard_that_drew_each_sample(monkeypatch):
    """Coarse x2 with the replay on the actors (one shard each): the learner's TD errors
    ``(K, 2B)`` are scattered back along the batch axis, so shard ``r`` updates exactly the
    slots it drew (columns ``rB..(r+1)B`` of the gathered sample) with their errors."""
    from msrl.algorithms import dqn
    from msrl.policy import load_policy
    from msrl.rl.buffers import PrioritizedReplayBuffer
    from msrl.run.job import Job, JobSpec

    updates, learned = [], []
    real_update, real_learn = PrioritizedReplayBuffer.update_priorities, dqn.DQNLearner.learn_prioritized

    def update(buf, index, td_error):
        updates.append((buf.generator.initial_seed(), index.clone(), td_error.clone()))
        return real_update(buf, index, td_error)

    def learn(learner, batch):
        out = real_learn(learner, batch)
        learned.append((batch["index"].clone(), out[1].clone()))
        return out

    learn.__msrl_returns__ = real_learn.__msrl_returns__
    monkeypatch.setattr(PrioritizedReplayBuffer, "update_priorities", update)
    monkeypatch.setattr(dqn.DQNLearner, "learn_prioritized", learn)
    hp = dqn.DQNConfig(learning_starts=16, train_frequency=4, gradient_steps=2, batch_size=8, buffer_size=256,
                       target_network_frequency=8, hidden_sizes=(8,), prioritized_replay=True)
    pol = load_policy("single_learner_coarse").with_overrides(replicas={"actor": 2})
    job = Job(JobSpec(dqn.ALGORITHM, hp, "CartPole-v1", 4, pol, seed=7, total_env_steps=5_000))
    updates.clear()
    learned.clear()
    try:
        job.reset()
        for _ in range(6):
            job.train_step()
    finally:
        job.close()
    assert learned and len(updates) == 2 * len(learned)
    seeds = sorted({s for s, _, _ in updates})
    for i, (index, td_error) in enumerate(learned):
        assert index.shape == td_error.shape == (2, 16)
        for r, seed in enumerate(seeds):
            mine = [(ix, err) for s, ix, err in updates if s == seed][i]
            assert torch.equal(mine[0], index[:, 8 * r:8 * (r + 1)]) and torch.equal(mine[1], td_error[:, 8 * r:8 * (r + 1)])


def _per_spec(policy, replicas=None, placement=None, num_envs=2, seed=7):
    from msrl.algorithms import dqn
    from msrl.policy import load_policy
    from msrl.run.job import JobSpec

    hp = dqn.DQNConfig(learning_starts=16, train_frequency=4, gradient_steps=2, batch_size=8, buffer_size=256,
                       target_network_frequency=8, hidden_sizes=(8,), prioritized_replay=True)
    pol = load_policy(policy).with_overrides(replicas=replicas, placement=placement)
    return JobSpec(dqn.ALGORITHM, hp, "CartPole-v1", num_envs, pol, seed=seed, total_env_steps=5_000)


def test_the_replay_in_a_fragment_of_its_own_is_placed_and_configured_from_yaml(tmp_path):
    from msrl.config import ConfigError, build_job_spec, load_config

    over = [f"runs_dir={tmp_path}", "algorithm.hparams.prioritized_replay=true", "env.num_envs=4",
            "distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2"]
    spec = build_job_spec(load_config("configs/dqn_cartpole.yaml", over + ["distribution_policy.placement.buffer=replay",
                                                                           "distribution_policy.replicas.replay=2"]))
    frags = [(f.name, f.roles, f.replicas) for f in spec.policy.fragments]
    assert frags == [("actor", ("env", "actor"), 2), ("replay", ("buffer",), 2), ("learner", ("learner",), 1)]
    with pytest.raises(ConfigError, match="placement.buffer=replay gives the buffer a fragment of its own"):
        build_job_spec(load_config("configs/dqn_cartpole.yaml", over + ["distribution_policy.replicas.replay=2"]))
    with pytest.raises(ConfigError, match=r"has no fragment 'replya'.*\(or replay: the buffer in a fragment of its own\)"):
        build_job_spec(load_config("configs/dqn_cartpole.yaml", over + ["distribution_policy.placement.buffer=replya"]))


def test_one_replay_shard_beside_one_actor_equals_single_bitwise():
    """Synchronous, one actor replica and one replay shard in their own fragments: the same
    learner weights and metrics as ``single``, bit for bit (the partition moves code, never
    what it computes)."""
    from msrl.run.job import Job

    def run(spec):
        job = Job(spec)
        try:
            job.reset()
            metrics = [job.train_step() for _ in range(8)]
            return metrics, {k: v.clone() for k, v in job.component("learner").get_weights().items()}, job.fragment_graph
        finally:
            job.close()

    a = run(_per_spec("single"))
    b = run(_per_spec("single_learner_coarse", {"actor": 1}, {"buffer": "replay"}))
    assert [f.name for f in b[2].fragments] == ["actor", "replay", "learner"]
    assert all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    assert [{k: float(v) for k, v in m.items()} for m in a[0]] == [{k: float(v) for k, v in m.items()} for m in b[0]]
    assert any("losses/td_loss" in m for m in a[0])


def test_two_replay_shards_take_their_actors_transitions_and_their_own_td_errors(monkeypatch):
    """Ape-X's layout: 2 actor replicas each feed their own replay shard (send per step), the
    learner gathers both shards' samples and scatters the TD errors back: each shard holds every
    transition of its actor's envs, and updates only the slots it drew."""
    from msrl.graph import NodeKind
    from msrl.rl.buffers import PrioritizedReplayBuffer
    from msrl.run.job import Job

    drawn, updated = [], []
    real_draw, real_update = PrioritizedReplayBuffer._draw, PrioritizedReplayBuffer.update_priorities
    monkeypatch.setattr(PrioritizedReplayBuffer, "_draw", lambda buf, shape: (
        lambda out: (drawn.append((id(buf), out["index"].clone())), out)[1])(real_draw(buf, shape)))
    monkeypatch.setattr(PrioritizedReplayBuffer, "update_priorities", lambda buf, index, td: (
        updated.append((id(buf), index.clone())), real_update(buf, index, td))[1])
    job = Job(_per_spec("single_learner_coarse", {"actor": 2, "replay": 2}, {"buffer": "replay"}, num_envs=4))
    drawn.clear()
    updated.clear()
    try:
        ops = {(b.comm_kind, b.src, b.dst) for b in job.fragment_graph.boundaries if b.method == "train_step"}
        assert {(NodeKind.SEND, "actor", "replay"), (NodeKind.GATHER, "replay", "learner"),
                (NodeKind.SCATTER, "learner", "replay")} <= ops
        job.reset()
        for _ in range(6):
            job.train_step()
        shards = [job.replica("replay", r).trainer.components["buffer"] for r in range(2)]
        assert [s.size for s in shards] == [6 * 4 * 2, 6 * 4 * 2]  # 6 iterations x 4 steps x its actor's 2 envs
    finally:
        job.close()
    def per_shard(calls):  # the shards run side by side (threads): each shard's calls in its order
        return {b: [ix.tolist() for c, ix in calls if c == b] for b in {c for c, _ in calls}}

    assert updated and len(per_shard(updated)) == 2 and per_shard(updated) == per_shard(drawn)
