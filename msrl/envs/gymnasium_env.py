"""Gymnasium adapter: any registered gymnasium env id as a batched :class:`~msrl.api.Environment`.

The batch is a gymnasium vector env (``gymnasium.make_vec``) created with
``autoreset_mode=SAME_STEP``, so the observation returned for a finished env is the first of
its next episode and the finished episode's last observation is ``info["final_obs"]``.
"""

from __future__ import annotations

import difflib
import pickle
from typing import Any, Mapping

import gymnasium
import numpy as np
import torch
from gymnasium.vector import AutoresetMode

from msrl.api import Environment, EnvSpec, EpisodeStats

__all__ = ["GymnasiumEnv", "UnknownEnvError", "check_env_id", "VECTORIZATION_MODES"]

#: Values of ``env.vectorization`` in the YAML.
VECTORIZATION_MODES = ("sync", "async")


class UnknownEnvError(ValueError):
    """An env id that gymnasium's registry does not hold."""


def check_env_id(env_id: str) -> None:
    """Checks that ``env_id`` is registered with gymnasium.

    Raises:
        UnknownEnvError: naming the closest registered ids and listing every registered id.
    """
    registry = gymnasium.envs.registry
    if env_id in registry:
        return
    known = sorted(registry)
    close = difflib.get_close_matches(env_id, known, n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise UnknownEnvError(
        f"unknown env id {env_id!r}.{hint} Registered gymnasium env ids: {', '.join(known)}"
    )


class GymnasiumEnv(Environment):
    """``N`` copies of a gymnasium env, stepped as one batch on torch tensors.

    Args:
        env_id: a registered gymnasium id, e.g. ``"CartPole-v1"``.
        num_envs: ``N``, the batch size; >= 1.
        vectorization: ``"sync"`` (one process, sequential) or ``"async"`` (a subprocess per
            env), gymnasium's vectorisation modes.
        device: where returned tensors live.
        env_kwargs: passed to ``gymnasium.make`` for each env.

    Raises:
        UnknownEnvError: ``env_id`` is not registered.
        ValueError: ``num_envs < 1`` or an unknown ``vectorization``.

    Observations are float32 ``(N, *obs_shape)``; discrete actions are int64 ``(N,)``, box
    actions float32 ``(N, *action_shape)`` (clipped to the space's bounds before stepping).
    """

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        vectorization: str = "sync",
        device: str | torch.device = "cpu",
        env_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        check_env_id(env_id)
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        if vectorization not in VECTORIZATION_MODES:
            raise ValueError(
                f"unknown vectorization {vectorization!r}; valid: {', '.join(VECTORIZATION_MODES)}"
            )
        self.env_id = env_id
        self.device = torch.device(device)
        self._vec = gymnasium.make_vec(
            env_id,
            num_envs=num_envs,
            vectorization_mode=vectorization,
            vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP},
            **dict(env_kwargs or {}),
        )
        self._vectorization = vectorization
        self.spec = EnvSpec(
            env_id=env_id,
            observation_space=self._vec.single_observation_space,
            action_space=self._vec.single_action_space,
            num_envs=num_envs,
        )
        self._discrete = isinstance(self.spec.action_space, gymnasium.spaces.Discrete)
        self._episode_return = np.zeros(num_envs, dtype=np.float64)
        self._episode_length = np.zeros(num_envs, dtype=np.int64)
        self._finished_returns: list[float] = []
        self._finished_lengths: list[int] = []
        self._env_steps = 0

    def _obs(self, obs: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(obs, dtype=np.float32), device=self.device)

    def reset(self, seed: int | None = None) -> torch.Tensor:
        """Resets every env; env ``i`` is seeded with ``seed + i``.

        Returns:
            float32 observations ``(N, *obs_shape)``.
        """
        obs, _ = self._vec.reset(seed=seed)
        self._episode_return[:] = 0.0
        self._episode_length[:] = 0
        return self._obs(obs)

    def step(
        self, action: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Steps every env once (see :meth:`msrl.api.Environment.step` for the contract).

        Args:
            action: ``(N,)`` int64 for discrete spaces, ``(N, *action_shape)`` float for boxes.

        Raises:
            ValueError: ``action`` has the wrong leading size.
            FloatingPointError: an observation or reward is NaN or infinite.
        """
        n = self.spec.num_envs
        if action.shape[0] != n:
            raise ValueError(f"action has leading size {action.shape[0]}, expected num_envs={n}")
        act = action.detach().cpu().numpy()
        if not self._discrete:
            space = self.spec.action_space
            act = np.clip(act, space.low, space.high)
        obs, reward, terminated, truncated, info = self._vec.step(act)
        reward = np.asarray(reward, dtype=np.float32)
        if not (np.isfinite(reward).all() and np.isfinite(obs).all()):
            raise FloatingPointError(
                f"env {self.env_id!r} returned a non-finite observation or reward "
                f"at env step {self._env_steps + n}"
            )
        done = np.logical_or(terminated, truncated)
        final_obs = obs
        if done.any():
            final_obs = np.array(obs, dtype=np.float32, copy=True)
            for i in np.flatnonzero(done):
                final_obs[i] = info["final_obs"][i]
        self._env_steps += n
        self._episode_return += reward
        self._episode_length += 1
        if done.any():
            idx = np.flatnonzero(done)
            self._finished_returns.extend(self._episode_return[idx].tolist())
            self._finished_lengths.extend(self._episode_length[idx].tolist())
            self._episode_return[idx] = 0.0
            self._episode_length[idx] = 0
        return (
            self._obs(obs),
            torch.as_tensor(reward, device=self.device),
            torch.as_tensor(np.asarray(terminated, dtype=bool), device=self.device),
            torch.as_tensor(np.asarray(truncated, dtype=bool), device=self.device),
            {"final_obs": self._obs(final_obs)},
        )

    def pop_episode_stats(self) -> EpisodeStats:
        """Returns and forgets the episodes finished since the last call."""
        stats = EpisodeStats(self._finished_returns, self._finished_lengths)
        self._finished_returns, self._finished_lengths = [], []
        return stats

    @property
    def env_steps(self) -> int:
        """Env steps taken so far, summed over the batch."""
        return self._env_steps

    def state_dict(self) -> dict[str, Any]:
        """The envs' full state (pickled sub-envs, RNGs included) and the episode trackers.

        Raises:
            NotImplementedError: for ``vectorization="async"``, whose envs live in subprocesses.
        """
        if self._vectorization != "sync":
            raise NotImplementedError("exact env checkpoints need vectorization='sync'")
        return {
            "envs": pickle.dumps(self._vec.envs),
            "autoreset_envs": self._vec._autoreset_envs.copy(),
            "episode_return": self._episode_return.copy(),
            "episode_length": self._episode_length.copy(),
            "env_steps": self._env_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output into this batch (same id and ``N``).

        Raises:
            ValueError: the saved batch has another size.
        """
        envs = pickle.loads(state["envs"])
        if len(envs) != self.spec.num_envs:
            raise ValueError(f"checkpoint holds {len(envs)} envs, this batch has {self.spec.num_envs}")
        self._vec.envs = envs
        self._vec._autoreset_envs = np.array(state["autoreset_envs"], copy=True)
        self._episode_return = np.array(state["episode_return"], copy=True)
        self._episode_length = np.array(state["episode_length"], copy=True)
        self._env_steps = int(state["env_steps"])

    def close(self) -> None:
        """Closes the vector env."""
        self._vec.close()
