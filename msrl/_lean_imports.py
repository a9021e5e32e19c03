"""Keeps ``import tensordict`` and torch's optimisers from loading TorchDynamo in msrl's processes.

tensordict marks a few of its functions for ``torch.compile`` at import time
(``torch.compiler.allow_in_graph``, ``assume_constant_result``), and each mark imports
``torch._dynamo`` -- with sympy, most of a second and tens of MB of private memory in every
process that imports tensordict (``bench/RESULTS.md``, "Figures behind the code"). msrl never compiles, and a replica process
pays this once per process: a coarse job with two actors pays it four times.

:func:`install` puts a finder first on ``sys.meta_path`` that, the first time ``tensordict`` is
imported and only while ``torch._dynamo`` is not loaded yet, runs tensordict's module with those
two marks as identity functions, then puts them back. Eager semantics are unchanged (the marks
only steer Dynamo's tracing); a program that later compiles code calling those tensordict
functions traces into them (or breaks its graph there) instead of treating them as opaque:
slower compiled code, never different results. ``MSRL_EAGER_TENSORDICT=0`` turns it off.

:func:`lean_optimizers` does the same for ``torch.optim`` (called by :mod:`msrl.api`, which every
component imports). In torch 2.13 an optimiser's constructor (``add_param_group``), ``zero_grad``,
``state_dict`` and ``load_state_dict`` are wrapped by ``torch._disable_dynamo``, and every
``step`` by ``_use_grad_for_differentiable``, and both import ``torch._dynamo`` on their first
call: ``torch.optim.Adam([p], lr=0.1)`` alone costs about as much as ``import torch`` itself
(``bench/RESULTS.md``, "Figures behind the code"), and every replica that builds a learner pays
it. Both wrappers exist only
for Dynamo's tracing (``disable`` marks a function opaque to it; ``graph_break`` is a no-op when
nothing is being traced), and nothing can be traced before ``torch._dynamo`` is loaded. So:

* each ``_disable_dynamo`` wrapper's per-function cache (``fn.__dynamo_disable``, which torch
  fills on the first call) is pre-filled with a shim that calls ``fn`` directly while
  ``torch._dynamo`` is not loaded and, once it is, removes itself and hands over to torch's own
  wrapper (which then caches the real ``torch._dynamo.disable(fn)``);
* each optimiser class's ``step`` (torch's ``_use_grad`` wrapper, before the class is first
  instantiated and ``profile_hook_step`` wraps it) is replaced by one that sets the grad mode as
  torch's does and calls the undecorated step, and calls torch's own wrapper, graph breaks and
  all, whenever ``torch._dynamo`` is loaded.

Eager results are identical (the same function runs in the same grad mode); compiled code that
reaches an optimiser after something loaded Dynamo runs torch's wrappers unchanged.
``MSRL_EAGER_OPTIMIZERS=0`` turns it off.

:func:`defer_gc` and :func:`resume_gc` bracket a process's start-up (the ``msrl`` command, from
its first line to the job's first iteration): with torch's ~2 million objects alive, Python's
cyclic collector runs hundreds of collections during the imports and the job's build, its
full (generation 2) ones rescanning all of torch: a fifth of the main job's command
(``bench/RESULTS.md``, "Figures behind the code"). Start-up is then collected once it
is over: :func:`resume_gc` moves what start-up made into the permanent generation
(``gc.freeze``: the modules, classes and networks that live as long as the process, never
rescanned again) and turns the collector back on for the training loop.

:func:`freeze_before_exit` does the same for the interpreter's exit: its final collections
rescan every object torch made (a quarter of ``python -c "import torch"``; figures:
``bench/RESULTS.md``, "Figures behind the code"), although the process is about to end. Only the ``msrl``
command calls it, when its work is done (files closed, processes stopped); ``atexit`` handlers
still run.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any, Sequence

__all__ = ["install", "lean_optimizers", "defer_gc", "resume_gc", "freeze_before_exit"]


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


def _dynamo_loaded() -> bool:
    return "torch._dynamo" in sys.modules


class _UntilDynamo:
    """The cache entry a ``torch._disable_dynamo`` wrapper finds on ``fn`` (see the module)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not _dynamo_loaded():
            return self.fn(*args, **kwargs)
        if getattr(self.fn, _CACHE, None) is self:
            delattr(self.fn, _CACHE)  # torch's wrapper fills its own cache from now on
        return self.fn.__msrl_disable_wrapper__(*args, **kwargs)


_CACHE = "__dynamo_disable"  # the attribute torch._compile._disable_dynamo caches its disabled fn in
_DISABLE_WRAPPER_CODE: Any = None
_USE_GRAD_CODE: Any = None


