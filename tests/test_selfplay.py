"""Self-play against frozen past snapshots (``algorithms/ppo_selfplay.py``) on PettingZoo's
turn-based classic games (``msrl.envs.pettingzoo_env.TurnBasedStackedEnv``)."""

import io
import math
import types

import numpy as np
import pytest
import torch

from msrl.algorithms import ppo_selfplay
from msrl.envs.pettingzoo_env import TurnBasedStackedEnv, make_parallel
from msrl.policy import load_policy
from msrl.run.job import Job, JobSpec

TICTACTOE = "pettingzoo/pettingzoo.classic.tictactoe_v3"


def test_a_turn_based_game_moves_one_ply_per_step_with_the_mask_and_turn_in_each_observation():
    env = make_parallel(TICTACTOE, {})
    assert isinstance(env, TurnBasedStackedEnv) and env.agents == ["player_1", "player_2"]
    obs, _ = env.reset(seed=0)
    assert obs.shape == (2, 18 + 9 + 1) and obs.dtype == np.float32
    assert obs[:, -1].tolist() == [1.0, 0.0]  # player_1 moves first
    assert obs[0, -10:-1].tolist() == [1.0] * 9 and obs[1, -10:-1].tolist() == [0.0] * 9  # mask only for the mover
    obs, reward, terminated, truncated, _ = env.step(np.array([4, 0]))  # player_2's 0 is not its move: ignored
    assert obs[:, -1].tolist() == [0.0, 1.0] and reward.tolist() == [0.0, 0.0] and not terminated and not truncated
    assert obs[1, -10:-1].tolist() == [1, 1, 1, 1, 0, 1, 1, 1, 1]  # the centre is taken
    # player_2 plays 1, 2, 5 while player_1 takes the left column (0, 3, 6); each step one ply
    for a in ([8, 1], [0, 8], [8, 2], [3, 8], [8, 5], [6, 8]):
        obs, reward, terminated, truncated, _ = env.step(np.array(a))
    assert terminated and reward.tolist() == [1.0, -1.0] and obs[:, -1].tolist() == [0.0, 0.0]


def test_an_illegal_move_is_the_games_to_judge():
    env = make_parallel(TICTACTOE, {})
    env.reset(seed=0)
    env.step(np.array([4, 0]))
    _, reward, terminated, _, _ = env.step(np.array([0, 4]))  # player_2 plays the taken centre
    assert terminated and reward.tolist() == [0.0, -1.0]


def test_a_module_with_neither_api_is_refused_naming_both():
    from msrl.envs.pettingzoo_env import check_pettingzoo_id

    with pytest.raises(ValueError, match="neither parallel_env\\(\\) nor env\\(\\)"):
        check_pettingzoo_id("pettingzoo/pettingzoo.utils")


def _net(hidden=(16,)):
    env = make_parallel(TICTACTOE, {})
    torch.manual_seed(0)
    return ppo_selfplay.SelfPlayNet(env.agent_observation_space, env.agent_action_space, hidden, turn_based=True), env


def test_illegal_moves_get_no_probability_and_a_waiting_player_no_gradient():
    net, env = _net()
    obs, _ = env.reset(seed=0)
    for a in ([4, 1], [1, 0], [8, 1], [1, 2]):  # plies 4, 0, 8, 2 (the waiting player's entry ignored)
        obs, *_ = env.step(np.array(a))
    x = torch.as_tensor(obs)
    logits, _ = net.head(x)
    probs = torch.softmax(logits[0].detach(), -1)  # player_1 to move; 0, 2, 4 and 8 taken
    assert probs[[0, 2, 4, 8]].tolist() == [0.0] * 4 and math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)
    log_prob, entropy, value = net.evaluate(x, torch.tensor([1, 3]))
    assert log_prob[1] == 0 and entropy[1] == 0 and log_prob[0] < 0 and entropy[0] > 0  # player_2 waits
    log_prob.sum().backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in net.parameters())


def test_too_short_observations_for_turn_based_are_refused_naming_the_key():
    import gymnasium

    with pytest.raises(ValueError, match="algorithm.hparams.turn_based"):
        ppo_selfplay.SelfPlayNet(gymnasium.spaces.Box(0, 1, (4,)), gymnasium.spaces.Discrete(9), (8,), turn_based=True)


def _actor(**hp):
    env = make_parallel(TICTACTOE, {})
    spec = types.SimpleNamespace(observation_space=env.agent_observation_space, action_space=env.agent_action_space)
    hparams = ppo_selfplay.SelfPlayPPOConfig(hidden_sizes=(8,), **hp)
    ctx = types.SimpleNamespace(env_spec=spec, hparams=hparams, seed=3, device=torch.device("cpu"))
    return ppo_selfplay.SelfPlayActor(ctx), env


