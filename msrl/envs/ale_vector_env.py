"""ale-py's own vector env as an env source: ``env.engine: ale_vector`` (ale-py >= 0.10).

ale-py's :class:`ale_py.vector_env.AtariVectorEnv` steps ``N`` ALE games on a C++ thread pool
and does the standard Atari preprocessing itself, in C++: up to 30 no-ops at reset, 4 frames per
action with the max of the last two, 84x84 grayscale frames, the last 4 stacked -- what msrl's
``atari`` wrapper does with gymnasium's ``AtariPreprocessing`` and ``FrameStackObservation`` in
Python (Mnih et al. 2015, Methods; Machado et al. 2018). So the engine takes ``ALE/<Game>-v5``
ids with ``env.wrappers: [atari]`` only, and its observations are the wrapper's: ``(N, 4, 84,
84)`` uint8. Its ``SameStep`` autoreset is msrl's contract: a finished env's row of the
observation is its next episode's first, ``info["final_obs"]`` keeps the last one.

What the ``-v5`` id means is kept: sticky actions at ``repeat_action_probability`` 0.25, the
minimal action set, at most 108,000 frames an episode; no reward clipping, no life-loss
episodes, no FIRE at reset (the ``atari`` wrapper does none of these; an algorithm clips rewards
itself where it wants to). ``env.kwargs`` may set ``repeat_action_probability``,
``full_action_space`` and ``max_num_frames_per_episode``.

Like EnvPool, ale-py's pool cannot save or restore its envs: a checkpoint holds the step count
only, and a resumed run's envs start fresh episodes (said on stderr). For exact checkpoints use
``env.engine: process``.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Mapping

import gymnasium
import numpy as np
import torch

from msrl.api import EnvSpec
from msrl.envs.gymnasium_env import EpisodeTracker, TrackedEnvironment
from msrl.envs.single_env import EnvKwargsError, UnknownEnvError

__all__ = ["AleVectorEnv", "ale_vector_spec", "ale_game", "ALE_VECTOR_KWARGS"]

#: ``env.kwargs`` the engine takes (an ALE ``-v5`` id's options), with the ``-v5`` defaults
ALE_VECTOR_KWARGS = {"repeat_action_probability": 0.25, "full_action_space": False,
                     "max_num_frames_per_episode": 108_000}
_ID = re.compile(r"^ALE/([A-Za-z0-9]+)-v5$")


def _vector_env() -> Any:
    try:
        from ale_py.vector_env import AtariVectorEnv
    except ImportError:
        raise UnknownEnvError("env.engine=ale_vector needs ale-py >= 0.10 with its vector env: "
                              "pip install -e '.[atari]'") from None
    return AtariVectorEnv


def ale_game(env_id: str) -> str:
    """The ale-py ROM name of ``ALE/<Game>-v5`` (``ALE/SpaceInvaders-v5`` -> ``space_invaders``).

    Raises:
        UnknownEnvError: not an ``ALE/<Game>-v5`` id, or a game ale-py has no ROM for (naming
            close ones).
    """
    import difflib

    m = _ID.match(env_id)
    if m is None:
        raise UnknownEnvError(f"env.engine=ale_vector steps ALE games by their v5 ids (ALE/<Game>-v5, e.g. "
                              f"ALE/Pong-v5), not {env_id!r}")
    _vector_env()
    from ale_py import roms

    game = re.sub(r"(?<!^)(?=[A-Z])", "_", m.group(1)).lower()
    known = roms.get_all_rom_ids()
    if game not in known:
        close = difflib.get_close_matches(game, known, n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownEnvError(f"ale-py has no ROM for {env_id!r} (game {game!r}).{hint}")
    return game


def _options(env_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    extra = sorted(set(env_kwargs or {}) - set(ALE_VECTOR_KWARGS))
    if extra:
        raise EnvKwargsError(f"env.kwargs {extra} are not options of env.engine=ale_vector; it takes "
                         f"{', '.join(ALE_VECTOR_KWARGS)}")
    return {**ALE_VECTOR_KWARGS, **dict(env_kwargs or {})}


def _make(game: str, num_envs: int, options: Mapping[str, Any], num_threads: int | None) -> Any:
    """An ``AtariVectorEnv`` doing the ``atari`` wrapper's preprocessing, ``SameStep`` autoreset."""
    return _vector_env()(game, num_envs, num_threads=num_threads or 0, autoreset_mode="SameStep",
                         img_height=84, img_width=84, grayscale=True, stack_num=4, frameskip=4, maxpool=True,
                         noop_max=30, episodic_life=False, reward_clipping=False, use_fire_reset=False,
                         **options)


def ale_vector_spec(env_id: str, num_envs: int, env_kwargs: Mapping[str, Any] | None = None) -> EnvSpec:
    """The :class:`~msrl.api.EnvSpec` of ``num_envs`` envs ``env_id`` on ale-py's vector env:
    observations ``(4, 84, 84)`` uint8, ``Discrete`` actions.

    Raises:
        UnknownEnvError: not an ALE v5 id, ale-py missing, or no such ROM.
        EnvKwargsError: an ``env.kwargs`` key the engine does not take.
    """
    env = _make(ale_game(env_id), 1, _options(env_kwargs), 1)
    try:
        return EnvSpec(env_id, env.single_observation_space, env.single_action_space, num_envs)
    finally:
        env.close()


