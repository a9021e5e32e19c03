"""Tag stepping: msrl's host kernel vs a NumPy implementation of the same rules, one run.

Game sizes (envs x (taggers + runners)): 1 x (5 + 100), 100 x (5 + 100), 2,000 x (10 + 990),
with WarpDrive's ``tag_continuous.yaml`` parameters (partial observation of the 10 nearest
agents, grid 20, 500-step games, acceleration +-0.1, turn +-2.356, 20 + 20 action levels,
tagging distance 0.02, tag reward/penalty +-10). Random actions; finished games reset.

Reported: env steps/s (games stepped per second) and agent-steps/s. The NumPy peer
(``bench/tag_numpy.py``) is one object per game, looped in Python as WarpDrive's CPU env is;
its cost is linear in the number of games, so at 2,000 games it is timed on the first
``--numpy-max-envs`` games and its rates per game are reported for the whole batch.

    python bench/bench_tag.py                  # host build
    python bench/bench_tag.py --device cuda    # on a GPU (NVRTC build through CuPy)
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from msrl.envs.native.tag import Tag, TagParams

YAML = dict(grid_length=20.0, episode_length=500, max_acceleration=0.1, min_acceleration=-0.1, max_turn=2.356,
            min_turn=-2.356, num_acceleration_levels=20, num_turn_levels=20, use_full_observation=False,
            num_other_agents_observed=10, tagging_distance=0.02, tag_reward_for_tagger=10.0, tag_penalty_for_runner=-10.0)
SIZES = [(1, 5, 100), (100, 5, 100), (2000, 10, 990)]


def bench_kernel(envs: int, taggers: int, runners: int, seconds: float, device: str = "cpu") -> float:
    env = Tag(envs, device=device, impl="kernel", num_taggers=taggers, num_runners=runners, **YAML)
    env.reset(seed=0)
    g = torch.Generator().manual_seed(0)
    acts = [torch.randint(0, 21, (envs, taggers + runners, 2), generator=g).to(device) for _ in range(4)]
    env.step(acts[0])
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 3:
        env.step(acts[n % 4])
        n += 1
        if len(env._finished) > 16:
            env._finished.clear()
            sync()
    sync()
    return envs * n / (time.perf_counter() - t0)


def bench_numpy(envs: int, taggers: int, runners: int, seconds: float, max_envs: int) -> float:
    from tag_numpy import NumpyTag

    params = TagParams(num_taggers=taggers, num_runners=runners, **YAML)
    games = [NumpyTag(params, seed=i) for i in range(min(envs, max_envs))]
    rng = np.random.default_rng(0)
    acts = [rng.integers(0, 21, (taggers + runners, 2)) for _ in range(4)]
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 2:
        for k, game in enumerate(games):
            game.step(acts[(n + k) % 4])
        n += 1
    return len(games) * n / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--numpy-max-envs", type=int, default=20)
    p.add_argument("--device", default="cpu", help="where the kernel runs: cpu (host build) or cuda (NVRTC build)")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    print("| envs x (taggers + runners) | system | env steps/s | agent-steps/s | kernel / NumPy |")
    print("| --- | --- | --- | --- | --- |")
    for envs, taggers, runners in SIZES:
        k = bench_kernel(envs, taggers, runners, args.seconds, args.device)
        n = bench_numpy(envs, taggers, runners, args.seconds, args.numpy_max_envs)
        agents = taggers + runners
        size = f"{envs} x ({taggers} + {runners})"
        name = "msrl host kernel" if args.device == "cpu" else f"msrl kernel ({args.device})"
        print(f"| {size} | {name} | {k:,.0f} | {k * agents:,.0f} | **{k / n:.0f}x** |")
        print(f"| {size} | NumPy (per game, looped) | {n:,.1f} | {n * agents:,.0f} | |", flush=True)


if __name__ == "__main__":
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
