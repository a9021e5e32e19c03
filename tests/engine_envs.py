"""Envs for the env engine's tests, registered on import (``engine_envs:Faulty-v0``), so the
engine's worker processes find them too."""

from __future__ import annotations

import os

import gymnasium
import numpy as np
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


class MatchTargets(gymnasium.Env):
    """Two targets shown each step in a ``Dict`` observation (``"first"``: a one-hot ``Box``
    of 3, ``"second"``: a ``Discrete(4)`` index), a ``MultiDiscrete([3, 4])`` action: 1 reward per
    component that names its target; 8-step episodes. A random policy's return is
    8 x (1/3 + 1/4) = 4.67 on average, a perfect one's 16."""

    def __init__(self) -> None:
        self.observation_space = gymnasium.spaces.Dict({
            "first": gymnasium.spaces.Box(0.0, 1.0, (3,), np.float32), "second": gymnasium.spaces.Discrete(4)})
        self.action_space = gymnasium.spaces.MultiDiscrete([3, 4])
        self.t, self.targets = 0, (0, 0)

    def _obs(self):
        self.targets = (int(self.np_random.integers(3)), int(self.np_random.integers(4)))
        return {"first": np.eye(3, dtype=np.float32)[self.targets[0]], "second": self.targets[1]}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        reward = float(int(action[0]) == self.targets[0]) + float(int(action[1]) == self.targets[1])
        self.t += 1
        return self._obs(), reward, False, self.t >= 8, {}


class TupleMatchTargets(MatchTargets):
    """MatchTargets with a ``Tuple(Discrete(3, start=1), Discrete(4))`` action (the first
    component names its target plus 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.action_space = gymnasium.spaces.Tuple((gymnasium.spaces.Discrete(3, start=1), gymnasium.spaces.Discrete(4)))

    def step(self, action):
        first, second = action
        return super().step((int(first) - 1, int(second)))


class LookAndMatch(gymnasium.Env):
    """A ``Dict`` observation of a frame and a vector: ``"frame"`` is a uint8 ``(1, 36, 36)``
    image with a bright 12x12 square in its left or right half (target ``a``), ``"hint"`` a
    float32 one-hot of 2 (target ``b``), ``"phase"`` a ``Discrete(9)`` step count; a
    ``MultiDiscrete([2, 2])`` action earns 1 per component that names its target; 8-step
    episodes. Random: 8 per episode, perfect: 16. A policy must read the image (through a CNN)
    and the vector: the packed row mixes bytes and floats."""

    def __init__(self) -> None:
        self.observation_space = gymnasium.spaces.Dict({
            "frame": gymnasium.spaces.Box(0, 255, (1, 36, 36), np.uint8),
            "hint": gymnasium.spaces.Box(0.0, 1.0, (2,), np.float32), "phase": gymnasium.spaces.Discrete(9)})
        self.action_space = gymnasium.spaces.MultiDiscrete([2, 2])
        self.t, self.targets = 0, (0, 0)

    def _obs(self):
        a, b = int(self.np_random.integers(2)), int(self.np_random.integers(2))
        self.targets = (a, b)
        frame = self.np_random.integers(0, 40, (1, 36, 36), dtype=np.uint8)
        top = int(self.np_random.integers(0, 24))
        frame[0, top:top + 12, 18 * a + 3:18 * a + 15] = 255
        return {"frame": frame, "hint": np.eye(2, dtype=np.float32)[b], "phase": self.t}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        reward = float(int(action[0]) == self.targets[0]) + float(int(action[1]) == self.targets[1])
        self.t += 1
        return self._obs(), reward, False, self.t >= 8, {}


class Frames(gymnasium.Env):
    """Random uint8 frames ``(4, 36, 36)`` (the Nature CNN's smallest input), three actions, reward
    1 when the action is the first frame's mean modulo 3; 8-step episodes. For what pixels cost
    and keep across boundaries, not for learning."""

    observation_space = gymnasium.spaces.Box(0, 255, (4, 36, 36), np.uint8)
    action_space = gymnasium.spaces.Discrete(3)

    def __init__(self) -> None:
        self.t, self.frame = 0, None

    def _obs(self):
        self.frame = self.np_random.integers(0, 256, (4, 36, 36), dtype=np.uint8)
        return self.frame

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        reward = float(int(action) == int(self.frame[0].mean()) % 3)
        self.t += 1
        return self._obs(), reward, False, self.t >= 8, {}


class Recall(gymnasium.Env):
    """A memory task: the first observation shows a cue (+1 or -1, with a flag), the next ones
    show nothing; at the last of 4 steps the action must name the cue (1 for +1) for a reward of
    1. A memoryless policy gets 0.5 on average, a recurrent one 1."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gymnasium.spaces.Discrete(2)

    def __init__(self, length: int = 4) -> None:
        self.length, self.t, self.cue = length, 0, 1

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.cue = 0, int(self.np_random.integers(2))
        return np.array([2.0 * self.cue - 1.0, 1.0], np.float32), {}

    def step(self, action):
        self.t += 1
        done = self.t >= self.length
        reward = float(int(action) == self.cue) if done else 0.0
        return np.zeros(2, np.float32), reward, done, False, {}


gymnasium.register("MatchTargets-v0", entry_point=MatchTargets)
gymnasium.register("Recall-v0", entry_point=Recall)
gymnasium.register("LookAndMatch-v0", entry_point=LookAndMatch)
gymnasium.register("TupleMatchTargets-v0", entry_point=TupleMatchTargets)
gymnasium.register("Frames-v0", entry_point=Frames)
gymnasium.register("WorkerOnlyFailure-v0", entry_point=WorkerOnlyFailure)
gymnasium.register("Faulty-v0", entry_point=FaultyCartPole, max_episode_steps=500)
gymnasium.register("Crashing-v0", entry_point=CrashingCartPole, max_episode_steps=500)
