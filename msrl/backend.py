"""Fragment backends: the registry of ``fragments/<name>.py`` modules (DESIGN.md §4).

A backend module defines ``BACKEND``, a :class:`Backend`: a lowering table for code
generation plus how the fragment's components are placed (device)."""

from __future__ import annotations

import dataclasses

from msrl import registry
from msrl.codegen import Lowering
from msrl.errors import InputError

__all__ = ["Backend", "UnknownBackendError", "load_backend", "available_backends"]


class UnknownBackendError(InputError, ValueError):
    """A backend name with no module in ``fragments/``."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """A fragment backend.

    Attributes:
        name: the YAML value of a fragment's ``backend``.
        lowering: rule table used by :func:`msrl.codegen.generate`.
        devices: device types it runs on (``("cpu", "cuda")``).
        env_engine: the env engine (:data:`msrl.envs.factory.ENGINES`) on which a fragment of this
            backend steps its gymnasium envs, whatever ``env.engine`` says (``None``: ``env.engine``).
    """

    name: str
    lowering: Lowering
    devices: tuple[str, ...]
    env_engine: str | None = None


def available_backends() -> list[str]:
    """Names of the backends in ``fragments/``."""
    return registry.names("msrl.fragments")


def load_backend(name: str) -> Backend:
    """The ``BACKEND`` of ``fragments/<name>.py``.

    Raises:
        UnknownBackendError: no such backend; the message lists those that exist.
    """
    return registry.load("msrl.fragments", name, "BACKEND", UnknownBackendError, "fragment backend")
