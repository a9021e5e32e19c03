"""PettingZoo parallel envs behind msrl's multi-agent :class:`~msrl.api.Environment` contract.

An id ``pettingzoo/<module>`` (e.g. ``pettingzoo/mpe2.simple_spread_v3``) names a PettingZoo
env module; ``env.kwargs`` go to its ``parallel_env(...)``. :class:`AgentStackedEnv` turns one
parallel env into a single env with an agent axis -- observation ``(A, *obs_shape)``, action
``(A, *action_shape)``, reward ``(A,)`` float32, one ``terminated``/``truncated`` per env -- which
both engines step (``sync`` in the actor's process, ``process`` in worker processes), so a batch
is ``(N, A, ...)`` tensors as for native Tag.

A module with no ``parallel_env`` but an AEC ``env`` -- a turn-based game such as PettingZoo's
classic ``tictactoe_v3`` or ``connect_four_v3`` -- is stepped one ply per env step by
:class:`TurnBasedStackedEnv`: every agent submits an action, only the one whose turn it is has its
action applied, and each agent's observation carries the legal-action mask and a to-move flag
(:data:`TURN_FEATURES`), so an algorithm can mask illegal moves and treat the other agents' plies
as forced no-ops of its own.

Agents must share one observation space and one action space (parameter sharing and a
centralised critic need it), and an env's agents must finish together (an episode ends for the
whole env: MPE's agents are truncated together at ``max_cycles``); anything else is an error
naming the agents, not a best effort. This module imports no torch (engine workers import it).
"""

from __future__ import annotations

import importlib
from typing import Any, Sequence

import gymnasium
import numpy as np

__all__ = ["PREFIX", "TURN_FEATURES", "is_pettingzoo", "AgentStackedEnv", "TurnBasedStackedEnv", "make_parallel",
           "check_pettingzoo_id"]

#: id prefix of PettingZoo env modules
PREFIX = "pettingzoo/"

#: what :class:`TurnBasedStackedEnv` appends to each agent's flattened observation: the
#: legal-action mask (``n`` entries, 1 = legal) then the to-move flag (1 = this agent's turn)
TURN_FEATURES = ("action_mask", "to_move")


def is_pettingzoo(env_id: str) -> bool:
    """Whether ``env_id`` names a PettingZoo env module (``pettingzoo/<module>``)."""
    return env_id.startswith(PREFIX)


def check_pettingzoo_id(env_id: str) -> Any:
    """Imports the module ``env_id`` names; returns it.

    Raises:
        ValueError: the module does not import, or has neither ``parallel_env`` (simultaneous
            moves) nor an AEC ``env`` (turn-based games).
    """
    name = env_id[len(PREFIX):]
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise ValueError(f"env id {env_id!r}: cannot import PettingZoo env module {name!r} ({e}); e.g. "
                         "pettingzoo/mpe2.simple_spread_v3 (pip install -e '.[pettingzoo]')") from None
    if not callable(getattr(module, "parallel_env", None)) and not callable(getattr(module, "env", None)):
        raise ValueError(f"env id {env_id!r}: module {name!r} has neither parallel_env() nor env(); name a PettingZoo "
                         "env module (e.g. pettingzoo/mpe2.simple_spread_v3, pettingzoo/pettingzoo.classic.tictactoe_v3)")
    return module


def make_parallel(env_id: str, kwargs: dict[str, Any], wrappers: Sequence[str] = ()) -> "AgentStackedEnv":
    """``AgentStackedEnv(<module>.parallel_env(**kwargs))`` (``wrappers``: ``pad_observations``
    pads the agents' observations to one space), or for a module with only an AEC ``env`` (a
    turn-based game) ``TurnBasedStackedEnv(<module>.env(**kwargs))``.

    Raises:
        ValueError: a wrapper for a turn-based game.
    """
    module = check_pettingzoo_id(env_id)
    if callable(getattr(module, "parallel_env", None)):
        return AgentStackedEnv(module.parallel_env(**kwargs), env_id, pad_observations="pad_observations" in wrappers)
    if wrappers:
        raise ValueError(f"env.wrappers {list(wrappers)}: {env_id} is a turn-based game, whose observations msrl builds "
                         "itself; leave env.wrappers empty")
    return TurnBasedStackedEnv(module.env(**kwargs), env_id)


def _stacked(space: gymnasium.Space, n: int) -> gymnasium.Space:
    if isinstance(space, gymnasium.spaces.Box):
        return gymnasium.spaces.Box(np.broadcast_to(space.low, (n, *space.shape)).copy(),
                                    np.broadcast_to(space.high, (n, *space.shape)).copy(), dtype=space.dtype)
    if isinstance(space, gymnasium.spaces.Discrete):
        return gymnasium.spaces.MultiDiscrete(np.full(n, space.n), start=np.full(n, space.start))
    raise ValueError(f"PettingZoo agents with {space} spaces are not supported (Box and Discrete are)")


