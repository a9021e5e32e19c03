"""Envs for the env engine's tests, registered on import (``engine_envs:Faulty-v0``), so the
engine's worker processes find them too."""

from __future__ import annotations

import os

import gymnasium
from gymnasium.envs.classic_control.cartpole import CartPoleEnv


class FaultyCartPole(CartPoleEnv):
    """CartPole whose ``step`` raises at its ``fail_at``-th call."""

    def __init__(self, fail_at: int = 5, **kwargs):
        super().__init__(**kwargs)
        self.fail_at, self.calls = fail_at, 0

    def step(self, action):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError(f"simulated simulator error at step {self.calls}")
        return super().step(action)


class CrashingCartPole(CartPoleEnv):
    """CartPole whose process dies (as a segfaulting simulator would) at its ``crash_at``-th
    step, once per marker file: the restarted worker finds the marker and runs on."""

    def __init__(self, crash_at: int = 5, marker: str = "", **kwargs):
        super().__init__(**kwargs)
        self.crash_at, self.marker, self.calls = crash_at, marker, 0

    def step(self, action):
        self.calls += 1
        if self.calls == self.crash_at and self.marker:
            try:  # created atomically: of several envs that get here together, one crashes
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return super().step(action)
            os._exit(3)
        return super().step(action)


class WorkerOnlyFailure(CartPoleEnv):
    """CartPole that cannot be built in a child process (a missing licence, a missing display)."""

    def __init__(self, **kwargs):
        import sys

        main = sys.modules["__main__"]
        if getattr(getattr(main, "__spec__", None), "name", None) == "msrl.envs._worker":
            raise OSError("simulator licence not found")
        super().__init__(**kwargs)


gymnasium.register("WorkerOnlyFailure-v0", entry_point=WorkerOnlyFailure)
gymnasium.register("Faulty-v0", entry_point=FaultyCartPole, max_episode_steps=500)
gymnasium.register("Crashing-v0", entry_point=CrashingCartPole, max_episode_steps=500)
