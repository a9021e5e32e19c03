"""Write once, tested: every algorithm under every policy it supports, on tiny budgets.

Each case asserts the fragments' comm ops, finite losses, and that ``single`` and
``single_learner_coarse`` with one actor replica produce bitwise-identical learner weights
and metrics (the partition changes where code runs, never what it computes)."""

import math

import pytest
import torch

from msrl.algorithms import (
    a2c,
    a3c,
    alphazero,
    c51,
    ddpg,
    dqn,
    dreamerv3,
    impala,
    impala_lstm,
    maddpg,
    mappo,
    pg,
    ppo,
    ppo_lstm,
    ppo_selfplay,
    qmix,
    sac,
    td3,
)
from msrl.graph import NodeKind
from msrl.policy import load_policy
from msrl.run.job import Job, JobSpec

TINY = {
    "ppo": (ppo.ALGORITHM, dict(num_steps=8, update_epochs=2, num_minibatches=2, hidden_sizes=(8,)), "CartPole-v1"),
    "a2c": (a2c.ALGORITHM, dict(num_steps=5, hidden_sizes=(8,)), "CartPole-v1"),
    # PG: Monte Carlo returns of the episodes that end inside each rollout (a random policy's
    # CartPole episodes last ~20 steps: some end in 24)
    "pg": (pg.ALGORITHM, dict(num_steps=24, hidden_sizes=(8,)), "CartPole-v1"),
    # A3C: gradients computed by the actors, a partial value reduced on its way to the learner
    "a3c": (a3c.ALGORITHM, dict(num_steps=5, hidden_sizes=(8,)), "CartPole-v1"),
    "impala": (impala.ALGORITHM, dict(num_steps=6, hidden_sizes=(8,), num_minibatches=2), "CartPole-v1"),
    "dqn": (dqn.ALGORITHM, dict(learning_starts=16, train_frequency=4, gradient_steps=2, batch_size=8, buffer_size=256,
                                target_network_frequency=8, hidden_sizes=(8,)), "CartPole-v1"),
    "sac": (sac.ALGORITHM, dict(learning_starts=8, batch_size=8, buffer_size=256, policy_frequency=2, hidden_sizes=(8, 8)),
            "Pendulum-v1"),
    # C51: a categorical return distribution per action, the projected target's cross-entropy
    "c51": (c51.ALGORITHM, dict(learning_starts=16, train_frequency=4, batch_size=8, buffer_size=256,
                                target_network_frequency=8, hidden_sizes=(8,), n_atoms=11, v_min=-10.0, v_max=10.0),
            "CartPole-v1"),
    # deterministic policies: DDPG (one critic) and TD3 (twin critics, target smoothing, delayed
    # policy updates), the noisy actor's draws from its own generator
    "ddpg": (ddpg.ALGORITHM, dict(learning_starts=8, batch_size=8, buffer_size=256, policy_frequency=2, hidden_sizes=(8, 8)),
             "Pendulum-v1"),
    "td3": (td3.ALGORITHM, dict(learning_starts=8, batch_size=8, buffer_size=256, policy_frequency=2, hidden_sizes=(8, 8)),
            "Pendulum-v1"),
    # Ape-X DQN: prioritized replay (TD errors flow back to the replay shard that drew each sample),
    # 3-step transitions, double Q, a dueling network, each env's own epsilon
    "dqn_apex": (dqn.ALGORITHM, dict(learning_starts=16, train_frequency=4, gradient_steps=2, batch_size=8, buffer_size=256,
                                     target_network_frequency=8, hidden_sizes=(8, 8), prioritized_replay=True, n_step=3,
                                     double_q=True, dueling=True, exploration="apex"), "CartPole-v1"),
    # PPO with CleanRL's continuous-control normalization: statistics in the nets, reduced over learners
    "ppo_norm": (ppo.ALGORITHM, dict(num_steps=8, update_epochs=2, num_minibatches=2, hidden_sizes=(8,), normalize_obs=True,
                                     normalize_reward=True), "Pendulum-v1"),
    "ppo_lstm": (ppo_lstm.ALGORITHM, dict(num_steps=8, update_epochs=2, num_minibatches=2, hidden_sizes=(8,), lstm_size=8),
                 "CartPole-v1"),
    "impala_lstm": (impala_lstm.ALGORITHM, dict(num_steps=6, hidden_sizes=(8,), lstm_size=8, num_minibatches=2),
                    "CartPole-v1"),
    "mappo": (mappo.ALGORITHM, dict(num_steps=6, update_epochs=2, num_minibatches=2, hidden_sizes=(8,)),
              "pettingzoo/mpe2.simple_spread_v3"),
    # self-play: one seat by the learning policy, the other by a snapshot drawn from its pool; a
    # turn-based PettingZoo game (AEC), a ply per step (9 plies: a game ends in every iteration)
    "ppo_selfplay": (ppo_selfplay.ALGORITHM, dict(num_steps=9, update_epochs=2, num_minibatches=2, hidden_sizes=(8,),
                                                  snapshot_every=1, pool_size=2, latest_prob=0.5),
                     "pettingzoo/pettingzoo.classic.tictactoe_v3"),
    # AlphaZero: a tree search beside the games (an env-side wrapper) whose leaf evaluations are
    # actor calls in a loop over simulations; positions replayed once their game ended
    "alphazero": (alphazero.ALGORITHM, dict(num_simulations=4, plies_per_iteration=5, buffer_size=256, batch_size=8,
                                            updates_per_iteration=2, learning_starts=40, hidden_sizes=(8,)),
                  "openspiel/tic_tac_toe"),
    # DreamerV3: a world model on replayed sequences, the actor-critic on rollouts imagined in the
    # learner; the acting side carries its recurrent model state from step to step
    "dreamerv3": (dreamerv3.ALGORITHM, dict(model_size="nano", batch_size=2, batch_length=4, horizon=3, train_ratio=2,
                                            steps_per_iteration=4, learning_starts=16, buffer_size=256), "CartPole-v1"),
    # QMIX: recurrent agents epsilon-greedy with their GRU states carried by the trainer, whole
    # episodes replayed, the agents' chosen values mixed by a hypernetwork of the global state
    "qmix": (qmix.ALGORITHM, dict(episode_limit=5, steps_per_iteration=5, batch_size=2, buffer_size=64, learning_starts=20,
                                  hidden_dim=8, mixing_embed_dim=4, hypernet_embed=8, target_network_frequency=20),
             "pettingzoo/mpe2.simple_spread_v3"),
    # MADDPG: an actor and a centralised critic per agent; Box actions with Gaussian noise, and
    # Discrete ones through the Gumbel-softmax
    "maddpg": (maddpg.ALGORITHM, dict(learning_starts=20, batch_size=8, buffer_size=256, hidden_sizes=(8, 8),
                                      steps_per_iteration=5, gradient_steps=1), "pettingzoo/mpe2.simple_spread_v3"),
    "maddpg_discrete": (maddpg.ALGORITHM, dict(learning_starts=20, batch_size=8, buffer_size=256, hidden_sizes=(8, 8),
                                               steps_per_iteration=5, gradient_steps=1), "pettingzoo/mpe2.simple_spread_v3"),
}
#: gymnasium.make / parallel_env kwargs per algorithm's env
ENV_KWARGS = {"mappo": {"N": 3, "max_cycles": 5, "continuous_actions": False},
              "qmix": {"N": 3, "max_cycles": 5, "continuous_actions": False},
              "maddpg": {"N": 3, "max_cycles": 5, "continuous_actions": True},
              "maddpg_discrete": {"N": 3, "max_cycles": 5, "continuous_actions": False}}
