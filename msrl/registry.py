"""Name -> module registries: algorithms, distribution policies and fragment backends are one
file each in a package, found by file name."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

__all__ = ["names", "load"]


def names(package: str) -> list[str]:
    """The public module names of ``package`` (e.g. ``"msrl.fragments"``), sorted."""
    pkg = importlib.import_module(package)
    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))


def load(package: str, name: str, attr: str, error: type[Exception], what: str) -> Any:
    """``package.<name>.<attr>``.

    Raises:
        error: no module ``name`` in ``package``; the message lists those that exist.
    """
    known = names(package)
    if name not in known:
        raise error(f"unknown {what} {name!r}; available: {', '.join(known)}")
    return getattr(importlib.import_module(f"{package}.{name}"), attr)