def _lean_step(use_grad: Any) -> Any:
    """``step`` for an optimiser class whose step is torch's ``_use_grad`` wrapper ``use_grad``."""
    import functools

    import torch

    step = use_grad.__wrapped__

    @functools.wraps(step)
    def lean_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _dynamo_loaded():
            return use_grad(self, *args, **kwargs)
        prev = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            return step(self, *args, **kwargs)
        finally:
            torch.set_grad_enabled(prev)

    lean_step.__msrl_lean__ = True  # type: ignore[attr-defined]
    return lean_step


def lean_optimizers() -> list[str]:
    """Lets ``torch.optim``'s optimisers run without importing ``torch._dynamo`` (see the module
    docstring). Idempotent; does nothing when ``torch._dynamo`` is loaded already or the
    environment says ``MSRL_EAGER_OPTIMIZERS=0``.

    Returns:
        the qualified names of what was changed in this call (for tests and debugging).
    """
    global _DISABLE_WRAPPER_CODE, _USE_GRAD_CODE
    if _dynamo_loaded() or os.environ.get("MSRL_EAGER_OPTIMIZERS") == "0":
        return []
    import torch
    import torch.optim
    from torch.optim import optimizer as optimizer_module

    if _DISABLE_WRAPPER_CODE is None:  # the code objects of torch's two wrappers, from fresh instances
        _DISABLE_WRAPPER_CODE = torch._disable_dynamo(_identity).__code__
        _USE_GRAD_CODE = optimizer_module._use_grad_for_differentiable(_identity).__code__
    changed: list[str] = []
    classes = [c for c in vars(torch.optim).values()
               if isinstance(c, type) and issubclass(c, optimizer_module.Optimizer)]
    for cls in [optimizer_module.Optimizer, *classes]:
        for name, attr in list(vars(cls).items()):
            code = getattr(attr, "__code__", None)
            if code is _DISABLE_WRAPPER_CODE:
                fn = attr.__wrapped__
                if getattr(fn, _CACHE, None) is None:
                    fn.__msrl_disable_wrapper__ = attr
                    setattr(fn, _CACHE, _UntilDynamo(fn))
                    changed.append(f"{cls.__qualname__}.{name}")
            elif name == "step" and code is _USE_GRAD_CODE and not getattr(attr, "hooked", False):
                setattr(cls, name, _lean_step(attr))
                changed.append(f"{cls.__qualname__}.step")
    return changed


def lean_dispatch_mode(cls: Any) -> Any:
    """Class decorator: lets a ``TorchDispatchMode`` subclass dispatch without importing
    ``torch._dynamo``. torch wraps each subclass's ``__torch_dispatch__`` in
    ``torch._disable_dynamo`` (``TorchDispatchMode.__init_subclass__``), whose first call
    imports TorchDynamo (2.7 s on the 2-core machine, 5-6 s on the H200 machine: a capture's
    probe, under :class:`~msrl.runtime.host_syncs.HostSyncRecorder`, took that long); the same
    shim as :func:`lean_optimizers` runs the plain method until Dynamo is loaded, then hands
    over to torch's wrapper. Does nothing when Dynamo is loaded or ``MSRL_EAGER_OPTIMIZERS=0``."""
    global _DISABLE_WRAPPER_CODE
    if _dynamo_loaded() or os.environ.get("MSRL_EAGER_OPTIMIZERS") == "0":
        return cls
    import torch

    if _DISABLE_WRAPPER_CODE is None:
        _DISABLE_WRAPPER_CODE = torch._disable_dynamo(_identity).__code__
    attr = cls.__dict__.get("__torch_dispatch__")
    if getattr(attr, "__code__", None) is _DISABLE_WRAPPER_CODE:
        fn = attr.__wrapped__
        if getattr(fn, _CACHE, None) is None:
            fn.__msrl_disable_wrapper__ = attr
            setattr(fn, _CACHE, _UntilDynamo(fn))
    return cls


_GC_DEFERRED = False


def defer_gc() -> None:
    """Turns Python's cyclic garbage collector off for start-up (see the module docstring);
    :func:`resume_gc` turns it back on. Does nothing where the collector is off already (a
    caller's choice is kept) or ``MSRL_DEFER_GC=0``."""
    global _GC_DEFERRED
    import gc

    if gc.isenabled() and os.environ.get("MSRL_DEFER_GC") != "0":
        gc.disable()
        _GC_DEFERRED = True


def resume_gc() -> None:
    """Ends :func:`defer_gc`'s start-up: what is alive now goes to the permanent generation
    (``gc.freeze()``) and the collector is turned back on. Idempotent; does nothing unless
    :func:`defer_gc` turned the collector off."""
    global _GC_DEFERRED
    import gc

    if _GC_DEFERRED:
        _GC_DEFERRED = False
        gc.freeze()
        gc.enable()


def freeze_before_exit() -> None:
    """Moves every live object to the permanent generation (``gc.freeze()``), so the
    interpreter's final collections at exit skip them (see the module docstring). For a process
    that is about to exit: nothing it holds is collected as garbage afterwards."""
    import gc

    gc.freeze()
