"""A fragment's hot tensor code compiled by ``torch.compile`` (DESIGN.md §4: the backend's program
hook; ``distribution_policy.compile.<fragment>: inductor | off``, default ``off``).

A fragment program calls its components' methods from Python, op by op. Under ``inductor`` the
methods a component declares as pure tensor code (:meth:`msrl.api.Component.compile_targets`:
attribute paths such as ``"net.head"`` or ``"ppo_loss"``) are replaced, on the trainer's first
iteration, by a :class:`CompiledMethod`: ``torch.compile(fn, backend="inductor",
fullgraph=True, dynamic=False)`` of the same callable, so the pointwise ops between matrix
products fuse into generated kernels (Triton on a GPU, C++/OpenMP on the CPU) and, inside a
gradient step, AOTAutograd compiles the backward too. The rest of the program (the env step,
the draw from a component's ``torch.Generator``, the optimiser step, comm ops) runs as
before, so sampling keeps its seeded stream exactly and the program's meaning is the eager
one up to float rounding.

* **Fallback.** A target that TorchDynamo cannot trace whole (a graph break: a data-dependent
  branch, a ``torch.Generator`` argument, a call into host code) runs eagerly from then on,
  with one line naming the break and where (:attr:`CompiledMethod.reason`; the run prints it
  once on stderr through :func:`msrl.runtime.programs.capture.notify`, ``msrl graph`` lists it). The
  failed attempt runs nothing of the target: Dynamo traces before it executes.
* **Capture.** Compilation happens in the first (warm-up) iteration, before a capture
  (:mod:`msrl.runtime.programs.capture`) records anything: a captured iteration records the compiled
  kernels into its CUDA graph. Under a ``TorchDispatchMode`` (the capture's probe, the CPU
  tape) a target runs eagerly: those modes watch aten ops, which compiled kernels bypass.
* **Start-up.** The time of each target's first call (trace + compile + one run) is reported
  in the run's start-up notices (``compiled actor.net.head with inductor in 4.2 s``). Inductor
  caches generated code across runs (its FX-graph and AOTAutograd caches, on by default in
  torch's cache folder, ``TORCHINDUCTOR_CACHE_DIR``); a second run traces again but compiles
  less.

Measured on the 2-core CPU machine (``bench/results/gpu.md``, "torch.compile in torch_graph"),
compiled tiny MLPs were slower than eager there; the default stays ``off``.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import torch

from msrl.errors import MsrlError
from msrl.policy import COMPILE_MODES

__all__ = ["COMPILE_MODES", "CompileTargetError", "CompiledMethod", "CompiledProgram", "compile_targets_of",
           "compiled_program_of", "install", "resolve_compile"]


_lock = threading.Lock()


class CompileTargetError(MsrlError, AttributeError):
    """A component's :meth:`~msrl.api.Component.compile_targets` names an attribute that is not
    a callable it has."""


def resolve_compile(mode: str | None) -> str:
    """The compile mode of a fragment: ``mode`` as given, or (``None``) ``off``.

    Raises:
        ValueError: an unknown mode (the valid ones are :data:`COMPILE_MODES`).
    """
    if mode is None:
        return "off"
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {mode!r}; valid: {', '.join(COMPILE_MODES)}")
    return mode


def _dispatch_mode_active() -> bool:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is not None


def _one_line(e: BaseException) -> str:
    """The graph break's first line and the innermost user frame of Dynamo's message
    (``file:line``), or the exception's type and first line."""
    lines = str(e).strip().splitlines()
    first = lines[0] if lines else type(e).__name__
    where = ""
    for i, line in enumerate(lines):  # Dynamo's "from user code:" frames, innermost last
        s = line.strip()
        if s.startswith('File "') and ", line " in s and "torch/" not in s.split('"')[1]:
            path = s.split('"')[1]
            lineno = s.split(", line ")[1].split(",")[0]
            src = lines[i + 1].strip() if i + 1 < len(lines) else ""
            where = f" at {path}:{lineno}" + (f" ({src})" if src else "")
    return f"{type(e).__name__}: {first}{where}"


