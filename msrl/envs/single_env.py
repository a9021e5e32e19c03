"""One gymnasium env from an id, its ``gymnasium.make`` kwargs and msrl's named wrappers.

Every engine builds its envs through :func:`make_single_env`, so a config means the same env
under ``env.engine: sync`` (in the actor's process) and ``env.engine: process`` (in worker
processes). This module imports neither torch nor msrl's graph code: the engine's worker
processes import it and stay light.
"""

from __future__ import annotations

import difflib
import importlib
import os
import pickle
import sys
from typing import Any, Callable, Mapping, Sequence

import gymnasium
import numpy as np

from msrl.errors import InputError

__all__ = ["ChannelFirstFrame", "make_single_env", "share_mujoco_models", "check_env_id", "check_wrappers", "WRAPPERS",
           "PETTINGZOO_WRAPPERS", "pettingzoo_wrappers", "UnknownEnvError",
           "EnvKwargsError"]


class UnknownEnvError(InputError, ValueError):
    """An env id that gymnasium's registry does not hold."""


class EnvKwargsError(InputError, TypeError):
    """``env.kwargs`` that the env's constructor does not take."""


#: what ``gymnasium.make`` takes itself, besides the env constructor's own arguments
_MAKE_KWARGS = ("max_episode_steps", "disable_env_checker", "render_mode", "autoreset", "apply_api_compatibility")


def _kwargs_error(env_id: str, kwargs: Mapping[str, Any], error: TypeError) -> EnvKwargsError | None:
    """The one-line error for ``env.kwargs`` that ``gymnasium.make(env_id, **kwargs)`` refused
    with ``error`` (``None`` where ``error`` is not about an unexpected keyword)."""
    import inspect
    import re

    found = re.search(r"unexpected keyword argument '([^']+)'", str(error))
    if found is None or found.group(1) not in kwargs:
        return None
    bad = found.group(1)
    try:
        entry = gymnasium.spec(env_id.split(":", 1)[-1]).entry_point  # (module:EnvId: the module is imported)
        creator = entry if callable(entry) else gymnasium.envs.registration.load_env_creator(entry)
        params = inspect.signature(creator).parameters.values()
        takes = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]
    except Exception:  # noqa: BLE001 - the names are a hint; the refusal stands without them
        takes = []
    valid = sorted(set(takes) | set(_MAKE_KWARGS))
    close = difflib.get_close_matches(bad, valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return EnvKwargsError(f"env.kwargs.{bad}: an unexpected keyword argument {bad!r} for {env_id}.{hint} Valid: "
                          f"{', '.join(valid)}")


#: the options of an ALE ``-v5`` env (ale-py's ``AtariEnv``), each with what it accepts: name ->
#: (what it is, a check of one value); Machado et al. 2018 give their meaning
ALE_OPTIONS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "repeat_action_probability": ("the sticky-action probability, in [0, 1]",
                                  lambda v: _number(v) and 0.0 <= v <= 1.0),
    "frameskip": ("frames per action: an integer >= 1, or a pair (low, high) of integers, 1 <= low < high",
                  lambda v: _integer(v) and v >= 1 or isinstance(v, (list, tuple)) and len(v) == 2
                  and all(_integer(x) for x in v) and 1 <= v[0] < v[1]),
    "mode": ("a game mode: an integer >= 0, or null for the default", lambda v: v is None or _integer(v) and v >= 0),
    "difficulty": ("a difficulty: an integer >= 0, or null for the default", lambda v: v is None or _integer(v) and v >= 0),
    "max_num_frames_per_episode": ("frames before truncation: an integer >= 1, or null",
                                   lambda v: v is None or _integer(v) and v >= 1),
    "continuous_action_threshold": ("in [0, 1]", lambda v: _number(v) and 0.0 <= v <= 1.0),
    "full_action_space": ("true or false", lambda v: isinstance(v, bool)),
    "continuous": ("true or false", lambda v: isinstance(v, bool)),
    "obs_type": ("rgb, grayscale or ram", lambda v: v in ("rgb", "grayscale", "ram")),
}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # (not NaN)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_ale_options(env_id: str, env_kwargs: Mapping[str, Any] | None) -> None:
    """Checks an ALE id's ``env.kwargs`` against the ranges of :data:`ALE_OPTIONS` before any env
    is made (ale-py takes ``repeat_action_probability=2`` without a word, and a whole run would
    train on a meaningless game). Other ids and unknown keys pass (the env's constructor names
    those).

    Raises:
        EnvKwargsError: a value outside its option's range, naming the key, the value and what is valid.
    """
    if not env_id.startswith("ALE/"):
        return
    for key, value in (env_kwargs or {}).items():
        option = ALE_OPTIONS.get(key)
        if option is not None and not option[1](value):
            raise EnvKwargsError(f"env.kwargs.{key}={value!r}: not a value {env_id} accepts; {key} is {option[0]}")


