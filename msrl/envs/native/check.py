"""Consistency checker: native env implementations against each other and against gymnasium
(CartPole-v1, Pendulum-v1), and for Tag, which gymnasium lacks, host kernel vs torch reference.

Like WarpDrive's CPU-vs-GPU checker, but stricter: every implementation (the kernel -- host
build on CPU, NVRTC build on a GPU -- and the torch reference) is stepped side by side with
gymnasium's own env, step by step, over many episodes with random actions and fixed seeds.
Where an episode starts, gymnasium's start state is copied into the native envs (their start
states come from another generator), so every step afterwards is compared: observations,
final observations, rewards, terminated and truncated flags.

Tolerances, per implementation, in float32 observation units (``max |obs - gymnasium obs|``):

* ``kernel`` on CPU: **0** -- the host build computes in float64 with the same operations and
  libm as gymnasium (``-ffp-contract=off``), so results are bitwise equal;
* ``torch``: **0** as measured here; ``TORCH_TOL`` (1e-6) is allowed because torch's vectorised
  float64 sin/cos may differ from libm by an ulp;
* ``kernel`` on a GPU: ``GPU_TOL`` (1e-5): CUDA's sin/cos differ from libm by a few ulp.

Flags (terminated/truncated) and rewards must match exactly for every implementation.

Two modes. ``trajectory``: the native envs follow their own states from each episode start, so
any difference would grow along the episode -- used where the implementation is exact (tolerance
0: the host kernel). ``step``: before every step, each native env is set to the reference's state
and step count, so each step is compared from the same state and a last-ulp difference (CUDA's
``sin``/``cos``) cannot grow through a chaotic 500-step CartPole episode into a flipped flag --
the default wherever the tolerance is not 0 (a GPU, the torch reference).

    python -m msrl.envs.native.check --env cartpole --controller balance --steps 5000
    python -m msrl.envs.native.check --env pendulum --steps 2000
    python -m msrl.envs.native.check --env halfcheetah --physics warp --num-envs 4 --steps 200
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import gymnasium
import numpy as np
import torch

from msrl.envs.native.cartpole import CartPole
from msrl.envs.native.pendulum import Pendulum

__all__ = ["CheckReport", "check_cartpole", "check_pendulum", "check_mujoco", "check_tag", "TOLERANCES", "TAG_TOL",
           "MUJOCO_WARP_TOL", "MUJOCO_WARP_REWARD_TOL"]

TORCH_TOL = 1e-6
#: Tag is float32 throughout: one step's observations may differ by a few float32 ulps.
TAG_TOL = 1e-5
GPU_TOL = 1e-5
#: MuJoCo on MJWarp (float32 physics) against MuJoCo's C (float64), one step from the same
#: state: max abs observation and reward differences (``step`` mode; measured over 8 envs x 300
#: HalfCheetah steps: 2.1e-3 and 1.8e-5, over 4 x 300 Hopper steps: 4.9e-6 and 1.4e-6)
MUJOCO_WARP_TOL = 1e-2
MUJOCO_WARP_REWARD_TOL = 1e-3
#: (impl, device type) -> allowed max abs observation difference.
TOLERANCES = {
    ("kernel", "cpu"): 0.0,
    ("torch", "cpu"): TORCH_TOL,
    ("kernel", "cuda"): GPU_TOL,
    ("torch", "cuda"): GPU_TOL,
}


@dataclasses.dataclass
class CheckReport:
    """The outcome for one implementation.

    Attributes:
        impl, device: what was checked; ``mode``: ``trajectory`` or ``step`` (see the module
        docstring); ``steps``: batch steps compared; ``episodes``: episodes
        finished; ``max_obs_diff``: max abs difference of (final) observations vs gymnasium;
        ``truncations``: episodes that ended by the time limit; ``flag_mismatches``: steps x envs
        where terminated/truncated differed or the reward by more than ``reward_tolerance``;
        ``tolerance``: the allowed ``max_obs_diff``; ``max_reward_diff``: max abs reward
        difference (0 unless the physics is float32).
    """

    impl: str
    device: str
    mode: str
    steps: int
    episodes: int
    truncations: int
    max_obs_diff: float
    flag_mismatches: int
    tolerance: float
    max_reward_diff: float = 0.0
    reward_tolerance: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the implementation is within tolerance and every flag and reward matched."""
        return (self.flag_mismatches == 0 and self.max_obs_diff <= self.tolerance
                and self.max_reward_diff <= self.reward_tolerance)


