"""A fragment's iteration captured once and replayed (DESIGN.md §4: the backend's program hook).

On a GPU a fragment program launches every op of its iteration from Python: ~700 kernel
launches per PPO iteration, each a few microseconds of host work for a few microseconds of GPU
work, so the GPU waits on the host. A CUDA graph (``torch.cuda.CUDAGraph``) records the
iteration's launches once and replays them with one call. :class:`CapturedProgram` does this
for a fragment's generated program, chosen per fragment in YAML
(``distribution_policy.capture.<fragment>: graph | eager``; default ``graph`` on a CUDA
device, ``eager`` on the CPU):

1. **warm-up**: the first :data:`WARMUP` iterations run eagerly (the optimiser creates its
   state, the allocator and the kernels settle);
2. **probe**: the next iteration runs eagerly under a
   :class:`~msrl.runtime.programs.host_syncs.HostSyncRecorder` and between two snapshots of the
   trainer's host state (:func:`host_state`). A replay re-runs the device work only: no Python
   runs, so an op that reads the device on the host, a tensor made from host data, a Python
   value that changes each iteration (a step counter, a learning rate computed as a float), a
   tensor attribute rebound to a new tensor, a draw from Python's or NumPy's global generator,
   an optimiser counting its steps on the host, or a Python number in the program's output
   would all be frozen at the capture, and a component whose
   :meth:`~msrl.api.Component.replay_contract` says ``capturable=False`` (a gymnasium env)
   would not run at all. The first such finding is the fragment's one-line
   reason to stay eager
   (:attr:`CapturedProgram.status`; ``msrl graph`` prints it, and a run prints it on stderr,
   from whichever process the replica runs in: :func:`pop_notices`) -- a best effort
   would change the program's meaning;
3. **capture**: the next iteration is captured (and, on a GPU, replayed once: capture records
   without running) with its trainer state attributes (``self.obs``) in static buffers: the
   program's last op copies each into the buffer the next replay reads. A capture that fails
   half-way restores the trainer's state and global generators from a snapshot, runs the
   iteration eagerly, and stays eager with the error as its reason;
4. **replay** from then on. A state attribute whose shape, dtype or device changed, a
   checkpoint loaded (:func:`invalidate`) or another program of the trainer run in between
   sends it back to 1.

Host bookkeeping a replay must repeat is declared by the component through one protocol
method, :meth:`msrl.api.Component.replay_contract` (a :class:`~msrl.api.ReplayContract`), not
guessed: ``counters`` names integer attributes that advance by the same amount each iteration
(a native env's ``_env_steps``), each advanced by the captured iteration's amount after a
replay, and ``logs`` names lists the iteration appends device tensors to (a native env's
finished episodes), appended the captured items again after a replay (their tensors hold the
replay's values; items left from the previous replay are cloned first). The object walk of
the probe (:func:`~msrl.runtime.programs.host_state.host_state`) is the check of that contract: what it finds changed that no
contract declares keeps the fragment eager, named in the reason.

On the CPU (``capture: graph`` on a CPU fragment, and CI, which has no GPU) the same machinery
runs with a :class:`~msrl.runtime.programs.replay.Tape` in place of the CUDA graph: a ``TorchDispatchMode`` that records each
aten op of the captured iteration with its arguments, and the native kernels' host launches
(:func:`msrl.device.record_foreign`), and replays them in order on the same tensors: the ops of the
iteration re-run without Python, exactly what a replayed graph does. A program that is not
replay-safe gives different results under the tape than eagerly, as it would on a GPU; the
tests compare the two bitwise. The tape is for checking: it is slower than eager execution.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils._pytree import tree_map

from msrl.api import ReplayContract
from msrl.device import in_host_side, register_packer
from msrl.policy import CAPTURE_MODES
from msrl.runtime.programs import packing
from msrl.runtime.programs.host_state import assignment_site, find_objects, first_change, host_state, source_of
from msrl.runtime.programs.host_syncs import HostSyncRecorder
from msrl.runtime.programs.replay import CudaGraph, NotCapturable, Tape
from msrl.runtime.startup import lean_dispatch_mode

__all__ = ["CAPTURE_MODES", "WARMUP", "CapturedProgram", "Capture", "captures", "NotCapturable", "invalidate", "notify",
           "pop_notices", "replayed", "resolve_capture"]

#: eager iterations before the probe (the optimiser's state is created in the first)
WARMUP = 1

def resolve_capture(mode: str | None, device: str) -> str:
    """The capture mode of a fragment: ``mode`` as given, or (``None``) ``graph`` on a CUDA
    device and ``eager`` elsewhere.

    Raises:
        ValueError: an unknown mode (the valid ones are :data:`CAPTURE_MODES`).
    """
    if mode is None:
        return "graph" if torch.device(device).type == "cuda" else "eager"
    if mode not in CAPTURE_MODES:
        raise ValueError(f"unknown capture mode {mode!r}; valid: {', '.join(CAPTURE_MODES)}")
    return mode


# -- the captured program ---------------------------------------------------------------------

@dataclasses.dataclass
class Capture:
    """One trainer's capture of one program, as :func:`captures` reports it.

    Attributes:
        runs: calls so far; ``probed``: the probe iteration ran; ``graph``: the captured graph
            (a CUDA graph, or on the CPU a :class:`Tape`; ``None`` before the capture);
        replays: replays of ``graph`` since it was captured; ``probe_s``: the probe's wall time (s).
    """

    runs: int = 0
    probed: bool = False
    graph: Any = None
    out: Any = None
    statics: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    counters: list[tuple[Any, str, int]] = dataclasses.field(default_factory=list)
    logs: list[tuple[Any, str, list]] = dataclasses.field(default_factory=list)
    replays: int = 0
    probe_s: float = 0.0  # the probe iteration's wall time (s)


_registry: "weakref.WeakKeyDictionary[Any, dict[int, Capture]]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def captures(trainer: Any) -> list[Capture]:
    """The captures of ``trainer``'s programs (one per captured program that has run; empty:
    none), for ``msrl graph``, debugging and tests. Reading them changes nothing."""
    with _lock:
        return list(_registry.get(trainer, {}).values())


_notices: "weakref.WeakKeyDictionary[Any, list[str]]" = weakref.WeakKeyDictionary()


def notify(trainer: Any, line: str) -> None:
    """Queues one notice line about ``trainer``'s programs for :func:`pop_notices` (captured or
    why not; a compiled target's time or why it runs eagerly: :mod:`msrl.runtime.programs.compiled`)."""
    with _lock:
        _notices.setdefault(trainer, []).append(line)