def _register_optional_namespaces(env_id: str) -> str:
    """Imports what registers ``env_id``, returns the id to look up: ``module:EnvId`` imports
    ``module`` (whose import registers ``EnvId``, gymnasium's convention, so worker processes
    find a user's env too); ALE ids (``ALE/Pong-v5``) register on ``gymnasium.register_envs(ale_py)``;
    OpenSpiel's games (``openspiel/tic_tac_toe``) on first use (:mod:`msrl.envs.openspiel_env`).

    Raises:
        UnknownEnvError: the module does not import, ale-py is missing for an ALE id, or an
            ``openspiel/<game>`` id OpenSpiel lacks or these envs cannot play."""
    if ":" in env_id:
        module, env_id = env_id.split(":", 1)
        try:
            importlib.import_module(module)
        except ImportError as e:
            top = module.split(".")[0]
            if isinstance(e, ModuleNotFoundError) and e.name == top and (
                    os.path.isfile(f"{top}.py") or os.path.isfile(os.path.join(top, "__init__.py"))):
                raise UnknownEnvError(
                    f"env id {module}:{env_id}: no module {top!r} on Python's path; the current directory holds one, "
                    f"but the msrl command does not search it: run with PYTHONPATH=. (or pip install your env's "
                    f"package)") from None
            raise UnknownEnvError(f"env id {module}:{env_id}: cannot import module {module!r}: {e}") from None
    if env_id.startswith("ALE/") and env_id not in gymnasium.envs.registry:
        try:
            import ale_py
        except ImportError:
            raise UnknownEnvError(
                f"env id {env_id!r} is an Atari game, which needs ale-py: pip install -e '.[atari]'"
            ) from None
        gymnasium.register_envs(ale_py)
    from msrl.envs.openspiel_env import is_openspiel

    if is_openspiel(env_id):
        from msrl.envs.openspiel_env import OpenSpielGameError, register

        try:
            register(env_id)
        except OpenSpielGameError as e:
            raise UnknownEnvError(str(e)) from None
    return env_id


def check_env_id(env_id: str) -> None:
    """Checks that ``env_id`` is registered with gymnasium (ALE ids register on first use;
    ``module:EnvId`` imports ``module`` first).

    Raises:
        UnknownEnvError: naming the closest registered ids and listing every registered id.
    """
    from msrl.envs.pettingzoo_env import check_pettingzoo_id, is_pettingzoo

    if is_pettingzoo(env_id):
        try:
            check_pettingzoo_id(env_id)
        except ValueError as e:
            raise UnknownEnvError(str(e)) from None
        return
    env_id = _register_optional_namespaces(env_id)
    registry = gymnasium.envs.registry
    if env_id in registry:
        return
    known = sorted(registry)
    close = difflib.get_close_matches(env_id, known, n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise UnknownEnvError(
        f"unknown env id {env_id!r}.{hint} Registered gymnasium env ids: {', '.join(known)}"
    )


def _atari(env_id: str, kwargs: dict[str, Any]) -> tuple[dict[str, Any], Callable[[gymnasium.Env], gymnasium.Env]]:
    """The standard Atari preprocessing of Mnih et al. 2015 ("Human-level control through deep
    reinforcement learning", Methods) as Machado et al. 2018 recommend it for ALE v5: up to 30
    no-ops at reset, 4 frames per action with the max of the last two, 84x84 grayscale frames
    (uint8), the last 4 stacked: observations ``(4, 84, 84)`` uint8. The base env is made with
    ``frameskip=1`` since the preprocessing skips frames itself; sticky actions
    (``repeat_action_probability``) stay at the id's default."""
    if not env_id.startswith("ALE/"):
        raise ValueError(f"env.wrappers: 'atari' preprocesses ALE games (ids ALE/<Game>-v5), not {env_id!r}")

    def wrap(env: gymnasium.Env) -> gymnasium.Env:
        env = gymnasium.wrappers.AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84,
                                                    terminal_on_life_loss=False, grayscale_obs=True)
        return gymnasium.wrappers.FrameStackObservation(env, 4)

    return {**kwargs, "frameskip": 1}, wrap


