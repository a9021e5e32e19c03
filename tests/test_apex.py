"""Ape-X DQN's parts (Horgan et al. 2018): n-step transitions in the replay, the dueling
Q-network, the fixed per-env exploration rates, and the whole (``configs/apex_dqn_cartpole.yaml``)
equal to ``single`` where the policy is synchronous with one actor and one replay shard."""

from __future__ import annotations

import dataclasses

import gymnasium
import numpy as np
import pytest
import torch

from msrl.algorithms import dqn
from msrl.api import BuildContext, EnvSpec
from msrl.rl.buffers import PrioritizedReplayBuffer, ReplayBuffer


def _ctx(n_step: int, gamma: float = 0.5, buffer_size: int = 64, num_envs: int = 2, **hp) -> BuildContext:
    space = gymnasium.spaces.Box(-np.inf, np.inf, (1,), np.float32)
    spec = EnvSpec(env_id="Test-v0", observation_space=space, action_space=gymnasium.spaces.Discrete(2), num_envs=num_envs)
    hparams = dqn.DQNConfig(buffer_size=buffer_size, batch_size=4, gamma=gamma, n_step=n_step, **hp)
    return BuildContext(hparams=hparams, env_spec=spec, replica=0, num_replicas=1, total_num_envs=num_envs,
                        total_env_steps=1000, seed=0, device=torch.device("cpu"))


# two envs, six steps: env 0 terminates at step 2 and starts again at step 3; env 1 is truncated at step 4
REWARDS = [[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0], [5.0, 50.0], [6.0, 60.0]]
TERMINATED = [[False, False], [False, False], [True, False], [False, False], [False, False], [False, False]]
TRUNCATED = [[False, False], [False, False], [False, False], [False, False], [False, True], [False, False]]


def _step(t: int) -> dict[str, torch.Tensor]:
    """Step ``t``: obs ``100 t + env``, next_obs ``100 t + env + 50``, action ``t % 2``."""
    return {"obs": torch.tensor([[100.0 * t], [100.0 * t + 1]]), "action": torch.tensor([t % 2, t % 2]),
            "reward": torch.tensor(REWARDS[t]), "next_obs": torch.tensor([[100.0 * t + 50], [100.0 * t + 51]]),
            "terminated": torch.tensor(TERMINATED[t]), "truncated": torch.tensor(TRUNCATED[t])}


def _expected(n: int, gamma: float) -> list[tuple[float, int, float, float, bool, float]]:
    """The n-step transitions of the six steps above, computed one by one from the definition:
    ``(obs, action, sum_k<m gamma^k r, next_obs after m steps, terminated, gamma^m)``, ``m = n``
    or up to the episode's end, in the order the buffer completes them."""
    out = []
    for t_end in range(6):  # a transition is completed at the step that gives its n-th reward or ends its episode
        for t0 in range(max(0, t_end - n + 1), t_end + 1):
            for e in range(2):
                steps = range(t0, t_end + 1)
                if any(TERMINATED[s][e] or TRUNCATED[s][e] for s in steps[:-1]):
                    continue  # an earlier end completed it (or it belongs to the next episode)
                ends = TERMINATED[t_end][e] or TRUNCATED[t_end][e]
                if len(steps) < n and not ends:
                    continue
                ret = sum(gamma ** k * REWARDS[s][e] for k, s in enumerate(steps))
                out.append((100.0 * t0 + e, t0 % 2, ret, 100.0 * t_end + e + 50, TERMINATED[t_end][e], gamma ** len(steps)))
    return out


def _stored(buf: ReplayBuffer) -> list[tuple]:
    s = buf.storage[:buf.size]
    return [(float(s["obs"][i, 0]), int(s["action"][i]), float(s["reward"][i]), float(s["next_obs"][i, 0]),
             bool(s["terminated"][i]), float(s["discount"][i])) for i in range(buf.size)]