def _weights(v):
    actor, _ = _actor()
    return {k: torch.full_like(t, v) for k, t in actor.net.state_dict().items()}


def test_the_pool_snapshots_every_kth_update_keeps_the_newest_and_the_opponent_comes_from_it():
    actor, _ = _actor(snapshot_every=3, pool_size=2, latest_prob=0.0)
    drawn = set()
    for u in range(10):
        actor.set_weights(_weights(float(u)))
        drawn.add(actor.opponent_index)
        opp = actor.opponent.state_dict()
        assert all(torch.equal(opp[k], actor.pool[actor.opponent_index][k]) for k in opp)
    # snapshots at updates 0, 3, 6, 9; the newest two kept
    assert [float(p["actor.0.weight"].flatten()[0]) for p in actor.pool] == [6.0, 9.0]
    assert drawn == {0, 1}  # latest_prob 0: uniform over the pool
    newest, _ = _actor(snapshot_every=1, pool_size=5, latest_prob=1.0)
    for u in range(4):
        newest.set_weights(_weights(float(u)))
        assert newest.opponent_index == len(newest.pool) - 1


def test_the_opponent_plays_the_other_seat_and_the_learning_seat_alternates_by_env():
    actor, env = _actor(snapshot_every=100)
    actor.set_weights(actor.net.state_dict())  # the pool: the initial weights
    with torch.no_grad():  # the learning policy now always wants square 0; the opponent (snapshot) does not
        actor.net.actor[-1].bias.copy_(torch.tensor([50.0] + [0.0] * 8))
        actor.opponent.actor[-1].bias.copy_(torch.tensor([0.0] * 8 + [50.0]))
    obs = torch.as_tensor(np.stack([env.reset(seed=s)[0] for s in range(4)]))
    action, log_prob, value, seat = actor.act(obs)
    assert seat.tolist() == [0, 1, 0, 1]
    # player_1 (seat 0) moves first: the learning policy's move in envs 0 and 2, the opponent's in 1 and 3
    assert action[:, 0].tolist() == [0, 8, 0, 8] and action[:, 1].tolist() == [0, 0, 0, 0]
    assert log_prob[[1, 3]].tolist() == [0.0, 0.0] and (log_prob[[0, 2]] > -1e-3).all()


def _spec(policy="single", replicas=None, **hp):
    params = dict(num_steps=9, update_epochs=2, num_minibatches=2, hidden_sizes=(8,), snapshot_every=1, pool_size=3,
                  latest_prob=0.5)
    params.update(hp)
    return JobSpec(ppo_selfplay.ALGORITHM, ppo_selfplay.SelfPlayPPOConfig(**params), TICTACTOE, 4,
                   load_policy(policy).with_overrides(replicas=replicas), seed=5, total_env_steps=10_000)


def test_the_update_reads_only_the_learning_seat():
    """The other seat's observations, moves and rewards do not change the learner's update."""
    job = Job(_spec())
    try:
        job.reset()
        job.train_step()
        batch = job.component("buffer").storage.clone()
    finally:
        job.close()

    def learn(b):
        learner = ppo_selfplay.SelfPlayLearner(types.SimpleNamespace(
            hparams=ppo_selfplay.SelfPlayPPOConfig(num_steps=9, update_epochs=2, num_minibatches=2, hidden_sizes=(8,)),
            env_spec=types.SimpleNamespace(observation_space=make_parallel(TICTACTOE, {}).agent_observation_space,
                                           action_space=make_parallel(TICTACTOE, {}).agent_action_space),
            seed=1, device=torch.device("cpu"), total_env_steps=10_000, total_num_envs=4))
        stats = learner.learn(b)
        return learner.get_weights(), stats

    w1, s1 = learn(batch)
    other = 1 - batch["seat"]
    changed = batch.clone()
    rows = torch.arange(4)
    for t in range(9):
        changed["obs"][t, rows, other[t]] = 7.0
        changed["action"][t, rows, other[t]] = 5
        changed["reward"][t, rows, other[t]] = 100.0
    w2, s2 = learn(changed)
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert float(s1["losses/value_loss"]) == float(s2["losses/value_loss"])
    assert float(s1["selfplay/games"]) >= 4  # a tic-tac-toe game ends within any 9 plies


@pytest.mark.parametrize("policy, replicas", [("single", None), ("single_learner_coarse", {"actor": 2})],
                         ids=["single", "coarse_x2"])
