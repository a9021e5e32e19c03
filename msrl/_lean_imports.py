"""Keeps ``import tensordict`` from loading TorchDynamo in msrl's processes.

tensordict marks a few of its functions for ``torch.compile`` at import time
(``torch.compiler.allow_in_graph``, ``assume_constant_result``), and each mark imports
``torch._dynamo`` -- with sympy, ~0.7 s and ~83 MB of private memory in every process that
imports tensordict (measured on the dev machine: ``python -X importtime -c "import torch;
import tensordict"``, ``/proc/self/smaps_rollup``). msrl never compiles, and a replica process
pays this once per process: a coarse job with two actors pays it four times.

:func:`install` puts a finder first on ``sys.meta_path`` that, the first time ``tensordict`` is
imported and only while ``torch._dynamo`` is not loaded yet, runs tensordict's module with those
two marks as identity functions, then puts them back. Eager semantics are unchanged (the marks
only steer Dynamo's tracing); a program that later compiles code calling those tensordict
functions traces into them (or breaks its graph there) instead of treating them as opaque:
slower compiled code, never different results. ``MSRL_EAGER_TENSORDICT=0`` turns it off.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any, Sequence

__all__ = ["install"]


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        import torch.compiler as compiler

        if "torch._dynamo" in sys.modules:  # already paid for: tensordict marks as it likes
            self.inner.exec_module(module)
            return
        saved = compiler.allow_in_graph, compiler.assume_constant_result
        compiler.allow_in_graph = compiler.assume_constant_result = _identity  # type: ignore[assignment]
        try:
            self.inner.exec_module(module)
        finally:
            compiler.allow_in_graph, compiler.assume_constant_result = saved


def _identity(fn: Any) -> Any:
    return fn


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of the ``tensordict`` package (once; then leaves ``sys.meta_path``)."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if name != "tensordict":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Puts the finder in place unless tensordict is imported already or the environment says
    ``MSRL_EAGER_TENSORDICT=0``."""
    if "tensordict" in sys.modules or os.environ.get("MSRL_EAGER_TENSORDICT") == "0":
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