@pytest.mark.parametrize("n", [2, 3])
def test_n_step_transitions_sum_n_rewards_and_stop_at_episode_ends(n):
    buf = ReplayBuffer(_ctx(n_step=n))
    for t in range(6):
        buf.insert(**_step(t))
    got, want = _stored(buf), _expected(n, 0.5)
    assert len(got) == len(want) and sorted(got) == sorted(want)
    # oldest start first within a step; env 0's terminated transitions never bootstrap across the reset
    assert (0.0, 0, 1.0 + 0.5 * 2.0 + 0.25 * 3.0, 250.0, True, 0.125) in got or n == 2
    # what is still pending: the last n - 1 steps of env 0, and of env 1 after its truncation
    assert len(buf.pending) == n - 1


def test_a_one_step_buffer_ignores_truncated_and_stores_what_it_always_did():
    a, b = ReplayBuffer(_ctx(n_step=1)), ReplayBuffer(_ctx(n_step=1))
    for t in range(6):
        step = _step(t)
        a.insert(**step)
        b.insert(**{k: v for k, v in step.items() if k != "truncated"})
    assert "discount" not in a.storage.keys() and a.size == 12
    assert all(torch.equal(a.storage[k], b.storage[k]) for k in ReplayBuffer.KEYS)


def test_an_n_step_buffer_needs_truncated():
    with pytest.raises(KeyError, match=r"takes exactly .*'truncated'"):
        ReplayBuffer(_ctx(n_step=3)).insert(**{k: v for k, v in _step(0).items() if k != "truncated"})


@pytest.mark.parametrize("cls", [ReplayBuffer, PrioritizedReplayBuffer])
def test_the_n_step_window_survives_a_checkpoint(cls):
    """Saved after step 3 with transitions still waiting for their rewards, restored into a new
    buffer: the rest of the steps store what an uninterrupted buffer stores, bit for bit."""
    whole, first = cls(_ctx(n_step=3)), cls(_ctx(n_step=3))
    for t in range(6):
        whole.insert(**_step(t))
    for t in range(3):
        first.insert(**_step(t))
    state = first.state_dict()
    assert len(state["pending"]) == 2
    torch.save(state, buf := __import__("io").BytesIO())
    buf.seek(0)
    second = cls(_ctx(n_step=3))
    second.load_state_dict(torch.load(buf, weights_only=False))
    for t in range(3, 6):
        second.insert(**_step(t))
    assert second.size == whole.size and all(torch.equal(second.storage[k], whole.storage[k]) for k in whole.storage.keys())
    if cls is PrioritizedReplayBuffer:
        assert torch.equal(second.tree.state_dict()["tree"], whole.tree.state_dict()["tree"])


def test_the_n_step_target_bootstraps_with_the_transitions_own_discount():
    """A terminated 2-step transition's target is its reward sum; a full 3-step one adds
    ``gamma^3 max_a Q_target(s')``."""
    ctx = _ctx(n_step=3, gamma=0.5, hidden_sizes=(4,))
    learner = dqn.DQNLearner(ctx)
    from tensordict import TensorDict

    batch = TensorDict({"obs": torch.zeros(2, 1), "action": torch.zeros(2, dtype=torch.int64),
                        "reward": torch.tensor([1.5, 2.0]), "next_obs": torch.tensor([[3.0], [4.0]]),
                        "terminated": torch.tensor([True, False]), "discount": torch.tensor([0.25, 0.125])}, batch_size=[2])
    with torch.no_grad():
        v = learner.target(batch["next_obs"]).max(-1).values
    assert torch.equal(learner._targets(batch), torch.stack([torch.tensor(1.5), 2.0 + 0.125 * v[1]]))


def test_the_dueling_network_is_value_plus_centred_advantage():
    torch.manual_seed(0)
    space = gymnasium.spaces.Box(-1, 1, (3,), np.float32)
    net = dqn.QNetwork(space, gymnasium.spaces.Discrete(4), (8, 6), dueling=True)
    obs = torch.randn(5, 3)
    h = net.net(obs)
    a, v = net.advantage(h), net.value(h)
    assert net.net[0].out_features == 8 and net.value[0].out_features == 6 and net.advantage[-1].out_features == 4
    torch.testing.assert_close(net(obs), v + a - a.mean(-1, keepdim=True))
    torch.testing.assert_close(net(obs).mean(-1), v.squeeze(-1))  # the advantages are centred: the mean Q is V
    with pytest.raises(ValueError, match="dueling needs at least one hidden layer"):
        dqn.QNetwork(space, gymnasium.spaces.Discrete(4), (), dueling=True)