def _padded_space(spaces: list[gymnasium.Space], env_id: str) -> gymnasium.spaces.Box:
    """One Box ``(D,)`` holding every agent's 1-D Box observation, ``D`` the longest, zeros
    appended to the shorter (their padded entries bounded by 0).

    Raises:
        ValueError: an observation space that is not a 1-D Box.
    """
    if not all(isinstance(s, gymnasium.spaces.Box) and len(s.shape) == 1 for s in spaces):
        raise ValueError(f"{env_id}: pad_observations pads 1-D Box observations, got {sorted({str(s) for s in spaces})}")
    d = max(s.shape[0] for s in spaces)
    low = np.min([np.pad(s.low.astype(np.float32), (0, d - s.shape[0])) for s in spaces], axis=0)
    high = np.max([np.pad(s.high.astype(np.float32), (0, d - s.shape[0])) for s in spaces], axis=0)
    return gymnasium.spaces.Box(low, high, (d,), np.float32)


def _shared_spaces(env: Any, agents: list[str], env_id: str, pad_observations: bool = False
                   ) -> tuple[gymnasium.Space, gymnasium.Space]:
    """The one observation space and the one action space every agent of ``env`` has
    (``pad_observations``: the observations' :func:`_padded_space`).

    Raises:
        ValueError: agents with different spaces, naming them and the spaces.
    """
    obs_spaces = [env.observation_space(a) for a in agents]
    act_spaces = [env.action_space(a) for a in agents]
    for kind, spaces in (("observation", obs_spaces), ("action", act_spaces)):
        if kind == "observation" and pad_observations:
            continue
        if any(s != spaces[0] for s in spaces):
            hint = " (env.wrappers: [pad_observations] appends zeros to the shorter)" if kind == "observation" else ""
            raise ValueError(f"{env_id}: agents {agents} have different {kind} spaces "
                             f"({sorted({str(s) for s in spaces})}); msrl needs one space shared by every agent{hint}")
    return (_padded_space(obs_spaces, env_id) if pad_observations else obs_spaces[0]), act_spaces[0]


class AgentStackedEnv(gymnasium.Env):
    """One PettingZoo parallel env as a single env with a leading agent axis.

    Args:
        env: a PettingZoo ``ParallelEnv``.
        env_id: its msrl id, for messages.
        pad_observations: agents of unequal 1-D Box observations share one, zeros appended to
            the shorter (``env.wrappers: [pad_observations]``; SuperSuit's ``pad_observations_v0``).

    Attributes:
        agents: the agent names, in axis order (``possible_agents``).
        agent_observation_space, agent_action_space: one agent's spaces.
        observation_space, action_space: stacked ``(A, ...)`` (a Discrete agent action space
            stacks to MultiDiscrete).

    Raises:
        ValueError: agents with different spaces, or spaces other than Box/Discrete.
    """

    def __init__(self, env: Any, env_id: str = "", pad_observations: bool = False) -> None:
        self.env, self.env_id = env, env_id
        self.agents = list(env.possible_agents)
        obs_space, act_space = _shared_spaces(env, self.agents, env_id, pad_observations)
        self.pad_observations = pad_observations
        self.agent_observation_space, self.agent_action_space = obs_space, act_space
        self.observation_space = _stacked(obs_space, len(self.agents))
        self.action_space = _stacked(act_space, len(self.agents))
        self._discrete = isinstance(act_space, gymnasium.spaces.Discrete)

    #: agents' observations padded to one space (set by the constructor; never for turn-based games)
    pad_observations = False

    def _stack(self, obs: dict[str, Any]) -> np.ndarray:
        if self.pad_observations:
            out = np.zeros(self.observation_space.shape, np.float32)
            for k, a in enumerate(self.agents):
                o = np.asarray(obs[a], np.float32)
                out[k, :o.shape[0]] = o
            return out
        return np.stack([np.asarray(obs[a]) for a in self.agents])

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        obs, _ = self.env.reset(seed=seed, options=options)
        return self._stack(obs), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool, bool, dict]:
        """Steps every agent; ``action`` ``(A, ...)``.

        Returns:
            ``(obs (A, ...), reward (A,) float32, terminated, truncated, {})``.

        Raises:
            ValueError: some agents finished and others did not.
        """
        acts = {a: (int(action[k]) if self._discrete else np.asarray(action[k])) for k, a in enumerate(self.agents)}
        obs, rew, term, trunc, _ = self.env.step(acts)
        reward = np.array([rew.get(a, 0.0) for a in self.agents], dtype=np.float32)
        te = [bool(term.get(a, False)) for a in self.agents]
        tr = [bool(trunc.get(a, False)) for a in self.agents]
        done = [x or y for x, y in zip(te, tr)]
        if any(done) and not all(done):
            raise ValueError(f"{self.env_id}: agents {[a for a, d in zip(self.agents, done) if d]} finished while "
                             f"{[a for a, d in zip(self.agents, done) if not d]} did not; msrl's multi-agent envs end "
                             "an episode for all agents at once")
        terminated = all(te)  # every agent terminated; else, once all are done, the episode was cut short
        return self._stack(obs), reward, terminated, all(done) and not terminated, {}

    def close(self) -> None:
        self.env.close()