def pop_notices(trainer: Any) -> list[str]:
    """What the captured programs of ``trainer`` have to say since the last call, one line each
    (captured, or why not): :meth:`msrl.runtime.replica.Replica.pop_notices` passes them to the
    driver, which prints them. Called every iteration: without notices it takes no lock."""
    if trainer not in _notices:
        return []
    with _lock:
        return _notices.pop(trainer, [])


_replaying: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def replayed(trainer: Any) -> bool:
    """Whether the last captured program run on ``trainer`` was a replay: its output tensors,
    and the items its components logged (their contracts' ``logs``), are the captured ones, the same
    tensors every replay (:meth:`msrl.runtime.replica.Replica.read_iteration` then reads them
    through :func:`packed`)."""
    return _replaying.get(trainer, False)


#: captured packs kept (:func:`packed`), least recently used dropped first


# msrl.device.start_read(static=True) packs a replayed iteration's outputs (looked up at each call)
register_packer(lambda tensors: packing.packed(tensors))


def invalidate(trainer: Any) -> None:
    """Drops every capture made on ``trainer`` (a checkpoint was loaded into it, its tensors
    replaced): its programs warm up, probe and capture again."""
    with _lock:
        _registry.pop(trainer, None)


def _replayed(trainer: Any) -> tuple[list[tuple[str, Any, str]], list[tuple[str, Any, str]]]:
    """The counters and logs the trainer's components declare in their replay contracts
    (:meth:`msrl.api.Component.replay_contract`): ``(path, component, attribute)`` each."""
    counters, logs = [], []
    for role, comp in getattr(trainer, "_components", {}).items():
        contract = _contract(comp)
        counters += [(f"{role}.{attr}", comp, attr) for attr in contract.counters]
        logs += [(f"{role}.{attr}", comp, attr) for attr in contract.logs]
    return counters, logs


