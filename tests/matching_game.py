"""A one-step cooperative game for two agents as a PettingZoo parallel env: each agent sees the
constant observation ``[1.0]`` and acts once. Continuous (``continuous=True``): actions in
``[0, 1]``, each agent paid ``-(a_0 - 0.3)^2 - (a_1 - 0.7)^2`` (the optimum: a_0 = 0.3,
a_1 = 0.7). Discrete: actions in {0, 1, 2}, each paid 1 when both choose 2, 0.5 when both choose
0, else 0 (a coordination game with a worse equilibrium at 0)."""

from __future__ import annotations

import gymnasium
import numpy as np
from pettingzoo import ParallelEnv


class MatchingGame(ParallelEnv):
    """Two agents, one step an episode."""

    metadata = {"name": "matching_game_v0", "render_modes": []}

    def __init__(self, continuous: bool = True) -> None:
        self.continuous = continuous
        self.possible_agents = ["agent_0", "agent_1"]
        self.agents = list(self.possible_agents)

    def observation_space(self, agent: str) -> gymnasium.Space:
        return gymnasium.spaces.Box(0.0, 1.0, (1,), np.float32)

    def action_space(self, agent: str) -> gymnasium.Space:
        return gymnasium.spaces.Box(0.0, 1.0, (1,), np.float32) if self.continuous else gymnasium.spaces.Discrete(3)

    def reset(self, seed=None, options=None):
        self.agents = list(self.possible_agents)
        return {a: np.ones(1, np.float32) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions):
        if self.continuous:
            a0, a1 = float(np.asarray(actions["agent_0"])[0]), float(np.asarray(actions["agent_1"])[0])
            reward = -(a0 - 0.3) ** 2 - (a1 - 0.7) ** 2
        else:
            a0, a1 = int(actions["agent_0"]), int(actions["agent_1"])
            reward = 1.0 if a0 == a1 == 2 else (0.5 if a0 == a1 == 0 else 0.0)
        obs = {a: np.ones(1, np.float32) for a in self.possible_agents}
        self.agents = []
        return (obs, {a: reward for a in self.possible_agents}, {a: True for a in self.possible_agents},
                {a: False for a in self.possible_agents}, {a: {} for a in self.possible_agents})


def parallel_env(continuous: bool = True) -> MatchingGame:
    """A fresh :class:`MatchingGame`."""
    return MatchingGame(continuous)
