"""OpenSpiel's board games as gymnasium envs: ``openspiel/<game>`` ids (``openspiel/tic_tac_toe``,
``openspiel/connect_four``), for two-player, zero-sum, sequential, deterministic games of
perfect information (Lanctot et al. 2019, "OpenSpiel: A Framework for Reinforcement Learning in
Games"). The game's rules are OpenSpiel's; msrl writes none.

An env is seen by the **player to move**: its observation is that player's
``observation_tensor()`` followed by the game's legal-action mask, and a step's reward is what
the game pays the player who just moved (its final return on the last move, else 0). Played by
one policy on both sides, that is self-play (AlphaZero's). With ``opponent`` set, the env plays
the other seat itself -- uniformly random legal moves, OpenSpiel's ``MCTSBot`` over random
rollouts (the usual yardstick of a board-game agent), or an exact solver by alpha-beta search
(:func:`open_spiel.python.algorithms.minimax.alpha_beta_search`, for small games) -- and every
step's reward is the agent's: the env is then an ordinary single-agent env whose episode return
is the agent's result (+1 win, 0 draw, -1 loss).

A planner (AlphaZero's tree search) reads the game's exact state from :attr:`OpenSpielGameEnv.state`
(an OpenSpiel ``State``: ``clone()``, ``apply_action``, ``legal_actions``, ``returns``).
"""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np

from msrl.errors import InputError

__all__ = ["OpenSpielGameEnv", "NAMESPACE", "is_openspiel", "register", "game_of", "observation_size", "observe",
           "OPPONENTS", "OpenSpielGameError"]

#: the id namespace of OpenSpiel's games
NAMESPACE = "openspiel/"

#: what ``env.kwargs.opponent`` takes
OPPONENTS = ("random", "mcts", "solver")


class OpenSpielGameError(InputError, ValueError):
    """An ``openspiel/<game>`` id whose game OpenSpiel does not have, or one these envs cannot
    play (not two-player zero-sum, sequential, deterministic, with perfect information and an
    observation tensor), or a bad ``env.kwargs`` value."""


def is_openspiel(env_id: str) -> bool:
    """Whether ``env_id`` names an OpenSpiel game (``openspiel/<game>``)."""
    return env_id.startswith(NAMESPACE)


def _pyspiel() -> Any:
    try:
        import pyspiel
    except ImportError:
        raise OpenSpielGameError("openspiel/<game> envs need OpenSpiel: pip install -e '.[games]'") from None
    return pyspiel


