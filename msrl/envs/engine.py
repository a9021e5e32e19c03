"""The env engine: gymnasium envs stepped by a pool of worker processes over shared memory.

:class:`ProcessEnv` is ``env.engine: process``. ``N`` envs are split over ``W`` worker processes
(env ``i`` on worker ``i * W // N``); each worker steps its envs one after another on shared
arrays (actions in, observations, final observations, rewards and flags out), so a step moves
no array through a pipe and pickles nothing: the pipe carries a one-byte command and the
workers' one-byte replies. Two ways to step, as EnvPool has (Weng et al. 2022, "EnvPool: A
Highly Parallel Reinforcement Learning Environment Execution Engine", section 3):

* synchronous: :meth:`ProcessEnv.step` steps every env and returns ``(N, ...)`` rows in env
  order, the :class:`~msrl.api.Environment` contract the training loop uses;
* asynchronous: :meth:`ProcessEnv.send` hands actions to some envs and returns at once;
  :meth:`ProcessEnv.recv` returns the first ``batch_size`` envs to finish, with their env ids.

Autoreset is gymnasium's ``SAME_STEP``: a finished env's row is the first observation of its next
episode and ``info["final_obs"]`` holds its last. Env ``i`` is seeded with ``seed + i``, as in
gymnasium's vector envs, so the process engine and ``env.engine: sync`` return the same
observations for the same seed and actions (tested bitwise). :meth:`ProcessEnv.state_dict`
snapshots every env exactly (:mod:`msrl.envs.state`).

A worker that dies (a simulator crash, the OOM killer, a SIGKILL) is restarted: its envs start
fresh episodes (reseeded with ``seed + i + k N`` at the ``k``-th restart) and the episodes they
were in are *lost*, never replaced: the step returns those rows with ``truncated=True``,
``info["lost"]`` set, reward 0 and, as final observation, the last observation the caller saw;
the lost episodes are counted in :attr:`~msrl.api.EpisodeStats.lost`, not in the returns, and
reported on stderr.
"""

from __future__ import annotations

import mmap
import os
import pickle
import socket
import subprocess
import sys
import tempfile
from multiprocessing.connection import Connection, wait
from typing import Any, Mapping, Sequence

import gymnasium
import numpy as np
import torch

from msrl.envs import _worker as W
from msrl.envs.gymnasium_env import EpisodeTracker, TrackedEnvironment, env_spec_of, obs_dtype
from msrl.envs.single_env import make_single_env
from msrl.errors import MsrlError

__all__ = ["ProcessEnv", "EnvWorkerError", "default_num_workers"]

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
#: seconds a worker may take to build its envs
START_TIMEOUT_S = 120.0


class EnvWorkerError(MsrlError, RuntimeError):
    """An env worker failed: its env raised (with the worker's traceback), it could not start,
    or it died where a restart cannot help (while saving or loading a checkpoint)."""


def default_num_workers(num_envs: int) -> int:
    """Worker processes when ``env.num_workers`` is not set: one per CPU this process may run
    on (its Ray bundle's share once the replica has pinned itself), at most one per env."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(num_envs, cpus))


def _shared_memory(size: int) -> tuple[int, mmap.mmap]:
    """An anonymous shared file of ``size`` bytes (``memfd_create`` on Linux, else an unlinked
    temporary file) and its mapping: nothing to clean up if this process is killed."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("msrl-env-engine")
    else:  # pragma: no cover - not Linux
        fd, path = tempfile.mkstemp(prefix="msrl-env-engine-")
        os.unlink(path)
    os.ftruncate(fd, size)
    return fd, mmap.mmap(fd, size)


def _cause(w: "_Worker") -> str:
    """How worker ``w``'s process ended (waits up to 5 s for it to be reaped)."""
    try:
        code = w.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        w.proc.kill()
        code = w.proc.wait()
    return f"signal {-code}" if code < 0 else f"exit code {code}"


class _Worker:
    def __init__(self, index: int, envs: np.ndarray) -> None:
        self.index, self.envs = index, envs
        self.proc: Any = None
        self.conn: Any = None

    def describe(self) -> str:
        lo, hi = int(self.envs[0]), int(self.envs[-1])
        return f"env worker {self.index} (envs {lo}..{hi}, pid {self.proc.pid if self.proc else '-'})"


