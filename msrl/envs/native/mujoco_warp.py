"""Native MuJoCo tasks with their physics on the env's device: gymnasium's ``HalfCheetah-v5`` and
``Hopper-v5`` stepped by MuJoCo Warp (MJWarp, ``mujoco-warp``: MuJoCo's pipeline as Warp kernels,
one simulation per "world"), the task's logic (observation, reward, termination, truncation,
same-step autoreset, reset noise) in torch on the same tensors -- no host round trip in a step,
so a ``gpu_only`` fragment can run thousands of envs on one GPU and capture its iteration.

Chosen with ``env.kwargs.physics: warp`` on the ``msrl/HalfCheetah-v5`` / ``msrl/Hopper-v5``
ids (the default, ``mjbatch``, is MuJoCo's C on the CPU: :mod:`msrl.envs.native.mujoco`). The
same code runs on the CPU (Warp's LLVM backend; small batches, for tests and debugging) and on
a CUDA device.

What differs from gymnasium's task, by construction:

* **float32 physics.** MJWarp computes in float32 (MuJoCo's C in float64), so a step is equal to
  gymnasium's to float32 tolerance, not bitwise, and trajectories drift apart as any chaotic
  system's do; :func:`msrl.envs.native.check.check_mujoco` therefore compares this physics in
  ``step`` mode (each step from gymnasium's state: observations within
  :data:`~msrl.envs.native.check.MUJOCO_WARP_TOL`, rewards within
  :data:`~msrl.envs.native.check.MUJOCO_WARP_REWARD_TOL`, flags equal).
* **Start states** come from msrl's counter-based generator with gymnasium's distributions (as
  the ``mjbatch`` tasks: env ``i`` keyed by ``seed + i``), rounded to float32.
* A reset sets ``qpos``, ``qvel``, the solver's warm start (0) and ``time`` (0) of the ended
  envs -- gymnasium's ``mj_resetData`` + ``set_state`` for these models, which have no
  activations, mocap bodies or plugins (checked at construction).

On a GPU the constraint solver runs the model's full iteration count every step (its converged
worlds' iterations are no-ops) instead of a loop whose exit Warp would read on the host: a step
launches a fixed sequence of kernels on torch's stream, with no host sync, which a CUDA graph
captures. On the CPU the loop exits early (a host read is free there).

Warp compiles MJWarp's kernels on first use (minutes on a CPU, cached across runs under Warp's
kernel cache, ``~/.cache/warp``); on the CPU they are compiled at optimisation level 0 (about
half the compile time, no slower here: a CPU step is bound by Warp's per-launch cost).
"""

from __future__ import annotations

import contextlib
import pathlib
from typing import Any, Iterator

import gymnasium
import numpy as np
import torch

from msrl.device import record_foreign
from msrl.envs.native.base import IMPLS, NativeEnv, box_muller, env_keys, uniform_many
from msrl.envs.native.mujoco import HalfCheetahRules, HopperRules

__all__ = ["WarpMujocoTask", "WarpHalfCheetah", "WarpHopper", "MUJOCO_WARP_VERSION"]

_ASSETS = pathlib.Path(gymnasium.__file__).parent / "envs" / "mujoco" / "assets"

#: the MJWarp release this module is written and tested against (``pip install -e '.[mujoco]'``)
MUJOCO_WARP_VERSION = "3.14.0"

_WARP_READY = False


def _import_warp() -> tuple[Any, Any]:
    """``(warp, mujoco_warp)``, Warp initialised, its banner and compile log silenced (unless the
    user set ``warp.config.log_level``).

    Raises:
        ImportError: ``mujoco-warp`` (or ``warp-lang``) missing, naming the extra to install.
    """
    try:
        import warp as wp

        if wp.config.log_level == wp.LOG_INFO:  # Warp's default: a banner and a line per compiled module
            wp.config.log_level = wp.LOG_ERROR  # (and, without a GPU, a warning that it has none)
        import mujoco_warp as mjw
    except ImportError as e:
        raise ImportError(f"env.kwargs.physics=warp needs mujoco-warp=={MUJOCO_WARP_VERSION}: "
                          f"pip install -e '.[mujoco]' ({e})") from None
    _init_quietly(wp)
    return wp, mjw


