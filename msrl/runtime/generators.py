"""Each replica's own global generators: torch's, NumPy's and Python's.

Algorithms written CleanRL-style draw from the global generators (``nn.Linear``'s default
initialisation, ``torch.rand``, ``np.random.rand``, ``random.random``) instead of generators of
their own. msrl seeds those for every replica from ``(seed, fragment, replica index)``, so a run
is reproducible: the same config and seed give the same draws, whichever runtime runs the
replicas and however their threads interleave.

- **Seeds.** :func:`derive_seed` hashes the key with NumPy's ``SeedSequence`` (O'Neill 2015,
  the hashing NumPy recommends for spawning independent streams) into 128 bits:
  ``torch.manual_seed`` takes the first 64, ``np.random.seed`` the four 32-bit words and
  ``random.seed`` the 128-bit integer. Components are built under ``(seed, "build", role,
  index)`` (the learner with index 0 on every replica, so ``multi_learner``'s replicas start from
  identical weights), and each replica's programs run under ``(seed, fragment, replica)``.
- **Per-replica state.** The global generators are one per process, but the local runtime runs
  its replicas as threads of one process, and central inference runs one thread per client
  replica. :data:`BATON` lets one such *holder* at a time run with its own states loaded: a
  replica holds it while its programs run and lets go only while it waits at a boundary
  (:meth:`Baton.released`); when another holder takes it, the states are swapped. Within one
  holder nothing is swapped, so a process with one replica (``single``, every Ray replica)
  swaps nothing while it trains.
- **What is swapped.** The probe records which generators the programs drew from
  (:func:`msrl.frontend.probe.probe`, :attr:`GlobalGenerators.kinds`). A replica whose programs drew
  from none (every shipped algorithm: they own their generators) runs without the baton, so
  its process's threads never wait for one another because of it; :meth:`Baton.watch` checks
  that no global state changed meanwhile and, if one did, makes every replica hold the baton
  from then on. A hand-over swaps torch's state (cheap) and NumPy's and Python's (tens of
  microseconds: ``bench/results/startup.md``, "Figures behind the code") only when the probe saw them
  drawn: central inference hands the baton over ~150 times an iteration. A holder taking over from the process
  itself loads every state, so a process with one replica draws seeded values even from a
  generator the probe did not see used; a holder that drew from NumPy's generator although the
  probe saw no draw is caught as it lets go (a 2.5 KB comparison of the Mersenne Twister's
  state) and swaps it from then on. With replicas sharing a process, both cases warn once: the
  draws before may have interleaved in an order that differs between runs.
- **Checkpoints.** A replica's states are part of its state dict, so a resumed run draws what
  the uninterrupted run would have.

CUDA's generators are seeded for a replica on a CUDA device (``torch.cuda.manual_seed``) and its
state kept with the others.
"""

from __future__ import annotations

import contextlib
import ctypes
import random
import threading
import warnings
from typing import Any, Iterator, Mapping

import numpy as np
import torch

__all__ = ["KINDS", "derive_seed", "GlobalGenerators", "Baton", "BATON", "drawn_kinds"]

#: the global generators: torch's (CPU, and the replica's CUDA device), NumPy's legacy
#: ``np.random``, Python's ``random``
KINDS = frozenset({"torch", "numpy", "python"})


def _entropy(part: Any) -> int:
    if isinstance(part, bool) or not isinstance(part, (int, str)):
        raise TypeError(f"a seed key part is an int or a str, not {type(part).__name__}")
    if isinstance(part, str):
        return int.from_bytes(part.encode(), "little") | (1 << (8 * len(part.encode())))  # "" differs from 0
    return part