def _contract(component: Any) -> ReplayContract:
    """A component's :class:`~msrl.api.ReplayContract` (an object without the method: the default)."""
    declare = getattr(component, "replay_contract", None)
    return declare() if declare is not None else ReplayContract()


def _host_rngs(device: torch.device) -> dict[str, Any]:
    """The states of the host's global generators a replay would not advance: Python's
    ``random`` and NumPy's, and torch's CPU generator when the fragment is on a GPU (its CPU
    ops are not in the CUDA graph; on the CPU the tape replays them)."""
    out = {"Python's global random generator (random.random, ...)": random.getstate(),
           "NumPy's global random generator (np.random.*)": repr(np.random.get_state())}
    if device.type == "cuda":
        out["torch's CPU generator"] = torch.random.get_rng_state().tolist()
    return out


_LIFT = (torch.ops.aten.lift_fresh, torch.ops.aten.lift_fresh_copy)
_COPIES = (torch.ops.aten._to_copy, torch.ops.aten.copy_)


@lean_dispatch_mode  # (msrl/runtime/startup.py)
class _ProbeRecorder(HostSyncRecorder):
    """A :class:`~msrl.runtime.programs.host_syncs.HostSyncRecorder` that also records what a CUDA graph
    cannot hold besides host syncs: a tensor made from host data (``torch.tensor``,
    ``torch.as_tensor``: ``lift_fresh``) and, on a GPU (``device``), a host-to-device copy."""

    internal_files = (*HostSyncRecorder.internal_files, "msrl/runtime/programs/capture.py")

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        if not in_host_side():
            packet = func.overloadpacket
            if packet in _LIFT:
                self._record(packet.__name__, "a tensor made from host data (torch.tensor, torch.as_tensor, torch.from_numpy): "
                                              "on a GPU a copy from host memory")
            elif self.device.type == "cuda" and packet in _COPIES and _host_to_device(packet, args, kwargs):
                self._record(packet.__name__, "a copy from host memory to the GPU")
        return super().__torch_dispatch__(func, types, args, kwargs)


def _host_to_device(packet: Any, args: Sequence[Any], kwargs: Any) -> bool:
    kwargs = kwargs or {}
    if packet is torch.ops.aten._to_copy:
        src, dev = args[0], kwargs.get("device")
        return isinstance(src, torch.Tensor) and src.device.type == "cpu" and dev is not None \
            and torch.device(dev).type == "cuda"
    dst, src = args[0], args[1]
    return isinstance(src, torch.Tensor) and src.device.type == "cpu" and dst.device.type == "cuda"


def _roots(trainer: Any) -> dict[str, Any]:
    roots = dict(getattr(trainer, "_components", {}))
    own = {k: v for k, v in vars(trainer).items() if k != "_components"}
    roots["self"] = own
    return roots