def check_cartpole(num_envs: int = 8, steps: int = 2000, seed: int = 0, device: str = "cpu",
                   impls: tuple[str, ...] = ("kernel", "torch"), controller: str = "random",
                   mode: str | None = None) -> list[CheckReport]:
    """Steps native CartPole (each impl) and gymnasium's CartPole-v1 side by side.

    Args:
        num_envs: envs per batch; ``steps``: batch steps; ``seed``: gymnasium env ``i`` is
        reset with ``seed + i``, actions come from ``numpy.random.default_rng(seed)``;
        ``device``: where the native envs run; ``controller``: ``"random"`` actions (short
        episodes, terminations) or ``"balance"`` (push toward the falling side 90% of the time,
        random otherwise: long episodes that reach the 500-step truncation); ``mode``:
        ``"trajectory"``, ``"step"``, or ``None``: per implementation, trajectory where its
        tolerance is 0, else step.

    Returns:
        one :class:`CheckReport` per implementation.

    Raises:
        ValueError: an unknown ``controller``.
    """
    if controller not in ("random", "balance"):
        raise ValueError(f"unknown controller {controller!r}; valid: random, balance")
    if mode not in (None, "trajectory", "step"):
        raise ValueError(f"unknown mode {mode!r}; valid: trajectory, step")

    def actions(rng: np.random.Generator, refs: list) -> tuple[np.ndarray, list]:
        action = rng.integers(0, 2, size=num_envs)
        if controller == "balance":
            st = np.stack([r.unwrapped.state for r in refs])
            push = (st[:, 2] + 0.5 * st[:, 3] > 0).astype(np.int64)
            action = np.where(rng.random(num_envs) < 0.9, push, action)
        return action, [int(a) for a in action]

    return _check(CartPole, "CartPole-v1", actions, num_envs, steps, seed, device, impls, mode)


def check_pendulum(num_envs: int = 8, steps: int = 1000, seed: int = 0, device: str = "cpu",
                   impls: tuple[str, ...] = ("kernel", "torch"), mode: str | None = None) -> list[CheckReport]:
    """Steps native Pendulum (each impl) and gymnasium's Pendulum-v1 side by side, with float32
    torques drawn from U[-2.5, 2.5) (so clipping to [-2, 2] is exercised).

    Returns:
        one :class:`CheckReport` per implementation (rewards compared as float32).
    """

    def actions(rng: np.random.Generator, refs: list) -> tuple[np.ndarray, list]:
        u = rng.uniform(-2.5, 2.5, size=(num_envs, 1)).astype(np.float32)
        return u, [u[i] for i in range(num_envs)]

    return _check(Pendulum, "Pendulum-v1", actions, num_envs, steps, seed, device, impls, mode)


def _check(cls, gym_id, actions, num_envs, steps, seed, device, impls, mode=None) -> list[CheckReport]:
    dev = torch.device(device).type
    modes = {impl: mode or ("trajectory" if TOLERANCES[(impl, dev)] == 0 else "step") for impl in impls}
    refs = [gymnasium.make(gym_id) for _ in range(num_envs)]
    for i, r in enumerate(refs):
        r.reset(seed=seed + i)
    natives = {impl: cls(num_envs, device=device, impl=impl) for impl in impls}
    for env in natives.values():
        env.reset(seed=seed)
        for i, r in enumerate(refs):
            env.set_state(i, r.unwrapped.state)
    stats = {impl: {"diff": 0.0, "flags": 0} for impl in impls}
    rng = np.random.default_rng(seed)
    episodes = truncations = 0
    for _ in range(steps):
        batch, per_env = actions(rng, refs)
        outs = {impl: env.step(torch.as_tensor(batch, device=device)) for impl, env in natives.items()}
        for i, r in enumerate(refs):
            o, rew, te, tr, _ = r.step(per_env[i])
            for impl, (_obs, reward, term, trunc, info) in outs.items():
                s = stats[impl]
                s["diff"] = max(s["diff"], float(np.abs(info["final_obs"][i].cpu().numpy() - o).max()))
                if bool(term[i]) != te or bool(trunc[i]) != tr or float(reward[i]) != float(np.float32(rew)):
                    s["flags"] += 1
            if te or tr:
                episodes += 1
                truncations += int(tr)
                o, _ = r.reset()
                for env in natives.values():
                    env.set_state(i, r.unwrapped.state)
            else:
                for impl, (obs, *_rest) in outs.items():
                    stats[impl]["diff"] = max(stats[impl]["diff"], float(np.abs(obs[i].cpu().numpy() - o).max()))
                    if modes[impl] == "step":  # the next step starts from the reference's state
                        natives[impl].set_state(i, r.unwrapped.state, steps=r.get_wrapper_attr("_elapsed_steps"))
    return [
        CheckReport(impl, device, modes[impl], steps, episodes, truncations, stats[impl]["diff"], stats[impl]["flags"],
                    TOLERANCES[(impl, dev)])
        for impl in impls
    ]


