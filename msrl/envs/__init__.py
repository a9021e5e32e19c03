"""Environments: the gymnasium engines (in-process and worker processes), msrl's native batched
envs, and the PettingZoo adapter, behind one factory (:mod:`msrl.envs.factory`).

Importing this package is light (no torch, no simulator): the env engine's worker processes
import :mod:`msrl.envs.single_env` and :mod:`msrl.envs.state` only. The factory's names load on
first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_env_id", "make_env", "env_spec", "eval_env_id", "UnknownEnvError", "is_native", "ENGINES",
           "engine"]


def __getattr__(name: str) -> Any:
    if name in ("ENGINES", "engine"):
        from msrl.envs import engines

        return getattr(engines, name)
    if name in __all__:
        from msrl.envs import factory

        return getattr(factory, name)
    raise AttributeError(f"module 'msrl.envs' has no attribute {name!r}")