def test_apex_epsilons_follow_the_papers_formula():
    eps = dqn.apex_epsilons(8, 0.4, 7.0)
    assert eps.dtype == torch.float32 and eps.shape == (8,)
    want = [0.4 ** (1 + 7 * i / 7) for i in range(8)]
    np.testing.assert_allclose(eps.numpy(), np.array(want, dtype=np.float32), rtol=1e-6)
    assert float(dqn.apex_epsilons(1)[0]) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="num_envs must be >= 1"):
        dqn.apex_epsilons(0)


def test_each_actor_replica_keeps_its_envs_share_of_the_apex_epsilons():
    ctx = _ctx(n_step=1, num_envs=2, exploration="apex")
    every = dqn.apex_epsilons(6)
    for r in range(3):
        actor = dqn.DQNActor(dataclasses.replace(ctx, replica=r, num_replicas=3, total_num_envs=6))
        assert torch.equal(actor.env_epsilons, every[2 * r:2 * r + 2])
    with pytest.raises(ValueError, match="keeps one epsilon for each of this actor's 2 envs, got observations of 3"):
        actor.act(torch.zeros(3, 1))


def _apex_spec(policy: str, replicas=None, placement=None, num_envs: int = 2, seed: int = 3):
    from msrl.policy import load_policy
    from msrl.run.job import JobSpec

    hp = dqn.DQNConfig(learning_starts=16, train_frequency=4, gradient_steps=2, batch_size=8, buffer_size=256,
                       target_network_frequency=8, hidden_sizes=(16, 8), prioritized_replay=True, double_q=True,
                       dueling=True, n_step=3, exploration="apex")
    pol = load_policy(policy).with_overrides(replicas=replicas, placement=placement)
    return JobSpec(dqn.ALGORITHM, hp, "CartPole-v1", num_envs, pol, seed=seed, total_env_steps=5_000)


def test_apex_with_one_actor_and_one_replay_shard_equals_single_bitwise():
    """Ape-X's parts together (n-step, double, dueling, prioritized, per-env epsilons) with the
    replay in a fragment of its own: synchronous, one actor and one shard, the same weights and
    metrics as ``single`` bit for bit."""
    from msrl.run.job import Job

    def run(spec):
        job = Job(spec)
        try:
            job.reset()
            metrics = [job.train_step() for _ in range(10)]
            return metrics, {k: v.clone() for k, v in job.component("learner").get_weights().items()}
        finally:
            job.close()

    a = run(_apex_spec("single"))
    b = run(_apex_spec("single_learner_coarse", {"actor": 1}, {"buffer": "replay"}))
    assert any("losses/td_loss" in m for m in a[0]) and all("charts/epsilon" not in m for m in a[0])
    assert all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    assert [{k: float(v) for k, v in m.items()} for m in a[0]] == [{k: float(v) for k, v in m.items()} for m in b[0]]


def test_the_apex_config_places_four_actors_and_two_replay_shards(tmp_path):
    from msrl.config import build_job_spec, load_config

    spec = build_job_spec(load_config("configs/apex_dqn_cartpole.yaml", [f"runs_dir={tmp_path}"]))
    assert [(f.name, f.roles, f.replicas) for f in spec.policy.fragments] == [
        ("actor", ("env", "actor"), 4), ("replay", ("buffer",), 2), ("learner", ("learner",), 1)]
    hp = spec.hparams
    assert (hp.n_step, hp.double_q, hp.dueling, hp.prioritized_replay, hp.exploration) == (3, True, True, True, "apex")