def game_of(name: str, params: dict[str, Any] | None = None) -> Any:
    """The OpenSpiel game ``name`` (with ``params``), checked to be one these envs can play.

    Raises:
        OpenSpielGameError: an unknown game (naming close ones), or one of another kind.
    """
    pyspiel = _pyspiel()
    known = sorted(pyspiel.registered_names())
    if name not in known:
        import difflib

        close = difflib.get_close_matches(name, known, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise OpenSpielGameError(f"unknown OpenSpiel game {name!r}.{hint} OpenSpiel's games: {', '.join(known)}")
    game = pyspiel.load_game(name, dict(params or {}))
    t = game.get_type()
    problems = [what for what, ok in (
        (f"has {game.num_players()} players", game.num_players() == 2),
        ("has simultaneous moves", t.dynamics == pyspiel.GameType.Dynamics.SEQUENTIAL),
        ("has chance moves", t.chance_mode == pyspiel.GameType.ChanceMode.DETERMINISTIC),
        ("has imperfect information", t.information == pyspiel.GameType.Information.PERFECT_INFORMATION),
        ("is not zero-sum", t.utility == pyspiel.GameType.Utility.ZERO_SUM),
        ("has no observation tensor", t.provides_observation_tensor)) if not ok]
    if problems:
        raise OpenSpielGameError(f"openspiel/{name}: these envs play two-player zero-sum board games (sequential, "
                                 f"deterministic, perfect information, with an observation tensor); {name} "
                                 f"{' and '.join(problems)} (e.g. openspiel/tic_tac_toe, openspiel/connect_four)")
    return game


def observation_size(game: Any) -> int:
    """The length of an env's observation: the game's observation tensor and its action mask."""
    return int(np.prod(game.observation_tensor_shape())) + game.num_distinct_actions()


def observe(state: Any, num_actions: int) -> np.ndarray:
    """The observation of ``state`` by its player to move: ``observation_tensor()`` then the
    legal-action mask, ``(D + num_actions,)`` float32 (a finished game: the last mover's view and
    an all-zero mask)."""
    player = state.current_player()
    if player < 0:  # terminal: the view of the player who moved last
        history = state.history()
        player = (len(history) - 1) % 2 if history else 0
        mask = np.zeros(num_actions, np.float32)
    else:
        mask = np.asarray(state.legal_actions_mask(player), np.float32)
    return np.concatenate([np.asarray(state.observation_tensor(player), np.float32), mask])


class OpenSpielGameEnv(gymnasium.Env):
    """One OpenSpiel game seen by the player to move (module docstring).

    Args:
        game: an OpenSpiel game name (``tic_tac_toe``, ``connect_four``).
        game_params: the game's parameters (``pyspiel.load_game(game, game_params)``).
        opponent: ``None`` (both seats are the agent's: self-play), ``"random"``, ``"mcts"``
            (OpenSpiel's ``MCTSBot``: UCT constant 2, ``opponent_simulations`` simulations, one
            random rollout per leaf, solving terminal subtrees) or ``"solver"`` (alpha-beta to the
            end of the game: for small games such as tic-tac-toe).
        opponent_simulations: the MCTS opponent's simulations per move.
        agent_seat: with an opponent, the agent's seat (0 moves first); ``None`` alternates
            every episode, starting with seat 0.

    Observations ``(D + A,)`` float32 (module docstring); actions ``Discrete(A)`` (OpenSpiel's
    distinct actions). An illegal move is a ``ValueError`` naming the legal ones.

    Raises:
        OpenSpielGameError: as :func:`game_of`; an unknown opponent, a bad seat or simulation count.
    """

    metadata = {"render_modes": ["ansi"]}

    def __init__(self, game: str, game_params: dict[str, Any] | None = None, opponent: str | None = None,
                 opponent_simulations: int = 1000, agent_seat: int | None = None, render_mode: str | None = None):
        self.game_name, self.game_params = game, dict(game_params or {})
        self.game = game_of(game, self.game_params)
        if opponent is not None and opponent not in OPPONENTS:
            raise OpenSpielGameError(f"env.kwargs.opponent: {opponent!r} is not one of {', '.join(OPPONENTS)} "
                                     "(or null: self-play)")
        if not (isinstance(opponent_simulations, int) and opponent_simulations >= 1):
            raise OpenSpielGameError(f"env.kwargs.opponent_simulations: expected an integer >= 1, got {opponent_simulations!r}")
        if agent_seat not in (None, 0, 1):
            raise OpenSpielGameError(f"env.kwargs.agent_seat: expected 0, 1 or null (alternate), got {agent_seat!r}")
        self.opponent, self.opponent_simulations, self.agent_seat = opponent, opponent_simulations, agent_seat
        self.num_actions = self.game.num_distinct_actions()
        d = observation_size(self.game)
        self.observation_space = gymnasium.spaces.Box(-np.inf, np.inf, (d,), np.float32)
        self.action_space = gymnasium.spaces.Discrete(self.num_actions)
        self.render_mode = render_mode
        self.state = self.game.new_initial_state()
        self.seat = 0
        self.episodes = 0
        self._bot_random = np.random.RandomState(0)
        self._bot: Any = None

    def __getstate__(self) -> dict[str, Any]:
        # OpenSpiel's MCTSBot does not pickle: it is rebuilt on demand from the game and its
        # (pickled) random state, which is all of its state between moves
        return {**self.__dict__, "_bot": None}

    def _opponent_move(self) -> int:
        state = self.state
        if self.opponent == "random":
            return int(self.np_random.choice(state.legal_actions()))
        if self.opponent == "solver":
            from open_spiel.python.algorithms.minimax import alpha_beta_search

            return int(alpha_beta_search(self.game, state.clone(), maximizing_player_id=state.current_player())[1])
        if self._bot is None:
            from open_spiel.python.algorithms import mcts

            self._bot = mcts.MCTSBot(self.game, 2.0, self.opponent_simulations,
                                     mcts.RandomRolloutEvaluator(1, self._bot_random), random_state=self._bot_random,
                                     solve=True)
        return int(self._bot.step(state))

    def _play_opponent(self) -> None:
        while self.opponent is not None and not self.state.is_terminal() and self.state.current_player() != self.seat:
            self.state.apply_action(self._opponent_move())

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        """A new game (the opponent's first move made where it moves first)."""
        super().reset(seed=seed)
        if seed is not None:
            self._bot_random = np.random.RandomState(seed)
            self._bot = None
        self.state = self.game.new_initial_state()
        self.seat = self.episodes % 2 if self.agent_seat is None else self.agent_seat
        self.episodes += 1
        self._play_opponent()
        return observe(self.state, self.num_actions), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        """The mover plays ``action`` (then, with an opponent, the opponent replies).

        Returns:
            ``(obs, reward, terminated, False, {})``: the next mover's observation, the reward of
            the player who moved (with an opponent: the agent's), whether the game ended.

        Raises:
            ValueError: an illegal move, or a step after the game ended.
        """
        state = self.state
        if state.is_terminal():
            raise ValueError("step() after the game ended: reset() first")
        action = int(action)
        legal = state.legal_actions()
        if action not in legal:
            raise ValueError(f"openspiel/{self.game_name}: move {action} is illegal here; legal moves: {legal}")
        me = state.current_player() if self.opponent is None else self.seat
        state.apply_action(action)
        self._play_opponent()
        done = state.is_terminal()
        reward = float(state.returns()[me]) if done else 0.0
        return observe(state, self.num_actions), reward, done, False, {}

    def render(self) -> str | None:
        """The board as OpenSpiel prints it (``render_mode="ansi"``)."""
        return str(self.state) if self.render_mode == "ansi" else None


def register(env_id: str) -> None:
    """Registers ``openspiel/<game>`` with gymnasium (its entry point :class:`OpenSpielGameEnv`
    with ``game=<game>``), once.

    Raises:
        OpenSpielGameError: as :func:`game_of`.
    """
    if env_id in gymnasium.envs.registry:
        return
    name = env_id[len(NAMESPACE):]
    game_of(name)
    gymnasium.register(id=env_id, entry_point="msrl.envs.openspiel_env:OpenSpielGameEnv", kwargs={"game": name},
                       disable_env_checker=True)
