"""Native batched environments: state in tensors on one device, stepped by a CUDA C kernel
(GPU or host build, see :mod:`msrl.envs.native.kernels`) or by a torch reference
implementation of the same rules.

Episode statistics stay on the device during an iteration (one ``(N,)`` row per step, NaN where
no episode finished) and are read back once, by :meth:`NativeEnv.pop_episode_stats`.
"""

from __future__ import annotations

import ctypes
import math
import pathlib
import sys
from typing import Any, Callable, Mapping

import numpy as np
import torch

from msrl.api import Environment, EnvSpec, EpisodeStats, ReplayContract
from msrl.device import host_side, read_host

__all__ = ["NativeEnv", "IMPLS", "splitmix64", "env_keys", "uniform", "uniform_many", "box_muller", "empty_output"]

#: Implementations of a native env's rules.
IMPLS = ("torch", "kernel")

_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (z >> s) & ((1 << (64 - s)) - 1)


#: CPU outputs from this size on ask for transparent huge pages (glibc serves them by mmap)
HUGE_PAGE_MIN_BYTES = 32 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def empty_output(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(shape)`` for a step's outputs. A CPU tensor of at least
    :data:`HUGE_PAGE_MIN_BYTES` is first advised ``MADV_HUGEPAGE`` (Linux), so the kernel that
    fills it faults 2 MiB pages instead of 4 KiB ones: a fresh 568 MB Tag observation costs
    ~140k page faults otherwise (15% of a 2,000 x 1,000 step, ``bench/RESULTS.md``). The advice
    is a hint: where transparent huge pages are off it does nothing."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if _libc is not None and t.device.type == "cpu" and t.nbytes >= HUGE_PAGE_MIN_BYTES:
        start = (t.data_ptr() + 4095) & ~4095
        end = (t.data_ptr() + t.nbytes) & ~4095
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    return t


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 (Steele, Lea, Flood 2014) on int64 tensors holding uint64 bit patterns;
    bit-identical to ``msrl_splitmix64`` in the kernels."""
    z = x + _signed(0x9E3779B97F4A7C15)
    z = (z ^ _srl(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _srl(z, 27)) * _signed(0x94D049BB133111EB)
    return z ^ _srl(z, 31)


def env_keys(seed: int, env_index: torch.Tensor) -> torch.Tensor:
    """Per-env generator keys ``seed + i`` (int64 bit patterns): env ``i`` is seeded with
    ``seed + i``, as gymnasium's vector envs seed theirs, so replica ``r`` of ``n`` envs seeded
    with ``seed + r n`` draws what envs ``r n .. r n + n - 1`` draw in one process."""
    return _signed(seed) + env_index


def uniform(key: torch.Tensor, stream: torch.Tensor | int, episode: torch.Tensor, k: int) -> torch.Tensor:
    """U[0, 1) float64 from (env key, stream, episode count, draw k < 4), as the kernels'
    ``msrl_uniform`` computes it."""
    h = splitmix64(key ^ splitmix64(stream ^ splitmix64(episode * 4 + k)))
    return _srl(h, 11).to(torch.float64) * (1.0 / 9007199254740992.0)


def uniform_many(key: torch.Tensor, stream: torch.Tensor | int, episode: torch.Tensor, k: int) -> torch.Tensor:
    """Like :func:`uniform` for any number of draws ``k`` per episode (``msrl_uniform_many``)."""
    h = splitmix64(key ^ splitmix64(stream ^ splitmix64(splitmix64(episode) + k)))
    return _srl(h, 11).to(torch.float64) * (1.0 / 9007199254740992.0)


def box_muller(u: torch.Tensor) -> torch.Tensor:
    """Standard normals by Box-Muller (Box & Muller 1958): ``(B, count)`` float64 from uniform
    draws ``u`` in [0, 1) of shape ``(B, 2 count)`` (the first ``count`` columns give the radius,
    the rest the angle)."""
    count = u.shape[1] // 2
    u1, u2 = 1.0 - u[:, :count], u[:, count:]  # u1 in (0, 1]: log is finite
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


class NativeEnv(Environment):
    """Base of native envs.

    Args:
        num_envs: ``N``.
        device: where state and outputs live.
        impl: ``"kernel"`` (the CUDA C source: NVRTC on a GPU, the host build on CPU) or
            ``"torch"`` (the reference implementation, any device).

    Raises:
        ValueError: ``num_envs < 1`` or an unknown ``impl``.
    """

    #: the kernels' source file, beside the subclass's module.
    KERNEL_SOURCE: pathlib.Path
    #: threads per block of single-agent kernels.
    BLOCK = 256

    def replay_contract(self) -> ReplayContract:
        """All of a native env's work is torch ops and kernels on its tensors, which a captured
        iteration replays; the step count and the finished-episode log are host bookkeeping a
        replay repeats."""
        return ReplayContract(capturable=True, counters=("_env_steps",), logs=("_finished",))

    def __init__(self, num_envs: int, device: str | torch.device = "cpu", impl: str = "kernel") -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        if impl not in IMPLS:
            raise ValueError(f"unknown native env implementation {impl!r}; valid: {', '.join(IMPLS)}")
        self.num_envs, self.device, self.impl = num_envs, torch.device(device), impl
        self._kernels = None
        if impl == "kernel":
            from msrl.envs.native.kernels import load_kernels

            self._kernels = load_kernels(self.KERNEL_SOURCE, self.device)
        self.seed = 0
        self._episode_return = torch.zeros(num_envs, dtype=torch.float64, device=self.device)
        self._episode_length = torch.zeros(num_envs, dtype=torch.int64, device=self.device)
        self._finished: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._env_steps = 0

    @property
    def grid(self) -> int:
        """Blocks of a one-thread-per-env launch."""
        return (self.num_envs + self.BLOCK - 1) // self.BLOCK

    def _track(self, reward: torch.Tensor, done: torch.Tensor) -> None:
        """Torch reference of the kernels' episode tracking: updates running returns/lengths
        on the device and logs finished episodes (length -1 where none) without a sync."""
        ret = self._episode_return + reward.to(torch.float64)
        length = self._episode_length + 1
        self._log_finished(torch.where(done, ret, 0.0), torch.where(done, length, -1))
        self._episode_return.copy_(torch.where(done, 0.0, ret))
        self._episode_length.copy_(torch.where(done, 0, length))

    def _log_finished(self, done_return: torch.Tensor, done_length: torch.Tensor) -> None:
        """Keeps one step's finished episodes, ``(N,)`` each, until :meth:`pop_episode_stats`."""
        self._env_steps += self.num_envs
        self._finished.append((done_return, done_length))

    def _reset_tracking(self) -> None:
        self._episode_return.zero_()
        self._episode_length.zero_()

    def pop_episode_stats(self) -> EpisodeStats:
        """Episodes finished since the last call (one device-to-host copy)."""
        tensors, build = self.pop_finished()
        return build(read_host(tensors))

    def pop_finished(self) -> tuple[list[list[torch.Tensor]], Callable[[list[torch.Tensor]], EpisodeStats]]:
        """The episodes finished since the last call, still on the device, for a read shared
        with other values (:meth:`msrl.runtime.replica.Replica.read_iteration`).

        Returns:
            ``(tensors, build)``: the device tensors to read, as the ``S`` steps since the last
            call logged them (so a replayed iteration reads the same tensors each time): the
            list of each step's returns ``(N,)`` float64 and the list of each step's lengths
            ``(N,)`` int64 (-1 where no episode ended), which
            :func:`~msrl.device.read_host` reads as ``(S, N)`` stacks; and
            ``build(host)``, which makes the :class:`EpisodeStats` from those host copies.
        """
        if not self._finished:
            return [], lambda host: EpisodeStats([], [])
        tensors = [[r for r, _ in self._finished], [n for _, n in self._finished]]
        self._finished = []

        def build(host: list[torch.Tensor]) -> EpisodeStats:
            with host_side():  # host copies: NumPy's ops cost ~1 us, torch's ~10
                rets, lens = host[0].numpy(), host[1].numpy()
            mask = lens >= 0
            return EpisodeStats(rets[mask].tolist(), lens[mask].tolist())

        return tensors, build

    @property
    def env_steps(self) -> int:
        """Env steps taken so far, summed over the batch."""
        return self._env_steps

    def _tensors(self) -> dict[str, torch.Tensor]:
        """The env's state tensors (saved by :meth:`state_dict`); single-agent envs' by default."""
        return {"state": self.state, "steps": self.steps, "episode": self.episode}

    # -- single-agent envs: float64 physical state (N, state_dim), step counters, episode counts --
    def _init_single_agent_state(self, state_dim: int) -> None:
        """Allocates ``state`` ``(N, state_dim)`` float64, ``steps`` ``(N,)`` int32 (steps into the
        episode) and ``episode`` ``(N,)`` int64 (episodes started, the RNG's episode counter)."""
        dev = self.device
        self.state = torch.zeros(self.num_envs, state_dim, dtype=torch.float64, device=dev)
        self.steps = torch.zeros(self.num_envs, dtype=torch.int32, device=dev)
        self.episode = torch.zeros(self.num_envs, dtype=torch.int64, device=dev)
        self._env_index = torch.arange(self.num_envs, dtype=torch.int64, device=dev)

    def _observe_state(self, state: torch.Tensor) -> torch.Tensor:
        """Observations ``(B, obs_dim)`` float32 of physical states ``(B, state_dim)``."""
        return state.to(torch.float32)

    def set_state(self, index: int, state: Any, steps: int = 0) -> torch.Tensor:
        """Overwrites env ``index``'s physical state (e.g. with gymnasium's, for the consistency
        checker) and its step count; returns its observation ``(obs_dim,)`` float32."""
        self.state[index] = torch.as_tensor(np.asarray(state, dtype=np.float64), device=self.device)
        self.steps[index] = steps
        return self._observe_state(self.state[index : index + 1])[0]

    # -- the single-agent kernels' common calling convention --------------------------------
    # ``<env>_reset(state, steps, episode, obs, seed, num_envs)`` and ``<env>_step(state, steps,
    # episode, action, obs, final_obs, reward, terminated, truncated, ep_return, ep_length,
    # done_return, done_length, seed, num_envs, max_steps)``, one thread per env.
    def _kernel_reset(self, name: str, obs_dim: int) -> torch.Tensor:
        """Launches a reset kernel; returns observations ``(N, obs_dim)`` float32."""
        obs = torch.empty(self.num_envs, obs_dim, dtype=torch.float32, device=self.device)
        self._kernels.launch(name, self.grid, self.BLOCK, self.state, self.steps, self.episode, obs,
                             self.seed & ((1 << 64) - 1), self.num_envs)
        return obs

    def _kernel_step(self, name: str, obs_dim: int, action: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Launches a step kernel on fresh output tensors; logs finished episodes.

        Returns:
            ``(obs, final_obs, reward, terminated, truncated)``.
        """
        n, dev = self.num_envs, self.device
        obs = torch.empty(n, obs_dim, dtype=torch.float32, device=dev)
        final_obs = torch.empty(n, obs_dim, dtype=torch.float32, device=dev)
        reward = torch.empty(n, dtype=torch.float32, device=dev)
        terminated = torch.empty(n, dtype=torch.bool, device=dev)
        truncated = torch.empty(n, dtype=torch.bool, device=dev)
        done_return = torch.empty(n, dtype=torch.float64, device=dev)
        done_length = torch.empty(n, dtype=torch.int64, device=dev)
        self._kernels.launch_unchecked(name, self.grid, self.BLOCK, self.state, self.steps, self.episode, action, obs,
                                       final_obs, reward, terminated, truncated, self._episode_return, self._episode_length,
                                       done_return, done_length, self.seed & ((1 << 64) - 1), n, self.max_episode_steps)
        self._log_finished(done_return, done_length)
        return obs, final_obs, reward, terminated, truncated

    def state_dict(self) -> dict[str, Any]:
        """State tensors, seed and episode trackers (exact resume)."""
        return {
            "tensors": {k: v.clone() for k, v in self._tensors().items()},
            "seed": self.seed,
            "episode_return": self._episode_return.clone(),
            "episode_length": self._episode_length.clone(),
            "env_steps": self._env_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output (same ``N``).

        Raises:
            ValueError: the saved state has another shape.
        """
        for k, v in self._tensors().items():
            saved = state["tensors"][k]
            if saved.shape != v.shape:
                raise ValueError(f"checkpoint's {k} has shape {tuple(saved.shape)}, this env's {tuple(v.shape)}")
            v.copy_(saved)
        self.seed = int(state["seed"])
        self._episode_return.copy_(state["episode_return"])
        self._episode_length.copy_(state["episode_length"])
        self._env_steps = int(state["env_steps"])

    def make_spec(self, env_id: str, observation_space: Any, action_space: Any) -> EnvSpec:
        """The :class:`~msrl.api.EnvSpec` of this batch."""
        return EnvSpec(env_id, observation_space, action_space, self.num_envs)