def test_the_pool_and_the_opponent_survive_a_checkpoint_bitwise(policy, replicas):
    """2 iterations, the job's state through torch.save/load, 2 more in a new job: the same
    weights and metrics as 4 uninterrupted iterations (the actors' pools, opponents and draws)."""
    def run(job, n):
        return [{k: float(v) for k, v in r["output"].items()} for r in job.run(n)]

    whole = Job(_spec(policy, replicas))
    try:
        whole.reset()
        expected = run(whole, 4)
        expected_w = whole.component("learner").get_weights()
    finally:
        whole.close()
    first = Job(_spec(policy, replicas))
    try:
        first.reset()
        head = run(first, 2)
        buf = io.BytesIO()
        torch.save(first.state_dict(), buf)
    finally:
        first.close()
    second = Job(_spec(policy, replicas))
    try:
        buf.seek(0)
        second.load_state_dict(torch.load(buf, weights_only=False))
        tail = run(second, 2)
        weights = second.component("learner").get_weights()
    finally:
        second.close()
    assert head + tail == expected
    assert all(torch.equal(weights[k], expected_w[k]) for k in weights)


def test_a_fresh_policy_plays_a_random_player_about_evenly():
    """The yardstick itself: an untrained (near-uniform) policy against a random legal player
    wins about as often as it loses over both seats (tic-tac-toe: about 0.44 / 0.13 / 0.43)."""
    net, _ = _net()
    rates = ppo_selfplay.play_against_random(net, TICTACTOE, games=200, seed=0, deterministic=False)
    assert math.isclose(sum(rates.values()), 1.0) and 0.3 < rates["win"] < 0.6 and 0.3 < rates["loss"] < 0.6


@pytest.mark.slow
def test_self_play_learns_tictactoe_against_a_random_player(tmp_path):
    """The shipped config trained by self-play alone (it never meets a random player) beats one:
    over 400 games, both seats, it wins >= 70% and loses <= 25% (an untrained policy: 42% / 45%;
    the config over seeds 1-3: 80% / 17%, its losses mostly forks a random player stumbles into;
    bench/results/learning.md "Self-play on tic-tac-toe")."""
    import msrl
    from msrl.config import load_config
    from msrl.run.training import train

    cfg = load_config("configs/ppo_selfplay_tictactoe.yaml", [f"runs_dir={tmp_path}", "train.progress=false"])
    result = train(cfg)
    policy = msrl.load(result.run_dir)
    net = policy.actor.net
    rates = ppo_selfplay.play_against_random(net, TICTACTOE, games=400, seed=123)
    assert rates["win"] >= 0.7 and rates["loss"] <= 0.25, rates


def test_msrl_graph_notes_each_actor_replicas_pool():
    from msrl.run.printer import format_job

    job = Job(_spec("single_learner_coarse", {"actor": 2}, snapshot_every=4, pool_size=6, latest_prob=0.8))
    try:
        text = format_job(job)
    finally:
        job.close()
    notes = [line for line in text.splitlines() if "self-play opponent pool" in line]
    assert len(notes) == 1 and "each of 2 replicas" in notes[0]
    assert "every 4 updates, the newest 6 kept" in notes[0] and "p=0.8" in notes[0]


def test_earlier_runs_join_the_pool_as_fixed_opponents(tmp_path):
    """``opponent_runs``: each earlier run's final policy is a fixed member of the draw, kept past
    ``pool_size``, loaded on every replica; a run that is not one, or of another size, is
    refused naming the key and the run."""
    import msrl
    from msrl.run.job import Job

    earlier = msrl.train("configs/ppo_selfplay_tictactoe.yaml", runs_dir=str(tmp_path), train__progress=False,
                         train__total_env_steps=256, name="earlier", **{"algorithm.hparams.num_steps": 8,
                                                                        "env.num_envs": 4,
                                                                        "algorithm.hparams.hidden_sizes": [8]})
    theirs = msrl.load(earlier.run_dir).actor.net.state_dict()
    job = Job(_spec("single_learner_coarse", {"actor": 2}, snapshot_every=1, pool_size=2, latest_prob=0.0,
                    opponent_runs=(str(earlier.run_dir),)))
    try:
        job.reset()
        drawn = set()
        for _ in range(12):
            job.train_step()
            for r in range(2):
                actor = job.replica("actor", r).trainer.components["actor"]
                assert len(actor.league) == 1 and len(actor.pool) <= 2
                drawn.add(actor.opponent_index)
                if actor.opponent_index == 0:
                    opp = actor.opponent.state_dict()
                    assert all(torch.equal(opp[k], theirs[k]) for k in theirs)
        assert drawn == {0, 1, 2}  # the earlier run's policy and both snapshots
        actor = job.replica("actor", 0).trainer.components["actor"]
        assert "with 1 fixed policies of earlier runs" in actor.describe()
    finally:
        job.close()
    with pytest.raises(ValueError, match=r"opponent_runs: .*earlier.*do not fit this network"):
        Job(_spec(hidden_sizes=(16,), opponent_runs=(str(earlier.run_dir),)))
    with pytest.raises(ValueError, match=r"opponent_runs: .*nowhere"):
        Job(_spec(opponent_runs=(str(tmp_path / "nowhere"),)))