#: values an actor sends the learner per rollout (the recurrent ones: the rollout and its initial LSTM
#: state; A3C: its gradients and their losses)
ROLLOUT_VALUES = {"ppo_lstm": 2, "impala_lstm": 2, "a3c": 2}
#: the on-policy algorithms: one push from each actor per iteration
ON_POLICY = ("ppo", "a2c", "pg", "a3c", "impala", "mappo", "ppo_norm", "ppo_lstm", "impala_lstm", "ppo_selfplay")
ITERATIONS = {"ppo_lstm": 3, "impala_lstm": 3, "ppo": 3, "a2c": 4, "pg": 3, "a3c": 4, "impala": 3, "dqn": 8, "dqn_apex": 8, "c51": 8, "sac": 16, "ddpg": 16, "td3": 16, "mappo": 3, "ppo_norm": 3,
              "ppo_selfplay": 3, "alphazero": 4, "dreamerv3": 4, "qmix": 4, "maddpg": 6,
              "maddpg_discrete": 6}

#: (policy, replicas, placement) each algorithm runs under.
POLICIES = [
    ("single", None, None),
    ("single_learner_coarse", {"actor": 1}, None),
    ("single_learner_coarse", {"actor": 2}, None),
]
#: the off-policy algorithms (a replay buffer): they also run with their replay beside the learner (Ape-X style)
OFF_POLICY = ("dqn", "dqn_apex", "c51", "sac", "ddpg", "td3", "alphazero", "dreamerv3", "qmix", "maddpg",
              "maddpg_discrete")
