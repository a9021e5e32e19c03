"""``Dict`` observations packed into one row per env, and restored by key before the network.

A gymnasium ``Dict`` observation (``{"image": (3, 64, 64) uint8, "position": (2,) float32,
"mode": Discrete(4)}``) crosses msrl the way every other observation does: one tensor per batch,
``(N, R)``, so the engines' shared memory, the rollout storage, every boundary and the codec
carry it unchanged; the network restores the keys (:meth:`DictLayout.unpack`) and encodes each
one (:class:`msrl.rl.networks.DictEncoder`). This is RLlib's design for its model API v2
(``Preprocessor`` packs, ``restore_original_dimensions`` restores), except that images stay
bytes:

* every key uint8 (frames, byte vectors): the row is uint8, each key's bytes as they came;
* no key uint8: the row is float32;
* both: the row is bytes, each float32 key as its 4 bytes (first, aligned), the uint8 keys
  after them, the row padded to a multiple of 4 bytes -- an Atari frame beside a float vector
  stays a quarter of the float size across every boundary.

``Discrete`` keys are stored as their index minus ``start`` (float32: exact below 2**24), and
``MultiDiscrete`` keys likewise per component; the encoder one-hot encodes them, as gymnasium's
``flatten`` does. ``MultiBinary`` keys are float32 0/1. Nested ``Dict``/``Tuple`` keys, and
``Text``, ``Graph`` or ``Sequence`` keys, are refused by name (``env.wrappers:
[flatten_observation]`` turns the whole observation into one vector instead).

This module imports no torch at import time: the env engine's worker processes pack rows with it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import gymnasium
import numpy as np

__all__ = ["DictField", "DictLayout", "PackDictObservation", "storage_space", "is_image_space"]

_BOX, _DISCRETE, _MULTI_DISCRETE, _MULTI_BINARY = "box", "discrete", "multi_discrete", "multi_binary"


def is_image_space(space: gymnasium.Space) -> bool:
    """Whether ``space`` is frames a CNN takes: a uint8 ``Box`` of shape ``(C, H, W)``."""
    return isinstance(space, gymnasium.spaces.Box) and space.dtype == np.uint8 and len(space.shape) == 3


@dataclasses.dataclass(frozen=True)
class DictField:
    """One key of a packed ``Dict`` observation.

    Attributes:
        key: the key in the ``Dict``.
        space: its sub-space.
        kind: ``"box"``, ``"discrete"``, ``"multi_discrete"`` or ``"multi_binary"``.
        uint8: stored as bytes (a uint8 Box), else float32.
        shape: the stored value's shape (the Box's; ``()`` for Discrete; ``(k,)`` for MultiDiscrete).
        offset: where its values start in the packed row, in the row's elements (bytes in a
            byte row).
        length: its number of stored values (each 4 bytes of a byte row when float32).
    """

    key: str
    space: gymnasium.Space
    kind: str
    uint8: bool
    shape: tuple[int, ...]
    offset: int
    length: int

    @property
    def image(self) -> bool:
        """Frames for a CNN (:func:`is_image_space`)."""
        return is_image_space(self.space)

    @property
    def flat_width(self) -> int:
        """The width of this key in the encoder's flat vector: one-hot widths for discrete
        kinds (``n``; ``sum(nvec)``), else its number of values."""
        if self.kind == _DISCRETE:
            return int(self.space.n)
        if self.kind == _MULTI_DISCRETE:
            return int(np.sum(self.space.nvec))
        return self.length


class DictLayout:
    """Where each key of a ``Dict`` observation space lies in its packed row.

    Args:
        space: a ``gymnasium.spaces.Dict`` whose keys are ``Box``, ``Discrete``,
            ``MultiDiscrete`` (one axis) or ``MultiBinary`` spaces.

    Attributes:
        fields: one :class:`DictField` per key, in the space's key order.
        dtype: the row's NumPy dtype (uint8 or float32; see the module docstring).
        bytes_row: the row mixes float32 keys (as 4 bytes each) and uint8 keys.
        width: ``R``, the row's length in elements.

    Raises:
        ValueError: not a Dict, an empty one, or a key of another kind (named, with the
            ``flatten_observation`` wrapper as the way out).
    """

    def __init__(self, space: gymnasium.Space) -> None:
        if not isinstance(space, gymnasium.spaces.Dict):
            raise ValueError(f"a packed observation needs a Dict space, got {space}")
        if not space.spaces:
            raise ValueError("the observation space is an empty Dict: there is nothing to observe")
        specs = []
        for key, sub in space.spaces.items():
            specs.append((str(key), sub, *_kind(key, sub)))
        uint8 = [s for s in specs if s[3]]
        floats = [s for s in specs if not s[3]]
        self.bytes_row = bool(uint8) and bool(floats)
        self.dtype = np.dtype(np.uint8) if uint8 else np.dtype(np.float32)
        ordered = floats + uint8 if self.bytes_row else specs  # float32 keys first: 4-byte aligned
        fields, at = {}, 0
        for key, sub, kind, is_u8, shape in ordered:
            length = int(np.prod(shape, dtype=np.int64))
            fields[key] = DictField(key, sub, kind, is_u8, shape, at, length)
            at += length * (4 if self.bytes_row and not is_u8 else 1)
        if self.bytes_row:
            at = -(-at // 4) * 4  # rows of whole float32 words: every float key stays aligned in a batch
        self.width = at
        self.fields = [fields[str(k)] for k in space.spaces]
        self.space = space

    def packed_space(self) -> gymnasium.spaces.Box:
        """The ``(R,)`` Box the engines store and step (bounds 0..255 for a byte row, +-inf for
        float32)."""
        if self.dtype == np.uint8:
            return gymnasium.spaces.Box(0, 255, (self.width,), np.uint8)
        return gymnasium.spaces.Box(-np.inf, np.inf, (self.width,), np.float32)

    def pack(self, obs: Mapping[str, Any], out: np.ndarray | None = None) -> np.ndarray:
        """One observation (a mapping with every key) as its packed row ``(R,)``.

        Raises:
            KeyError: a key of the space is missing.
            ValueError: a key's value has the wrong shape, or a discrete key's is outside its space.
            FloatingPointError: a float key holds NaN or infinity (named).
        """
        row = np.zeros(self.width, self.dtype) if out is None else out
        for f in self.fields:
            if f.key not in obs:
                raise KeyError(f"the observation has no key {f.key!r}; the Dict space has {[g.key for g in self.fields]}")
            value = np.asarray(obs[f.key])
            if f.kind == _DISCRETE:
                value = value.reshape(()) - int(f.space.start)
            elif f.kind == _MULTI_DISCRETE:
                value = value - f.space.start
            if value.shape != f.shape:
                raise ValueError(f"observation key {f.key!r} has shape {value.shape}, its space {f.space} has {f.shape}")
            if f.kind == _DISCRETE and not 0 <= value < f.space.n or (
                    f.kind == _MULTI_DISCRETE and not ((0 <= value) & (value < f.space.nvec)).all()):
                raise ValueError(f"observation key {f.key!r} is {obs[f.key]}, outside its space {f.space}")
            if f.uint8:
                row[f.offset:f.offset + f.length] = value.reshape(-1)
                continue
            flat = value.astype(np.float32, copy=False).reshape(-1)
            if not np.isfinite(flat).all():
                raise FloatingPointError(f"observation key {f.key!r} holds a NaN or infinite value: {flat[~np.isfinite(flat)][:4]}")
            if self.bytes_row:
                row[f.offset:f.offset + 4 * f.length] = flat.view(np.uint8)
            else:
                row[f.offset:f.offset + f.length] = flat
        return row

    def unpack(self, x: Any) -> dict[str, Any]:
        """A batch of packed rows ``(B, R)`` (torch) as ``{key: (B, *shape)}``: uint8 keys as
        uint8, the others float32 (discrete indices counted from 0), views of ``x`` where the
        layout allows.

        Raises:
            ValueError: ``x`` is not ``(B, R)`` of the row's dtype.
        """
        import torch

        want = torch.uint8 if self.dtype == np.uint8 else torch.float32
        if x.dim() != 2 or x.shape[1] != self.width or x.dtype != want:
            raise ValueError(f"packed Dict observations are (B, {self.width}) {want}, got {tuple(x.shape)} {x.dtype}")
        out = {}
        for f in self.fields:
            if self.bytes_row and not f.uint8:
                part = x[:, f.offset:f.offset + 4 * f.length]
                if part.storage_offset() % 4 or x.stride(0) % 4 or part.stride(1) != 1:
                    part = part.contiguous()
                part = part.view(torch.float32)
            else:
                part = x[:, f.offset:f.offset + f.length]
            out[f.key] = part.reshape(x.shape[0], *f.shape)
        return out

    def describe(self) -> str:
        """``key: shape dtype`` of each key, and the row: for messages and ``msrl graph``."""
        keys = ", ".join(f"{f.key}: {f.shape} {'uint8' if f.uint8 else 'float32'}" for f in self.fields)
        return f"Dict({keys}) packed as ({self.width},) {self.dtype}{' bytes' if self.bytes_row else ''}"


def _kind(key: Any, sub: gymnasium.Space) -> tuple[str, bool, tuple[int, ...]]:
    if isinstance(sub, gymnasium.spaces.Box):
        return _BOX, sub.dtype == np.uint8, tuple(int(s) for s in sub.shape)
    if isinstance(sub, gymnasium.spaces.Discrete):
        return _DISCRETE, False, ()
    if isinstance(sub, gymnasium.spaces.MultiDiscrete):
        if len(sub.nvec.shape) != 1:
            raise ValueError(f"observation key {key!r}: a MultiDiscrete of one axis is supported, got nvec of shape "
                             f"{sub.nvec.shape} (env.wrappers: [flatten_observation] flattens the whole observation)")
        return _MULTI_DISCRETE, False, (int(sub.nvec.shape[0]),)
    if isinstance(sub, gymnasium.spaces.MultiBinary):
        return _MULTI_BINARY, False, tuple(int(s) for s in np.atleast_1d(sub.n))
    raise ValueError(f"observation key {key!r} is a {type(sub).__name__} space; a Dict observation's keys may be "
                     "Box, Discrete, MultiDiscrete or MultiBinary (env.wrappers: [flatten_observation] flattens "
                     "nested Dict and Tuple observations into one vector)")


def storage_space(space: gymnasium.Space) -> gymnasium.Space:
    """The space observations of ``space`` are stored and sent as: a Dict's packed ``(R,)`` Box
    (:meth:`DictLayout.packed_space`), any other space itself."""
    if isinstance(space, gymnasium.spaces.Dict):
        return DictLayout(space).packed_space()
    return space


class PackDictObservation(gymnasium.ObservationWrapper):
    """A gymnasium env whose ``Dict`` observations come packed (:class:`DictLayout`): its
    ``observation_space`` is the ``(R,)`` Box, ``dict_space`` the env's own. Every engine's env
    with a Dict observation space is wrapped in it last (:func:`msrl.envs.single_env.make_single_env`).
    A class (not a lambda): env snapshots pickle it.

    Raises (from :meth:`observation`): as :meth:`DictLayout.pack`.
    """

    def __init__(self, env: gymnasium.Env) -> None:
        super().__init__(env)
        self.dict_space = env.observation_space
        self.layout = DictLayout(self.dict_space)
        self.observation_space = self.layout.packed_space()

    def observation(self, observation: Any) -> np.ndarray:
        return self.layout.pack(observation)