def _atari64(env_id: str, kwargs: dict[str, Any]) -> tuple[dict[str, Any], Callable[[gymnasium.Env], gymnasium.Env]]:
    """Atari for world models (DreamerV3's, Hafner et al. 2023, in DreamerV2's grayscale where the
    paper's frames are RGB): up to 30 no-ops at reset, 4 frames per action with the max of the
    last two, one 64x64 grayscale frame a step and no frame stack (the model's recurrent state
    remembers): observations ``(1, 64, 64)`` uint8. The base env is made with ``frameskip=1``;
    sticky actions stay at the id's default."""
    if not env_id.startswith("ALE/"):
        raise ValueError(f"env.wrappers: 'atari64' preprocesses ALE games (ids ALE/<Game>-v5), not {env_id!r}")

    def wrap(env: gymnasium.Env) -> gymnasium.Env:
        env = gymnasium.wrappers.AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=64,
                                                    terminal_on_life_loss=False, grayscale_obs=True)
        return ChannelFirstFrame(env)

    return {**kwargs, "frameskip": 1}, wrap


class ChannelFirstFrame(gymnasium.ObservationWrapper):
    """A grayscale frame ``(H, W)`` uint8 as ``(1, H, W)``: the channel axis a CNN takes.

    A class of its own, not gymnasium's ``ReshapeObservation``, whose transform is a lambda that an
    exact checkpoint of the env (:func:`msrl.envs.state.dump_env`) cannot pickle."""

    def __init__(self, env: gymnasium.Env) -> None:
        super().__init__(env)
        space = env.observation_space
        if not (isinstance(space, gymnasium.spaces.Box) and len(space.shape) == 2):
            raise ValueError(f"ChannelFirstFrame takes (H, W) frames, not observations of space {space}")
        self.observation_space = gymnasium.spaces.Box(space.low[None], space.high[None], (1, *space.shape),
                                                      space.dtype)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        """``(H, W)`` -> ``(1, H, W)`` (a view)."""
        return observation[None]


def _flatten_observation(env_id: str, kwargs: dict[str, Any]) -> tuple[dict[str, Any], Callable[[gymnasium.Env], gymnasium.Env]]:
    """gymnasium's ``FlattenObservation``: a ``Dict``, ``Tuple``, ``MultiDiscrete`` (one-hot) or
    multi-axis ``Box`` observation flattened into one float vector (``gymnasium.spaces.flatten``),
    for algorithms whose networks take a vector."""
    return kwargs, gymnasium.wrappers.FlattenObservation


class TupleAsMultiDiscrete(gymnasium.ActionWrapper):
    """An env whose ``Tuple`` of ``Discrete`` actions is taken as one ``MultiDiscrete``: the
    policy picks ``(k,)`` int64 indices counted from 0, the env gets the tuple of each
    sub-space's ``start + index``. (gymnasium has no action-flattening wrapper; this is the
    inverse of its ``MultiDiscrete`` to ``Tuple`` view.) A class, not a lambda: env snapshots
    pickle it.

    Raises:
        ValueError: a Tuple with a sub-space other than Discrete (named, by position).
    """

    def __init__(self, env: gymnasium.Env) -> None:
        super().__init__(env)
        space = env.action_space
        if not isinstance(space, gymnasium.spaces.Tuple):
            raise ValueError(f"'multi_discrete_action' takes a Tuple of Discrete actions, this env has {space}")
        for i, sub in enumerate(space.spaces):
            if not isinstance(sub, gymnasium.spaces.Discrete):
                raise ValueError(f"'multi_discrete_action': action {i} of the Tuple is {sub}; only a Tuple of "
                                 "Discrete actions is one MultiDiscrete")
        self.starts = tuple(int(sub.start) for sub in space.spaces)
        self.action_space = gymnasium.spaces.MultiDiscrete([int(sub.n) for sub in space.spaces])

    def action(self, action: Any) -> tuple[int, ...]:
        return tuple(int(a) + s for a, s in zip(np.asarray(action).reshape(-1), self.starts))