class AleVectorEnv(TrackedEnvironment):
    """``N`` ALE games on ale-py's C++ thread pool, preprocessed there, same-step autoreset.

    Args:
        env_id: ``ALE/<Game>-v5``.
        num_envs: ``N`` >= 1.
        num_threads: the pool's threads (``env.num_workers``; default: ale-py's, one per CPU).
        device: where returned tensors live.
        env_kwargs: :data:`ALE_VECTOR_KWARGS` keys.

    Observations are ``(N, 4, 84, 84)`` uint8 (never widened here: the network scales them),
    actions int64 ``(N,)``, rewards float32 ``(N,)``. :meth:`reset` with a seed seeds env ``i``
    as ale-py does (from the one seed).

    Raises:
        UnknownEnvError: as :func:`ale_game`.
        EnvKwargsError: an unknown ``env_kwargs`` key.
        ValueError: ``num_envs < 1``.
    """

    def __init__(self, env_id: str, num_envs: int, num_threads: int | None = None, device: str | torch.device = "cpu",
                 env_kwargs: Mapping[str, Any] | None = None) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.env_id, self.device = env_id, torch.device(device)
        self._options = _options(env_kwargs)
        self._game = ale_game(env_id)
        self._vec = _make(self._game, num_envs, self._options, num_threads)
        self.spec = EnvSpec(env_id, self._vec.single_observation_space, self._vec.single_action_space, num_envs)
        if not isinstance(self.spec.action_space, gymnasium.spaces.Discrete):
            raise ValueError(f"env.engine=ale_vector: {env_id} has {self.spec.action_space} actions, not Discrete")
        self._seed: int | None = None
        self._started = False
        self._tracker = EpisodeTracker(num_envs)
        self._rows = np.arange(num_envs)
        self._env_steps = 0

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def reset(self, seed: int | None = None) -> torch.Tensor:
        """Resets every env (seeded from ``seed`` when given).

        Returns:
            observations ``(N, 4, 84, 84)`` uint8.
        """
        obs, info = self._vec.reset(seed=None if seed is None else int(seed))
        self._seed = self._seed if seed is None else int(seed)
        self._started = True
        self._tracker.reset()
        return self._tensor(obs[np.argsort(info["env_id"])])

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Steps every env once (the :class:`~msrl.api.Environment` contract, same-step autoreset).

        Returns:
            ``(obs, reward, terminated, truncated, {"final_obs": ...})``: ``(N, 4, 84, 84)`` uint8,
            ``(N,)`` float32, ``(N,)`` bool, ``(N,)`` bool; ``final_obs`` is ``obs`` with the
            finished envs' rows their episodes' last observations.

        Raises:
            ValueError: ``action`` has the wrong leading size.
            RuntimeError: :meth:`reset` was not called.
            FloatingPointError: a non-finite reward.
        """
        n = self.spec.num_envs
        if action.shape[0] != n:
            raise ValueError(f"action has leading size {action.shape[0]}, expected num_envs={n}")
        if not self._started:
            raise RuntimeError("call reset() before step()")
        obs, reward, terminated, truncated, info = self._vec.step(action.detach().cpu().numpy().astype(np.int64))
        order = np.argsort(info["env_id"])  # rows in env order
        obs, reward = obs[order], np.asarray(reward, dtype=np.float64)[order]
        terminated, truncated = np.asarray(terminated, bool)[order], np.asarray(truncated, bool)[order]
        if not np.isfinite(reward).all():
            raise FloatingPointError(f"env {self.env_id!r} returned a non-finite reward at env step {self._env_steps + n}")
        done = terminated | truncated
        final = obs
        if done.any():
            final = obs.copy()
            final[done] = np.asarray(info["final_obs"])[order][done]
        self._env_steps += n
        self._tracker.update(self._rows, reward, done)
        return (self._tensor(obs), torch.from_numpy(reward.astype(np.float32)).to(self.device),
                torch.from_numpy(terminated).to(self.device), torch.from_numpy(truncated).to(self.device),
                {"final_obs": self._tensor(final)})

    def state_dict(self) -> dict[str, Any]:
        """The step count and seed only: ale-py's pool cannot snapshot its envs (``exact: False``)."""
        return {"exact": False, "seed": self._seed, "env_steps": self._env_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the step count; the envs start fresh episodes (said on stderr)."""
        self._env_steps = int(state["env_steps"])
        self.reset(int(state["seed"] or 0) + self._env_steps)  # a new seed: not the first episodes again
        print(f"msrl: env.engine=ale_vector cannot restore its envs' state; the {self.spec.num_envs} envs of "
              f"{self.env_id!r} start fresh episodes (use env.engine=process for exact checkpoints)", file=sys.stderr)

    def close(self) -> None:
        """Closes the pool."""
        if self._vec is not None:
            self._vec.close()
            self._vec = None