def _init_quietly(wp: Any) -> None:
    """``wp.init()`` (idempotent) with its native library's notice that a machine has no CUDA
    driver dropped (printed from C, past ``log_level``: on a CPU-only machine it is no news);
    anything else it prints is passed on to stderr. The process's stdout and stderr point at a
    temporary file while Warp initialises (once per process): another thread's output in that
    moment goes to stderr after it."""
    import os
    import sys
    import tempfile

    global _WARP_READY
    if _WARP_READY:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as sink:
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            wp.init()
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        sink.seek(0)
        text = sink.read().decode(errors="replace")
    rest = [line for line in text.splitlines() if line and "Could not find or load the NVIDIA CUDA driver" not in line]
    if rest:
        print("\n".join(rest), file=sys.stderr)
    _WARP_READY = True


class WarpMujocoTask(NativeEnv):
    """Base of the MuJoCo tasks on MJWarp physics (see the module docstring).

    Args:
        num_envs: ``N`` >= 1 (MJWarp worlds).
        device: where the simulations, observations and rewards live (``cpu`` or ``cuda:K``).
        impl: ``"torch"`` or ``"kernel"`` (the backends' choice for native envs): the same here --
            the physics is Warp's kernels and the task logic torch ops either way.
        max_episode_steps: the time limit (gymnasium's: 1,000).

    Raises:
        ValueError: ``num_envs < 1``, an unknown ``impl``, ``max_episode_steps < 1``.
        ImportError: ``mujoco-warp`` missing.
    """

    ENV_ID: str
    GYMNASIUM_ID: str
    XML: str
    FRAME_SKIP: int
    NOISE: float
    CTRL_COST_WEIGHT: float
    #: RNG stream of the reset noise (the ``mjbatch`` tasks' stream: same start-state draws)
    STREAM = 0x6D756A6F

    def __init__(self, num_envs: int, device: str | torch.device = "cpu", impl: str = "kernel",
                 max_episode_steps: int = 1000) -> None:
        if impl not in IMPLS:
            raise ValueError(f"unknown native env implementation {impl!r}; valid: {', '.join(IMPLS)}")
        super().__init__(num_envs, device, "torch")  # no CUDA C source: Warp's kernels are the physics
        if max_episode_steps < 1:
            raise ValueError(f"max_episode_steps must be >= 1, got {max_episode_steps}")
        import mujoco

        wp, mjw = _import_warp()
        self._wp, self._mjw = wp, mjw
        self.impl = impl
        self.max_episode_steps = max_episode_steps
        self.model = mujoco.MjModel.from_xml_path(str(_ASSETS / self.XML))
        m = self.model
        if m.na or m.nmocap or m.nplugin or m.nuserdata:
            raise ValueError(f"{self.ENV_ID}: the model has state beyond qpos/qvel (activations, mocap, plugins or "
                             "user data), which this task's reset does not set")
        if self.device.type == "cpu" and wp.config.optimization_level is None:
            wp.config.optimization_level = 0
        self._wp_device = wp.device_from_torch(self.device)
        data = mujoco.MjData(m)
        with self._warp_scope():
            self._m = mjw.put_model(m)
            self._d = mjw.put_data(m, data, nworld=num_envs)
        if self.device.type == "cuda":
            # the solver's loop as a fixed count of iterations (a converged world's are no-ops), not
            # a loop whose exit Warp reads on the host each iteration when it is not capturing
            # itself: no host sync in a step, and plain kernels a torch CUDA graph captures
            self._m.opt.graph_conditional = False
        # torch views of the simulations' state (the same memory): (N, nq) / (N, nv) / (N, nu) / (N,)
        self.qpos, self.qvel, self.ctrl, self.qacc_warmstart, self.time = (
            wp.to_torch(getattr(self._d, k)) for k in ("qpos", "qvel", "ctrl", "qacc_warmstart", "time"))
        dev = self.device
        self.init_qpos = torch.as_tensor(m.qpos0.copy(), dtype=torch.float64, device=dev)
        self.init_qvel = torch.zeros(m.nv, dtype=torch.float64, device=dev)
        self.dt = m.opt.timestep * self.FRAME_SKIP
        low, high = m.actuator_ctrlrange.copy().astype(np.float32).T
        self._low = torch.as_tensor(low, device=dev)
        self._high = torch.as_tensor(high, device=dev)
        self._ctrl_cost_weight = torch.tensor(self.CTRL_COST_WEIGHT, dtype=torch.float32, device=dev)
        self.obs_dim = m.nq - 1 + m.nv
        self.spec = self.make_spec(self.ENV_ID, gymnasium.spaces.Box(-np.inf, np.inf, (self.obs_dim,), np.float64),
                                   gymnasium.spaces.Box(low, high, dtype=np.float32))
        # steps into the episode (N,) int32, episodes started (N,) int64 (the RNG's episode counter)
        self.steps = torch.zeros(num_envs, dtype=torch.int32, device=dev)
        self.episode = torch.zeros(num_envs, dtype=torch.int64, device=dev)
        self._env_index = torch.arange(num_envs, dtype=torch.int64, device=dev)

    @contextlib.contextmanager
    def _warp_scope(self) -> Iterator[None]:
        """Warp's calls on this env's device and, on a GPU, on torch's current stream (ordered
        with the torch ops around them, and captured with them into a CUDA graph)."""
        wp = self._wp
        with wp.ScopedDevice(self._wp_device):
            if self.device.type == "cuda":
                with wp.ScopedStream(wp.stream_from_torch(torch.cuda.current_stream(self.device))):
                    yield
            else:
                yield

    # -- task logic, batched, in torch (gymnasium's formulas) ------------------------------------
    def _ctrl_cost(self, action: torch.Tensor) -> torch.Tensor:
        """``CTRL_COST_WEIGHT * sum(action^2)`` in float32 as gymnasium computes it on a float32
        action (the squares added left to right, as NumPy's sum of fewer than 8); float64 ``(B,)``."""
        sq = action * action
        acc = sq[:, 0].clone()
        for k in range(1, sq.shape[1]):
            acc += sq[:, k]
        return (acc * self._ctrl_cost_weight).to(torch.float64)

    def _observe(self, qpos: torch.Tensor, qvel: torch.Tensor) -> torch.Tensor:
        """``concat(qpos[:, 1:], qvel)``: float32 ``(B, obs_dim)``."""
        return torch.cat([qpos[:, 1:], qvel], dim=1).to(torch.float32)

    def _reward(self, x_velocity: torch.Tensor, action: torch.Tensor, qpos: torch.Tensor,
                qvel: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _terminated(self, qpos: torch.Tensor, qvel: torch.Tensor) -> torch.Tensor:
        return torch.zeros(qpos.shape[0], dtype=torch.bool, device=qpos.device)

    def _noise(self, episode: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Start states ``(qpos, qvel)`` float64 ``(N, nq)``, ``(N, nv)`` of every env for its
        episode ``episode`` ``(N,)``: ``init + noise``."""
        raise NotImplementedError

    def _uniforms(self, episode: torch.Tensor, count: int, first: int = 0) -> torch.Tensor:
        """U[0, 1) float64 ``(N, count)``: draws ``first..first+count-1`` of each env's episode."""
        keys = env_keys(self.seed, self._env_index)
        return torch.stack([uniform_many(keys, self.STREAM, episode, first + k) for k in range(count)], 1)

    def _normals(self, episode: torch.Tensor, count: int, first: int) -> torch.Tensor:
        """Standard normal float64 ``(N, count)`` (:func:`~msrl.envs.native.base.box_muller`)."""
        return box_muller(self._uniforms(episode, 2 * count, first))

    def _restart(self, done: torch.Tensor) -> None:
        """Starts the next episode of the envs where ``done`` ``(N,)`` bool, as gymnasium's
        ``reset`` (``mj_resetData`` then ``set_state``), without a host sync."""
        self.episode += done.to(torch.int64)
        qpos, qvel = self._noise(self.episode)
        rows = done.unsqueeze(1)
        self.qpos.copy_(torch.where(rows, qpos.to(torch.float32), self.qpos))
        self.qvel.copy_(torch.where(rows, qvel.to(torch.float32), self.qvel))
        self.qacc_warmstart.copy_(torch.where(rows, 0.0, self.qacc_warmstart))
        self.time.copy_(torch.where(done, 0.0, self.time))
        self.steps.copy_(torch.where(done, 0, self.steps))

    # -- Environment -----------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> torch.Tensor:
        """Starts episode 0 of every env; env ``i`` draws its start state from key ``seed + i``.

        Returns:
            float32 observations ``(N, obs_dim)``.
        """
        if seed is not None:
            self.seed = int(seed)
        self._reset_tracking()
        self.episode.fill_(-1)
        self._restart(torch.ones(self.num_envs, dtype=torch.bool, device=self.device))
        return self._observe(self.qpos, self.qvel)

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Steps every env by ``FRAME_SKIP`` physics steps (the :class:`~msrl.api.Environment`
        contract, same-step autoreset).

        Args:
            action: float ``(N, nu)``; clipped to the actuators' control range.

        Returns:
            ``(obs, reward, terminated, truncated, {"final_obs": ...})``: float32 ``(N, obs_dim)``,
            float32 ``(N,)``, bool ``(N,)``, bool ``(N,)``, float32 ``(N, obs_dim)``.

        A diverged simulation is not checked here (the check would read the device on the host
        every step, and keep the iteration from being captured): its non-finite observations
        reach the learner, whose loss check raises on them.

        Raises:
            ValueError: wrong action shape.
        """
        n, nu = self.num_envs, self.model.nu
        if tuple(action.shape) != (n, nu):
            raise ValueError(f"action has shape {tuple(action.shape)}, expected (num_envs, nu) = {(n, nu)}")
        a = torch.clamp(action.to(self.device, torch.float32), self._low, self._high)
        self.ctrl.copy_(a)
        x_before = self.qpos[:, 0].to(torch.float64)
        record_foreign(self._physics_step)
        qpos, qvel = self.qpos, self.qvel
        x_velocity = (qpos[:, 0].to(torch.float64) - x_before) / self.dt
        final_obs = self._observe(qpos, qvel)
        reward = self._reward(x_velocity, a, qpos, qvel).to(torch.float32)
        terminated = self._terminated(qpos, qvel)
        self.steps += 1
        truncated = self.steps >= self.max_episode_steps
        done = terminated | truncated
        self._track(reward, done)
        self._restart(done)  # every step, without a branch on the device's values: a replay repeats it
        return self._observe(self.qpos, self.qvel), reward, terminated, truncated, {"final_obs": final_obs}

    def _physics_step(self) -> None:
        """``FRAME_SKIP`` MJWarp steps of every simulation, on the device's (torch's) stream: a
        foreign call to torch, recorded as one by the CPU capture tape
        (:func:`~msrl.device.record_foreign`)."""
        with self._warp_scope():
            for _ in range(self.FRAME_SKIP):
                self._mjw.step(self._m, self._d)

    def set_state(self, index: int, qpos: Any, qvel: Any, steps: int = 0, qacc_warmstart: Any = None) -> torch.Tensor:
        """Overwrites env ``index``'s state (e.g. with gymnasium's, for the checker) as
        gymnasium's ``set_state``; the solver's warm start is ``qacc_warmstart`` (0 if None).
        Returns its observation ``(obs_dim,)`` float32."""
        dev = self.device
        self.qpos[index] = torch.as_tensor(np.asarray(qpos, dtype=np.float32), device=dev)
        self.qvel[index] = torch.as_tensor(np.asarray(qvel, dtype=np.float32), device=dev)
        warm = np.zeros(self.model.nv) if qacc_warmstart is None else qacc_warmstart
        self.qacc_warmstart[index] = torch.as_tensor(np.asarray(warm, dtype=np.float32), device=dev)
        self.time[index] = 0.0
        self.steps[index] = steps
        return self._observe(self.qpos[index:index + 1], self.qvel[index:index + 1])[0]

    def _tensors(self) -> dict[str, torch.Tensor]:
        """The integration state of every simulation (what the next step reads) and the counters."""
        return {"qpos": self.qpos, "qvel": self.qvel, "qacc_warmstart": self.qacc_warmstart, "time": self.time,
                "steps": self.steps, "episode": self.episode}


class WarpHalfCheetah(HalfCheetahRules, WarpMujocoTask):
    """``HalfCheetah-v5`` on MJWarp physics (:class:`~msrl.envs.native.mujoco.HalfCheetahRules`)."""

    def _reward(self, x_velocity, action, qpos, qvel):
        return x_velocity - self._ctrl_cost(action)


class WarpHopper(HopperRules, WarpMujocoTask):
    """``Hopper-v5`` on MJWarp physics (:class:`~msrl.envs.native.mujoco.HopperRules`)."""

    def _observe(self, qpos, qvel):
        return torch.cat([qpos[:, 1:], torch.clamp(qvel, -10.0, 10.0)], dim=1).to(torch.float32)

    def _healthy(self, qpos, qvel):
        state = torch.cat([qpos, qvel], dim=1)[:, 2:]
        z, angle = qpos[:, 1], qpos[:, 2]
        r, a = self.STATE_RANGE, self.MAX_ANGLE
        return ((state > -r) & (state < r)).all(1) & (z > self.MIN_Z) & (angle > -a) & (angle < a)

    def _reward(self, x_velocity, action, qpos, qvel):
        healthy = self._healthy(qpos, qvel).to(torch.float64) * self.HEALTHY_REWARD
        return x_velocity + healthy - self._ctrl_cost(action)

    def _terminated(self, qpos, qvel):
        return ~self._healthy(qpos, qvel)
