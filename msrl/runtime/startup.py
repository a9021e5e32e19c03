"""Start-up of the processes msrl owns: what it changes there, why, and nothing anywhere else.

``import msrl`` (and ``msrl.api``, ``msrl.train``, ``msrl.load``) changes nothing of the process
it is imported into: torch, ``torch.optim`` and tensordict stay exactly as they are. The
shortcuts below run only where :func:`own_process` is called, which msrl does in the processes
it owns -- the ``msrl`` command (once its config says whether the job compiles), every Ray
replica process (before it imports anything heavy) -- and in a user's process only when asked,
``msrl.train(..., own_process=True)``. They apply only to the torch releases in
:data:`TESTED_TORCH` (another release runs plain torch; a debug line of the logger
``msrl.runtime.startup`` says so once), never in a job that compiles a fragment
(``distribution_policy.compile``: TorchDynamo is loaded there anyway and tensordict's marks
steer it), and they are thread-safe (:class:`~msrl.runtime.local.LocalRuntime` runs replicas on
threads). The env engine's worker processes import no torch and change nothing.

What :func:`own_process` changes, and why (figures: ``bench/results/startup.md``, "Figures behind the
code" and the start-up sections; ``python bench/bench_startup.py``):

* **tensordict without its compile marks.** tensordict marks a few of its functions for
  ``torch.compile`` at import time (``torch.compiler.allow_in_graph``,
  ``assume_constant_result``), and each mark imports ``torch._dynamo`` -- with sympy, most of a
  second and tens of MB of private memory in every process that imports tensordict. A finder put
  first on ``sys.meta_path`` runs tensordict's module, the first time it is imported and only
  while ``torch._dynamo`` is not loaded yet, with those two marks as identity functions, then
  puts them back. Eager semantics are unchanged (the marks only steer Dynamo's tracing).
  ``MSRL_EAGER_TENSORDICT=0`` turns it off.
* **torch.optim without TorchDynamo's wrappers while nothing has loaded Dynamo.** In torch
  2.13 an optimiser's constructor (``add_param_group``), ``zero_grad``, ``state_dict`` and
  ``load_state_dict`` are wrapped by ``torch._disable_dynamo``, and every ``step`` by
  ``_use_grad_for_differentiable``; both import ``torch._dynamo`` on their first call:
  ``torch.optim.Adam([p], lr=0.1)`` alone costs about as much as ``import torch``. Both
  wrappers exist only for Dynamo's tracing, and nothing can be traced before ``torch._dynamo``
  is loaded. So each ``_disable_dynamo`` wrapper's per-function cache (``fn.__dynamo_disable``)
  is pre-filled with a shim that calls ``fn`` directly while ``torch._dynamo`` is not loaded and,
  once it is, removes itself (under a lock) and hands over to torch's own wrapper; and each
  optimiser class's ``step`` is replaced by one that sets the grad mode as torch's does and
  calls the undecorated step, or torch's own wrapper whenever ``torch._dynamo`` is loaded. Eager
  results are bitwise the same (``tests/test_startup.py``). ``MSRL_EAGER_OPTIMIZERS=0`` turns it
  off.
* **The cyclic collector deferred through start-up** (:func:`defer_gc`, :func:`resume_gc`, the
  ``msrl`` command only): with torch's ~2 million objects alive, Python's full collections
  during the imports and the job's build rescan all of torch, a fifth of the main job's command.
  Start-up is collected once it is over: what it made goes to the permanent generation
  (``gc.freeze``) and the collector is turned back on for the training loop.
  :func:`freeze_before_exit` does the same for the interpreter's exit (its final collections
  rescan every object torch made). ``MSRL_DEFER_GC=0`` turns the deferral off.
* **glibc's malloc holding its heap at the training step's peak** (:func:`steady_malloc`, in
  :func:`own_process`). A gradient step frees and allocates the same tens of MB of activations
  every step (CQL's critics on 7,680 sampled actions a minibatch: 7.9 MB tensors); glibc's
  dynamic thresholds trim the heap's top once more than twice the largest freed chunk is free,
  so every step gives the pages back and faults them in again, zeroed by the kernel: 11,000 page
  faults a gradient step, 17% of CQL's process time in the kernel on HalfCheetah. The mmap
  threshold is fixed at glibc's largest (32 MiB: bigger blocks are still mapped and returned)
  and the trim threshold at 1 GiB, so the heap stays at the size the loop reaches every step,
  as a caching allocator keeps it. ``MSRL_STEADY_MALLOC=0`` turns it off; other C libraries
  are left alone.

:func:`lean_dispatch_mode` is the one shortcut outside :func:`own_process`: it changes only
msrl's own ``TorchDispatchMode`` classes (the capture's probe and recorder), never torch's.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
from typing import Any, Mapping, Sequence

__all__ = ["TESTED_TORCH", "own_process", "owned_changes", "steady_malloc", "job_compiles", "config_compiles",
           "lean_dispatch_mode", "defer_gc", "resume_gc", "freeze_before_exit"]

#: the torch releases whose private wrappers (``torch._disable_dynamo``'s cache attribute,
#: ``_use_grad_for_differentiable``'s body) :func:`own_process` was tested against, bitwise
#: (``tests/test_startup.py``); any other release runs plain torch
TESTED_TORCH = ("2.13.0",)

_LOG = logging.getLogger("msrl.runtime.startup")
_LOCK = threading.RLock()  # own_process and the shims' hand-over to torch's wrappers
_OWNED: list[str] = []     # what own_process changed in this process
_SAID: set[str] = set()    # the debug lines said once


def _say_once(line: str) -> None:
    if line not in _SAID:
        _SAID.add(line)
        _LOG.debug(line)


def torch_release() -> str:
    """The torch release without its local part (``"2.13.0"`` for ``2.13.0+cpu``): the imported
    module's, or, before ``import torch``, the installed package's (torch is not imported for
    it); ``"none"`` where torch is not installed."""
    torch = sys.modules.get("torch")
    if torch is not None:
        version = torch.__version__
    else:
        import importlib.metadata

        try:
            version = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            return "none"
    return str(version).split("+")[0]


def job_compiles(compile_modes: Mapping[str, str]) -> bool:
    """Whether a job compiles a fragment: ``distribution_policy.compile`` (fragment -> mode)
    names a mode other than ``off``."""
    return any(mode != "off" for mode in compile_modes.values())


def config_compiles(raw: Any) -> bool | None:
    """Whether a config mapping, read but not yet validated, compiles a fragment
    (``distribution_policy.compile`` naming a mode other than ``off``; YAML's unquoted ``off``,
    read as ``False``, is ``off``). ``None``: not a mapping this can read (its error comes from
    the validation that follows)."""
    try:
        modes = (raw.get("distribution_policy") or {}).get("compile") or {}
        return job_compiles({k: "off" if v is False else str(v) for k, v in dict(modes).items()})
    except (AttributeError, TypeError, ValueError):
        return None


def own_process(*, compiles: bool = False) -> list[str]:
    """Makes this process msrl's own for start-up (the module docstring says what changes).

    Called by msrl in the processes it owns, before the job's components are built; a user's
    process gets it only through ``msrl.train(..., own_process=True)``. Idempotent and
    thread-safe. Changes nothing when ``compiles`` (the job compiles a fragment), when the torch
    release is not in :data:`TESTED_TORCH`, or when ``torch._dynamo`` is loaded already (each
    said once at debug level).

    Args:
        compiles: the job compiles a fragment (:func:`job_compiles` of its config).

    Returns:
        what this call changed: ``"tensordict"`` for the import finder, the qualified names
        of the ``torch.optim`` methods, ``"glibc malloc"`` for :func:`steady_malloc` (empty when
        nothing was changed). Before ``import torch`` the optimisers are changed once torch's
        import ends (the finder waits for it; nothing else of torch is touched):
        :func:`owned_changes` lists them from then on.
    """
    if compiles:
        _say_once("start-up: plain torch (the job compiles a fragment)")
        return []
    release = torch_release()
    if release not in TESTED_TORCH:
        _say_once(f"start-up: plain torch ({release} is not a release msrl's start-up was tested on: "
                  f"{', '.join(TESTED_TORCH)})")
        return []
    with _LOCK:
        changed: list[str] = []
        pending = set()
        finder = next((f for f in sys.meta_path if isinstance(f, _Finder)), None)
        waiting = finder.pending if finder is not None else set()
        if ("tensordict" not in sys.modules and "tensordict" not in waiting and not _dynamo_loaded()
                and os.environ.get("MSRL_EAGER_TENSORDICT") != "0"):
            pending.add("tensordict")
            changed.append("tensordict")
        if "torch" in sys.modules:
            changed += _lean_optimizers()
        else:  # torch's own import ends before the optimisers are changed
            pending.add("torch")
        _install_finder(pending)
        changed += steady_malloc()
        _OWNED.extend(changed)
        return changed


#: ``mallopt``'s parameters (glibc's ``malloc.h``) and the values :func:`steady_malloc` sets
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD, _TRIM_THRESHOLD = 32 << 20, 1 << 30


def steady_malloc() -> list[str]:
    """Keeps glibc's malloc from trimming its heap between training steps (the module docstring
    says why): the mmap threshold fixed at 32 MiB, the trim threshold at 1 GiB. Only
    :func:`own_process` calls it. Once per process; nothing under another C library or with
    ``MSRL_STEADY_MALLOC=0``.

    Returns:
        ``["glibc malloc"]`` when this call set the thresholds, else ``[]``.
    """
    import ctypes
    import platform

    with _LOCK:
        if "glibc malloc" in _OWNED or os.environ.get("MSRL_STEADY_MALLOC") == "0":
            return []
        libc = platform.libc_ver()[0]
        if libc != "glibc":
            _say_once(f"start-up: malloc left as it is (C library {libc or 'unknown'}, not glibc)")
            return []
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        if mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) != 1:
            _say_once("start-up: malloc left as it is (glibc refused mallopt)")
            return []
        return ["glibc malloc"]


def owned_changes() -> list[str]:
    """What :func:`own_process` has changed in this process so far (empty: nothing; for tests
    and ``msrl`` debugging)."""
    with _LOCK:
        return list(_OWNED)


class _TensordictLoader(importlib.abc.Loader):
    """Runs tensordict's package with ``torch.compiler``'s two marks as identity functions,
    then puts them back (see the module docstring)."""

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


class _TorchLoader(importlib.abc.Loader):
    """Runs torch's package as it is, then changes its optimisers (:func:`_lean_optimizers`)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        try:
            changed = _lean_optimizers()
        except Exception as e:  # noqa: BLE001 - a start-up shortcut never breaks torch's import
            _say_once(f"start-up: plain torch.optim ({type(e).__name__}: {e})")
            return
        with _LOCK:
            _OWNED.extend(changed)


