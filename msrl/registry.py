"""Name -> module registries: algorithms, distribution policies and fragment backends are one
file each in a package, found by file name; an algorithm may also be a user's module or file
(:func:`load_algorithm`)."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from typing import Any

from msrl.api import AlgorithmSpec
from msrl.errors import InputError

__all__ = ["names", "load", "UnknownAlgorithmError", "available_algorithms", "load_algorithm"]


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


class UnknownAlgorithmError(InputError, ValueError):
    """An algorithm name with no file in ``algorithms/``."""


def available_algorithms() -> list[str]:
    """Names of the algorithm files in ``algorithms/``."""
    return names("msrl.algorithms")


def load_algorithm(name: str) -> AlgorithmSpec:
    """The module-level ``ALGORITHM`` of an algorithm module.

    Args:
        name: a built-in name (``"ppo"``: ``algorithms/ppo.py``), a module on ``sys.path``
            (``"my_dqn"`` with its folder on ``PYTHONPATH``, ``"mypkg.my_dqn"``), or the path of a Python file (``"./my_dqn.py"``,
            relative to the working directory; imported as module ``msrl_user.<stem>``).

    Raises:
        UnknownAlgorithmError: no such built-in, module or file (the message lists the
            built-ins), a module that fails to import, or one without an ``AlgorithmSpec``
            named ``ALGORITHM``.
    """
    import importlib
    import importlib.util
    import pathlib

    if name in available_algorithms():
        return load("msrl.algorithms", name, "ALGORITHM", UnknownAlgorithmError, "algorithm")
    builtin = ", ".join(available_algorithms())
    if name.endswith(".py") or "/" in name or "\\" in name:
        path = pathlib.Path(name).expanduser().resolve()
        if not path.is_file():
            raise UnknownAlgorithmError(f"algorithm file {name!r} does not exist (built-in algorithms: {builtin})")
        import hashlib

        module_name = f"msrl_user.{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
        module = sys.modules.get(module_name)
        if "msrl_user" not in sys.modules:  # the namespace of file algorithms (pickle imports it)
            import types

            sys.modules["msrl_user"] = types.ModuleType("msrl_user", "algorithms loaded from files")
            sys.modules["msrl_user"].__path__ = []  # type: ignore[attr-defined]
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module  # dataclasses and inspect.getsource look it up
            try:
                spec.loader.exec_module(module)
            except Exception as e:
                del sys.modules[module_name]
                raise UnknownAlgorithmError(f"algorithm file {name!r} failed to import: {type(e).__name__}: {e}") from e
        where = f"file {name!r}"
    elif "." in name or importlib.util.find_spec(name) is not None:  # a module on sys.path (PYTHONPATH)
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            raise UnknownAlgorithmError(
                f"unknown algorithm {name!r}: no module {e.name!r} on sys.path (built-in algorithms: {builtin})"
            ) from None
        except Exception as e:
            raise UnknownAlgorithmError(f"algorithm module {name!r} failed to import: {type(e).__name__}: {e}") from e
        where = f"module {name!r}"
    else:
        raise UnknownAlgorithmError(
            f"unknown algorithm {name!r}; available: {builtin} (or a module on sys.path, or a .py file)"
        )
    algorithm = getattr(module, "ALGORITHM", None)
    if not isinstance(algorithm, AlgorithmSpec):
        raise UnknownAlgorithmError(
            f"algorithm {where} defines no ALGORITHM = msrl.api.AlgorithmSpec(...) (found {type(algorithm).__name__})"
        )
    return algorithm
