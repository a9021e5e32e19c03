"""The env factory: msrl's native batched envs and gymnasium envs on one of the engines.

Env ids in the ``msrl/`` namespace (``msrl/CartPole-v1``) are native envs; every other id is a
registered gymnasium id (or an engine's own: EnvPool's tasks, ALE games), stepped by the engine
``env.engine`` names (:mod:`msrl.envs.engines`, :data:`ENGINES`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch

from msrl.api import Environment, EnvSpec
from msrl.envs.engines import ENGINES, check_env_id
from msrl.envs.engines import engine as engine_kind
from msrl.envs.native import NATIVE_ENVS, is_native, make_native
from msrl.envs.single_env import UnknownEnvError, check_ale_options, make_single_env

__all__ = ["check_env_id", "make_env", "env_spec", "eval_env_id", "UnknownEnvError", "is_native", "ENGINES"]


def make_env(
    env_id: str,
    num_envs: int,
    device: str | torch.device = "cpu",
    engine: str = "sync",
    env_kwargs: Mapping[str, Any] | None = None,
    wrappers: Sequence[str] = (),
    num_workers: int | None = None,
    native_impl: str = "torch",
) -> Environment:
    """Builds ``num_envs`` envs ``env_id`` on ``device`` (what a fragment backend's
    :meth:`~msrl.runtime.programs.backends.Backend.build_env` calls).

    A native env runs its torch reference (``native_impl="torch"``) or its CUDA C kernels
    (``"kernel"``, the ``cuda_kernel`` backend's choice); a gymnasium env runs on ``engine``
    (:data:`ENGINES`) with ``num_workers`` worker processes for ``process``.

    Raises:
        UnknownEnvError: unknown id.
        ValueError: an unknown engine, or wrappers on a native env.
    """
    kind = engine_kind(engine)
    if kind.spec is not None:  # the engine's own ids (EnvPool's tasks, ALE games)
        problem = kind.wrappers_problem(wrappers)
        if problem is not None:
            raise ValueError(f"env.wrappers: {problem}")
        return kind.make(env_id, num_envs, num_workers, device, env_kwargs, wrappers)
    check_env_id(env_id)
    if is_native(env_id):
        if wrappers:
            raise ValueError(f"env.wrappers apply to gymnasium envs, not the native env {env_id!r}")
        return make_native(env_id, num_envs, device=device, impl=native_impl, **dict(env_kwargs or {}))
    return kind.make(env_id, num_envs, num_workers, device, env_kwargs, wrappers)


def env_spec(env_id: str, num_envs: int, env_kwargs: Mapping[str, Any] | None = None,
             wrappers: Sequence[str] = (), engine: str = "sync") -> EnvSpec:
    """The :class:`~msrl.api.EnvSpec` of a batch of ``num_envs`` envs ``env_id``: single-env
    (single-agent) spaces, and the agents per env.

    Raises:
        UnknownEnvError: unknown id (an EnvPool task id with ``engine="envpool"``, an ALE v5 id
            with ``"ale_vector"``).
        EnvKwargsError: an ``env_kwargs`` key ``ale_vector`` does not take, or an ALE option
            outside its range (:func:`~msrl.envs.single_env.check_ale_options`).
    """
    check_ale_options(env_id, env_kwargs)  # (every engine: ale-py itself takes any value)
    kind = engine_kind(engine)
    if kind.spec is not None:
        return kind.spec(env_id, num_envs, env_kwargs)
    check_env_id(env_id)
    if is_native(env_id):
        spec = make_native(env_id, 1, impl="torch", **dict(env_kwargs or {})).spec
        return dataclasses.replace(spec, num_envs=num_envs)
    from msrl.envs.gymnasium_env import env_spec_of

    env = make_single_env(env_id, env_kwargs, wrappers)
    try:
        return env_spec_of(env, env_id, num_envs)
    finally:
        env.close()


def eval_env_id(env_id: str) -> str | None:
    """The gymnasium env a policy trained on ``env_id`` is evaluated on: a native env's
    gymnasium counterpart (``msrl/CartPole-v1`` -> ``CartPole-v1``; ``None`` if it has none,
    like Tag), a PettingZoo turn-based game ``None`` (the policy plays every seat: the training
    curves tell), else ``env_id`` (a PettingZoo parallel env is evaluated with every agent acting
    and its team return, the agents' rewards summed)."""
    from msrl.envs.pettingzoo_env import check_pettingzoo_id, is_pettingzoo

    if is_native(env_id):
        return NATIVE_ENVS[env_id].GYMNASIUM_ID
    if is_pettingzoo(env_id) and not callable(getattr(check_pettingzoo_id(env_id), "parallel_env", None)):
        return None
    return env_id
