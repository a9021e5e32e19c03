"""Native Pendulum-v1: gymnasium's ``PendulumEnv`` (continuous torque) under ``TimeLimit(200)``,
batched, with same-step autoreset.

The arithmetic follows gymnasium's under NumPy 2's promotion rules: the clipped torque ``u`` is
float32 and the terms made from it alone (``0.001 * u**2``, ``3 * u``) are float32; the state
(theta, theta_dot) is float64; the angle is normalised with NumPy's floored remainder.
Start states: theta ~ U[-pi, pi), theta_dot ~ U[-1, 1), per env and episode from splitmix64.
"""

from __future__ import annotations

import math
import pathlib

import gymnasium
import numpy as np
import torch

from msrl.envs.native.base import NativeEnv, env_keys, uniform

__all__ = ["Pendulum"]

G, DT, MAX_SPEED, MAX_TORQUE = 10.0, 0.05, 8.0, 2.0


def _remainder(a: torch.Tensor, b: float) -> torch.Tensor:
    """NumPy's float remainder (floored modulo via fmod), bitwise."""
    mod = torch.fmod(a, b)
    adjust = (mod != 0) & ((mod < 0) != (b < 0))
    return torch.where(adjust, mod + b, torch.where(mod == 0, torch.copysign(torch.zeros_like(mod), torch.tensor(b)), mod))


class Pendulum(NativeEnv):
    """``N`` Pendulum-v1 envs in tensors (see the module docstring).

    Observations ``(N, 3)`` float32 ``(cos theta, sin theta, theta_dot)``; actions ``(N, 1)``
    float32 torques, clipped to [-2, 2]; rewards ``-(theta^2 + 0.1 theta_dot^2 + 0.001 u^2)``.
    """

    KERNEL_SOURCE = pathlib.Path(__file__).with_name("pendulum.cu")
    ENV_ID = "msrl/Pendulum-v1"
    GYMNASIUM_ID = "Pendulum-v1"

    def __init__(self, num_envs: int, device: str | torch.device = "cpu", impl: str = "kernel", max_episode_steps: int = 200) -> None:
        super().__init__(num_envs, device, impl)
        self.max_episode_steps = max_episode_steps
        high = np.array([1.0, 1.0, MAX_SPEED], dtype=np.float32)
        self.spec = self.make_spec(
            self.ENV_ID,
            gymnasium.spaces.Box(-high, high, dtype=np.float32),
            gymnasium.spaces.Box(-MAX_TORQUE, MAX_TORQUE, shape=(1,), dtype=np.float32),
        )
        self._init_single_agent_state(2)

    def _start(self, episode: torch.Tensor) -> torch.Tensor:
        th = -math.pi + 2.0 * math.pi * uniform(env_keys(self.seed, self._env_index), 0, episode, 0)
        thdot = -1.0 + 2.0 * uniform(env_keys(self.seed, self._env_index), 0, episode, 1)
        return torch.stack([th, thdot], dim=1)

    def _observe_state(self, state: torch.Tensor) -> torch.Tensor:
        """``(cos theta, sin theta, theta_dot)`` float32 of states ``(B, 2)``."""
        return torch.stack([torch.cos(state[:, 0]), torch.sin(state[:, 0]), state[:, 1]], dim=1).to(torch.float32)

    def reset(self, seed: int | None = None) -> torch.Tensor:
        """Starts episode 0 of every env from ``seed``; returns observations ``(N, 3)`` float32."""
        if seed is not None:
            self.seed = int(seed)
        self._reset_tracking()
        if self._kernels is not None:
            return self._kernel_reset("pendulum_reset", 3)
        self.episode.zero_()
        self.steps.zero_()
        self.state.copy_(self._start(self.episode))
        return self._observe_state(self.state)

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """One step of every env (same-step autoreset; episodes end by truncation only).

        Args:
            action: ``(N, 1)`` or ``(N,)`` torques (converted to float32).

        Raises:
            ValueError: wrong shape.
        """
        if action.shape not in ((self.num_envs, 1), (self.num_envs,)):
            raise ValueError(f"action has shape {tuple(action.shape)}, expected ({self.num_envs}, 1)")
        u = action.reshape(self.num_envs).to(device=self.device, dtype=torch.float32).contiguous()
        if self._kernels is not None:
            obs, final_obs, reward, terminated, truncated = self._kernel_step("pendulum_step", 3, u)
        else:
            obs, final_obs, reward, terminated, truncated = self._step_torch(u)
            self._track(reward, truncated)
        return obs, reward, terminated, truncated, {"final_obs": final_obs}

    def _step_torch(self, u: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The torch reference of ``pendulum_step``."""
        th, thdot = self.state[:, 0], self.state[:, 1]
        u = u.clamp(-MAX_TORQUE, MAX_TORQUE)
        thn = _remainder(th + math.pi, 2.0 * math.pi) - math.pi
        cost = (thn * thn + 0.1 * (thdot * thdot)) + (0.001 * (u * u)).to(torch.float64)
        newthdot = thdot + (3.0 * G / 2.0 * torch.sin(th) + (3.0 * u).to(torch.float64)) * DT
        newthdot = newthdot.clamp(-MAX_SPEED, MAX_SPEED)
        new = torch.stack([th + newthdot * DT, newthdot], dim=1)
        steps = self.steps + 1
        truncated = steps >= self.max_episode_steps
        final_obs = self._observe_state(new)
        self.episode += truncated.to(torch.int64)
        if self.device.type != "cpu" or bool(truncated.any()):  # on a CPU a check is free: draw starts only when needed
            new = torch.where(truncated.unsqueeze(1), self._start(self.episode), new)
        self.state.copy_(new)
        self.steps.copy_(torch.where(truncated, 0, steps).to(torch.int32))
        reward = (-cost).to(torch.float32)
        terminated = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        return self._observe_state(new), final_obs, reward, terminated, truncated
