"""Native batched MuJoCo tasks: gymnasium's ``HalfCheetah-v5`` and ``Hopper-v5``, physics for
all ``N`` envs stepped at once by ``mjbatch`` (a C++ thread pool, GIL released), the task's
logic (observation, reward, termination, truncation) batched in NumPy on the physics state's
live arrays, reset noise in torch.

The physics is MuJoCo's own ``mj_step`` on gymnasium's model files, so it is bitwise equal to
gymnasium's (checked step by step by :func:`msrl.envs.native.check.check_mujoco`); the task
logic follows gymnasium's ``half_cheetah_v5.py``/``hopper_v5.py`` term by term (default
arguments: ``forward_reward_weight`` 1, ``ctrl_cost_weight`` 0.1 / 1e-3, ``healthy_reward`` 1,
``frame_skip`` 5 / 4, positions but the x coordinate observed, 1,000-step time limit). Reset
noise comes from msrl's counter-based generator (:func:`~msrl.envs.native.base.uniform_many`,
env ``i`` keyed by ``seed + i``) with gymnasium's distributions, not from gymnasium's numpy
generators, so start states are distributed as gymnasium's but not the same draws (the checker
copies gymnasium's start states in).

Physics runs on the CPU whatever ``device`` is; observations and rewards are returned on
``device``.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Mapping

import gymnasium
import numpy as np
import torch

from msrl.api import EnvSpec
from msrl.envs.gymnasium_env import EpisodeTracker, TrackedEnvironment
from msrl.envs.native.base import box_muller, env_keys, uniform_many

__all__ = ["MujocoTask", "HalfCheetah", "Hopper", "HalfCheetahRules", "HopperRules"]

_ASSETS = pathlib.Path(gymnasium.__file__).parent / "envs" / "mujoco" / "assets"


class MujocoTask(TrackedEnvironment):
    """Base of the native MuJoCo tasks.

    Args:
        num_envs: ``N`` >= 1.
        device: where observations, rewards and flags are returned (physics runs on the CPU).
        impl: ``"torch"`` only (there is no CUDA kernel: the physics is MuJoCo's C on the CPU).
        num_threads: physics threads (default: the CPUs this process may run on).

    Raises:
        ValueError: ``num_envs < 1``, ``impl`` other than torch, ``num_threads < 1``.
        ImportError: ``mjbatch`` or ``mujoco`` missing (``pip install -e '.[mujoco]'``).
    """

    ENV_ID: str
    GYMNASIUM_ID: str
    XML: str
    FRAME_SKIP: int
    MAX_EPISODE_STEPS = 1000
    #: RNG stream of the reset noise
    STREAM = 0x6D756A6F

    def __init__(self, num_envs: int, device: str | torch.device = "cpu", impl: str = "torch",
                 num_threads: int | None = None) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        if impl != "torch":
            raise ValueError(f"{self.ENV_ID} steps MuJoCo on the CPU; it has no {impl!r} implementation (valid: torch)")
        if num_threads is None:
            num_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        try:
            import mjbatch
            import mujoco
        except ImportError as e:
            raise ImportError(f"{self.ENV_ID} needs mujoco and mjbatch: pip install -e '.[mujoco]' ({e})") from None
        self.num_envs, self.device = num_envs, torch.device(device)
        self.model = mujoco.MjModel.from_xml_path(str(_ASSETS / self.XML))
        self.batch = mjbatch.Batch(self.model, num_envs, min(num_threads, num_envs))
        # live (N, nq) / (N, nv) / (N, nu) float64 views of the simulations' states: NumPy for the
        # per-step task logic (a NumPy op on these small arrays costs ~1 us, a torch op ~4 us),
        # torch views of the same memory for resets
        self._qpos, self._qvel, self._ctrl = (self.batch.bind(k) for k in ("qpos", "qvel", "ctrl"))
        self.qpos, self.qvel = torch.from_numpy(self._qpos), torch.from_numpy(self._qvel)
        self.init_qpos = torch.as_tensor(self.model.qpos0.copy())
        self.init_qvel = torch.zeros(self.model.nv, dtype=torch.float64)
        self.dt = self.model.opt.timestep * self.FRAME_SKIP
        low, high = self.model.actuator_ctrlrange.copy().astype(np.float32).T
        self._low, self._high = low, high
        obs_dim = self.model.nq - 1 + self.model.nv
        self.spec = EnvSpec(self.ENV_ID, gymnasium.spaces.Box(-np.inf, np.inf, (obs_dim,), np.float64),
                            gymnasium.spaces.Box(low, high, dtype=np.float32), num_envs)
        self.steps = torch.zeros(num_envs, dtype=torch.int64)
        self._steps = self.steps.numpy()
        self.episode = torch.zeros(num_envs, dtype=torch.int64)
        self.seed = 0
        self._index = torch.arange(num_envs, dtype=torch.int64)
        self._index_np = self._index.numpy()
        self._tracker = EpisodeTracker(num_envs)
        self._env_steps = 0

    # -- task logic, batched (gymnasium's formulas), on NumPy arrays ------------------------------
    def _ctrl_cost(self, action: np.ndarray, weight: float) -> np.ndarray:
        """``weight * np.sum(np.square(action))`` as gymnasium computes it on a float32 action:
        in float32 (NumPy 2 keeps a Python float times a float32 in float32), the squares added
        left to right as NumPy's sum does for fewer than 8 elements; float64 ``(B,)``."""
        sq = action * action
        acc = sq[:, 0].copy()
        for k in range(1, sq.shape[1]):
            acc += sq[:, k]
        return (np.float32(weight) * acc).astype(np.float64)

    def _observe(self, qpos: np.ndarray, qvel: np.ndarray) -> np.ndarray:
        """``concat(qpos[:, 1:], qvel)``: float64 ``(B, nq - 1 + nv)``."""
        return np.concatenate([qpos[:, 1:], qvel], axis=1)

    def _reward(self, x_velocity: np.ndarray, action: np.ndarray, qpos: np.ndarray,
                qvel: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _terminated(self, qpos: np.ndarray, qvel: np.ndarray) -> np.ndarray:
        return np.zeros(qpos.shape[0], dtype=bool)

    def _noise(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Start states ``(qpos, qvel)`` of envs ``ids``: ``init + noise``."""
        raise NotImplementedError

    def _uniforms(self, ids: torch.Tensor, count: int, first: int = 0) -> torch.Tensor:
        """U[0, 1) float64 ``(B, count)``: draws ``first..first+count-1`` of each env's episode."""
        keys = env_keys(self.seed, ids)
        return torch.stack([uniform_many(keys, self.STREAM, self.episode[ids], first + k) for k in range(count)], 1)

    def _normals(self, ids: torch.Tensor, count: int, first: int) -> torch.Tensor:
        """Standard normal float64 ``(B, count)`` by Box-Muller (Box & Muller 1958) from
        ``2 count`` uniform draws starting at ``first``."""
        return box_muller(self._uniforms(ids, 2 * count, first))

    def _reset_envs(self, ids: torch.Tensor) -> None:
        """mj_resetData + start state for envs ``ids`` (int64 ``(B,)``), as gymnasium's reset."""
        self.batch.reset(ids.numpy().astype(np.int64))
        qpos, qvel = self._noise(ids)
        self.qpos[ids] = qpos
        self.qvel[ids] = qvel
        self.steps[ids] = 0
        self.episode[ids] += 1

    # -- Environment -------------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> torch.Tensor:
        """Resets every env; env ``i`` draws its start states from key ``seed + i``.

        Returns:
            float32 observations ``(N, obs_dim)``.
        """
        if seed is not None:
            self.seed = int(seed)
            self.episode.zero_()
        self._reset_envs(self._index)
        self._tracker.reset()
        return torch.from_numpy(self._observe(self._qpos, self._qvel).astype(np.float32)).to(self.device)

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Steps every env by ``FRAME_SKIP`` physics steps (the :class:`~msrl.api.Environment`
        contract, same-step autoreset).

        Args:
            action: float ``(N, nu)``; clipped to the actuators' control range.

        Raises:
            ValueError: wrong action shape.
            FloatingPointError: a non-finite state (the simulation diverged).
        """
        n = self.num_envs
        if tuple(action.shape) != (n, self.model.nu):
            raise ValueError(f"action has shape {tuple(action.shape)}, expected (num_envs, nu) = {(n, self.model.nu)}")
        a = np.clip(action.detach().to("cpu", torch.float32).numpy(), self._low, self._high)
        self._ctrl[:] = a
        qpos, qvel = self._qpos, self._qvel  # live views: read before any reset below
        x_before = qpos[:, 0].copy()
        self.batch.step(nstep=self.FRAME_SKIP)
        x_velocity = (qpos[:, 0] - x_before) / self.dt
        obs = self._observe(qpos, qvel)
        reward = self._reward(x_velocity, a, qpos, qvel)
        if not (np.isfinite(obs).all() and np.isfinite(reward).all()):
            raise FloatingPointError(f"{self.ENV_ID}: non-finite simulation state at env step {self._env_steps + n}")
        terminated = self._terminated(qpos, qvel)
        self._steps += 1
        truncated = self._steps >= self.MAX_EPISODE_STEPS
        done = terminated | truncated
        final32 = obs32 = obs.astype(np.float32)
        if done.any():
            ids = np.flatnonzero(done)
            self._reset_envs(torch.from_numpy(ids))
            obs32 = obs32.copy()
            obs32[ids] = self._observe(qpos[ids], qvel[ids])
        self._env_steps += n
        self._tracker.update(self._index_np, reward, done)
        dev = self.device
        out = [torch.from_numpy(x).to(dev) for x in (obs32, reward.astype(np.float32), terminated, truncated)]
        final = out[0] if final32 is obs32 else torch.from_numpy(final32).to(dev)
        return out[0], out[1], out[2], out[3], {"final_obs": final}

    def set_state(self, index: int, qpos: Any, qvel: Any, steps: int = 0) -> torch.Tensor:
        """Overwrites env ``index``'s state (e.g. with gymnasium's, for the checker) as
        gymnasium's ``set_state`` does after ``mj_resetData``; returns its observation float32."""
        self.batch.reset(np.array([index], dtype=np.int64))
        self.qpos[index] = torch.as_tensor(np.asarray(qpos, dtype=np.float64))
        self.qvel[index] = torch.as_tensor(np.asarray(qvel, dtype=np.float64))
        self.steps[index] = steps
        return torch.from_numpy(self._observe(self._qpos[index:index + 1], self._qvel[index:index + 1])[0].astype(np.float32))


    def state_dict(self) -> dict[str, Any]:
        """The simulations' full integration states (``mjSTATE_INTEGRATION`` rows), step and
        episode counters, seed and episode trackers: an exact resume."""
        return {"sim_state": torch.from_numpy(self.batch.bind("state").copy()), "steps": self.steps.clone(),
                "episode": self.episode.clone(), "seed": self.seed, "env_steps": self._env_steps,
                **self._tracker.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output (same task and ``N``).

        Raises:
            ValueError: the saved states have another shape.
        """
        rows = self.batch.bind("state")
        saved = np.asarray(state["sim_state"])
        if saved.shape != rows.shape:
            raise ValueError(f"checkpoint holds simulation states {saved.shape}, this batch has {rows.shape}")
        rows[:] = saved
        self.steps.copy_(state["steps"])
        self.episode.copy_(state["episode"])
        self.seed, self._env_steps = int(state["seed"]), int(state["env_steps"])
        self._tracker.load_state_dict(state)


class HalfCheetahRules:
    """``HalfCheetah-v5``'s constants and start states (gymnasium ``half_cheetah_v5.py``), shared
    by the task on mjbatch physics and the one on MJWarp's (:mod:`msrl.envs.native.mujoco_warp`):
    observation ``(17,)``, action ``(6,)`` in [-1, 1]; reward ``x_velocity - 0.1 |a|^2``; never
    terminates; qpos noise U(-0.1, 0.1), qvel noise 0.1 N(0, 1)."""

    ENV_ID = "msrl/HalfCheetah-v5"
    GYMNASIUM_ID = "HalfCheetah-v5"
    XML = "half_cheetah.xml"
    FRAME_SKIP = 5
    CTRL_COST_WEIGHT = 0.1
    NOISE = 0.1

    def _noise(self, which: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Start states ``(qpos, qvel)`` float64 of the envs ``which`` names (the task's own
        ``_uniforms``/``_normals`` key): ``init + noise``."""
        nq, nv = self.model.nq, self.model.nv
        u = self._uniforms(which, nq)
        qpos = self.init_qpos + (-self.NOISE + 2 * self.NOISE * u)
        qvel = self.init_qvel + self.NOISE * self._normals(which, nv, first=nq)
        return qpos, qvel


class HopperRules:
    """``Hopper-v5``'s constants and start states (gymnasium ``hopper_v5.py``), shared as
    :class:`HalfCheetahRules`: observation ``(11,)`` with velocities clipped to [-10, 10], action
    ``(3,)`` in [-1, 1]; reward ``x_velocity + healthy - 1e-3 |a|^2``; terminates when unhealthy
    (|state[2:]| >= 100, z <= 0.7 or |angle| >= 0.2); qpos and qvel noise U(-5e-3, 5e-3)."""

    ENV_ID = "msrl/Hopper-v5"
    GYMNASIUM_ID = "Hopper-v5"
    XML = "hopper.xml"
    FRAME_SKIP = 4
    CTRL_COST_WEIGHT = 1e-3
    HEALTHY_REWARD = 1.0
    NOISE = 5e-3
    #: the healthy ranges: |state[2:]| < STATE_RANGE, z > MIN_Z, |angle| < MAX_ANGLE
    STATE_RANGE, MIN_Z, MAX_ANGLE = 100.0, 0.7, 0.2

    def _noise(self, which: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Start states ``(qpos, qvel)`` float64 of the envs ``which`` names: ``init + noise``."""
        nq, nv = self.model.nq, self.model.nv
        u = self._uniforms(which, nq + nv)
        noise = -self.NOISE + 2 * self.NOISE * u
        return self.init_qpos + noise[:, :nq], self.init_qvel + noise[:, nq:]


class HalfCheetah(HalfCheetahRules, MujocoTask):
    """``HalfCheetah-v5`` on mjbatch physics (:class:`HalfCheetahRules`)."""

    def _reward(self, x_velocity, action, qpos, qvel):
        return x_velocity - self._ctrl_cost(action, self.CTRL_COST_WEIGHT)


class Hopper(HopperRules, MujocoTask):
    """``Hopper-v5`` on mjbatch physics (:class:`HopperRules`)."""

    def _observe(self, qpos, qvel):
        return np.concatenate([qpos[:, 1:], np.clip(qvel, -10.0, 10.0)], axis=1)

    def _healthy(self, qpos, qvel):
        state = np.concatenate([qpos, qvel], axis=1)[:, 2:]
        z, angle = qpos[:, 1], qpos[:, 2]
        r, a = self.STATE_RANGE, self.MAX_ANGLE
        return ((state > -r) & (state < r)).all(1) & (z > self.MIN_Z) & (angle > -a) & (angle < a)

    def _reward(self, x_velocity, action, qpos, qvel):
        healthy = self._healthy(qpos, qvel).astype(np.float64) * self.HEALTHY_REWARD
        return x_velocity + healthy - self._ctrl_cost(action, self.CTRL_COST_WEIGHT)

    def _terminated(self, qpos, qvel):
        return ~self._healthy(qpos, qvel)
