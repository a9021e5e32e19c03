"""msrl's input error, in a module of its own: processes that only raise it (the Ray replicas,
the runtime) need not import pydantic and the config schema (:mod:`msrl.config` re-exports it)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A config, override or name that cannot run; the message says what is valid."""
