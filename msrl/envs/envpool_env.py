"""EnvPool (Weng et al. 2022) as an env source: ``env.engine: envpool``.

EnvPool's C++ thread pool steps its own implementations of the tasks (``HalfCheetah-v5``,
``Pong-v5``, ...; ids from ``envpool.list_all_envs()``). Its gymnasium API resets a finished env
on the *next* step; :class:`EnvPoolEnv` keeps msrl's same-step contract instead: after a step,
the finished envs are reset at once (``reset(env_ids)``), their rows of the observation become
the new episodes' first observations and ``info["final_obs"]`` keeps the last ones.

EnvPool cannot save or restore its envs: a checkpoint holds the episode counters only, and a
resumed run's envs start fresh episodes, which :meth:`EnvPoolEnv.load_state_dict` says on
stderr. For exact checkpoints use ``env.engine: process``.
"""

from __future__ import annotations

import difflib
import sys
from typing import Any, Mapping

import gymnasium
import numpy as np
import torch

from msrl.api import EnvSpec
from msrl.envs.gymnasium_env import EpisodeTracker, TrackedEnvironment, obs_dtype
from msrl.envs.single_env import UnknownEnvError

__all__ = ["EnvPoolEnv", "check_envpool_id", "envpool_spec"]


def _envpool() -> Any:
    try:
        import envpool
    except ImportError:
        raise UnknownEnvError("env.engine=envpool needs envpool: pip install envpool") from None
    return envpool


def check_envpool_id(env_id: str) -> None:
    """Checks that EnvPool has task ``env_id``.

    Raises:
        UnknownEnvError: envpool missing, or an unknown task (naming close ones).
    """
    known = _envpool().list_all_envs()
    if env_id not in known:
        close = difflib.get_close_matches(env_id, known, n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownEnvError(f"envpool has no task {env_id!r}.{hint} (envpool.list_all_envs() lists its tasks)")


def envpool_spec(env_id: str, num_envs: int, env_kwargs: Mapping[str, Any] | None = None) -> EnvSpec:
    """The :class:`~msrl.api.EnvSpec` of ``num_envs`` EnvPool envs ``env_id``."""
    check_envpool_id(env_id)
    env = _envpool().make(env_id, env_type="gymnasium", num_envs=1, **dict(env_kwargs or {}))
    try:
        return EnvSpec(env_id, env.observation_space, env.action_space, num_envs)
    finally:
        env.close()


class EnvPoolEnv(TrackedEnvironment):
    """``N`` EnvPool envs on EnvPool's thread pool, with same-step autoreset.

    Args:
        env_id: an EnvPool task id.
        num_envs: ``N`` >= 1.
        num_threads: EnvPool's threads (default: EnvPool's, one per CPU).
        device: where returned tensors live.
        env_kwargs: ``envpool.make`` kwargs (e.g. ``episodic_life``, ``reward_clip`` for Atari).

    Raises:
        UnknownEnvError: envpool missing or an unknown task.
        ValueError: ``num_envs < 1``.

    Env ``i`` is seeded ``seed + i`` (EnvPool's own seeding); :meth:`reset` with another seed
    than the pool's builds a new pool.
    """

    def __init__(self, env_id: str, num_envs: int, num_threads: int | None = None, device: str | torch.device = "cpu",
                 env_kwargs: Mapping[str, Any] | None = None) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        check_envpool_id(env_id)
        self.env_id, self.device = env_id, torch.device(device)
        self._kwargs = dict(env_kwargs or {})
        self._threads = num_threads
        self._pool: Any = None
        self._seed: int | None = None
        self.spec = envpool_spec(env_id, num_envs, self._kwargs)
        self._box = isinstance(self.spec.action_space, gymnasium.spaces.Box)
        self._dtype = obs_dtype(self.spec.observation_space)
        self._tracker = EpisodeTracker(num_envs)
        self._rows = np.arange(num_envs)
        self._env_steps = 0

    def _make(self, seed: int) -> None:
        if self._pool is not None:
            self._pool.close()
        extra = {} if self._threads is None else {"num_threads": self._threads}
        self._pool = _envpool().make(self.env_id, env_type="gymnasium", num_envs=self.spec.num_envs, seed=seed,
                                     **extra, **self._kwargs)
        self._seed = seed

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=self.device, dtype=self._dtype)

    def reset(self, seed: int | None = None) -> torch.Tensor:
        """Resets every env (a new pool when ``seed`` is not the pool's).

        Returns:
            observations ``(N, *obs_shape)``.
        """
        if self._pool is None or (seed is not None and seed != self._seed):
            self._make(0 if seed is None else int(seed))
        obs, _ = self._pool.reset()
        self._tracker.reset()
        return self._tensor(obs)

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Steps every env once (the :class:`~msrl.api.Environment` contract, same-step autoreset).

        Raises:
            ValueError: ``action`` has the wrong leading size.
            RuntimeError: :meth:`reset` was not called.
            FloatingPointError: a non-finite observation or reward.
        """
        n = self.spec.num_envs
        if action.shape[0] != n:
            raise ValueError(f"action has leading size {action.shape[0]}, expected num_envs={n}")
        if self._pool is None:
            raise RuntimeError("call reset() before step()")
        act = action.detach().cpu().numpy()
        if self._box:
            act = np.clip(act, self.spec.action_space.low, self.spec.action_space.high).astype(np.float32)
        obs, reward, terminated, truncated, info = self._pool.step(act)
        order = np.argsort(info["env_id"])  # rows in env order
        obs, reward = obs[order], np.asarray(reward, dtype=np.float64)[order]
        terminated, truncated = np.asarray(terminated, bool)[order], np.asarray(truncated, bool)[order]
        if not (np.isfinite(reward).all() and (obs.dtype == np.uint8 or np.isfinite(obs).all())):
            raise FloatingPointError(f"env {self.env_id!r} returned a non-finite observation or reward "
                                     f"at env step {self._env_steps + n}")
        done = terminated | truncated
        final = obs
        if done.any():
            ids = np.flatnonzero(done)
            first, reset_info = self._pool.reset(ids)
            obs = obs.copy()
            obs[np.asarray(reset_info["env_id"])] = first
        self._env_steps += n
        self._tracker.update(self._rows, reward, done)
        return (self._tensor(obs), torch.from_numpy(reward.astype(np.float32)).to(self.device),
                torch.from_numpy(terminated).to(self.device), torch.from_numpy(truncated).to(self.device),
                {"final_obs": self._tensor(final)})


    def state_dict(self) -> dict[str, Any]:
        """The step count and seed only: EnvPool cannot snapshot its envs (``exact: False``)."""
        return {"exact": False, "seed": self._seed, "env_steps": self._env_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the step count; the envs start fresh episodes (said on stderr)."""
        self._env_steps = int(state["env_steps"])
        self._make(int(state["seed"] or 0) + self._env_steps)  # a new seed: not the first episodes again
        self._pool.reset()
        self._tracker.reset()
        print(f"msrl: env.engine=envpool cannot restore its envs' state; the {self.spec.num_envs} envs of "
              f"{self.env_id!r} start fresh episodes (use env.engine=process for exact checkpoints)", file=sys.stderr)

    def close(self) -> None:
        """Closes the pool."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
