"""``SleepCartPole-v1``: CartPole whose every step also sleeps ``delay_s`` (default 5 ms) -- a
simulator whose step costs wall time but (almost) no CPU, standing for a remote or GPU
simulator. ``bench/bench_scale.py`` measures scaling with it: on one 2-core machine, N actors of a
CPU-bound env would only measure the two cores, not how msrl scales; with this env the system's
own overhead is what shows.

    env.id: sleep_env:SleepCartPole-v1    (with PYTHONPATH=bench; env.kwargs.delay_s to change it)
"""

from __future__ import annotations

import time

import gymnasium
from gymnasium.envs.classic_control.cartpole import CartPoleEnv


class SleepCartPole(CartPoleEnv):
    """CartPole-v1 whose ``step`` sleeps ``delay_s`` seconds first.

    Args:
        delay_s: the wall time of one step (seconds, >= 0).

    Raises:
        ValueError: ``delay_s`` is negative.
    """

    def __init__(self, delay_s: float = 0.005, **kwargs):
        if delay_s < 0:
            raise ValueError(f"SleepCartPole: delay_s must be >= 0 seconds, got {delay_s}")
        super().__init__(**kwargs)
        self.delay_s = float(delay_s)

    def step(self, action):
        time.sleep(self.delay_s)
        return super().step(action)


if "SleepCartPole-v1" not in gymnasium.envs.registry:
    gymnasium.register("SleepCartPole-v1", entry_point=SleepCartPole, max_episode_steps=500, reward_threshold=475.0)
