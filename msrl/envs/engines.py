"""The env engines in one table: everything msrl does differently by ``env.engine``, as one
:class:`EngineKind` per engine (the way backends are hooks, not names). No module outside
``msrl/envs/`` compares engine names (``tests/test_code_layout.py``); each asks the table.

===============  ==========================================  ==================================
engine           steps                                       module
===============  ==========================================  ==================================
``sync``         gymnasium envs one after another in the     :mod:`msrl.envs.gymnasium_env`
                 actor's process (and msrl's native envs)
``process``      gymnasium envs in worker processes over     :mod:`msrl.envs.engine`
                 shared memory
``envpool``      EnvPool's own tasks on its thread pool      :mod:`msrl.envs.envpool_env`
``ale_vector``   ALE games on ale-py's C++ vector env        :mod:`msrl.envs.ale_vector_env`
===============  ==========================================  ==================================

Adding an engine is its module and one entry of :data:`ENGINE_KINDS`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

__all__ = ["EngineKind", "ENGINE_KINDS", "ENGINES", "engine", "check_env_id"]


def check_env_id(env_id: str) -> None:
    """Checks that ``env_id`` is a native env or a registered gymnasium env (the ids of the
    ``sync`` and ``process`` engines).

    Raises:
        UnknownEnvError: naming close gymnasium ids, the native ids and every gymnasium id.
    """
    from msrl.envs.native import NATIVE_ENVS, is_native
    from msrl.envs.single_env import UnknownEnvError
    from msrl.envs.single_env import check_env_id as check_gymnasium_id

    if is_native(env_id):
        return
    if env_id.startswith("msrl/"):
        raise UnknownEnvError(f"unknown native env id {env_id!r}; native envs: {', '.join(NATIVE_ENVS)}")
    try:
        check_gymnasium_id(env_id)
    except UnknownEnvError as e:
        raise UnknownEnvError(f"{e}; native envs: {', '.join(NATIVE_ENVS)}") from None


def _envpool_id(env_id: str) -> None:
    from msrl.envs.envpool_env import check_envpool_id

    check_envpool_id(env_id)


def _ale_id(env_id: str) -> None:
    from msrl.envs.ale_vector_env import ale_game

    ale_game(env_id)


def _any_wrappers(wrappers: Sequence[str]) -> str | None:
    return None


def _no_wrappers(wrappers: Sequence[str]) -> str | None:
    return "they apply to gymnasium envs; EnvPool's tasks take their options as env.kwargs" if wrappers else None


def _atari_only(wrappers: Sequence[str]) -> str | None:
    if list(wrappers) != ["atari"]:
        return (f"env.engine=ale_vector does the atari preprocessing itself, in C++: set env.wrappers: [atari] "
                f"(got {list(wrappers)})")
    return None


def _reset_padding_with_atari(wrappers: Sequence[str]) -> str | None:
    return "reset" if "atari" in wrappers else None


def _as_trained(env_id: str, kwargs: Mapping[str, Any], wrappers: Sequence[str]) -> tuple[str | None, dict, list]:
    return env_id, dict(kwargs), list(wrappers)


def _envpool_twin(env_id: str, kwargs: Mapping[str, Any], wrappers: Sequence[str]) -> tuple[str | None, dict, list]:
    """EnvPool's kwargs are not gymnasium's, and its ids may not be gymnasium ids."""
    from msrl.envs.single_env import UnknownEnvError, check_env_id

    try:
        check_env_id(env_id)
    except UnknownEnvError:
        return None, {}, []
    return env_id, {}, []


def _make_gymnasium(env_id: str, num_envs: int, num_workers: int | None, device: Any, kwargs: Any,
                    wrappers: Sequence[str]) -> Any:
    from msrl.envs.gymnasium_env import GymnasiumEnv

    return GymnasiumEnv(env_id, num_envs, device, kwargs, wrappers)


def _make_process(env_id: str, num_envs: int, num_workers: int | None, device: Any, kwargs: Any,
                  wrappers: Sequence[str]) -> Any:
    from msrl.envs.engine import ProcessEnv

    return ProcessEnv(env_id, num_envs, num_workers, device, kwargs, wrappers)


def _make_envpool(env_id: str, num_envs: int, num_workers: int | None, device: Any, kwargs: Any,
                  wrappers: Sequence[str]) -> Any:
    from msrl.envs.envpool_env import EnvPoolEnv

    return EnvPoolEnv(env_id, num_envs, num_workers, device, kwargs)


def _make_ale(env_id: str, num_envs: int, num_workers: int | None, device: Any, kwargs: Any,
              wrappers: Sequence[str]) -> Any:
    from msrl.envs.ale_vector_env import AleVectorEnv

    return AleVectorEnv(env_id, num_envs, num_workers, device, kwargs)


def _envpool_spec(env_id: str, num_envs: int, kwargs: Any) -> Any:
    from msrl.envs.envpool_env import envpool_spec

    return envpool_spec(env_id, num_envs, kwargs)


def _ale_spec(env_id: str, num_envs: int, kwargs: Any) -> Any:
    from msrl.envs.ale_vector_env import ale_vector_spec

    return ale_vector_spec(env_id, num_envs, kwargs)


@dataclasses.dataclass(frozen=True)
class EngineKind:
    """One value of ``env.engine`` and what msrl does differently for it.

    Attributes:
        name: the value of ``env.engine``.
        check_id: raises :class:`~msrl.envs.single_env.UnknownEnvError` for an id the engine cannot
            step (naming what it can).
        wrappers_problem: what is wrong with ``env.wrappers`` on this engine (``None``: nothing).
        make: ``make(env_id, num_envs, num_workers, device, env_kwargs, wrappers)`` -> the
            batched :class:`~msrl.api.Environment` of a gymnasium-side id.
        spec: ``spec(env_id, num_envs, env_kwargs)`` -> its :class:`~msrl.api.EnvSpec`, for an
            engine whose ids are its own (``None``: gymnasium's spaces of one env).
        frame_padding: how an episode's first frame stack is filled, given the wrappers
            (``"zeros"``, ``"reset"``; ``None``: values cross whole; :mod:`msrl.runtime.frame_stacks`).
        evaluation: ``evaluation(env_id, env_kwargs, wrappers)`` -> the gymnasium env id
            (``None``: none), ``gymnasium.make`` kwargs and wrappers evaluations run on.
        gymnasium_ids: its ids are gymnasium ids (an evaluation twin exists without
            ``eval.env_id``).
        steps_native: it steps msrl's native batched envs too.
        workers: it takes ``env.num_workers`` (worker processes or threads).
        in_worker_processes: the engine that steps the same envs in worker processes (the
            ``cpu_process_group`` backend's; ``None``: none).
        loses_episodes: a worker's death loses the episodes in flight, counted as
            ``faults/lost_episodes`` where the job does not restart replicas.
    """

    name: str
    check_id: Callable[[str], None]
    wrappers_problem: Callable[[Sequence[str]], str | None]
    make: Callable[..., Any]
    spec: Callable[[str, int, Any], Any] | None
    frame_padding: Callable[[Sequence[str]], str | None]
    evaluation: Callable[[str, Mapping[str, Any], Sequence[str]], tuple[str | None, dict, list]]
    gymnasium_ids: bool
    steps_native: bool
    workers: bool
    in_worker_processes: str | None
    loses_episodes: bool


#: every engine, by ``env.engine``
ENGINE_KINDS: dict[str, EngineKind] = {k.name: k for k in (
    EngineKind("sync", check_env_id, _any_wrappers, _make_gymnasium, None, _reset_padding_with_atari, _as_trained,
               gymnasium_ids=True, steps_native=True, workers=False, in_worker_processes="process",
               loses_episodes=False),
    EngineKind("process", check_env_id, _any_wrappers, _make_process, None, _reset_padding_with_atari, _as_trained,
               gymnasium_ids=True, steps_native=False, workers=True, in_worker_processes="process",
               loses_episodes=True),
    EngineKind("envpool", _envpool_id, _no_wrappers, _make_envpool, _envpool_spec, lambda wrappers: "reset",
               _envpool_twin, gymnasium_ids=False, steps_native=False, workers=True, in_worker_processes=None,
               loses_episodes=False),
    EngineKind("ale_vector", _ale_id, _atari_only, _make_ale, _ale_spec, lambda wrappers: "zeros", _as_trained,
               gymnasium_ids=True, steps_native=False, workers=True, in_worker_processes=None, loses_episodes=False),
)}
#: the values of ``env.engine``
ENGINES = tuple(ENGINE_KINDS)


def engine(name: str) -> EngineKind:
    """The :class:`EngineKind` of ``env.engine`` = ``name``.

    Raises:
        ValueError: an unknown engine (the message names the valid ones).
    """
    kind = ENGINE_KINDS.get(name)
    if kind is None:
        raise ValueError(f"unknown env engine {name!r}; valid: {', '.join(ENGINES)}")
    return kind
