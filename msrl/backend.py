"""Fragment backends: the registry of ``fragments/<name>.py`` modules (DESIGN.md §4).

A backend module defines ``BACKEND``, a :class:`Backend`: a lowering table for code
generation plus how the fragment's components are placed (device)."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from msrl.codegen import Lowering

__all__ = ["Backend", "UnknownBackendError", "load_backend", "available_backends"]


class UnknownBackendError(ValueError):
    """A backend name with no module in ``fragments/``."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """A fragment backend.

    Attributes:
        name: the YAML value of a fragment's ``backend``.
        lowering: rule table used by :func:`msrl.codegen.generate`.
        devices: device types it runs on (``("cpu", "cuda")``).
    """

    name: str
    lowering: Lowering
    devices: tuple[str, ...]


def available_backends() -> list[str]:
    """Names of the backends in ``fragments/``."""
    import msrl.fragments as pkg

    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))


def load_backend(name: str) -> Backend:
    """The ``BACKEND`` of ``fragments/<name>.py``.

    Raises:
        UnknownBackendError: no such backend; the message lists those that exist.
    """
    known = available_backends()
    if name not in known:
        raise UnknownBackendError(f"unknown fragment backend {name!r}; available: {', '.join(known)}")
    return importlib.import_module(f"msrl.fragments.{name}").BACKEND
