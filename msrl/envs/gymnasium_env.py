"""Gymnasium adapter: any registered gymnasium env id as a batched :class:`~msrl.api.Environment`
stepped in the caller's process (``env.engine: sync``).

The batch is a list of :func:`~msrl.envs.single_env.make_single_env` envs stepped in order with
gymnasium's same-step autoreset (the ``SAME_STEP`` mode of its vector envs): the observation
returned for a finished env is the first of its next episode and the finished episode's last
observation is ``info["final_obs"]``. The step itself is the env engine's worker's
(:func:`msrl.envs._worker.step_into`), so ``sync`` and ``process`` cannot drift apart.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import gymnasium
import numpy as np
import torch

from msrl.api import Environment, EnvSpec, EpisodeStats
from msrl.envs.single_env import UnknownEnvError, check_env_id, make_single_env
from msrl.envs.state import dump_env, load_env

__all__ = ["GymnasiumEnv", "TrackedEnvironment", "UnknownEnvError", "check_env_id", "EpisodeTracker", "obs_dtype",
           "env_spec_of"]


def obs_dtype(space: gymnasium.Space) -> torch.dtype:
    """The dtype observations of ``space`` are returned in: uint8 for uint8 boxes (Atari frames
    stay bytes until the network), float32 otherwise."""
    return torch.uint8 if isinstance(space, gymnasium.spaces.Box) and space.dtype == np.uint8 else torch.float32


def env_spec_of(env: gymnasium.Env, env_id: str, num_envs: int) -> EnvSpec:
    """The :class:`~msrl.api.EnvSpec` of a batch of ``num_envs`` copies of ``env``: a PettingZoo
    env's (:class:`~msrl.envs.pettingzoo_env.AgentStackedEnv`) spaces are one agent's, with its
    agent count; a Dict-observation env's is its ``Dict`` (its observations come packed:
    :class:`~msrl.envs.dict_obs.PackDictObservation`)."""
    from msrl.envs.pettingzoo_env import AgentStackedEnv

    if isinstance(env, AgentStackedEnv):
        return EnvSpec(env_id, env.agent_observation_space, env.agent_action_space, num_envs, len(env.agents))
    # a packed Dict observation (PackDictObservation): the spec names the env's own Dict space
    return EnvSpec(env_id, getattr(env, "dict_space", env.observation_space), env.action_space, num_envs)


class EpisodeTracker:
    """Per-env running returns and lengths of a batch; finished episodes collect until popped.

    Args:
        num_envs: ``N``.
    """

    def __init__(self, num_envs: int) -> None:
        self.episode_return = np.zeros(num_envs, dtype=np.float64)
        self.episode_length = np.zeros(num_envs, dtype=np.int64)
        self.returns: list[float] = []
        self.lengths: list[int] = []
        self.lost = 0

    def update(self, rows: np.ndarray, reward: np.ndarray, done: np.ndarray) -> None:
        """Adds one step of envs ``rows`` (int ``(B,)``): rewards ``(B,)`` float, done ``(B,)`` bool."""
        self.episode_return[rows] += reward
        self.episode_length[rows] += 1
        if done.any():
            idx = rows[done]
            self.returns.extend(self.episode_return[idx].tolist())
            self.lengths.extend(self.episode_length[idx].tolist())
            self.episode_return[idx] = 0.0
            self.episode_length[idx] = 0

    def lose(self, rows: np.ndarray) -> None:
        """Envs ``rows`` lost their episodes (their worker died): counted, not returned."""
        self.lost += len(rows)
        self.episode_return[rows] = 0.0
        self.episode_length[rows] = 0

    def reset(self) -> None:
        """Every env starts a new episode."""
        self.episode_return[:] = 0.0
        self.episode_length[:] = 0

    def pop(self) -> EpisodeStats:
        """The episodes finished (and lost) since the last call."""
        out = EpisodeStats(self.returns, self.lengths, lost=self.lost)
        self.returns, self.lengths, self.lost = [], [], 0
        return out

    def state_dict(self) -> dict[str, Any]:
        """The running returns and lengths."""
        return {"episode_return": self.episode_return.copy(), "episode_length": self.episode_length.copy()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output."""
        self.episode_return = np.array(state["episode_return"], dtype=np.float64, copy=True)
        self.episode_length = np.array(state["episode_length"], dtype=np.int64, copy=True)


class TrackedEnvironment(Environment):
    """An :class:`~msrl.api.Environment` whose episodes an :class:`EpisodeTracker` (``_tracker``)
    records and whose steps ``_env_steps`` counts; subclasses update both in ``step``."""

    _tracker: EpisodeTracker
    _env_steps: int

    def pop_episode_stats(self) -> EpisodeStats:
        """Returns and forgets the episodes finished (and lost) since the last call."""
        return self._tracker.pop()

    @property
    def env_steps(self) -> int:
        """Env steps taken so far, summed over the batch."""
        return self._env_steps