def check_mujoco(env_id: str = "msrl/HalfCheetah-v5", num_envs: int = 4, steps: int = 1200, seed: int = 0,
                 device: str = "cpu", physics: str = "mjbatch", start_step: int = 0) -> CheckReport:
    """Steps a native MuJoCo task and gymnasium's own env side by side, with float32 actions from
    U[-1.2, 1.2) (clipping exercised); gymnasium's start states are copied in at every episode
    start.

    * ``physics="mjbatch"`` (:mod:`msrl.envs.native.mujoco`): ``trajectory`` mode. The physics is
      MuJoCo's ``mj_step`` on the same model in both, so observations must be bitwise equal
      (tolerance 0) and rewards and flags exactly equal over whole episodes, the 1,000-step
      truncation (HalfCheetah) and the unhealthy terminations (Hopper) included.
    * ``physics="warp"`` (:mod:`msrl.envs.native.mujoco_warp`, float32): ``step`` mode. Before
      each step the native env takes gymnasium's state (qpos, qvel, the solver's warm start, the
      step count), so each step is compared from the same state: observations within
      :data:`MUJOCO_WARP_TOL`, rewards within :data:`MUJOCO_WARP_REWARD_TOL`, flags equal.

    Args:
        start_step: each episode starts at this step count in both (e.g. 990: the 1,000-step
            truncation within a few steps).

    Returns:
        the :class:`CheckReport` (``impl`` is the physics engine).
    """
    from msrl.envs.native import native_class

    cls = native_class(env_id, physics)
    warp = physics == "warp"
    mode = "step" if warp else "trajectory"
    tol, reward_tol = (MUJOCO_WARP_TOL, MUJOCO_WARP_REWARD_TOL) if warp else (0.0, 0.0)
    refs = [gymnasium.make(cls.GYMNASIUM_ID) for _ in range(num_envs)]
    native = cls(num_envs, device=device, impl="torch")

    def take_state(i: int, ref: gymnasium.Env, elapsed: int) -> None:
        data = ref.unwrapped.data
        if warp:
            native.set_state(i, data.qpos, data.qvel, steps=elapsed, qacc_warmstart=data.qacc_warmstart)
        else:
            native.set_state(i, data.qpos, data.qvel, steps=elapsed)

    def start(i: int, ref: gymnasium.Env, **reset_kwargs) -> None:
        ref.reset(**reset_kwargs)
        ref.set_wrapper_attr("_elapsed_steps", start_step)
        take_state(i, ref, start_step)

    native.reset(seed=seed)
    for i, r in enumerate(refs):
        start(i, r, seed=seed + i)
    rng = np.random.default_rng(seed)
    diff = reward_diff = 0.0
    flags = episodes = truncations = 0
    low, high = native.spec.action_space.low * 1.2, native.spec.action_space.high * 1.2
    for _ in range(steps):
        batch = rng.uniform(low, high, size=(num_envs, *low.shape)).astype(np.float32)
        obs, reward, term, trunc, info = native.step(torch.as_tensor(batch, device=device))
        for i, r in enumerate(refs):
            o, rew, te, tr, _ = r.step(np.clip(batch[i], native.spec.action_space.low, native.spec.action_space.high))
            diff = max(diff, float(np.abs(info["final_obs"][i].cpu().numpy() - o.astype(np.float32)).max()))
            step_reward_diff = abs(float(reward[i]) - float(np.float32(rew)))
            reward_diff = max(reward_diff, step_reward_diff)
            if bool(term[i]) != te or bool(trunc[i]) != tr or step_reward_diff > reward_tol:
                flags += 1
            if te or tr:
                episodes += 1
                truncations += int(tr)
                start(i, r)
            else:
                diff = max(diff, float(np.abs(obs[i].cpu().numpy() - o.astype(np.float32)).max()))
                if warp:
                    take_state(i, r, r.get_wrapper_attr("_elapsed_steps"))
    return CheckReport(physics, device, mode, steps, episodes, truncations, diff, flags, tol, reward_diff, reward_tol)