#: Off-policy algorithms also run with their replay beside the learner (Ape-X style).
REPLAY_AT_LEARNER = [("single_learner_coarse", {"actor": 1}, {"buffer": "learner"}),
                     ("single_learner_coarse", {"actor": 2}, {"buffer": "learner"})]

CASES = [(a, *p) for a in TINY for p in POLICIES] + [(a, *p) for a in OFF_POLICY for p in REPLAY_AT_LEARNER]


def spec(algo, policy, replicas, placement, num_envs=2):
    algorithm, hp, env = TINY[algo]
    pol = load_policy(policy).with_overrides(replicas=replicas, placement=placement)
    return JobSpec(algorithm, algorithm.hparams(**hp), env, num_envs, pol, seed=7, total_env_steps=5_000,
                   env_kwargs=ENV_KWARGS.get(algo, {}))


def run(s, iterations):
    job = Job(s)
    try:
        job.reset()
        metrics = [job.train_step() for _ in range(iterations)]
        weights = {k: v.clone() for k, v in job.component("learner").get_weights().items()}
        comm = {(b.method, b.value, b.comm_kind, b.src, b.dst) for b in job.fragment_graph.boundaries}
        return metrics, weights, comm, job.env_steps
    finally:
        job.close()


def _id(case):
    algo, policy, replicas, placement = case
    parts = [algo, policy] + [f"{k}={v}" for k, v in (replicas or {}).items()] + [f"{k}@{v}" for k, v in (placement or {}).items()]
    return "-".join(parts)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_algorithm_runs_under_policy(case):
    algo, policy, replicas, placement = case
    num_envs = 2 * (replicas or {}).get("actor", 1)
    metrics, weights, comm, steps = run(spec(algo, policy, replicas, placement, num_envs), ITERATIONS[algo])
    losses = [float(v) for m in metrics for k, v in m.items() if k.startswith("losses/") and "kl" not in k]
    assert losses and all(math.isfinite(x) for x in losses), algo
    assert steps == ITERATIONS[algo] * TINY[algo][0].env_steps_per_iteration(TINY[algo][0].hparams(**TINY[algo][1]), num_envs)
    ops = {(m, op, src, dst) for m, _, op, src, dst in comm}
    if policy == "single":
        assert comm == set()
        return
    many = (replicas or {}).get("actor", 1) > 1
    to_learner = (NodeKind.REDUCE if algo == "a3c" else NodeKind.GATHER) if many else NodeKind.SEND
    to_actor = NodeKind.BROADCAST if many else NodeKind.SEND
    # the learner's weights go back to the actors at reset and during training
    assert ("reset", to_actor, "learner", "actor") in ops and ("train_step", to_actor, "learner", "actor") in ops
    # data flows to the learner: trajectories (on-policy), replay samples, or every transition
    assert ("train_step", to_learner, "actor", "learner") in ops
    values = {v for m, v, op, src, dst in comm if src == "actor" and m == "train_step"}
    if algo in ON_POLICY:
        assert len(values) == ROLLOUT_VALUES.get(algo, 1)  # the gathered rollout, once per iteration
    elif placement:
        assert {"reward", "terminated"} <= values and ({"self.obs", "next_obs"} & values)  # transitions, every step
        assert "action" in values or algo == "alphazero"  # (whose replay keeps the search's policy instead)
    elif algo in ("dqn", "dqn_apex"):  # the prioritized sample and the uniform one (each in a branch)
        assert "batch" in values and len(values) == 2
        assert ("train_step", NodeKind.SCATTER if many else NodeKind.SEND, "learner", "actor") in ops  # TD errors back
    else:
        assert len(values) == 1 and next(iter(values)).startswith(("_buffer_sample", "batch"))