def _multi_discrete_action(env_id: str, kwargs: dict[str, Any]) -> tuple[dict[str, Any], Callable[[gymnasium.Env], gymnasium.Env]]:
    """:class:`TupleAsMultiDiscrete`."""
    return kwargs, TupleAsMultiDiscrete


#: classic-control ids -> the indices of their observations that are velocities
VELOCITIES = {"CartPole-v1": (1, 3), "Pendulum-v1": (2,), "MountainCar-v0": (1,), "MountainCarContinuous-v0": (1,),
              "Acrobot-v1": (4, 5)}


class MaskVelocity(gymnasium.ObservationWrapper):
    """A classic-control task made partially observed: its velocity entries (:data:`VELOCITIES`)
    are always 0 (sb3-contrib's ``MaskVelocityWrapper``, RL Zoo's ``CartPoleNoVel-v1``), so a
    policy must infer them from the observations it has seen: a memoryless (MLP) policy cannot
    balance CartPole this way, a recurrent one can. A class, not a lambda: env snapshots pickle it."""

    def __init__(self, env: gymnasium.Env, indices: Sequence[int]) -> None:
        super().__init__(env)
        self.mask = np.ones(env.observation_space.shape, dtype=env.observation_space.dtype)
        self.mask[list(indices)] = 0

    def observation(self, observation: Any) -> Any:
        return observation * self.mask


def _mask_velocity(env_id: str, kwargs: dict[str, Any]) -> tuple[dict[str, Any], Callable[[gymnasium.Env], gymnasium.Env]]:
    """:class:`MaskVelocity` for the tasks :data:`VELOCITIES` lists."""
    if env_id not in VELOCITIES:
        raise ValueError(f"'mask_velocity' knows the velocities of {', '.join(VELOCITIES)}, not of {env_id!r}")
    indices = VELOCITIES[env_id]
    return kwargs, lambda env: MaskVelocity(env, indices)


#: msrl's named wrappers, for ``env.wrappers`` in the YAML: name -> (env id, gymnasium.make
#: kwargs) -> (kwargs to make the base env with, wrapping function).
WRAPPERS: dict[str, Callable[[str, dict[str, Any]], tuple[dict[str, Any], Callable[[gymnasium.Env], gymnasium.Env]]]] = {
    "atari": _atari,
    "atari64": _atari64,
    "flatten_observation": _flatten_observation,
    "mask_velocity": _mask_velocity,
    "multi_discrete_action": _multi_discrete_action,
}


#: the wrappers of PettingZoo parallel envs, which :class:`~msrl.envs.pettingzoo_env.AgentStackedEnv`
#: applies as it stacks the agents: ``pad_observations`` gives agents of unequal observation
#: spaces (MPE's simple_adversary: 8 and 10 entries) one space, zeros appended to the shorter
#: observations, as SuperSuit's ``pad_observations_v0`` does (whose lambdas an exact checkpoint
#: cannot snapshot).
PETTINGZOO_WRAPPERS = ("pad_observations",)


def check_wrappers(wrappers: Sequence[str]) -> None:
    """Raises ValueError naming an unknown wrapper and the valid ones."""
    for w in wrappers:
        if w not in WRAPPERS and w not in PETTINGZOO_WRAPPERS:
            raise ValueError(f"unknown env wrapper {w!r}; valid: {', '.join([*WRAPPERS, *PETTINGZOO_WRAPPERS])}")