class CapturedProgram:
    """A fragment program run eagerly, probed, captured and replayed (see the module's
    docstring); called as the program it wraps, ``fn(trainer, comm)``.

    Args:
        fn: the generated program ``program(self, comm)``.
        method: the traced method it was generated for (in its notices).
        state_attrs: the trainer attributes the program reads and writes back (``obs``).
        device: the fragment's device: ``cuda`` captures CUDA graphs, ``cpu`` a :class:`Tape`.
        reason: why it cannot be captured, known before it runs (boundary ops), or ``None``.
    """

    def __init__(self, fn: Callable[[Any, Any], Any], method: str, state_attrs: Sequence[str], device: str,
                 reason: str | None = None) -> None:
        self.fn, self.method = fn, method
        self.state_attrs = tuple(state_attrs)
        self.device = torch.device(device)
        #: the one-line reason this program runs eagerly (``None`` while it may be captured)
        self.reason = reason
        self._calls, self._told = 0, False

    @property
    def status(self) -> str:
        """``graph`` (captured and replayed, or still warming up), or ``eager: <reason>``."""
        return "graph" if self.reason is None else f"eager: {self.reason}"

    def capture_of(self, trainer: Any) -> Capture | None:
        """This program's :class:`Capture` on ``trainer`` (``None``: it has not run there since
        its last invalidation). Reading it changes nothing."""
        with _lock:
            return _registry.get(trainer, {}).get(id(self))

    def replays_next(self, trainer: Any) -> bool:
        """Whether the next call on ``trainer`` is a replay (captured, nothing run in between,
        the state attributes still fit their buffers): no Python of the program runs then, so
        it cannot draw from the global generators (the runtime's watch over them is skipped:
        :meth:`msrl.runtime.replica.Replica.run_method`). Changes nothing."""
        if self.reason is not None:
            return False
        caps = _registry.get(trainer)
        cap = caps.get(id(self)) if caps is not None and len(caps) == 1 else None
        if cap is None or cap.graph is None:
            return False
        for a, buf in cap.statics.items():
            v = getattr(trainer, a, None)
            if v is not buf and (not isinstance(v, torch.Tensor) or v.shape != buf.shape or v.dtype != buf.dtype
                                 or v.device != buf.device):
                return False
        return True

    def __call__(self, trainer: Any, comm: Any) -> Any:
        _replaying.pop(trainer, None)
        if self.reason is not None:
            self._calls += 1
            if self._calls == WARMUP + 1 and not self._told:  # a program that runs once (reset) says nothing
                self._give_up(trainer, self.reason)
            return self.fn(trainer, comm)
        with _lock:
            caps = _registry.setdefault(trainer, {})
            for key in [k for k in caps if k != id(self)]:  # another program ran: its captures re-made
                del caps[key]
            cap = caps.get(id(self))
            if cap is None:
                cap = caps[id(self)] = Capture()
        if cap.graph is not None:
            if self._inputs_fit(trainer, cap):
                out = self._replay(cap)
                _replaying[trainer] = True
                return out
            cap = caps[id(self)] = Capture()
        cap.runs += 1
        if cap.runs <= WARMUP:
            return self._eager(trainer, comm)
        if not cap.probed:
            for role, comp in getattr(trainer, "_components", {}).items():
                if not _contract(comp).capturable:
                    self._give_up(trainer, f"its {role} ({type(comp).__name__}, {source_of(type(comp))}) works on the "
                                           "host, outside torch (its replay_contract: capturable=False): a replay would "
                                           "not run it")
                    return self.fn(trainer, comm)
            t0 = time.perf_counter()
            out = self._probe(trainer, comm)
            cap.probe_s = time.perf_counter() - t0
            cap.probed = True
            return out
        return self._capture(trainer, comm, cap)

    # each stage ---------------------------------------------------------------------------
    def _eager(self, trainer: Any, comm: Any) -> Any:
        if self.device.type == "cuda":  # warm up on a side stream (torch.cuda.graphs' advice)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                out = self.fn(trainer, comm)
            torch.cuda.current_stream(self.device).wait_stream(side)
            return out
        return self.fn(trainer, comm)

    def _probe(self, trainer: Any, comm: Any) -> Any:
        counters, logs = _replayed(trainer)
        # tensor state attributes are the static buffers' business; Python ones are host state
        skip = [p for p, _, _ in counters + logs] + [f"self[{a!r}]" for a in self.state_attrs
                                                      if isinstance(getattr(trainer, a, None), torch.Tensor)]
        roots = _roots(trainer)
        before, rngs = host_state(roots, skip), _host_rngs(self.device)
        with _ProbeRecorder(self.device) as rec:
            out = self.fn(trainer, comm)
        after = host_state(_roots(trainer), skip)
        reason = None
        if rec.syncs:
            s = rec.syncs[0]
            reason = f"{s.op} at {s.where}: {s.why}; a replay cannot do it"
        if reason is None:
            for name, state in _host_rngs(self.device).items():
                if state != rngs[name]:
                    reason = (f"{name} drew during an iteration: its draws are made on the host, and a replay "
                              "would repeat the captured ones; draw with torch on the fragment's device")
                    break
        if reason is None:
            change = first_change(before, after)
            if change is not None:
                path, a, b = change
                root = roots.get(path.split(".")[0].split("[")[0])
                site = assignment_site(root, path) if root is not None and not path.startswith("self") else "?"
                what = "rebound to another tensor" if isinstance(a, tuple) and a and a[0] == "tensor" else \
                    f"changed from {a!r} to {b!r}"
                reason = (f"{path.replace('#len', ' (its length)')} {what} during an iteration (at {site}); "
                          "a replay runs the device work only: keep it in a tensor updated in place")
        if reason is None:
            for path, opt in find_objects(trainer, torch.optim.Optimizer):
                if not all(g.get("fused") or g.get("capturable") for g in opt.param_groups):
                    reason = (f"{path} ({type(opt).__name__}) keeps its step count on the host: build it with "
                              "fused=True or capturable=True")
                    break
        if reason is None:
            for path, leaf in _leaves(out):
                if not isinstance(leaf, torch.Tensor):
                    reason = (f"the program's output {path} is a Python {type(leaf).__name__}; a replay would "
                              "return the captured value: return a tensor")
                    break
        if reason is not None:
            self._give_up(trainer, reason)
        return out

    def _give_up(self, trainer: Any, reason: str) -> None:
        """Runs eagerly from now on, for ``reason`` (one notice, once per program)."""
        self.reason, self._told = reason, True
        notify(trainer, f"{self.method} runs eagerly, not captured: {reason}")

    def _capture(self, trainer: Any, comm: Any, cap: Capture) -> Any:
        t0 = time.perf_counter()
        statics = {}
        for a in self.state_attrs:
            v = getattr(trainer, a, None)
            if isinstance(v, torch.Tensor):
                statics[a] = v.clone()
                setattr(trainer, a, statics[a])
        counters, logs = _replayed(trainer)
        counts = [(comp, attr, getattr(comp, attr)) for _, comp, attr in counters]
        lens = [(comp, attr, len(getattr(comp, attr))) for _, comp, attr in logs]

        def iteration() -> Any:
            out = self.fn(trainer, comm)
            for a, buf in statics.items():
                v = getattr(trainer, a)
                if v is not buf:
                    buf.copy_(v)
                    setattr(trainer, a, buf)
            return out

        groups = []
        if self.device.type == "cuda":
            generators = [v for _, v in find_objects(trainer, torch.Generator)]
            try:
                graph = CudaGraph(generators)
            except NotCapturable as e:
                self._give_up(trainer, str(e))
                return self.fn(trainer, comm)
            # torch refuses to capture step() unless the groups say capturable; a fused
            # optimiser's kernel is the same either way (its step count is on the device), so
            # the flag is raised for the capture only (a replay runs no Python to check it)
            groups = [g for _, opt in find_objects(trainer, torch.optim.Optimizer) for g in opt.param_groups
                      if g.get("fused") and not g.get("capturable")]
        else:
            graph = Tape()
        # what a capture cannot hold fails it half-way through the iteration's Python (a CUDA
        # capture records without running): the trainer's state is kept to go back to, and the
        # iteration runs eagerly instead (where an error of the program's own raises again)
        saved = _snapshot(trainer, self.state_attrs)
        for g in groups:
            g["capturable"] = True
        try:
            if isinstance(graph, Tape):
                with graph:
                    out = iteration()
            else:
                out = graph.capture(iteration)
        except Exception as e:  # noqa: BLE001 - CUDA's capture errors come as RuntimeError, others as they are
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            _restore(trainer, saved)
            for comp, attr, n in lens:
                del getattr(comp, attr)[n:]
            self._give_up(trainer, f"capturing it failed ({type(e).__name__}: {' '.join(str(e).split())[:300]})")
            return self.fn(trainer, comm)
        finally:
            for g in groups:
                g["capturable"] = False
        cap.graph, cap.out, cap.statics = graph, out, statics
        cap.counters = [(comp, attr, getattr(comp, attr) - n) for comp, attr, n in counts]
        cap.logs = [(comp, attr, list(getattr(comp, attr)[n:])) for comp, attr, n in lens]
        what = "a CUDA graph" if self.device.type == "cuda" else f"a host tape of {len(graph.steps)} ops"
        took = time.perf_counter() - t0
        notify(trainer, f"{self.method} captured as {what}, replayed from its next iteration (capture {took:.2f} s, "
                         f"probe {cap.probe_s:.2f} s)")
        return _fresh(out)

    def _inputs_fit(self, trainer: Any, cap: Capture) -> bool:
        """Whether the state attributes still fit the static buffers (copying a rebound value in)."""
        for a, buf in cap.statics.items():
            v = getattr(trainer, a, None)
            if v is buf:
                continue
            if not isinstance(v, torch.Tensor) or v.shape != buf.shape or v.dtype != buf.dtype or v.device != buf.device:
                return False
            buf.copy_(v)
            setattr(trainer, a, buf)
        return True

    def _replay(self, cap: Capture) -> Any:
        for comp, attr, items in cap.logs:  # items still held from the last replay: kept as they are now
            held = getattr(comp, attr)
            ids = {id(x) for x in items}
            for i, x in enumerate(held):
                if id(x) in ids:
                    held[i] = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, x)
        cap.graph.replay()
        cap.replays += 1
        for comp, attr, delta in cap.counters:
            setattr(comp, attr, getattr(comp, attr) + delta)
        for comp, attr, items in cap.logs:
            getattr(comp, attr).extend(items)
        return _fresh(cap.out)