@pytest.mark.parametrize("algo", list(TINY))
@pytest.mark.parametrize("placement", [None, {"buffer": "learner"}], ids=["policy-default", "buffer@learner"])
def test_single_and_coarse_with_one_actor_replica_agree_bitwise(algo, placement):
    if placement and algo in ON_POLICY:
        pytest.skip("on-policy rollout buffers stay with the actor")
    a = run(spec(algo, "single", None, None), ITERATIONS[algo])
    b = run(spec(algo, "single_learner_coarse", {"actor": 1}, placement), ITERATIONS[algo])
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    as_float = [{k: float(v) for k, v in m.items()} for m in a[0]]
    assert as_float == [{k: float(v) for k, v in m.items()} for m in b[0]]
    assert any(as_float)  # learning happened within the budget


@pytest.mark.parametrize("algo", list(TINY))
def test_multi_learner_runs_every_algorithm_with_identical_replicas(algo):
    """multi_learner (written for PPO's DD-PPO) runs A2C, DQN and SAC unchanged: no boundaries,
    finite losses, and the two learner replicas hold bitwise-identical weights."""
    job = Job(spec(algo, "multi_learner", {"main": 2}, None, num_envs=4))
    try:
        job.reset()
        metrics = [job.train_step() for _ in range(ITERATIONS[algo])]
        losses = [float(v) for m in metrics for k, v in m.items() if k.startswith("losses/") and "kl" not in k]
        assert losses and all(math.isfinite(x) for x in losses)
        assert not job.fragment_graph.boundaries
        w0, w1 = (job.replica("main", r).trainer.components["learner"].get_weights() for r in range(2))
        assert all(torch.equal(w0[k], w1[k]) for k in w0)
    finally:
        job.close()


@pytest.mark.parametrize("algo", list(TINY))
def test_multi_learner_with_one_replica_equals_single_bitwise(algo):
    """multi_learner x1 (data parallel over one replica: no all-reduce) computes what single
    computes, bit for bit: the same learner weights and metrics."""
    a = run(spec(algo, "single", None, None), ITERATIONS[algo])
    b = run(spec(algo, "multi_learner", {"main": 1}, None), ITERATIONS[algo])
    assert b[2] == set()  # no boundary
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    assert [{k: float(v) for k, v in m.items()} for m in a[0]] == [{k: float(v) for k, v in m.items()} for m in b[0]]


#: the asynchronous boundary kinds each algorithm runs under: IMPALA's policy (written for it)
#: and coarse made asynchronous in YAML
ASYNC = [("async_learner", {"actor": 1}, None, None), ("async_learner", {"actor": 2}, None, None),
         ("single_learner_coarse", {"actor": 2}, None, {"trajectories": "fifo", "weights": "latest"}),
         ("single_learner_coarse", {"actor": 2}, None, {"trajectories": "fifo"})]
ASYNC_CASES = [(a, *p) for a in TINY for p in ASYNC] + [
    (a, "async_learner", {"actor": 2}, {"buffer": "learner"}, None) for a in OFF_POLICY]


def _async_id(case):
    algo, policy, replicas, placement, boundaries = case
    return "-".join([_id((algo, policy, replicas, placement)), *(f"{k}:{v}" for k, v in (boundaries or {}).items())])