def _space_dtype(space: gymnasium.Space, what: str, env_id: str) -> np.dtype:
    if isinstance(space, (gymnasium.spaces.Discrete, gymnasium.spaces.MultiDiscrete)):
        return np.dtype(np.int64)
    if isinstance(space, gymnasium.spaces.Box):
        return np.dtype(space.dtype)
    raise ValueError(f"env {env_id!r}: the process engine steps Box, Discrete and MultiDiscrete {what} spaces, "
                     f"not {space} (env.wrappers: [flatten_observation] flattens Dict and Tuple observations)")


class ProcessEnv(TrackedEnvironment):
    """``N`` gymnasium envs stepped by ``W`` worker processes on shared memory.

    Args:
        env_id: a registered gymnasium id (``HalfCheetah-v5``, ``ALE/Pong-v5``, ...).
        num_envs: ``N`` >= 1.
        num_workers: ``W``, 1..N worker processes (default :func:`default_num_workers`).
        device: where returned tensors live.
        env_kwargs: ``gymnasium.make`` kwargs of every env.
        wrappers: msrl's named wrappers (:data:`msrl.envs.single_env.WRAPPERS`), e.g. ``["atari"]``.
        batch_size: envs :meth:`recv` returns (default ``N``).

    Raises:
        UnknownEnvError: unknown id.
        ValueError: ``num_envs``, ``num_workers`` or ``batch_size`` out of range, or a space
            other than Box/Discrete.
        EnvWorkerError: a worker failed to build its envs (with its traceback).

    Observations are ``(N, *obs_shape)`` in the space's dtype as float32 (uint8 frames stay
    uint8); discrete actions int64 ``(N,)``, box actions float32 ``(N, *action_shape)``, clipped
    to the space's bounds.
    """

    def __init__(self, env_id: str, num_envs: int, num_workers: int | None = None, device: str | torch.device = "cpu",
                 env_kwargs: Mapping[str, Any] | None = None, wrappers: Sequence[str] = (),
                 batch_size: int | None = None) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        num_workers = default_num_workers(num_envs) if num_workers is None else num_workers
        if not 1 <= num_workers <= num_envs:
            raise ValueError(f"env.num_workers must be in 1..num_envs={num_envs}, got {num_workers}")
        batch_size = num_envs if batch_size is None else batch_size
        if not 1 <= batch_size <= num_envs:
            raise ValueError(f"batch_size must be in 1..num_envs={num_envs}, got {batch_size}")
        self.env_id, self.device, self.batch_size = env_id, torch.device(device), batch_size
        self._env_kwargs, self._wrappers = dict(env_kwargs or {}), list(wrappers)
        probe = make_single_env(env_id, self._env_kwargs, self._wrappers)
        try:
            # the spaces one env steps on: a PettingZoo env's are stacked over its agents
            self._obs_space, self._action_space = probe.observation_space, probe.action_space
            self.spec = env_spec_of(probe, env_id, num_envs)
        finally:
            probe.close()
        agent_actions = self.spec.action_space  # one agent's (the env's when single-agent)
        self._discrete = isinstance(self._action_space, gymnasium.spaces.Discrete)  # a scalar action
        raw_obs_dtype = _space_dtype(self._obs_space, "observation", env_id)
        act_dtype = _space_dtype(agent_actions, "action", env_id)
        act_dtype = np.dtype(np.int64) if act_dtype == np.int64 else np.dtype(np.float32)
        self._out_dtype = obs_dtype(self._obs_space)
        obs_shape = tuple(self._obs_space.shape)
        act_shape = tuple(self._action_space.shape)
        agents = () if self.spec.num_agents == 1 else (self.spec.num_agents,)
        shapes = {
            "obs": (raw_obs_dtype, (num_envs, *obs_shape)),
            "final_obs": (raw_obs_dtype, (num_envs, *obs_shape)),
            "action": (act_dtype, (num_envs, *act_shape)),
            "reward": (np.dtype(np.float64), (num_envs, *agents)),
            "terminated": (np.dtype(np.bool_), (num_envs,)),
            "truncated": (np.dtype(np.bool_), (num_envs,)),
        }
        self._layout: dict[str, tuple[str, tuple[int, ...], int]] = {}
        size = 0
        for name, (dt, shape) in shapes.items():
            self._layout[name] = (dt.str, shape, size)
            size += -(-int(np.prod(shape)) * dt.itemsize // 64) * 64  # 64-byte aligned rows of arrays
        self._size = max(size, 64)
        self._mem_fd, self._memory = _shared_memory(self._size)
        self._a = W.arrays_from(self._memory, self._layout)
        self._workers = [_Worker(w, np.arange(w * num_envs // num_workers, (w + 1) * num_envs // num_workers))
                         for w in range(num_workers)]
        self._worker_of = np.empty(num_envs, dtype=np.int64)
        for w in self._workers:
            self._worker_of[w.envs] = w.index
        self._tracker = EpisodeTracker(num_envs)
        self._index = np.arange(num_envs)
        self._float_obs = np.issubdtype(raw_obs_dtype, np.floating)
        self._env_steps = 0
        self._seed: int | None = None
        self._restarts = 0
        self._last_obs = np.zeros((num_envs, *obs_shape), dtype=raw_obs_dtype)
        # async state: envs stepping, envs finished and not yet returned, envs lost by a restart
        self._in_flight = np.zeros(num_envs, dtype=bool)
        self._ready: list[int] = []
        self._lost = np.zeros(num_envs, dtype=bool)  # to return as lost when next received
        self._fresh = np.zeros(num_envs, dtype=bool)  # reset by async_reset, not stepped yet
        self._closed = False
        try:
            for w in self._workers:
                self._start(w)
            for w in self._workers:
                self._await_ready(w)
        except BaseException:
            self.close()
            raise

    # -- workers ------------------------------------------------------------------------------
    def _start(self, w: _Worker) -> None:
        parent, child = socket.socketpair()
        env = {**os.environ, **{k: "1" for k in _THREAD_VARS}}  # one thread per worker process
        try:
            w.proc = subprocess.Popen(
                [sys.executable, "-m", "msrl.envs._worker", str(child.fileno()), str(self._mem_fd)],
                pass_fds=(child.fileno(), self._mem_fd), env=env, stdin=subprocess.DEVNULL,
            )
        finally:
            child.close()
        w.conn = Connection(parent.detach())
        setup = {"sys_path": list(sys.path), "size": self._size, "env_indices": [int(i) for i in w.envs],
                 "env_id": self.env_id, "env_kwargs": self._env_kwargs, "wrappers": self._wrappers,
                 "discrete": self._discrete, "layout": self._layout}
        self._send(w, pickle.dumps(setup, protocol=pickle.HIGHEST_PROTOCOL))

    def _await_ready(self, w: _Worker) -> None:
        if not w.conn.poll(START_TIMEOUT_S):
            raise EnvWorkerError(f"{w.describe()} did not start within {START_TIMEOUT_S:.0f} s")
        msg = self._recv(w)
        if msg is None:
            raise EnvWorkerError(f"{w.describe()} died while building its envs ({_cause(w)})")
        if msg[:1] != W.READY:
            raise EnvWorkerError(f"{w.describe()} failed to build its envs of {self.env_id!r}:\n{msg[1:].decode()}")

    @staticmethod
    def _recv(w: _Worker) -> bytes | None:
        """The worker's next reply, or None if it died."""
        try:
            return w.conn.recv_bytes()
        except (EOFError, OSError):
            return None

    def _reply(self, msg: bytes | None, w: _Worker, expect: bytes, what: str) -> bool:
        """Checks one reply; False if the worker died. Raises EnvWorkerError on an env error."""
        if msg is None:
            return False
        if msg[:1] == W.ERROR:
            raise EnvWorkerError(f"{w.describe()} raised while {what} {self.env_id!r}:\n{msg[1:].decode()}")
        if msg[:1] != expect:
            raise EnvWorkerError(f"{w.describe()} sent an unexpected reply {msg[:16]!r} while {what}")
        return True

    @staticmethod
    def _send(w: _Worker, data: bytes) -> bool:
        """Sends a command; False if the worker is dead (its pipe is closed)."""
        try:
            w.conn.send_bytes(data)
            return True
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            return False

    def _command(self, workers: Sequence[_Worker], data: bytes | Mapping[int, bytes], expect: bytes,
                 what: str) -> tuple[dict[int, bytes], list[_Worker]]:
        """Sends ``data`` (or ``data[worker index]``) to each of ``workers`` and waits for one
        reply from each; returns (replies by worker index, dead workers).

        Raises:
            EnvWorkerError: a worker's env raised, or an unexpected reply."""
        pending = {}
        dead: list[_Worker] = []
        for w in workers:
            if self._send(w, data if isinstance(data, bytes) else data[w.index]):
                pending[w.index] = w
            else:
                dead.append(w)
        replies: dict[int, bytes] = {}
        # every reply is needed: read them in worker order (no select per reply; a dead
        # worker's socket reads as end of file)
        for w in pending.values():
            msg = self._recv(w)
            if self._reply(msg, w, expect, what):
                replies[w.index] = msg
            else:
                dead.append(w)
        return replies, dead

    def _restart(self, w: _Worker, losing: bool = True) -> None:
        """Replaces dead worker ``w`` with a fresh one whose envs start new episodes."""
        cause = _cause(w)
        w.conn.close()
        self._restarts += 1
        self._start(w)
        self._await_ready(w)
        seed = None if self._seed is None else self._seed + self._restarts * self.spec.num_envs
        _, dead = self._command([w], bytes([W.RESET]) + W.encode_seed(seed), W.DONE, "resetting")
        if dead:
            raise EnvWorkerError(f"{w.describe()} died again right after its restart")
        lost = f", and the {len(w.envs)} episode(s) its envs were in are lost" if losing else ""
        print(f"msrl: {w.describe()} of {self.env_id!r} died ({cause}); restarted it{lost} "
              f"(restart {self._restarts})", file=sys.stderr)

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' pids, worker 0 first."""
        return [w.proc.pid for w in self._workers]

    @property
    def restarts(self) -> int:
        """Workers restarted so far."""
        return self._restarts

    # -- helpers ---------------------------------------------------------------------------------
    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(a, copy=True)).to(device=self.device, dtype=self._out_dtype)

    def _write_actions(self, action: torch.Tensor, rows: np.ndarray | slice) -> None:
        act = action.detach().cpu().numpy()
        if isinstance(self._action_space, gymnasium.spaces.Box):
            act = np.clip(act, self._action_space.low, self._action_space.high)
        self._a["action"][rows] = act

    def _rows(self, rows: np.ndarray, every: bool = False) -> tuple[torch.Tensor, ...]:
        """Returns envs ``rows``' outputs, marks lost rows, updates trackers and env steps.
        ``every``: ``rows`` is the whole batch in order (read through views, not copies)."""
        a = self._a
        sel = slice(None) if every else rows
        obs = a["obs"][sel]
        reward = a["reward"][sel]
        terminated = a["terminated"][sel].copy()
        truncated = a["truncated"][sel].copy()
        done = terminated | truncated
        lost = self._lost[sel].copy()
        obs_t = self._tensor(obs)
        final_t = obs_t  # no episode ended and no env lost: the final observations are these
        any_done, any_lost = bool(done.any()), bool(lost.any())
        if any_done or any_lost:
            final = obs.copy()
            final[done] = a["final_obs"][rows[done]]
            if any_lost:
                final[lost] = self._last_obs[rows[lost]]
                reward = np.where(lost.reshape(-1, *[1] * (reward.ndim - 1)), 0.0, reward)
                terminated[lost], truncated[lost] = False, True
                self._lost[sel] = False
            final_t = self._tensor(final)
        stepped = ~(lost | self._fresh[sel])
        self._fresh[sel] = False
        episode_reward = reward if reward.ndim == 1 else reward.sum(1)  # multi-agent: summed over agents
        if stepped.all():
            self._tracker.update(rows, episode_reward, done)
            self._env_steps += len(rows)
        else:
            self._tracker.update(rows[stepped], episode_reward[stepped], done[stepped])
            self._env_steps += int(stepped.sum())
        self._last_obs[sel] = obs
        dev = self.device
        return (obs_t, torch.from_numpy(reward.astype(np.float32)).to(dev), torch.from_numpy(terminated).to(dev),
                torch.from_numpy(truncated).to(dev), final_t, torch.from_numpy(lost).to(dev))

    def _lose(self, w: _Worker) -> None:
        self._restart(w)
        self._lost[w.envs] = True
        self._tracker.lose(w.envs)

    def _lose_in_flight(self, w: _Worker) -> None:
        """Async mode: worker ``w`` died. Every env of it is lost: those in flight become ready
        (returned as lost by the next recv), those ready or held by the caller are returned as
        lost when received or sent."""
        flying = w.envs[self._in_flight[w.envs]]
        self._lose(w)
        self._in_flight[flying] = False
        self._ready.extend(flying.tolist())

    # -- Environment ------------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> torch.Tensor:
        """Resets every env; env ``i`` is seeded with ``seed + i``.

        Returns:
            observations ``(N, *obs_shape)``.

        Raises:
            RuntimeError: envs are in flight (:meth:`send` without :meth:`recv`).
            EnvWorkerError: an env raised.
        """
        self._check_idle("reset")
        self._seed = seed
        _, dead = self._command(self._workers, bytes([W.RESET]) + W.encode_seed(seed), W.DONE, "resetting")
        for w in dead:  # nothing was lost yet: a fresh worker and a fresh reset
            self._restart(w, losing=False)
            if self._command([w], bytes([W.RESET]) + W.encode_seed(seed), W.DONE, "resetting")[1]:
                raise EnvWorkerError(f"{w.describe()} died again right after its restart")
        self._tracker.reset()
        self._lost[:] = False
        self._fresh[:] = False
        self._ready.clear()
        self._last_obs[:] = self._a["obs"]
        return self._tensor(self._a["obs"])

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Steps every env once (:meth:`msrl.api.Environment.step`'s contract); ``info["lost"]``
        ``(N,)`` bool marks envs whose worker died during the step (see the module docstring).

        Args:
            action: ``(N,)`` int64 for discrete spaces, ``(N, *action_shape)`` float for boxes.

        Raises:
            ValueError: ``action`` has the wrong leading size.
            RuntimeError: envs are in flight.
            EnvWorkerError: an env raised (with the worker's traceback).
            FloatingPointError: an observation or reward is NaN or infinite.
        """
        n = self.spec.num_envs
        if action.shape[0] != n:
            raise ValueError(f"action has leading size {action.shape[0]}, expected num_envs={n}")
        self._check_idle("step")
        self._write_actions(action, slice(None))
        _, dead = self._command(self._workers, bytes([W.STEP_ALL]), W.DONE, "stepping")
        for w in dead:
            self._lose(w)
        self._check_finite(slice(None))
        obs, reward, terminated, truncated, final, lost = self._rows(self._index, every=True)
        return obs, reward, terminated, truncated, {"final_obs": final, "lost": lost}

    def _check_finite(self, rows: np.ndarray | slice) -> None:
        a = self._a
        if self._float_obs and not np.isfinite(a["obs"][rows]).all() or not np.isfinite(a["reward"][rows]).all():
            count = self.spec.num_envs if isinstance(rows, slice) else len(rows)
            raise FloatingPointError(f"env {self.env_id!r} returned a non-finite observation or reward "
                                     f"at env step {self._env_steps + count}")

    def _check_idle(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"cannot {what}: the env engine is closed")
        if self._in_flight.any() or self._ready:
            raise RuntimeError(f"cannot {what} while envs are in flight; recv() every env sent first")

    # -- EnvPool-style asynchronous stepping --------------------------------------------------------
    def async_reset(self, seed: int | None = None) -> None:
        """Resets every env and makes all ``N`` ready for :meth:`recv` (reward 0, not done)."""
        self.reset(seed)
        self._a["reward"][:] = 0.0
        self._a["terminated"][:] = False
        self._a["truncated"][:] = False
        self._ready = list(range(self.spec.num_envs))
        self._fresh[:] = True

    def send(self, action: torch.Tensor, env_ids: torch.Tensor) -> None:
        """Hands ``action`` ``(B, *action_shape)`` to envs ``env_ids`` (int ``(B,)``, distinct,
        none in flight) and returns without waiting.

        Raises:
            ValueError: mismatched sizes, repeated or out-of-range ids, or ids already in flight.
        """
        ids = np.asarray(env_ids.detach().cpu().numpy(), dtype=np.int64).reshape(-1)
        if action.shape[0] != len(ids):
            raise ValueError(f"send: {action.shape[0]} actions for {len(ids)} env ids")
        if len(ids) and (ids.min() < 0 or ids.max() >= self.spec.num_envs):
            raise ValueError(f"send: env ids must be in 0..{self.spec.num_envs - 1}")
        if len(np.unique(ids)) != len(ids):
            raise ValueError("send: repeated env ids")
        if self._in_flight[ids].any() or set(self._ready) & set(ids.tolist()):
            raise ValueError(f"send: envs {sorted(set(ids[self._in_flight[ids]].tolist()) | (set(self._ready) & set(ids.tolist())))}"
                             " are in flight or not yet received")
        self._write_actions(action, ids)
        lost = self._lost[ids]
        self._ready.extend(ids[lost].tolist())  # their worker restarted: returned as lost, not stepped
        ids = ids[~lost]
        self._in_flight[ids] = True
        for w in self._workers:
            mine = ids[self._worker_of[ids] == w.index]
            if len(mine) and not self._send(w, bytes([W.STEP_IDS]) + mine.astype(np.int32).tobytes()):
                self._lose_in_flight(w)  # it died since the last recv

    def recv(self, batch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The first ``batch_size`` envs (default the engine's) to finish since they were sent.

        Returns:
            ``(obs, reward, terminated, truncated, info)`` with ``B = batch_size`` rows, and
            ``info["env_id"]`` int64 ``(B,)``, ``info["final_obs"]``, ``info["lost"]``.

        Raises:
            ValueError: fewer than ``batch_size`` envs in flight or ready.
            EnvWorkerError: an env raised.
        """
        b = self.batch_size if batch_size is None else batch_size
        if b > int(self._in_flight.sum()) + len(self._ready):
            raise ValueError(f"recv: batch_size={b}, but only {int(self._in_flight.sum()) + len(self._ready)} envs were sent")
        while len(self._ready) < b:
            busy = {int(self._worker_of[i]) for i in np.flatnonzero(self._in_flight)}
            by_conn = {self._workers[wi].conn: self._workers[wi] for wi in busy}
            # one reply from every worker that has one: taking only the first ready worker's
            # would starve a slower one (its finished envs never returned, its death never
            # noticed) whenever a faster one always has a reply waiting
            for conn in wait(list(by_conn)):
                w = by_conn[conn]
                msg = self._recv(w)
                if self._reply(msg, w, W.ENV_DONE, "stepping"):
                    i = W.ENV_ID.unpack_from(msg, 1)[0]
                    self._in_flight[i] = False
                    self._ready.append(i)
                else:
                    self._lose_in_flight(w)  # restarted: its new connection is collected next time
        rows = np.asarray(self._ready[:b], dtype=np.int64)
        del self._ready[:b]
        self._check_finite(rows)
        obs, reward, terminated, truncated, final, lost = self._rows(rows)
        return obs, reward, terminated, truncated, {"final_obs": final, "lost": lost,
                                                    "env_id": torch.from_numpy(rows).to(self.device)}

    # -- bookkeeping -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Every env's exact snapshot (:func:`msrl.envs.state.dump_env`), the episode trackers and
        the step count.

        Raises:
            RuntimeError: envs are in flight.
            EnvStateError / EnvWorkerError: an env that cannot be snapshotted (named), or a
                worker that died while saving.
        """
        self._check_idle("save the envs' state")
        replies, dead = self._command(self._workers, bytes([W.GET_STATE]), W.STATE, "saving the state of")
        if dead:
            raise EnvWorkerError(f"{dead[0].describe()} died while saving its envs' state")
        blobs: list[bytes] = []
        shared: dict[str, bytes] = {}
        for w in self._workers:
            b, s = pickle.loads(replies[w.index][1:])
            blobs.extend(b)
            shared.update(s)
        return {"envs": blobs, "shared": shared, "seed": self._seed, "restarts": self._restarts,
                "last_obs": self._last_obs.copy(), "env_steps": self._env_steps, **self._tracker.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output (same id and ``N``; any worker count).

        Raises:
            ValueError: the saved batch has another size.
            EnvStateError / EnvWorkerError: a damaged snapshot, or a worker that died loading it.
        """
        self._check_idle("load the envs' state")
        blobs = state["envs"]
        if len(blobs) != self.spec.num_envs:
            raise ValueError(f"checkpoint holds {len(blobs)} envs, this batch has {self.spec.num_envs}")
        data = {w.index: bytes([W.SET_STATE]) + pickle.dumps(([blobs[i] for i in w.envs], state["shared"]),
                                                             protocol=pickle.HIGHEST_PROTOCOL)
                for w in self._workers}
        _, dead = self._command(self._workers, data, W.DONE, "loading the state of")
        if dead:
            raise EnvWorkerError(f"{dead[0].describe()} died while loading its envs' state")
        self._seed, self._restarts = state["seed"], int(state["restarts"])
        self._last_obs[:] = state["last_obs"]
        self._a["obs"][:] = state["last_obs"]
        self._env_steps = int(state["env_steps"])
        self._tracker.load_state_dict(state)
        self._lost[:] = False

    def close(self) -> None:
        """Stops the workers (CLOSE, then terminate after 5 s) and frees the shared memory."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            if w.proc is not None and w.proc.poll() is None:
                self._send(w, bytes([W.CLOSE]))
        for w in self._workers:
            if w.proc is None:
                continue
            try:
                w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait(timeout=5)
            if w.conn is not None:
                w.conn.close()
        self._a = {}
        try:
            self._memory.close()
        except BufferError:  # a caller still holds a view; the mapping goes with it
            pass
        os.close(self._mem_fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