_LOADERS = {"tensordict": _TensordictLoader, "torch": _TorchLoader}


def _identity(fn: Any) -> Any:
    return fn


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loaders of the packages it waits for (``tensordict``, ``torch``), each once;
    leaves ``sys.meta_path`` when it waits for none."""

    def __init__(self) -> None:
        self.pending: set[str] = set()

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if name not in self.pending:
            return None
        with _LOCK:
            self.pending.discard(name)
            if not self.pending and self in sys.meta_path:
                sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _LOADERS[name](spec.loader)
        return spec


def _install_finder(names: set[str]) -> None:
    """Makes the finder (first on ``sys.meta_path``) wait for ``names`` too."""
    if not names:
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _Finder)), None)
    if finder is None:
        finder = _Finder()
        sys.meta_path.insert(0, finder)
    finder.pending |= names


def _dynamo_loaded() -> bool:
    return "torch._dynamo" in sys.modules


class _UntilDynamo:
    """The cache entry a ``torch._disable_dynamo`` wrapper finds on ``fn`` (see the module)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not _dynamo_loaded():
            return self.fn(*args, **kwargs)
        with _LOCK:  # several threads may hand over at once: one removes the entry
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


def _lean_optimizers() -> list[str]:
    """Lets ``torch.optim``'s optimisers run without importing ``torch._dynamo`` (see the module
    docstring; only :func:`own_process` calls it). Idempotent; does nothing when
    ``torch._dynamo`` is loaded already or the environment says ``MSRL_EAGER_OPTIMIZERS=0``.

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
    probe, under :class:`~msrl.runtime.programs.host_syncs.HostSyncRecorder`, took that long); the same
    shim as :func:`own_process` gives the optimisers runs the plain method until Dynamo is loaded, then hands
    over to torch's wrapper. Changes only ``cls`` (msrl's own class), never torch. Does nothing
    when Dynamo is loaded, the torch release is not in :data:`TESTED_TORCH` or
    ``MSRL_EAGER_OPTIMIZERS=0``."""
    global _DISABLE_WRAPPER_CODE
    if _dynamo_loaded() or os.environ.get("MSRL_EAGER_OPTIMIZERS") == "0" or torch_release() not in TESTED_TORCH:
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
