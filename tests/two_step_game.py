"""The two-step cooperative matrix game of the QMIX paper (Rashid et al. 2018, Section 6.1,
Figure 3) as a PettingZoo parallel env: in the first step agent 0's action chooses game 2A
(action 0) or 2B (action 1), rewarding nothing; in the second the team is paid 7 in 2A whatever
it does, and in 2B ``[[0, 1], [1, 8]][a_0][a_1]``. The optimum (2B, both action 1) pays 8; an
additive decomposition (VDN) cannot represent 2B's payoffs and settles for 2A's 7. Both agents
see the one-hot state (first step, 2A, 2B); the team reward is split evenly between them."""

from __future__ import annotations

import gymnasium
import numpy as np
from pettingzoo import ParallelEnv

PAYOFF_2B = np.array([[0.0, 1.0], [1.0, 8.0]])


class TwoStepGame(ParallelEnv):
    """Two agents, ``Discrete(2)`` actions, observations the one-hot state ``(3,)``."""

    metadata = {"name": "two_step_game_v0", "render_modes": []}

    def __init__(self) -> None:
        self.possible_agents = ["agent_0", "agent_1"]
        self.agents = list(self.possible_agents)
        self.state_index = 0

    def observation_space(self, agent: str) -> gymnasium.Space:
        return gymnasium.spaces.Box(0.0, 1.0, (3,), np.float32)

    def action_space(self, agent: str) -> gymnasium.Space:
        return gymnasium.spaces.Discrete(2)

    def _obs(self) -> dict:
        o = np.zeros(3, np.float32)
        o[self.state_index] = 1.0
        return {a: o.copy() for a in self.agents}

    def reset(self, seed=None, options=None):
        self.agents, self.state_index = list(self.possible_agents), 0
        return self._obs(), {a: {} for a in self.agents}

    def step(self, actions):
        a0, a1 = int(actions["agent_0"]), int(actions["agent_1"])
        if self.state_index == 0:
            self.state_index, reward, done = 1 + a0, 0.0, False
        else:
            reward, done = (7.0 if self.state_index == 1 else float(PAYOFF_2B[a0, a1])), True
        obs = self._obs()
        rewards = {a: reward / 2 for a in self.agents}
        terms = {a: done for a in self.agents}
        truncs = {a: False for a in self.agents}
        if done:
            self.agents = []
        return obs, rewards, terms, truncs, {a: {} for a in self.possible_agents}


def parallel_env() -> TwoStepGame:
    """A fresh :class:`TwoStepGame`."""
    return TwoStepGame()