def derive_seed(seed: int, *key: int | str) -> int:
    """A 128-bit seed for the stream named by ``(seed, *key)``: ``SeedSequence([seed, *key])``'s
    first four 32-bit words (strings as their UTF-8 bytes read as one integer).

    Raises:
        ValueError: ``seed`` is negative; TypeError: a key part is neither int nor str.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    words = np.random.SeedSequence([seed, *(_entropy(k) for k in key)]).generate_state(4, np.uint32)
    return sum(int(w) << (32 * i) for i, w in enumerate(words))


class GlobalGenerators:
    """A saved state of this process's global generators: torch's CPU generator (and the CUDA
    generator of ``device`` when it is a CUDA device), NumPy's legacy ``np.random`` state and
    Python's ``random``.

    Args:
        seed: the 128-bit seed (:func:`derive_seed`); ``None``: the process's current states.
        device: the CUDA device whose generator belongs to the state (``None`` or CPU: none).
        kinds: the generators a hand-over between holders swaps (:data:`KINDS`' members;
            ``"torch"`` always); every state is kept and loaded when the holder takes over
            from the process itself.

    Raises:
        ValueError: an unknown kind.
    """

    def __init__(self, seed: int | None = None, device: torch.device | str | None = None,
                 kinds: frozenset[str] | set[str] = KINDS) -> None:
        if not set(kinds) <= KINDS:
            raise ValueError(f"unknown generator kinds {sorted(set(kinds) - KINDS)}; valid: {sorted(KINDS)}")
        self.kinds = set(kinds) | {"torch"}
        device = torch.device(device) if device is not None else None
        self.cuda = device if device is not None and device.type == "cuda" else None
        self._cuda_seed: int | None = None
        self.cuda_state: torch.Tensor | None = None
        self._numpy_seen: bytes | None = None  # NumPy's raw state when this holder took over without swapping it
        #: whether this holder's programs drew from any global generator in the probe (those
        #: that did not run without the baton; see :meth:`Baton.watch`)
        self.kinds_drawn = True
        if seed is None:
            self.capture(KINDS)
            return
        low = seed & ((1 << 64) - 1)
        self.torch = torch.Generator().manual_seed(low).get_state()
        self.numpy = np.random.RandomState(np.array([(seed >> (32 * i)) & 0xFFFFFFFF for i in range(4)],
                                                    dtype=np.uint32)).get_state()
        self.python = random.Random(seed).getstate()
        self._cuda_seed = low if self.cuda is not None else None

    @classmethod
    def seeded(cls, seed: int, *key: int | str, device: torch.device | str | None = None,
               kinds: frozenset[str] | set[str] = KINDS) -> "GlobalGenerators":
        """The states ``torch.manual_seed``, ``np.random.seed`` and ``random.seed`` give for
        :func:`derive_seed` ``(seed, *key)``."""
        return cls(derive_seed(seed, *key), device, kinds)

    def capture(self, kinds: frozenset[str] | set[str] | None = None) -> None:
        """Saves the process's current states of ``kinds`` (default: :attr:`kinds`) into this object."""
        kinds = self.kinds if kinds is None else kinds
        self.torch = torch.get_rng_state()
        if "numpy" in kinds:
            self.numpy = np.random.get_state()
        if "python" in kinds:
            self.python = random.getstate()
        if self.cuda is not None:
            self.cuda_state = torch.cuda.get_rng_state(self.cuda)
            self._cuda_seed = None

    def restore(self, kinds: frozenset[str] | set[str] | None = None) -> None:
        """Loads this object's states of ``kinds`` (default: :attr:`kinds`) into the process's generators."""
        kinds = self.kinds if kinds is None else kinds
        torch.set_rng_state(self.torch)
        if "numpy" in kinds:
            np.random.set_state(self.numpy)
        if "python" in kinds:
            random.setstate(self.python)
        if self.cuda is not None:
            if self._cuda_seed is not None:
                with torch.cuda.device(self.cuda):
                    torch.cuda.manual_seed(self._cuda_seed)
            else:
                torch.cuda.set_rng_state(self.cuda_state, self.cuda)

    def state_dict(self) -> dict[str, Any]:
        """The states as plain values (a uint8 tensor, NumPy's state tuple, Python's tuple)."""
        out: dict[str, Any] = {"torch": self.torch.clone(), "numpy": self.numpy, "python": self.python}
        if self.cuda is not None:
            out["cuda"] = self.cuda_state if self._cuda_seed is None else None
            out["cuda_seed"] = self._cuda_seed
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output (the process's generators are untouched).

        Raises:
            KeyError: a state is missing.
        """
        self.torch = state["torch"].clone()
        self.numpy = state["numpy"]
        self.python = state["python"]
        if self.cuda is not None and "cuda_seed" in state:
            self._cuda_seed = state["cuda_seed"]
            self.cuda_state = state["cuda"]


def _numpy_raw() -> bytes:
    """The Mersenne Twister state behind ``np.random`` (key and position, 2,500 bytes), read
    through the bit generator's documented ``ctypes`` interface: it changes with every draw."""
    bg = np.random.mtrand._rand._bit_generator
    return ctypes.string_at(bg.ctypes.state_address, 624 * 4 + 4)


def drawn_kinds(before: GlobalGenerators, after: GlobalGenerators) -> set[str]:
    """The generators whose states differ between two full captures (what code between them drew from)."""
    out = set()
    if not torch.equal(before.torch, after.torch):
        out.add("torch")
    b, a = before.numpy, after.numpy
    if b[0] != a[0] or not np.array_equal(b[1], a[1]) or tuple(b[2:]) != tuple(a[2:]):
        out.add("numpy")
    if before.python != after.python:
        out.add("python")
    return out


_NO_OP = contextlib.nullcontext()


class Baton:
    """Lets one holder at a time run with its own global generator states (see the module
    docstring). A holder is a :class:`GlobalGenerators`; the states in the process's generators
    belong to the last holder until another takes the baton (swapped then, not at every
    release), or to the process itself (``None``) before the first and after :meth:`give_back`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: GlobalGenerators | None = None
        self._outside: GlobalGenerators | None = None
        self._local = threading.local()
        #: swaps so far (a holder's states loaded over another's)
        self.swaps = 0
        #: set once a program that drew from no global generator in the probe drew from one:
        #: every replica of this process holds the baton from then on
        self.forced = False
        self._watching = 0
        self._watch_lock = threading.Lock()
        self._watch_start: tuple | None = None

    def _switch(self, g: GlobalGenerators) -> None:  # under the lock
        if self._owner is g:
            return
        owner = self._owner
        if owner is None:  # from the process itself: every state
            self._outside = GlobalGenerators()
            g.restore(KINDS)
        else:
            owner.capture()
            g.restore()
        self._owner = g
        self.swaps += 1

    def _check_numpy(self, g: GlobalGenerators) -> None:  # under the lock, as g lets go
        if g._numpy_seen is not None and _numpy_raw() != g._numpy_seen:
            g.kinds.add("numpy")  # drawn from although the probe saw no draw: swapped from now on
            g.capture({"numpy"})
            g._numpy_seen = None
            if self.shared:
                warnings.warn("a replica drew from NumPy's global generator (np.random) although the probe saw no "
                              "draw from it: its draws so far may differ between runs, later ones are reproducible",
                              RuntimeWarning, stacklevel=3)

    def _took(self, g: GlobalGenerators) -> None:  # under the lock, as g takes over
        self._switch(g)
        g._numpy_seen = None if "numpy" in g.kinds else _numpy_raw()

    def held(self) -> GlobalGenerators | None:
        """The holder the calling thread runs as, or ``None``."""
        return getattr(self._local, "held", None)

    @contextlib.contextmanager
    def hold(self, g: GlobalGenerators) -> Iterator[None]:
        """Runs the block as holder ``g``: its states in the global generators, no other holder
        running meanwhile except while the block waits in :meth:`released`.

        Raises:
            RuntimeError: the calling thread holds the baton already.
        """
        if self.held() is not None:
            raise RuntimeError("this thread holds the global generators already")
        with self._lock:
            self._took(g)
            self._local.held = g
            try:
                yield
            finally:
                self._local.held = None
                self._check_numpy(g)

    def released(self) -> contextlib.AbstractContextManager:
        """Lets other holders run while the block waits (a boundary's wait); a no-op in a thread
        that holds nothing. The block must not hold a lock another holder takes."""
        g = getattr(self._local, "held", None)
        return _NO_OP if g is None else self._released(g)

    @contextlib.contextmanager
    def _released(self, g: GlobalGenerators) -> Iterator[None]:
        self._local.held = None
        self._check_numpy(g)
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()
            self._took(g)
            self._local.held = g

    @staticmethod
    def _fingerprint() -> tuple:
        return torch.get_rng_state(), _numpy_raw(), random.getstate()

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Runs the block without the baton (programs that drew from no global generator in
        the probe), checking that the global generators did not change while any watched
        block ran (~10 us a block). If they did, with other threads of this process running
        programs too, their draws interleaved in an order that may differ between runs:
        warns once and sets :attr:`forced`, so every replica holds the baton from then on."""
        with self._watch_lock:
            if self._watching == 0:
                self._watch_start = self._fingerprint()
            self._watching += 1
        try:
            yield
        finally:
            with self._watch_lock:
                self._watching -= 1
                if self._watching == 0 and self._watch_start is not None and not self.forced:
                    t, n, p = self._fingerprint()
                    t0, n0, p0 = self._watch_start
                    if not torch.equal(t, t0) or n != n0 or p != p0:
                        self.forced = True
                        if self.shared:
                            warnings.warn("a program drew from the global generators (torch, np.random or random) "
                                          "although the probe saw no draw: with replicas sharing this process, its "
                                          "draws so far may differ between runs; from now on each replica draws from "
                                          "its own seeded states", RuntimeWarning, stacklevel=3)

    #: whether more than one replica runs in this process (set by the runtimes): a draw the
    #: probe did not see is then worth a warning
    shared = False

    def state_dict(self, g: GlobalGenerators) -> dict[str, Any]:
        """``g``'s states, current even while they are loaded in the process's generators."""
        with self._lock:
            if self._owner is g:
                g.capture(KINDS)
            return g.state_dict()

    def load_state_dict(self, g: GlobalGenerators, state: Mapping[str, Any]) -> None:
        """Loads ``state`` into holder ``g`` (and the process's generators when they hold ``g``'s)."""
        with self._lock:
            g.load_state_dict(state)
            if self._owner is g:
                g.restore(KINDS)

    def give_back(self) -> None:
        """Saves the last holder's states and gives the process its own states back (a job's end)."""
        with self._lock:
            if self._owner is not None:
                self._owner.capture(KINDS)
                if self._outside is not None:
                    self._outside.restore()
                self._owner = self._outside = None


#: The process's baton: every replica, client run and build of this process holds it.
BATON = Baton()