@pytest.mark.parametrize("case", ASYNC_CASES, ids=_async_id)
def test_algorithm_runs_under_asynchronous_boundaries(case):
    """Every algorithm, unchanged, with its actor -> learner values queued and its weights in a
    latest-value slot: replicas run their iterations free (``Job.run``), losses stay finite,
    every env step is taken, the boundaries are put/get of the chosen kinds, and the learner
    records the policy lag of every queued item whose producer read the slot."""
    algo, policy, replicas, placement, boundaries = case
    algorithm, hp, env = TINY[algo]
    pol = load_policy(policy).with_overrides(replicas=replicas, placement=placement, boundaries=boundaries)
    num_envs = 2 * replicas["actor"]
    s = JobSpec(algorithm, algorithm.hparams(**hp), env, num_envs, pol, seed=7, total_env_steps=5_000,
                env_kwargs=ENV_KWARGS.get(algo, {}))
    job = Job(s)
    try:
        job.reset()
        records = job.run(ITERATIONS[algo] * 2)
        kinds = {(b.src, b.channel) for b in job.fragment_graph.boundaries if b.method == "train_step"}
        modes = {bc.src: bc.channel for bc in pol.boundaries}
        assert kinds == {(src, modes[src]) for src, _ in kinds}
        for b in job.fragment_graph.boundaries:
            assert (b.comm_kind in (NodeKind.PUT, NodeKind.GET)) == (b.channel != "sync")
        losses = [float(v) for r in records for k, v in (r["output"] or {}).items()
                  if k.startswith("losses/") and "kl" not in k]
        assert losses and all(math.isfinite(x) for x in losses), algo
        per_iteration = algorithm.env_steps_per_iteration(algorithm.hparams(**hp), num_envs)
        assert job.env_steps == len(records) * per_iteration
        lags = [lag for r in records for lag in r["policy_lags"]]
        if modes.get("learner") == "latest" and modes.get("actor") == "fifo" and algo in ON_POLICY:
            # one rollout per actor replica and iteration, each tagged with the weights it used
            assert (len(lags) == len(records) * replicas["actor"] * ROLLOUT_VALUES.get(algo, 1) and min(lags) >= 0
                    and max(lags) <= 3)
        else:
            assert all(lag >= 0 for lag in lags)
    finally:
        job.close()


#: coarse in lockstep over streams: the rollouts queued, the weights a slot whose reader waits
#: for each new version (what makes its actors replaceable alone, cluster.on_replica_loss)
LOCKSTEP = {"trajectories": "fifo", "weights": "fresh"}


@pytest.mark.parametrize("algo", list(TINY))
def test_coarse_in_lockstep_over_streams_equals_synchronous_coarse_bitwise(algo):
    """Every algorithm under coarse x2 with ``trajectories: fifo`` and ``weights: fresh``, its
    replicas running free (``Job.run``): the same learner weights and metrics as synchronous
    coarse, bit for bit, with no policy lag; its train_step boundaries are put/get."""
    algorithm, hp, env = TINY[algo]
    a = run(spec(algo, "single_learner_coarse", {"actor": 2}, None, num_envs=4), ITERATIONS[algo])
    pol = load_policy("single_learner_coarse").with_overrides(replicas={"actor": 2}, boundaries=LOCKSTEP)
    job = Job(JobSpec(algorithm, algorithm.hparams(**hp), env, 4, pol, seed=7, total_env_steps=5_000,
                      env_kwargs=ENV_KWARGS.get(algo, {})))
    try:
        job.reset()
        records = job.run(ITERATIONS[algo])
        weights = job.component("learner").get_weights()
        channels = {b.channel for b in job.fragment_graph.boundaries if b.method == "train_step"}
    finally:
        job.close()
    assert channels == {"fifo", "fresh"}
    assert a[1].keys() == weights.keys() and all(torch.equal(a[1][k], weights[k]) for k in a[1])
    assert [{k: float(v) for k, v in m.items()} for m in a[0]] == [
        {k: float(v) for k, v in r["output"].items()} for r in records]
    lags = [lag for r in records for lag in r["policy_lags"]]
    assert lags and all(lag == 0 for lag in lags), lags  # each item made with the newest weights


