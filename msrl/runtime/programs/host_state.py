"""The host state a replayed iteration would not change: a bounded walk of a trainer's objects
(:func:`host_state`), what changed between two walks (:func:`first_change`) and where the user's
code set it, and the objects of one kind it holds (:func:`find_objects`). What the capture probe
(:mod:`msrl.runtime.programs.capture`) checks a component's replay contract against."""

from __future__ import annotations

import inspect
import random
import re
import threading
import weakref
from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["host_state", "first_change", "find_objects", "not_walked", "source_of", "assignment_site"]

_SCALARS = (int, float, bool, str, bytes, complex, type(None))
_OPAQUE = (type, type(len), type(lambda: 0), type(inspect), property, staticmethod, classmethod,
           threading.Thread, weakref.ref)


def not_walked(obj: Any) -> bool:
    """Whether the walks over a trainer's objects (:func:`host_state`, :func:`find_objects`) stop at
    ``obj``: a module, class, function or other code object (its namespace is not the
    trainer's state; a native env's GPU kernels hold the ``cupy`` module)."""
    return isinstance(obj, _OPAQUE) or callable(obj) and not hasattr(obj, "__dict__")


def host_state(roots: dict[str, Any], skip: Sequence[str] = (), max_items: int = 256) -> dict[str, Any]:
    """A snapshot of the host state reachable from ``roots``: ``path -> value`` for every Python
    number, string and ``None``, the identity of every tensor and generator (a rebinding shows),
    the length of every list and dict, a NumPy array's bytes and a host RNG's state. Tensors'
    contents are not read (that is device state, which a replay does change).

    Args:
        roots: name -> object (``{"learner": learner, ...}``); paths start with the name.
        skip: paths left out, with everything under them (declared replayed state).
        max_items: elements of a list or dict walked (the length is always recorded).

    Returns:
        the snapshot; compare two with :func:`first_change`.
    """
    out: dict[str, Any] = {}
    seen: set[int] = set()
    skipped = set(skip)

    def walk(path: str, obj: Any, depth: int) -> None:
        if path in skipped:
            return
        if isinstance(obj, _SCALARS):
            out[path] = obj
            return
        if isinstance(obj, torch.Tensor):
            out[path] = ("tensor", id(obj))
            return
        if isinstance(obj, torch.Generator):
            out[path] = ("generator", id(obj))
            return
        if isinstance(obj, np.ndarray):
            out[path] = ("ndarray", obj.tobytes() if obj.nbytes <= 1 << 16 else id(obj))
            return
        if isinstance(obj, np.random.Generator):
            out[path] = ("numpy rng", repr(obj.bit_generator.state))
            return
        if isinstance(obj, random.Random):
            out[path] = ("python rng", obj.getstate())
            return
        if not_walked(obj) or depth > 10:
            return
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            out[path + "#len"] = len(obj)
            for i, v in enumerate(obj[:max_items]):
                walk(f"{path}[{i}]", v, depth + 1)
            return
        if isinstance(obj, dict):
            out[path + "#len"] = len(obj)
            for i, (k, v) in enumerate(list(obj.items())[:max_items]):
                walk(f"{path}[{k!r}]" if isinstance(k, (str, int)) else f"{path}[#{i}]", v, depth + 1)
            return
        if isinstance(obj, torch.optim.Optimizer):
            walk(f"{path}.param_groups", obj.param_groups, depth + 1)
            walk(f"{path}.state", list(obj.state.values()), depth + 1)
            return
        attrs = getattr(obj, "__dict__", None)
        if attrs is None:
            return
        for k, v in list(attrs.items()):
            if k in ("_forward_hooks", "_backward_hooks", "_forward_pre_hooks", "_state_dict_hooks",
                     "_load_state_dict_pre_hooks", "_non_persistent_buffers_set"):
                continue
            walk(f"{path}.{k}", v, depth + 1)

    for name, obj in roots.items():
        walk(name, obj, 0)
    return out


def first_change(before: dict[str, Any], after: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """The first path whose value differs between two :func:`host_state` snapshots, with both
    values (``None`` for a path one lacks); ``None`` when they are equal."""
    for path in list(before) + [p for p in after if p not in before]:
        a, b = before.get(path), after.get(path)
        if a != b:
            return path, a, b
    return None


def source_of(cls: type) -> str:
    """``file:line`` of a class ('?' when unknown)."""
    try:
        return f"{inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]}"
    except (OSError, TypeError):
        return "?"


def assignment_site(root: Any, path: str) -> str:
    """``file:line`` where the attribute at ``path`` (``learner.iteration``) is assigned outside
    ``__init__`` in its owner's class, or the owner class's ``file:line`` ('?' when unknown)."""
    parts = re.split(r"\.|\[", path)
    obj = root
    for part in parts[1:-1]:
        obj = getattr(obj, part, None) if not part.endswith("]") else None
        if obj is None:
            return "?"
    attr = parts[-1].split("#")[0]
    for cls in type(obj).__mro__:
        try:
            lines, start = inspect.getsourcelines(cls)
            file = inspect.getsourcefile(cls)
        except (OSError, TypeError):
            continue
        func = None
        for i, line in enumerate(lines):
            m = re.match(r"\s*def (\w+)", line)
            if m:
                func = m.group(1)
            if func not in (None, "__init__", "load_state_dict") and re.search(rf"self\.{re.escape(attr)}\s*([-+*/]?=)(?!=)", line):
                return f"{file}:{start + i}"
    return source_of(type(obj))


def find_objects(trainer: Any, kind: type) -> list[tuple[str, Any]]:
    """The objects of type ``kind`` (generators, optimisers) the trainer's components hold,
    each once, with its path."""
    found, seen = [], set()

    def walk(path: str, obj: Any, depth: int) -> None:
        if isinstance(obj, kind):
            if id(obj) not in seen:
                seen.add(id(obj))
                found.append((path, obj))
            return
        # not into what host_state does not walk either (walking cupy's namespace visited ~160k
        # objects, ~0.3 s of a GPU job's start), NumPy arrays or the tensors' contents
        if depth > 6 or isinstance(obj, (torch.Tensor, np.ndarray, *_SCALARS)) or not_walked(obj) or id(obj) in seen:
            return
        seen.add(id(obj))
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else \
            getattr(obj, "__dict__", {}).items()
        for i, (k, v) in enumerate(list(items)[:256]):
            # a key that is not a name or an index (an optimiser's state is keyed by its
            # parameters) is named by its position: formatting a CUDA tensor reads every element
            # back to the host (~1,000 syncs, ~90 ms, in the GPU job's capture)
            walk(f"{path}.{k}" if isinstance(k, (str, int)) else f"{path}[#{i}]", v, depth + 1)

    for role, comp in getattr(trainer, "_components", {}).items():
        walk(role, comp, 0)
    return found
