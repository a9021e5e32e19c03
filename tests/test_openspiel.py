"""OpenSpiel's board games as envs (``openspiel/<game>``, :mod:`msrl.envs.openspiel_env`): what the
player to move sees and is paid, the opponents, the errors, exact snapshots."""

import numpy as np
import pytest
import torch

pyspiel = pytest.importorskip("pyspiel")

from msrl.envs import make_env  # noqa: E402
from msrl.envs.openspiel_env import OpenSpielGameEnv, OpenSpielGameError, observe  # noqa: E402
from msrl.envs.single_env import UnknownEnvError, make_single_env  # noqa: E402


def test_the_player_to_move_sees_its_own_view_and_the_legal_moves():
    env = OpenSpielGameEnv("tic_tac_toe")
    obs, _ = env.reset(seed=0)
    game = pyspiel.load_game("tic_tac_toe")
    state = game.new_initial_state()
    assert obs.shape == (27 + 9,) and obs.dtype == np.float32
    assert np.array_equal(obs[:27], state.observation_tensor(0)) and np.array_equal(obs[27:], np.ones(9))
    obs, reward, done, truncated, _ = env.step(4)
    state.apply_action(4)
    # now player 1 moves: its observation tensor, the centre no longer legal
    assert np.array_equal(obs[:27], state.observation_tensor(1)) and obs[27 + 4] == 0 and obs[27:].sum() == 8
    assert (reward, done, truncated) == (0.0, False, False)


def test_the_winning_move_pays_its_mover_and_ends_the_game():
    env = OpenSpielGameEnv("tic_tac_toe")
    env.reset(seed=0)
    for a in (0, 3, 1, 4):  # x: 0, 1; o: 3, 4
        assert env.step(a)[1:3] == (0.0, False)
    obs, reward, done, _, _ = env.step(2)  # x completes the top row
    assert (reward, done) == (1.0, True) and obs[27:].sum() == 0  # a finished game: no legal move
    with pytest.raises(ValueError, match="after the game ended"):
        env.step(5)


def test_an_illegal_move_names_the_legal_ones():
    env = OpenSpielGameEnv("tic_tac_toe")
    env.reset(seed=0)
    env.step(4)
    with pytest.raises(ValueError, match=r"move 4 is illegal here; legal moves: \[0, 1, 2, 3, 5, 6, 7, 8\]"):
        env.step(4)


def test_the_solver_never_loses_and_the_agents_reward_is_its_own():
    rng = np.random.default_rng(0)
    results = []
    for episode in range(6):  # seats alternate: the agent moves first in episodes 0, 2, 4
        env = OpenSpielGameEnv("tic_tac_toe", opponent="solver")
        env.episodes = episode
        obs, _ = env.reset(seed=episode)
        assert env.seat == episode % 2
        done, reward = False, 0.0
        while not done:
            obs, reward, done, _, _ = env.step(int(rng.choice(np.flatnonzero(obs[27:]))))
        results.append(reward)
    assert all(r <= 0 for r in results) and any(r < 0 for r in results)  # a random agent loses or draws


def test_an_mcts_opponent_answers_and_its_env_snapshots_exactly():
    """The MCTS opponent (OpenSpiel's MCTSBot, which does not pickle) is rebuilt from its random
    state: an env restored from a snapshot mid-game plays on exactly as the original."""
    kwargs = {"opponent": "mcts", "opponent_simulations": 20}
    env = make_env("openspiel/tic_tac_toe", 2, env_kwargs=kwargs)
    env.reset(seed=3)
    env.step(torch.tensor([4, 4]))  # the agents move first (seat 0 in the first episode); the bot replies
    assert all(len(env.envs[i].unwrapped.state.history()) == 2 for i in range(2))
    saved = env.state_dict()

    def play(e):  # each game's first legal move, twice: the bot's replies show in the observations
        return [e.step(torch.tensor([_legal(e, 0), _legal(e, 1)]))[0] for _ in range(2)]

    first = play(env)
    twin = make_env("openspiel/tic_tac_toe", 2, env_kwargs=kwargs)
    twin.load_state_dict(saved)
    assert all(torch.equal(x, y) for x, y in zip(first, play(twin)))


def _legal(env, i):
    state = env.envs[i].unwrapped.state
    return state.legal_actions()[0] if not state.is_terminal() else 0


def test_unknown_and_unsupported_games_are_one_clear_error():
    with pytest.raises(UnknownEnvError, match="unknown OpenSpiel game 'tic_tac_to'. Did you mean tic_tac_toe"):
        make_single_env("openspiel/tic_tac_to")
    with pytest.raises(UnknownEnvError, match="kuhn_poker has chance moves and has imperfect information"):
        make_single_env("openspiel/kuhn_poker")
    with pytest.raises(OpenSpielGameError, match="env.kwargs.opponent: 'minimax' is not one of random, mcts, solver"):
        OpenSpielGameEnv("tic_tac_toe", opponent="minimax")
    with pytest.raises(OpenSpielGameError, match="agent_seat"):
        OpenSpielGameEnv("tic_tac_toe", agent_seat=2)


def test_a_finished_games_observation_is_the_last_movers_view():
    game = pyspiel.load_game("tic_tac_toe")
    state = game.new_initial_state()
    for a in (0, 3, 1, 4, 2):
        state.apply_action(a)
    obs = observe(state, 9)
    assert np.array_equal(obs[:27], state.observation_tensor(0)) and not obs[27:].any()


def test_connect_four_plays_too():
    env = make_env("openspiel/connect_four", 3)
    obs = env.reset(seed=0)
    assert obs.shape == (3, 3 * 6 * 7 + 7) and env.spec.action_space.n == 7
    obs, reward, terminated, truncated, info = env.step(torch.tensor([3, 3, 3]))
    assert not terminated.any() and torch.equal(info["final_obs"], obs)