@pytest.mark.parametrize("envs", [1, 2])
@pytest.mark.parametrize("algo", list(TINY))
def test_single_learner_fine_runs_every_algorithm_bitwise_like_single(algo, envs):
    """single_learner_fine (written for SEED-style central inference): env-only replicas send
    observations every step and get actions back from the central actor + buffer + learner.
    Every algorithm runs unchanged, its observations gathered and actions scattered inside the
    step loop, and learns exactly what it learns under single (the envs keep their seeds, the
    actor sees every env's observation at once)."""
    num_envs = 4
    a = run(spec(algo, "single", None, None, num_envs), ITERATIONS[algo])
    b = run(spec(algo, "single_learner_fine", {"env": envs}, None, num_envs), ITERATIONS[algo])
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    assert [{k: float(v) for k, v in m.items()} for m in a[0]] == [{k: float(v) for k, v in m.items()} for m in b[0]]
    ops = {(op, src, dst) for m, _, op, src, dst in b[2] if m == "train_step"}
    to_central = NodeKind.GATHER if envs > 1 else NodeKind.SEND
    to_envs = NodeKind.SCATTER if envs > 1 else NodeKind.SEND
    assert {(to_central, "env", "learner"), (to_envs, "learner", "env")} <= ops


#: the policies an algorithm written outside the project runs under with its global-generator
#: draws reproducible (asynchronous boundaries are left out: what a learner trains on there
#: depends on timing by design)
GLOBAL_POLICIES = [("single", None), ("single_learner_coarse", {"actor": 1}), ("single_learner_coarse", {"actor": 2}),
                   ("multi_learner", {"main": 2}), ("single_learner_fine", {"env": 2})]


@pytest.mark.parametrize("policy, replicas", GLOBAL_POLICIES, ids=lambda p: str(p))
def test_an_algorithm_drawing_from_the_global_generators_is_reproducible_under_every_policy(policy, replicas):
    """``tests/global_rng_algo.py`` seeds nothing and draws from torch's, NumPy's and Python's
    global generators; msrl seeds each replica's: two jobs compute the same, bit for bit."""
    import global_rng_algo

    algorithm = global_rng_algo.ALGORITHM
    pol = load_policy(policy).with_overrides(replicas=replicas)
    s = JobSpec(algorithm, algorithm.hparams(num_steps=6, hidden_sizes=(8,)), "CartPole-v1", 4, pol, seed=7,
                total_env_steps=5_000)
    (m1, w1, _, steps), (m2, w2, _, _) = run(s, 4), run(s, 4)
    as_float = [[{k: float(v) for k, v in m.items()} for m in ms] for ms in (m1, m2)]
    assert as_float[0] == as_float[1] and all(torch.equal(w1[k], w2[k]) for k in w1)
    assert all(math.isfinite(v) for m in as_float[0] for v in m.values()) and steps == 4 * 6 * 4


MODULE_STATE = '''
import dataclasses
from msrl.algorithms.a2c import ALGORITHM as A2C, A2CTrainer
from msrl.algorithms.ppo import PPOActor

ACTED = {"n": 0}


class CountingActor(PPOActor):
    def act(self, obs, deterministic=False):
        ACTED["n"] += 1
        return super().act(obs, deterministic)


class CountingTrainer(A2CTrainer):
    def train_step(self):
        if ACTED["n"] > 20:
            return super().train_step()
        return super().train_step()


ALGORITHM = dataclasses.replace(A2C, name="counting", trainer=CountingTrainer,
                                components={**A2C.components, "actor": CountingActor})
'''


@pytest.mark.parametrize("policy, replicas", GLOBAL_POLICIES + [("async_learner", {"actor": 2})], ids=lambda p: str(p))
def test_branching_on_module_level_state_is_refused_under_every_policy(policy, replicas, tmp_path):
    """Module-level state each fragment (each process, on Ray) would hold a copy of: one trace
    error naming the line, whichever policy."""
    from msrl.frontend.tracer import TraceError
    from msrl.registry import load_algorithm

    path = tmp_path / "counting_algo.py"
    path.write_text(MODULE_STATE)
    algorithm = load_algorithm(str(path))
    pol = load_policy(policy).with_overrides(replicas=replicas)
    s = JobSpec(algorithm, algorithm.hparams(num_steps=6, hidden_sizes=(8,)), "CartPole-v1", 4, pol, seed=7,
                total_env_steps=5_000)
    with pytest.raises(TraceError, match=rf"{path}:\d+: .*module-level 'ACTED' is a mutable dict"):
        Job(s)