def test_grouped_patterns_map_each_replica_to_its_group():
    """The pattern table with groups: a gather from 4 replicas to 2 takes replicas 0-1 to dst 0
    and 2-3 to dst 1; a scatter (or broadcast) from 2 to 4 the reverse; one dst (or src) is the
    whole set, as before."""
    from types import SimpleNamespace

    from msrl.graph import NodeKind
    from msrl.runtime.patterns import combine, deliveries, group_size, shards, sources

    def b(kind, src, dst):
        return SimpleNamespace(pattern=kind, src_replicas=src, dst_replicas=dst, axis=0, name="b", reduce=None)

    g = b(NodeKind.GATHER, 4, 2)
    assert [deliveries(g, r) for r in range(4)] == [[(0, None)], [(0, None)], [(1, None)], [(1, None)]]
    assert [sources(g, j) for j in range(2)] == [[0, 1], [2, 3]]
    assert torch.equal(combine(g, [torch.tensor([2]), torch.tensor([3])]), torch.tensor([2, 3]))
    assert sources(b(NodeKind.GATHER, 3, 1), 0) == [0, 1, 2] and deliveries(b(NodeKind.GATHER, 3, 1), 2) == [(0, None)]
    s = b(NodeKind.SCATTER, 2, 4)
    assert [deliveries(s, r) for r in range(2)] == [[(0, 0), (1, 1)], [(2, 0), (3, 1)]]
    assert [sources(s, j) for j in range(4)] == [[0], [0], [1], [1]]
    assert [t.tolist() for t in shards(s, torch.arange(4))] == [[0, 1], [2, 3]]
    assert deliveries(b(NodeKind.SCATTER, 1, 3), 0) == [(0, 0), (1, 1), (2, 2)]
    bc = b(NodeKind.BROADCAST, 2, 4)
    assert [deliveries(bc, r) for r in range(2)] == [[(0, None), (1, None)], [(2, None), (3, None)]]
    with pytest.raises(ValueError, match="4 src and 3 dst replicas: neither count divides the other"):
        group_size(b(NodeKind.GATHER, 4, 3))


def _shards(actors: int, shards: int) -> list[ReplayBuffer]:
    from msrl.policy import load_policy
    from msrl.run.job import Job, JobSpec

    # learning starts at the end of iteration 2: both iterations act with the initial weights
    hp = dict(learning_starts=24, train_frequency=3, gradient_steps=1, batch_size=4, buffer_size=64, hidden_sizes=(8,),
              prioritized_replay=True, n_step=1)
    pol = load_policy("single_learner_coarse").with_overrides(replicas={"actor": actors, "replay": shards},
                                                               placement={"buffer": "replay"})
    job = Job(JobSpec(dqn.ALGORITHM, dqn.DQNConfig(**hp), "CartPole-v1", actors, pol, seed=5, total_env_steps=50_000))
    try:
        job.reset()
        for _ in range(2):
            job.train_step()
        return [job.replica("replay", r).trainer.components["buffer"] for r in range(shards)]
    finally:
        job.close()


def test_two_replay_shards_each_gather_the_transitions_of_their_own_two_actors():
    """4 actor replicas (one env each) over 2 replay shards: shard ``j`` stores, step by step,
    the transitions of actors ``2j`` and ``2j + 1`` in that order -- what 4 shards, one per
    actor, store, two by two."""
    two, four = _shards(4, 2), _shards(4, 4)
    assert [s.size for s in two] == [12, 12] and [s.size for s in four] == [6, 6, 6, 6]
    for j in range(2):
        for key in ReplayBuffer.KEYS:
            want = torch.stack([four[2 * j].storage[key][:6], four[2 * j + 1].storage[key][:6]], 1).flatten(0, 1)
            assert torch.equal(two[j].storage[key][:12], want), key


def test_replicas_that_do_not_divide_are_a_partition_error():
    from msrl.errors import PartitionError
    from msrl.policy import load_policy
    from msrl.run.job import Job, JobSpec

    pol = load_policy("single_learner_coarse").with_overrides(replicas={"actor": 4, "replay": 3}, placement={"buffer": "replay"})
    hp = dqn.DQNConfig(learning_starts=16, train_frequency=4, gradient_steps=1, batch_size=4, hidden_sizes=(8,))
    with pytest.raises(PartitionError, match=r"between 4 and 3 replicas: a gather or scatter needs one replica count to be a "
                                             r"multiple of the other \(set distribution_policy.replicas.replay"):
        Job(JobSpec(dqn.ALGORITHM, hp, "CartPole-v1", 4, pol, seed=5, total_env_steps=50_000))
