"""Per-core ceilings of the simulator targets (issue "Real simulators at speed"), in one run.

On one thread each, HalfCheetah-v5 with zero actions:

* ``mj_step x5`` -- MuJoCo's physics alone (``mujoco.mj_step(model, data, nstep=5)``, the
  env's 5 substeps), no task logic: what any implementation pays per env step;
* ``gymnasium env.step`` -- one gymnasium ``HalfCheetah-v5`` (``gymnasium.make``, its default
  wrappers), the work an engine worker does per env step;
* ``envpool`` -- ``envpool.make("HalfCheetah-v5", num_envs=64, num_threads=1)``, batch
  ``step`` (the peer).

The ratios bound what msrl can reach against EnvPool on this machine, whatever its engine does:
a native task must at least step the physics (``mj_step x5`` / ``envpool``), and the process
engine at least runs gymnasium's step in its workers (``gymnasium env.step`` / ``envpool``).
Rounds alternate the systems; medians over ``--rounds``.

    python bench/bench_env_ceilings.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
from bench_mujoco_envs import timed  # batch steps/s of a step function


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args()
    import envpool
    import gymnasium
    import mujoco

    genv = gymnasium.make("HalfCheetah-v5")
    genv.reset(seed=0)
    zero = np.zeros(6)
    model, data = genv.unwrapped.model, mujoco.MjData(genv.unwrapped.model)

    def physics() -> None:
        mujoco.mj_step(model, data, nstep=5)

    def gym_step() -> None:
        genv.step(zero)

    pool = envpool.make("HalfCheetah-v5", env_type="gymnasium", num_envs=64, num_threads=1, seed=0)
    pool.reset()
    zeros = np.zeros((64, 6))

    def pool_step() -> None:
        pool.step(zeros)

    systems = {"mj_step x5": (physics, 1), "gymnasium env.step": (gym_step, 1), "envpool": (pool_step, 64)}
    out: dict[str, list[float]] = {k: [] for k in systems}
    for _ in range(args.rounds):
        for name, (step, per) in systems.items():
            out[name].append(timed(step, args.seconds) * per)
    med = {k: statistics.median(v) for k, v in out.items()}
    print(f"HalfCheetah-v5, one thread each, median of {args.rounds} rounds of {args.seconds:g} s")
    print("| system | env steps/s | us per env step | / envpool |")
    print("| --- | --- | --- | --- |")
    for k, v in med.items():
        print(f"| {k} | {v:,.0f} | {1e6 / v:.1f} | {v / med['envpool']:.2f}x |")


if __name__ == "__main__":
    main()
