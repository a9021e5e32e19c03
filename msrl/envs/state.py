"""Exact snapshots of gymnasium envs, wrappers included, for checkpoints.

``pickle.dumps(env)`` is not a snapshot for most simulator envs: gymnasium's MuJoCo envs and
ALE's Atari envs are :class:`~gymnasium.utils.ezpickle.EzPickle`, whose pickle holds only the
constructor's arguments, so unpickling makes a *fresh* env (measured: a HalfCheetah-v5 unpickled
that way diverges from the original at the next step). :func:`dump_env` pickles every object's
``__dict__`` instead (MuJoCo's ``MjModel``/``MjData`` pickle with their full state), and an ALE
game through ``ALEInterface.cloneState(include_rng=True)``, so a restored env continues exactly
where the original was: same observations, rewards and RNG draws (tested for CartPole,
Pendulum, HalfCheetah, Hopper, Ant, Pong and MPE's simple_spread). pygame's render objects (a
``Surface``, a freetype ``Font``: rendering, not simulation state) are restored blank/reopened.

Large objects that are the same in every env of a batch (a MuJoCo ``MjModel``, ~1.2 MB) are
stored once: :func:`dump_env` returns them apart, keyed by content hash, and :func:`load_env`
takes them back. Snapshots are zlib-compressed (level 1): a MuJoCo ``MjData`` arena is mostly
zeros and compresses by an order of magnitude in milliseconds (``bench/results/startup.md``, "Figures
behind the code").
"""

from __future__ import annotations

import hashlib
import io
import pickle
import sys
import zlib
from typing import Any, Mapping

from gymnasium.utils.ezpickle import EzPickle

from msrl.errors import MsrlError

__all__ = ["dump_env", "load_env", "EnvStateError"]


class EnvStateError(MsrlError, RuntimeError):
    """An env whose state cannot be saved or restored exactly."""


def _new(cls: type) -> Any:
    return cls.__new__(cls)


def _set_dict(obj: Any, state: Mapping[str, Any]) -> None:
    obj.__dict__.update(state)


def _atari_env(cls: type, args: tuple, kwargs: dict) -> Any:
    return cls(*args, **kwargs)


def _set_atari(obj: Any, state: Mapping[str, Any]) -> None:
    state = dict(state)
    ale_state = state.pop("__ale_state__")
    obj.__dict__.update(state)
    obj.ale.restoreState(ale_state)


def _blank_surface(size: tuple[int, int]) -> Any:
    import pygame

    return pygame.Surface(size)


def _freetype_font(path: Any, size: Any) -> Any:
    import pygame.freetype

    pygame.freetype.init()
    return pygame.freetype.Font(path, size)


def _pygame_reduce(obj: Any) -> Any:
    """Render objects of pygame (a ``Surface``, restored blank at its size; a freetype ``Font``,
    reopened from its file, or pygame's default font where freetype was quit since the font was
    made -- another env's ``close`` -- and its file cannot be read back): rendering state, not
    simulation state. None for other objects."""
    cls = type(obj)
    if not cls.__module__.startswith("pygame"):
        return None
    if cls.__name__ == "Surface":
        return (_blank_surface, (obj.get_size(),))
    if cls.__name__ == "Font":
        import pygame

        try:
            return (_freetype_font, (obj.path, obj.size))
        except AttributeError:
            return None
        except pygame.error:  # freetype was quit since (another env's close): pygame's default font
            return (_freetype_font, (None, 24))
    return None


def _is_atari(obj: Any) -> bool:
    cls = type(obj)
    return cls.__name__ == "AtariEnv" and cls.__module__.startswith("ale_py")


def _is_flatten_observation(obj: Any) -> bool:
    cls = type(obj)
    return cls.__name__ == "FlattenObservation" and cls.__module__.startswith("gymnasium.wrappers")


def _flatten_observation(env: Any) -> Any:
    """gymnasium's ``FlattenObservation`` around ``env`` again: it holds no state of its own (its
    spaces and its transform, a lambda that cannot pickle, follow from ``env``'s spaces)."""
    from gymnasium.wrappers import FlattenObservation

    return FlattenObservation(env)


def _mj_model_type() -> type | None:
    mujoco = sys.modules.get("mujoco")  # not loaded: no env holds an MjModel (and no import to pay for)
    return None if mujoco is None else mujoco.MjModel


class _StatePickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, shared: dict[str, bytes]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._shared = shared
        self._mj_model = _mj_model_type()

    def persistent_id(self, obj: Any) -> str | None:
        if self._mj_model is not None and type(obj) is self._mj_model:
            blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            key = "mjmodel:" + hashlib.sha256(blob).hexdigest()
            if key not in self._shared:
                self._shared[key] = zlib.compress(blob, 1)
            return key
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type):
            return NotImplemented
        render = _pygame_reduce(obj)  # MPE keeps a screen and a font
        if render is not None:
            return render
        if _is_atari(obj):
            state = {k: v for k, v in obj.__dict__.items() if k != "ale"}
            state["__ale_state__"] = obj.ale.cloneState(include_rng=True)
            return (_atari_env, (type(obj), obj._ezpickle_args, obj._ezpickle_kwargs), state, None, None, _set_atari)
        if isinstance(obj, EzPickle):
            return (_new, (type(obj),), dict(obj.__dict__), None, None, _set_dict)
        if _is_flatten_observation(obj):  # its transform is a lambda: the wrapper is made again around its env
            return (_flatten_observation, (obj.env,))
        return NotImplemented


class _StateUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, shared: Mapping[str, bytes]) -> None:
        super().__init__(file)
        self._shared = shared

    def persistent_load(self, pid: str) -> Any:
        try:
            return pickle.loads(zlib.decompress(self._shared[pid]))
        except KeyError:
            raise EnvStateError(f"env snapshot refers to shared object {pid!r}, which the checkpoint lacks") from None


def dump_env(env: Any, shared: dict[str, bytes]) -> bytes:
    """Snapshots one gymnasium env (wrappers, RNGs and simulator state included).

    Args:
        env: the env.
        shared: filled with the large objects the snapshot refers to (content hash -> bytes);
            pass the same dict for every env of a batch to store each once.

    Returns:
        the snapshot's bytes, for :func:`load_env`.

    Raises:
        EnvStateError: an object in the env that cannot be saved, named with the env's type.
    """
    buf = io.BytesIO()
    try:
        _StatePickler(buf, shared).dump(env)
    except (TypeError, pickle.PicklingError, AttributeError) as e:
        raise EnvStateError(
            f"cannot snapshot env {env!s} for an exact checkpoint: {e} (an object in it holds state that "
            "neither pickles nor has a known snapshot method)"
        ) from None
    return zlib.compress(buf.getvalue(), 1)


def load_env(blob: bytes, shared: Mapping[str, bytes]) -> Any:
    """Restores a snapshot made by :func:`dump_env`.

    Raises:
        EnvStateError: the snapshot refers to a shared object missing from ``shared``, or is damaged.
    """
    try:
        return _StateUnpickler(io.BytesIO(zlib.decompress(blob)), shared).load()
    except EnvStateError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged snapshot can raise anything pickle raises
        raise EnvStateError(f"damaged env snapshot: {type(e).__name__}: {e}") from None
