"""Deterministic evaluation of an actor on fresh envs."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from msrl.api import Actor
from msrl.envs.gymnasium_env import GymnasiumEnv

__all__ = ["evaluate"]


@torch.no_grad()
def evaluate(
    actor: Actor,
    env_id: str,
    episodes: int,
    seed: int,
    env_kwargs: Mapping[str, Any] | None = None,
    device: str | torch.device = "cpu",
    wrappers: Sequence[str] = (),
) -> list[float]:
    """Runs ``episodes`` episodes, one per env of a batch, with ``actor.act(obs, deterministic=True)``.

    Args:
        actor: an actor whose ``act`` returns an action ``(N, ...)`` or a tuple whose first
            item is the action.
        env_id: gymnasium id; ``env_kwargs``: for ``gymnasium.make``; ``wrappers``: msrl's
            named wrappers, as in training.
        episodes: number of episodes (= envs in the batch), >= 1.
        seed: env ``i`` is seeded with ``seed + i``.

    Returns:
        the undiscounted return of each episode, in env order.

    Raises:
        UnknownEnvError: unknown ``env_id``.
    """
    env = GymnasiumEnv(env_id, episodes, device, env_kwargs, wrappers)
    try:
        obs = env.reset(seed=seed)
        returns = np.zeros(episodes)
        finished = np.zeros(episodes, dtype=bool)
        while not finished.all():
            out = actor.act(obs, deterministic=True)
            action = out[0] if isinstance(out, tuple) else out
            obs, reward, terminated, truncated, _ = env.step(action)
            returns += np.where(finished, 0.0, reward.cpu().numpy())
            finished |= (terminated | truncated).cpu().numpy()
        return returns.tolist()
    finally:
        env.close()
