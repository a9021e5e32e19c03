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
  (:meth:`Baton.released`); when another holder takes it, the states are swapped (``~50 us``,
  NumPy's ``get_state``/``set_state`` being most of it). Within one holder nothing is swapped.
- **Checkpoints.** A replica's states are part of its state dict, so a resumed run draws what
  the uninterrupted run would have.

CUDA's generators are seeded for a replica on a CUDA device (``torch.cuda.manual_seed``) and its
state kept with the others.
"""

from __future__ import annotations

import contextlib
import random
import threading
from typing import Any, Iterator, Mapping

import numpy as np
import torch

__all__ = ["derive_seed", "GlobalGenerators", "Baton", "BATON"]


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
    """

    def __init__(self, seed: int | None = None, device: torch.device | str | None = None) -> None:
        device = torch.device(device) if device is not None else None
        self.cuda = device if device is not None and device.type == "cuda" else None
        self._cuda_seed: int | None = None
        if seed is None:
            self.capture()
            return
        low = seed & ((1 << 64) - 1)
        self.torch = torch.Generator().manual_seed(low).get_state()
        self.numpy = np.random.RandomState(np.array([(seed >> (32 * i)) & 0xFFFFFFFF for i in range(4)],
                                                    dtype=np.uint32)).get_state()
        self.python = random.Random(seed).getstate()
        self.cuda_state: torch.Tensor | None = None
        self._cuda_seed = low if self.cuda is not None else None

    @classmethod
    def seeded(cls, seed: int, *key: int | str, device: torch.device | str | None = None) -> "GlobalGenerators":
        """The states ``torch.manual_seed``, ``np.random.seed`` and ``random.seed`` give for
        :func:`derive_seed` ``(seed, *key)``."""
        return cls(derive_seed(seed, *key), device)

    def capture(self) -> None:
        """Saves the process's current global states into this object."""
        self.torch = torch.get_rng_state()
        self.numpy = np.random.get_state()
        self.python = random.getstate()
        if self.cuda is not None:
            self.cuda_state = torch.cuda.get_rng_state(self.cuda)
            self._cuda_seed = None

    def restore(self) -> None:
        """Loads this object's states into the process's global generators."""
        torch.set_rng_state(self.torch)
        np.random.set_state(self.numpy)
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

    def _switch(self, g: GlobalGenerators) -> None:  # under the lock
        if self._owner is g:
            return
        if self._owner is None:
            self._outside = GlobalGenerators()
        else:
            self._owner.capture()
        g.restore()
        self._owner = g
        self.swaps += 1

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
            self._switch(g)
            self._local.held = g
            try:
                yield
            finally:
                self._local.held = None

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """Lets other holders run while the block waits (a boundary's wait); a no-op in a thread
        that holds nothing. The block must not hold a lock another holder takes."""
        g = self.held()
        if g is None:
            yield
            return
        self._local.held = None
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()
            self._switch(g)
            self._local.held = g

    def state_dict(self, g: GlobalGenerators) -> dict[str, Any]:
        """``g``'s states, current even while they are loaded in the process's generators."""
        with self._lock:
            if self._owner is g:
                g.capture()
            return g.state_dict()

    def load_state_dict(self, g: GlobalGenerators, state: Mapping[str, Any]) -> None:
        """Loads ``state`` into holder ``g`` (and the process's generators when they hold ``g``'s)."""
        with self._lock:
            g.load_state_dict(state)
            if self._owner is g:
                g.restore()

    def give_back(self) -> None:
        """Saves the last holder's states and gives the process its own states back (a job's end)."""
        with self._lock:
            if self._owner is not None:
                self._owner.capture()
                if self._outside is not None:
                    self._outside.restore()
                self._owner = self._outside = None


#: The process's baton: every replica, client run and build of this process holds it.
BATON = Baton()