def _snapshot(trainer: Any, state_attrs: Sequence[str]) -> dict[str, Any]:
    """Copies of what an iteration changes: each component's ``state_dict`` and the trainer's
    state attributes (for :func:`_restore` after a failed capture)."""
    import copy

    return {"components": {r: copy.deepcopy(c.state_dict()) for r, c in getattr(trainer, "_components", {}).items()},
            "attrs": {a: copy.deepcopy(getattr(trainer, a)) for a in state_attrs if hasattr(trainer, a)},
            # the global generators (a replica's own while its program runs: msrl.runtime.generators)
            "rng": (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                    random.getstate(), np.random.get_state())}


def _restore(trainer: Any, saved: dict[str, Any]) -> None:
    for role, state in saved["components"].items():
        trainer._components[role].load_state_dict(state)
    for a, v in saved["attrs"].items():
        setattr(trainer, a, v)
    cpu, cuda, py, nump = saved["rng"]
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)
    np.random.set_state(nump)


def _fresh(out: Any) -> Any:
    """The program's output as the caller gets it: containers copied (the caller may change
    them), tensors as captured (a replay overwrites them: read before the next iteration)."""
    if isinstance(out, dict) and all(isinstance(v, (torch.Tensor, int, float, str, type(None))) for v in out.values()):
        return dict(out)  # the common output, a flat dict of metrics, without a tree walk (~30 us)
    return tree_map(lambda v: v, out)


def _leaves(out: Any, path: str = "output") -> Iterator[tuple[str, Any]]:
    if isinstance(out, dict):
        for k, v in out.items():
            yield from _leaves(v, f"{path}[{k!r}]")
    elif isinstance(out, (list, tuple)):
        for i, v in enumerate(out):
            yield from _leaves(v, f"{path}[{i}]")
    elif out is not None:
        yield path, out