class CompiledMethod:
    """A callable replaced by its ``torch.compile`` (inductor, whole graph, static shapes),
    falling back to the callable itself on a graph break (see the module's docstring).

    Args:
        fn: the component's callable (a bound method, a function).
        name: its label in notices (``"actor.net.head"``).
        notify: called with one line when the first call compiled (its time) or fell back
            (the reason).

    Attributes:
        reason: why it runs eagerly (``None`` while compiled).
        seconds: the first compiled call's wall time (trace + compile + run), or ``None``.
    """

    __slots__ = ("eager", "name", "reason", "seconds", "_compiled", "_notify")

    def __init__(self, fn: Callable[..., Any], name: str, notify: Callable[[str], None]) -> None:
        self.eager = fn
        self.name = name
        self.reason: str | None = None
        self.seconds: float | None = None
        self._compiled = torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False)
        self._notify = notify

    @property
    def status(self) -> str:
        """``inductor`` (compiled, or not yet called) or ``eager: <reason>``."""
        return "inductor" if self.reason is None else f"eager: {self.reason}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.reason is not None or _dispatch_mode_active():
            return self.eager(*args, **kwargs)
        first = self.seconds is None
        t = time.perf_counter()
        try:
            out = self._compiled(*args, **kwargs)
        except Exception as e:  # a graph break is traced before anything ran: the eager call is the first
            from torch._dynamo.exc import TorchDynamoException  # loaded: the call above went through Dynamo

            if not isinstance(e, TorchDynamoException):
                raise
            self.reason = _one_line(e)
            self._notify(f"{self.name} runs eagerly (compile: inductor): {self.reason}")
            return self.eager(*args, **kwargs)
        if first:
            self.seconds = time.perf_counter() - t
            self._notify(f"compiled {self.name} with inductor in {self.seconds:.1f} s")
        return out


def _resolve(component: Any, path: str) -> tuple[Any, str, Any]:
    owner = component
    parts = path.split(".")
    for p in parts[:-1]:
        owner = getattr(owner, p, None)
        if owner is None:
            break
    fn = getattr(owner, parts[-1], None) if owner is not None else None
    if fn is None or not callable(fn) or isinstance(fn, torch.nn.Module):
        raise CompileTargetError(f"{type(component).__name__}.compile_targets() names {path!r}, which is not a method "
                                 "or function of the component (a module: name its forward)")
    return owner, parts[-1], fn


def compile_targets_of(trainer: Any) -> list[tuple[str, str]]:
    """``(role, path)`` of every compile target of ``trainer``'s components, in role order."""
    out = []
    for role, comp in getattr(trainer, "components", {}).items():
        targets = getattr(comp, "compile_targets", None)
        for path in targets() if targets is not None else ():
            out.append((role, path))
    return out


def install(trainer: Any, notify: Callable[[str], None], roles: Sequence[str] | None = None) -> list[CompiledMethod]:
    """Replaces each compile target of ``trainer``'s components (those of ``roles``; default
    all) by a :class:`CompiledMethod`, set as an attribute of the object that owns it (an
    instance attribute shadowing the class's method). Targets already replaced are kept.

    Returns:
        the :class:`CompiledMethod` of every target.

    Raises:
        CompileTargetError: a declared target is not a callable attribute.
    """
    out = []
    for role, path in compile_targets_of(trainer):
        if roles is not None and role not in roles:
            continue
        owner, attr, fn = _resolve(trainer.components[role], path)
        if not isinstance(fn, CompiledMethod):
            fn = CompiledMethod(fn, f"{role}.{path}", notify)
            setattr(owner, attr, fn)
        out.append(fn)
    return out


class CompiledProgram:
    """A fragment program whose components' compile targets are compiled (see the module's
    docstring); called as the program it wraps, ``fn(trainer, comm)``.

    Args:
        fn: the generated program (or the program as another wrapper left it).
        roles: the roles of the fragment (whose components' targets are compiled).
    """

    def __init__(self, fn: Callable[[Any, Any], Any], roles: Sequence[str]) -> None:
        self.fn = fn
        self.roles = tuple(roles)
        #: trainer id -> its compiled methods (installed at the trainer's first call)
        self.methods: dict[int, list[CompiledMethod]] = {}

    def __call__(self, trainer: Any, comm: Any) -> Any:
        if id(trainer) not in self.methods:
            from msrl.runtime.programs.capture import notify

            with _lock:
                self.methods[id(trainer)] = install(trainer, lambda line: notify(trainer, line), self.roles)
        return self.fn(trainer, comm)

    def status(self, trainer: Any) -> list[str]:
        """One line per compile target of ``trainer``: ``<role>.<path>: inductor`` or
        ``... : eager: <reason>`` (empty before the trainer's first call)."""
        return [f"{m.name}: {m.status}" for m in self.methods.get(id(trainer), [])]


def compiled_program_of(fn: Any) -> CompiledProgram | None:
    """The :class:`CompiledProgram` of a fragment's program as its backend wrapped it (itself,
    or inside a :class:`~msrl.runtime.programs.capture.CapturedProgram`), or ``None``."""
    while fn is not None and not isinstance(fn, CompiledProgram):
        fn = getattr(fn, "fn", None)
    return fn
