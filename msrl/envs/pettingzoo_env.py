"""PettingZoo parallel envs behind msrl's multi-agent :class:`~msrl.api.Environment` contract.

An id ``pettingzoo/<module>`` (e.g. ``pettingzoo/mpe2.simple_spread_v3``) names a PettingZoo
env module; ``env.kwargs`` go to its ``parallel_env(...)``. :class:`AgentStackedEnv` turns one
parallel env into a single env with an agent axis -- observation ``(A, *obs_shape)``, action
``(A, *action_shape)``, reward ``(A,)`` float32, one ``terminated``/``truncated`` per env -- which
both engines step (``sync`` in the actor's process, ``process`` in worker processes), so a batch
is ``(N, A, ...)`` tensors as for native Tag.

Agents must share one observation space and one action space (parameter sharing and a
centralised critic need it), and an env's agents must finish together (an episode ends for the
whole env: MPE's agents are truncated together at ``max_cycles``); anything else is an error
naming the agents, not a best effort. This module imports no torch (engine workers import it).
"""

from __future__ import annotations

import importlib
from typing import Any

import gymnasium
import numpy as np

__all__ = ["PREFIX", "is_pettingzoo", "AgentStackedEnv", "make_parallel", "check_pettingzoo_id"]

#: id prefix of PettingZoo env modules
PREFIX = "pettingzoo/"


def is_pettingzoo(env_id: str) -> bool:
    """Whether ``env_id`` names a PettingZoo env module (``pettingzoo/<module>``)."""
    return env_id.startswith(PREFIX)


def check_pettingzoo_id(env_id: str) -> Any:
    """Imports the module ``env_id`` names; returns it.

    Raises:
        ValueError: the module does not import or has no ``parallel_env``.
    """
    name = env_id[len(PREFIX):]
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise ValueError(f"env id {env_id!r}: cannot import PettingZoo env module {name!r} ({e}); e.g. "
                         "pettingzoo/mpe2.simple_spread_v3 (pip install -e '.[pettingzoo]')") from None
    if not callable(getattr(module, "parallel_env", None)):
        raise ValueError(f"env id {env_id!r}: module {name!r} has no parallel_env(); name a PettingZoo env module")
    return module


def make_parallel(env_id: str, kwargs: dict[str, Any]) -> "AgentStackedEnv":
    """``AgentStackedEnv(<module>.parallel_env(**kwargs))``."""
    return AgentStackedEnv(check_pettingzoo_id(env_id).parallel_env(**kwargs), env_id)


def _stacked(space: gymnasium.Space, n: int) -> gymnasium.Space:
    if isinstance(space, gymnasium.spaces.Box):
        return gymnasium.spaces.Box(np.broadcast_to(space.low, (n, *space.shape)).copy(),
                                    np.broadcast_to(space.high, (n, *space.shape)).copy(), dtype=space.dtype)
    if isinstance(space, gymnasium.spaces.Discrete):
        return gymnasium.spaces.MultiDiscrete(np.full(n, space.n), start=np.full(n, space.start))
    raise ValueError(f"PettingZoo agents with {space} spaces are not supported (Box and Discrete are)")


class AgentStackedEnv(gymnasium.Env):
    """One PettingZoo parallel env as a single env with a leading agent axis.

    Args:
        env: a PettingZoo ``ParallelEnv``.
        env_id: its msrl id, for messages.

    Attributes:
        agents: the agent names, in axis order (``possible_agents``).
        agent_observation_space, agent_action_space: one agent's spaces.
        observation_space, action_space: stacked ``(A, ...)`` (a Discrete agent action space
            stacks to MultiDiscrete).

    Raises:
        ValueError: agents with different spaces, or spaces other than Box/Discrete.
    """

    def __init__(self, env: Any, env_id: str = "") -> None:
        self.env, self.env_id = env, env_id
        self.agents = list(env.possible_agents)
        obs_spaces = [env.observation_space(a) for a in self.agents]
        act_spaces = [env.action_space(a) for a in self.agents]
        for kind, spaces in (("observation", obs_spaces), ("action", act_spaces)):
            if any(s != spaces[0] for s in spaces):
                raise ValueError(f"{env_id}: agents {self.agents} have different {kind} spaces "
                                 f"({sorted({str(s) for s in spaces})}); msrl needs one space shared by every agent")
        self.agent_observation_space, self.agent_action_space = obs_spaces[0], act_spaces[0]
        self.observation_space = _stacked(obs_spaces[0], len(self.agents))
        self.action_space = _stacked(act_spaces[0], len(self.agents))
        self._discrete = isinstance(act_spaces[0], gymnasium.spaces.Discrete)

    def _stack(self, obs: dict[str, Any]) -> np.ndarray:
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