class GymnasiumEnv(TrackedEnvironment):
    """``N`` copies of a gymnasium env (or of a PettingZoo env, agent-stacked), stepped one after
    another in this process, on torch tensors (``env.engine: sync``).

    Args:
        env_id: a registered gymnasium id (``"CartPole-v1"``) or ``pettingzoo/<module>``.
        num_envs: ``N``, the batch size; >= 1.
        device: where returned tensors live.
        env_kwargs: passed to ``gymnasium.make`` (or ``parallel_env``) for each env.
        wrappers: msrl's named wrappers (:data:`msrl.envs.single_env.WRAPPERS`), e.g. ``["atari"]``.

    Raises:
        UnknownEnvError: ``env_id`` is not registered.
        ValueError: ``num_envs < 1`` or an unknown wrapper.

    Observations are ``(N, *obs_shape)`` (multi-agent: ``(N, A, *obs_shape)``), float32 (uint8
    for uint8 boxes: :func:`obs_dtype`); discrete actions are int64 ``(N,)`` (``(N, A)``), box
    actions float32 ``(N, *action_shape)``, clipped to the space's bounds before stepping;
    rewards ``(N,)`` (``(N, A)``). Env ``i`` steps exactly as in :class:`~msrl.envs.engine.ProcessEnv`
    (same-step autoreset, seeds ``seed + i``), one after another.
    """

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        device: str | torch.device = "cpu",
        env_kwargs: Mapping[str, Any] | None = None,
        wrappers: Sequence[str] = (),
    ) -> None:
        from msrl.envs._worker import step_into

        check_env_id(env_id)
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.env_id = env_id
        self.device = torch.device(device)
        self.envs = [make_single_env(env_id, env_kwargs, wrappers) for _ in range(num_envs)]
        env = self.envs[0]
        self.spec = env_spec_of(env, env_id, num_envs)
        self._action_space = env.action_space
        self._discrete = isinstance(env.action_space, gymnasium.spaces.Discrete)
        self._dtype = obs_dtype(env.observation_space)
        agents = () if self.spec.num_agents == 1 else (self.spec.num_agents,)
        obs_shape, obs_np = env.observation_space.shape, env.observation_space.dtype
        self._a = {
            "obs": np.zeros((num_envs, *obs_shape), obs_np), "final_obs": np.zeros((num_envs, *obs_shape), obs_np),
            "action": np.zeros((num_envs, *env.action_space.shape),
                               np.float32 if isinstance(env.action_space, gymnasium.spaces.Box) else np.int64),
            "reward": np.zeros((num_envs, *agents)), "terminated": np.zeros(num_envs, bool),
            "truncated": np.zeros(num_envs, bool),
        }
        self._step_into = step_into
        self._tracker = EpisodeTracker(num_envs)
        self._rows = np.arange(num_envs)
        self._env_steps = 0

    def _obs(self, obs: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(obs, copy=True)).to(device=self.device, dtype=self._dtype)

    def reset(self, seed: int | None = None) -> torch.Tensor:
        """Resets every env; env ``i`` is seeded with ``seed + i``.

        Returns:
            observations ``(N, *obs_shape)``.
        """
        for i, env in enumerate(self.envs):
            self._a["obs"][i], _ = env.reset(seed=None if seed is None else seed + i)
        self._tracker.reset()
        return self._obs(self._a["obs"])

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
        n, a = self.spec.num_envs, self._a
        if action.shape[0] != n:
            raise ValueError(f"action has leading size {action.shape[0]}, expected num_envs={n}")
        act = action.detach().cpu().numpy()
        if isinstance(self._action_space, gymnasium.spaces.Box):
            act = np.clip(act, self._action_space.low, self._action_space.high)
        a["action"][:] = act
        for i, env in enumerate(self.envs):
            self._step_into(env, i, a, self._discrete)
        obs, reward = a["obs"], a["reward"]
        if not (np.isfinite(reward).all() and (obs.dtype == np.uint8 or np.isfinite(obs).all())):
            raise FloatingPointError(
                f"env {self.env_id!r} returned a non-finite observation or reward "
                f"at env step {self._env_steps + n}"
            )
        done = a["terminated"] | a["truncated"]
        final = obs.copy()
        final[done] = a["final_obs"][done]
        self._env_steps += n
        self._tracker.update(self._rows, reward if reward.ndim == 1 else reward.sum(1), done)
        return (
            self._obs(obs),
            torch.from_numpy(reward.astype(np.float32)).to(self.device),
            torch.from_numpy(a["terminated"].copy()).to(self.device),
            torch.from_numpy(a["truncated"].copy()).to(self.device),
            {"final_obs": self._obs(final)},
        )

    def state_dict(self) -> dict[str, Any]:
        """Every env's exact snapshot (:func:`msrl.envs.state.dump_env`: simulator state and RNGs
        included) and the episode trackers.

        Raises:
            EnvStateError: an env that cannot be snapshotted.
        """
        shared: dict[str, bytes] = {}
        envs = [dump_env(e, shared) for e in self.envs]
        return {"envs": envs, "shared": shared, "env_steps": self._env_steps, **self._tracker.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output into this batch (same id and ``N``).

        Raises:
            ValueError: the saved batch has another size.
            EnvStateError: a damaged snapshot.
        """
        if len(state["envs"]) != self.spec.num_envs:
            raise ValueError(f"checkpoint holds {len(state['envs'])} envs, this batch has {self.spec.num_envs}")
        envs = [load_env(b, state["shared"]) for b in state["envs"]]
        for e in self.envs:
            e.close()
        self.envs = envs
        self._tracker.load_state_dict(state)
        self._env_steps = int(state["env_steps"])

    def close(self) -> None:
        """Closes the envs."""
        for e in self.envs:
            e.close()