class TurnBasedStackedEnv(AgentStackedEnv):
    """A turn-based two-or-more-player PettingZoo AEC game (classic board games: tic-tac-toe,
    connect four) as an agent-stacked env that moves one ply per step.

    Each step every agent submits an action ``(A,)``; only the action of the agent to move
    (``agent_selection``) is applied. Agent ``i``'s observation is float32 ``(D + n + 1,)``: the
    game's own observation of ``i`` flattened (``gymnasium.spaces.flatten``), the legal-action
    mask ``(n,)`` (1 = legal; zeros when it is not ``i``'s turn) and the to-move flag (1 = ``i``
    moves next) -- :data:`TURN_FEATURES`. Rewards ``(A,)`` are the ply's (``env.rewards``: board
    games reward the end, +1 win, -1 loss, 0 draw). An illegal move is the game's to judge
    (PettingZoo's classic games end it with a loss for the mover).

    Args:
        env: a PettingZoo ``AECEnv`` whose agents share one ``Discrete(n)`` action space and one
            observation space: a ``Dict`` with ``"observation"`` and ``"action_mask"`` (classic
            games), or any space ``gymnasium.spaces.flatten`` takes (all moves then legal).
        env_id: its msrl id, for messages.

    Raises:
        ValueError: agents with different spaces, or an action space other than Discrete.
    """

    def __init__(self, env: Any, env_id: str = "") -> None:
        self.env, self.env_id = env, env_id
        self.agents = list(env.possible_agents)
        space, act_space = _shared_spaces(env, self.agents, env_id)
        if not isinstance(act_space, gymnasium.spaces.Discrete):
            raise ValueError(f"{env_id}: a turn-based game needs a Discrete action space, got {act_space}")
        self._masked = isinstance(space, gymnasium.spaces.Dict) and {"observation", "action_mask"} <= set(space.spaces)
        self._board_space = space["observation"] if self._masked else space
        self.num_actions = int(act_space.n)
        dim = gymnasium.spaces.flatdim(self._board_space) + self.num_actions + 1
        self.agent_observation_space = gymnasium.spaces.Box(-np.inf, np.inf, (dim,), np.float32)
        self.agent_action_space = act_space
        self.observation_space = _stacked(self.agent_observation_space, len(self.agents))
        self.action_space = _stacked(act_space, len(self.agents))

    def _observe(self, agent: str, done: bool) -> np.ndarray:
        obs = self.env.observe(agent)
        to_move = not done and agent == self.env.agent_selection
        mask = np.zeros(self.num_actions, dtype=np.float32)
        if to_move:
            mask[:] = obs["action_mask"] if self._masked else 1.0
        board = gymnasium.spaces.flatten(self._board_space, obs["observation"] if self._masked else obs)
        return np.concatenate([np.asarray(board, dtype=np.float32), mask, np.float32([to_move])])

    def _stack_turn(self, done: bool) -> np.ndarray:
        return np.stack([self._observe(a, done) for a in self.agents])

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        self.env.reset(seed=seed, options=options)
        return self._stack_turn(False), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool, bool, dict]:
        """Applies the action of the agent to move; ``action`` ``(A,)`` (the others' are ignored).

        Returns:
            ``(obs (A, D + n + 1), reward (A,) float32, terminated, truncated, {})``.

        Raises:
            ValueError: some agents finished and others did not.
        """
        mover = self.env.agent_selection
        self.env.step(int(action[self.agents.index(mover)]))
        reward = np.array([self.env.rewards.get(a, 0.0) for a in self.agents], dtype=np.float32)
        te = [bool(self.env.terminations.get(a, False)) for a in self.agents]
        tr = [bool(self.env.truncations.get(a, False)) for a in self.agents]
        done = [x or y for x, y in zip(te, tr)]
        if any(done) and not all(done):
            raise ValueError(f"{self.env_id}: agents {[a for a, d in zip(self.agents, done) if d]} finished while "
                             f"{[a for a, d in zip(self.agents, done) if not d]} did not; msrl's multi-agent envs end "
                             "an episode for all agents at once")
        terminated = all(te)
        return self._stack_turn(all(done)), reward, terminated, all(done) and not terminated, {}
