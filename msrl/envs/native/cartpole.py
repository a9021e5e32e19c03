"""Native CartPole-v1: gymnasium's ``CartPoleEnv`` (Euler integration, termination at
|x| > 2.4 or |theta| > 12 degrees, reward 1 per step) under ``TimeLimit(500)``, batched, with
same-step autoreset. State is float64 as in gymnasium; observations are float32.

Start states are U[-0.05, 0.05)^4 drawn per env and per episode from a counter-based generator
(splitmix64 of the env's seed ``seed + i`` and its episode count), so one seed gives one
trajectory on every device and in both implementations. (gymnasium draws them from NumPy's PCG64, so start states
differ from gymnasium's; the consistency checker copies gymnasium's start states in.)
"""

from __future__ import annotations

import math
import pathlib

import gymnasium
import numpy as np
import torch

from msrl.envs.native.base import NativeEnv, env_keys, uniform

__all__ = ["CartPole"]

GRAVITY, MASSCART, MASSPOLE, LENGTH, FORCE_MAG, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
TOTAL_MASS = MASSPOLE + MASSCART
POLEMASS_LENGTH = MASSPOLE * LENGTH
THETA_THRESHOLD = 12 * 2 * math.pi / 360
X_THRESHOLD = 2.4


class CartPole(NativeEnv):
    """``N`` CartPole-v1 envs in tensors (see the module docstring).

    Args:
        num_envs: ``N``; device: where the state lives; impl: ``"kernel"`` or ``"torch"``.
        max_episode_steps: truncation limit (gymnasium's 500).

    Observations ``(N, 4)`` float32; actions ``(N,)`` int64 in {0, 1}.
    """

    KERNEL_SOURCE = pathlib.Path(__file__).with_name("cartpole.cu")
    ENV_ID = "msrl/CartPole-v1"
    #: the gymnasium env with the same rules (evaluations run there)
    GYMNASIUM_ID = "CartPole-v1"

    def __init__(self, num_envs: int, device: str | torch.device = "cpu", impl: str = "kernel", max_episode_steps: int = 500) -> None:
        super().__init__(num_envs, device, impl)
        self.max_episode_steps = max_episode_steps
        high = np.array([X_THRESHOLD * 2, np.inf, THETA_THRESHOLD * 2, np.inf], dtype=np.float32)
        self.spec = self.make_spec(self.ENV_ID, gymnasium.spaces.Box(-high, high, dtype=np.float32), gymnasium.spaces.Discrete(2))
        self._init_single_agent_state(4)

    def _start(self, episode: torch.Tensor) -> torch.Tensor:
        return torch.stack([-0.05 + 0.1 * uniform(env_keys(self.seed, self._env_index), 0, episode, k) for k in range(4)], dim=1)

    def reset(self, seed: int | None = None) -> torch.Tensor:
        """Starts episode 0 of every env from ``seed`` (``None``: keep the current seed).

        Returns:
            observations ``(N, 4)`` float32.
        """
        if seed is not None:
            self.seed = int(seed)
        self._reset_tracking()
        if self._kernels is not None:
            return self._kernel_reset("cartpole_reset", 4)
        self.episode.zero_()
        self.state.copy_(self._start(self.episode))
        self.steps.zero_()
        return self.state.to(torch.float32)

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """One step of every env (same-step autoreset; ``info["final_obs"]`` as in the
        :class:`~msrl.api.Environment` contract).

        Args:
            action: ``(N,)`` int64 (other integer dtypes are converted).

        Raises:
            ValueError: wrong shape.
        """
        if action.shape != (self.num_envs,):
            raise ValueError(f"action has shape {tuple(action.shape)}, expected ({self.num_envs},)")
        action = action.to(device=self.device, dtype=torch.int64).contiguous()
        if self._kernels is not None:
            obs, final_obs, reward, terminated, truncated = self._kernel_step("cartpole_step", 4, action)
        else:
            obs, final_obs, reward, terminated, truncated = self._step_torch(action)
            self._track(reward, terminated | truncated)
        return obs, reward, terminated, truncated, {"final_obs": final_obs}

    def _step_torch(self, action: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The torch reference of ``cartpole_step`` (float64 state, same operation order)."""
        x, x_dot, theta, theta_dot = self.state.unbind(1)
        force = torch.where(action == 1, FORCE_MAG, -FORCE_MAG).to(torch.float64)
        costheta, sintheta = torch.cos(theta), torch.sin(theta)
        temp = (force + POLEMASS_LENGTH * (theta_dot * theta_dot) * sintheta) / TOTAL_MASS
        thetaacc = (GRAVITY * sintheta - costheta * temp) / (LENGTH * (4.0 / 3.0 - MASSPOLE * (costheta * costheta) / TOTAL_MASS))
        xacc = temp - POLEMASS_LENGTH * thetaacc * costheta / TOTAL_MASS
        new = torch.stack([x + TAU * x_dot, x_dot + TAU * xacc, theta + TAU * theta_dot, theta_dot + TAU * thetaacc], dim=1)
        terminated = (new[:, 0] < -X_THRESHOLD) | (new[:, 0] > X_THRESHOLD) | (new[:, 2] < -THETA_THRESHOLD) | (new[:, 2] > THETA_THRESHOLD)
        steps = self.steps + 1
        truncated = steps >= self.max_episode_steps
        final_obs = new.to(torch.float32)
        done = terminated | truncated
        self.episode += done.to(torch.int64)
        if self.device.type != "cpu" or bool(done.any()):  # on a CPU a check is free: draw starts only when needed
            new = torch.where(done.unsqueeze(1), self._start(self.episode), new)
        self.state.copy_(new)
        self.steps.copy_(torch.where(done, 0, steps).to(torch.int32))
        reward = torch.ones(self.num_envs, dtype=torch.float32, device=self.device)
        return new.to(torch.float32), final_obs, reward, terminated, truncated