def check_tag(num_envs: int = 4, steps: int = 300, seed: int = 0, device: str = "cpu", **params) -> CheckReport:
    """Host kernel vs torch reference of native Tag, one step at a time.

    Before every step the torch env is given the kernel env's exact state, then both take the
    same random actions; so each step is compared on its own and float32 ulp differences (the
    host build's libm ``sinf``/``cosf`` vs torch's vectorised ones) cannot compound into chaos.
    Observations must agree to ``TAG_TOL``; rewards, tags (``in_game``), runner counts,
    ``terminated`` and the finished games' statistics exactly.

    Returns:
        a :class:`CheckReport` for the kernel (``flag_mismatches`` counts differing rewards,
        tags and flags; ``episodes`` finished games).
    """
    from msrl.envs.native.tag import Tag

    a = Tag(num_envs, device=device, impl="kernel", **params)
    b = Tag(num_envs, device=device, impl="torch", **params)
    a.reset(seed=seed)
    b.reset(seed=seed)
    rng = np.random.default_rng(seed)
    p = a.params
    diff, mismatches, games = 0.0, 0, 0
    for _ in range(steps):
        b.load_state_dict(a.state_dict())
        act = torch.as_tensor(np.stack([rng.integers(0, p.num_acceleration_levels + 1, (num_envs, a.num_agents)),
                                        rng.integers(0, p.num_turn_levels + 1, (num_envs, a.num_agents))], axis=2), device=device)
        x, y = a.step(act), b.step(act)
        diff = max(diff, float((x[0] - y[0]).abs().max()), float((x[4]["final_obs"] - y[4]["final_obs"]).abs().max()))
        mismatches += int((x[1] != y[1]).sum()) + int((x[2] != y[2]).sum())
        mismatches += int((a.in_game != b.in_game).sum()) + int((a.runners_left != b.runners_left).sum())
        games += int(x[2].sum())
        sa, sb = a.pop_episode_stats(), b.pop_episode_stats()  # per-game returns, lengths, per-type returns
        mismatches += int(sa != sb)
    return CheckReport("kernel", device, "step", steps, games, 0, diff, mismatches, TAG_TOL)


def main() -> None:
    """``python -m msrl.envs.native.check``: prints one JSON report per implementation; exits 1
    when any is out of tolerance."""
    p = argparse.ArgumentParser(description="native envs vs gymnasium, step by step")
    p.add_argument("--env", default="cartpole", choices=["cartpole", "pendulum", "tag", "halfcheetah", "hopper"])
    p.add_argument("--num-envs", type=int, default=8)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--controller", default="random", choices=["random", "balance"])
    p.add_argument("--mode", default=None, choices=["trajectory", "step"],
                   help="default: trajectory where the tolerance is 0 (host kernel), else step")
    p.add_argument("--physics", default="mjbatch", choices=["mjbatch", "warp"], help="MuJoCo tasks' physics engine")
    p.add_argument("--start-step", type=int, default=0, help="MuJoCo tasks: episodes start at this step count")
    args = p.parse_args()
    if args.env == "cartpole":
        reports = check_cartpole(args.num_envs, args.steps, args.seed, args.device, controller=args.controller, mode=args.mode)
    elif args.env in ("halfcheetah", "hopper"):
        reports = [check_mujoco({"halfcheetah": "msrl/HalfCheetah-v5", "hopper": "msrl/Hopper-v5"}[args.env],
                                args.num_envs, args.steps, args.seed, args.device, args.physics, args.start_step)]
    elif args.env == "pendulum":
        reports = check_pendulum(args.num_envs, args.steps, args.seed, args.device, mode=args.mode)
    else:
        reports = [check_tag(args.num_envs, args.steps, args.seed, args.device),
                   check_tag(args.num_envs, args.steps, args.seed, args.device, use_full_observation=False,
                             num_other_agents_observed=3)]
    for r in reports:
        print(json.dumps({**dataclasses.asdict(r), "ok": r.ok}))
    raise SystemExit(0 if all(r.ok for r in reports) else 1)


if __name__ == "__main__":
    main()
