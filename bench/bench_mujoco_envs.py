"""Simulator stepping: env steps/s of msrl's env engine and native MuJoCo tasks against EnvPool,
in one run, on the same threads.

HalfCheetah-v5, ``--envs`` envs (default 64), ``--threads`` threads (default 2):

* ``gymnasium sync`` -- the envs stepped one after another in this process (``env.engine: sync``);
* ``msrl process engine`` -- :class:`msrl.envs.engine.ProcessEnv`, one worker process per thread;
* ``msrl native task`` -- ``msrl/HalfCheetah-v5``: mjbatch physics on ``--threads`` threads, task
  logic in NumPy;
* ``mjbatch physics alone (ceiling)`` -- the native task's physics without its task logic
  (``mj_step`` x 5 per env on ``--threads`` threads): what the native task can reach;
* ``envpool`` -- ``envpool.make("HalfCheetah-v5", env_type="gymnasium")`` on ``--threads`` threads;
* with ``--warp``: ``msrl native task, MJWarp physics`` -- ``msrl/HalfCheetah-v5`` with
  ``env.kwargs.physics: warp`` on this CPU (Warp's CPU kernels run on one thread), and ``MJWarp
  physics alone`` (its ``mjw.step`` x 5 without the task logic).

Atari (``--atari``): ``ALE/Pong-v5`` with the standard preprocessing (84x84 grayscale, 4 stacked
frames, frame skip 4, up to 30 no-ops, no sticky actions) through the process engine and through
ale-py's C++ vector env (``env.engine: ale_vector``, :class:`msrl.envs.ale_vector_env.AleVectorEnv`),
against envpool's ``Pong-v5`` with the same settings.

Every system steps with zero actions (MuJoCo) or random actions (Atari) and autoreset on.
Rounds alternate the systems. Reported per system: the median env steps/s over ``--rounds``
rounds, and the median over rounds of its rate divided by EnvPool's in the same round
(``vs_envpool``): this VM's speed drifts by tens of percent within minutes, and a ratio of
rates measured seconds apart is steadier than a ratio of medians.

    python bench/bench_mujoco_envs.py --envs 64 --threads 2 --rounds 3 --atari
    python bench/bench_mujoco_envs.py --envs 16 64 --rounds 2 --warp
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import numpy as np
import torch


def timed(step: Callable[[], None], seconds: float) -> float:
    """Batch steps/s of ``step`` over at least ``seconds`` after a warm-up."""
    for _ in range(10):
        step()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            step()
        n += 10
    return n / (time.perf_counter() - t0)


def mujoco_systems(n: int, threads: int, warp: bool = False) -> dict[str, Callable[[], tuple[Callable[[], None], Callable[[], None]]]]:
    """name -> builder returning (step, close) for HalfCheetah-v5 with ``n`` envs (``warp``: also
    the task on MJWarp physics, on this CPU)."""

    def sync():
        from msrl.envs.gymnasium_env import GymnasiumEnv

        env = GymnasiumEnv("HalfCheetah-v5", n)
        env.reset(seed=0)
        a = torch.zeros(n, 6)
        return (lambda: env.step(a)), env.close

    def engine():
        from msrl.envs.engine import ProcessEnv

        env = ProcessEnv("HalfCheetah-v5", n, num_workers=threads)
        env.reset(seed=0)
        a = torch.zeros(n, 6)
        return (lambda: env.step(a)), env.close

    def native():
        from msrl.envs.native import HalfCheetah

        env = HalfCheetah(n, num_threads=threads)
        env.reset(seed=0)
        a = torch.zeros(n, 6)
        return (lambda: env.step(a)), (lambda: None)

    def physics():
        import mjbatch

        from msrl.envs.native import HalfCheetah

        batch = mjbatch.Batch(HalfCheetah(1).model, n, min(threads, n))
        return (lambda: batch.step(nstep=HalfCheetah.FRAME_SKIP)), (lambda: None)

    def envpool_():
        import envpool

        env = envpool.make("HalfCheetah-v5", env_type="gymnasium", num_envs=n, num_threads=threads, seed=0)
        env.reset()
        a = np.zeros((n, 6), dtype=np.float32)
        return (lambda: env.step(a)), env.close

    def warp_native():
        from msrl.envs.native import WarpHalfCheetah

        env = WarpHalfCheetah(n)
        env.reset(seed=0)
        a = torch.zeros(n, 6)
        return (lambda: env.step(a)), (lambda: None)

    def warp_physics():
        from msrl.envs.native import WarpHalfCheetah

        env = WarpHalfCheetah(n)
        env.reset(seed=0)
        return env._physics_step, (lambda: None)

    systems = {"gymnasium sync": sync, "msrl process engine": engine, "msrl native task": native,
               "mjbatch physics alone (ceiling)": physics, "envpool": envpool_}
    if warp:
        systems.update({"msrl native task, MJWarp physics": warp_native, "MJWarp physics alone": warp_physics})
    return systems


def atari_systems(n: int, threads: int) -> dict[str, Callable[[], tuple[Callable[[], None], Callable[[], None]]]]:
    """name -> builder returning (step, close) for Pong with the standard preprocessing."""
    rng = np.random.default_rng(0)

    def engine():
        from msrl.envs.engine import ProcessEnv

        env = ProcessEnv("ALE/Pong-v5", n, num_workers=threads, wrappers=["atari"],
                         env_kwargs={"repeat_action_probability": 0.0})
        env.reset(seed=0)
        acts = [torch.as_tensor(rng.integers(0, 6, n)) for _ in range(64)]
        i = [0]

        def step():
            i[0] += 1
            env.step(acts[i[0] % 64])
        return step, env.close

    def envpool_():
        import envpool

        env = envpool.make("Pong-v5", env_type="gymnasium", num_envs=n, num_threads=threads, seed=0,
                           episodic_life=False, reward_clip=False, repeat_action_probability=0.0,
                           noop_max=30, stack_num=4, frame_skip=4, img_height=84, img_width=84)
        env.reset()
        acts = [rng.integers(0, 6, n) for _ in range(64)]
        i = [0]

        def step():
            i[0] += 1
            env.step(acts[i[0] % 64])
        return step, env.close

    def ale_vector():
        from msrl.envs.ale_vector_env import AleVectorEnv

        env = AleVectorEnv("ALE/Pong-v5", n, num_threads=threads, env_kwargs={"repeat_action_probability": 0.0})
        env.reset(seed=0)
        acts = [torch.as_tensor(rng.integers(0, 6, n)) for _ in range(64)]
        i = [0]

        def step():
            i[0] += 1
            env.step(acts[i[0] % 64])
        return step, env.close

    return {"msrl process engine": engine, "msrl ale_vector engine": ale_vector, "envpool": envpool_}


def run(systems, n: int, rounds: int, seconds: float) -> dict[str, dict[str, float]]:
    """Per system: ``steps_per_s``, the median env steps/s over ``rounds`` alternating rounds,
    and ``vs_envpool``, the median over rounds of its rate / EnvPool's in the same round."""
    out: dict[str, list[float]] = {k: [] for k in systems}
    for _ in range(rounds):
        for name, build in systems.items():
            step, close = build()
            try:
                out[name].append(timed(step, seconds) * n)
            finally:
                close()
    ref = out["envpool"]
    return {k: {"steps_per_s": round(statistics.median(v)),
                "vs_envpool": round(statistics.median(x / r for x, r in zip(v, ref)), 2)} for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--envs", type=int, nargs="+", default=[64])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--atari", action="store_true", help="also Pong, the engines vs envpool")
    p.add_argument("--atari-only", action="store_true", help="Pong only")
    p.add_argument("--warp", action="store_true", help="also the native task on MJWarp physics (env.kwargs.physics=warp), on the CPU")
    args = p.parse_args()
    torch.set_num_threads(1)
    for n in [] if args.atari_only else args.envs:
        res = run(mujoco_systems(n, args.threads, args.warp), n, args.rounds, args.seconds)
        print(json.dumps({"task": "HalfCheetah-v5", "envs": n, "threads": args.threads, **res}))
    if args.atari or args.atari_only:
        n = args.envs[0]
        res = run(atari_systems(n, args.threads), n, args.rounds, args.seconds)
        print(json.dumps({"task": "Pong (atari preprocessing)", "envs": n, "threads": args.threads, **res}))


if __name__ == "__main__":
    main()