def pettingzoo_wrappers(env_id: str, wrappers: Sequence[str]) -> list[str]:
    """``wrappers`` (:data:`PETTINGZOO_WRAPPERS`) for the PettingZoo env ``env_id``.

    Raises:
        ValueError: a wrapper of gymnasium envs (naming the PettingZoo ones).
    """
    other = [w for w in wrappers if w not in PETTINGZOO_WRAPPERS]
    if other:
        raise ValueError(f"env.wrappers {other} apply to gymnasium envs, not the PettingZoo env {env_id!r}; its wrappers: "
                         f"{', '.join(PETTINGZOO_WRAPPERS)}")
    return list(wrappers)


def make_single_env(env_id: str, env_kwargs: Mapping[str, Any] | None = None,
                    wrappers: Sequence[str] = ()) -> gymnasium.Env:
    """``gymnasium.make(env_id, **env_kwargs)`` with msrl's named ``wrappers`` applied in order; for
    a ``pettingzoo/<module>`` id, the module's ``parallel_env(**env_kwargs)`` with a leading agent
    axis (:class:`~msrl.envs.pettingzoo_env.AgentStackedEnv`), :data:`PETTINGZOO_WRAPPERS` applied
    to the parallel env first. A ``Dict`` observation comes
    packed into one row (:class:`~msrl.envs.dict_obs.PackDictObservation`, outermost).

    Raises:
        UnknownEnvError: unknown id.
        EnvKwargsError: a key of ``env_kwargs`` the env does not take (naming the valid ones).
        ValueError: an unknown wrapper, or one that does not apply to ``env_id``.
    """
    from msrl.envs.pettingzoo_env import is_pettingzoo, make_parallel

    check_env_id(env_id)
    check_wrappers(wrappers)
    check_ale_options(env_id, env_kwargs)
    kwargs = dict(env_kwargs or {})
    if is_pettingzoo(env_id):
        return make_parallel(env_id, kwargs, pettingzoo_wrappers(env_id, wrappers))
    gym_only = [w for w in wrappers if w not in WRAPPERS]
    if gym_only:
        raise ValueError(f"env.wrappers {gym_only} apply to PettingZoo envs, not {env_id!r}")
    wraps = []
    for w in wrappers:
        kwargs, wrap = WRAPPERS[w](env_id, kwargs)
        wraps.append(wrap)
    try:
        env = gymnasium.make(env_id, **kwargs)
    except TypeError as e:
        refused = _kwargs_error(env_id, kwargs, e)
        if refused is None:
            raise
        raise refused from None
    for wrap in wraps:
        env = wrap(env)
    if isinstance(env.observation_space, gymnasium.spaces.Dict):  # one row per env from here on
        from msrl.envs.dict_obs import PackDictObservation

        env = PackDictObservation(env)
    return env


def share_mujoco_models(envs: Sequence[gymnasium.Env]) -> int:
    """Makes gymnasium's own MuJoCo envs (``gymnasium.envs.mujoco``: HalfCheetah, Hopper, Ant,
    ...) in ``envs`` step on one ``MjModel`` where their models are byte-for-byte the same.

    Each ``gymnasium.make`` loads its own model, so many envs in one process step through many
    copies of it and miss the CPU's caches; stepped in turn on one shared model they run faster
    (``bench/results/startup.md``, "Figures behind the code"). Only
    gymnasium's own classes are shared: they never write their model after construction
    (``mj_step`` reads it), so nothing an env computes changes. A user's env, which may
    randomise its model per env, keeps its own. Each env keeps its own ``MjData``.

    Returns:
        how many envs now share another env's model.
    """
    mujoco = sys.modules.get("mujoco")  # not loaded: no env holds an MjModel (and no import to pay for)
    if mujoco is None:
        return 0
    first: dict[tuple[type, bytes], Any] = {}
    shared = 0
    for env in envs:
        base = env.unwrapped
        model = getattr(base, "model", None)
        if type(model) is not mujoco.MjModel or not type(base).__module__.startswith("gymnasium.envs.mujoco."):
            continue
        key = (type(base), pickle.dumps(model, protocol=pickle.HIGHEST_PROTOCOL))  # the model's full serialisation
        if key not in first:
            first[key] = model
            continue
        base.model = first[key]
        renderer = getattr(base, "mujoco_renderer", None)
        if renderer is not None and getattr(renderer, "model", None) is model:
            renderer.model = first[key]
        shared += 1
    return shared
