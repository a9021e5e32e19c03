"""Batched CartPole stepping: env steps/s of msrl's native CartPole against peers, one run.

At each batch size (default 4,096 and 65,536 envs), on this machine's 2 threads:

* ``msrl host kernel`` -- ``msrl/envs/native/cartpole.cu`` through the host build (OpenMP);
* ``msrl torch reference`` -- the same rules as torch ops (2 intra-op threads);
* ``gymnasium vector`` -- ``gymnasium.make_vec("CartPole-v1", vectorization_mode="vector_entry_point")``
  (gymnasium's NumPy-vectorised CartPole);
* ``envpool`` -- ``envpool.make_gymnasium("CartPole-v1")``, 2 threads (if envpool imports);
* ``plain C loop`` -- ``bench/cartpole_loop.c``: the kernel's work as one OpenMP loop, the limit.

Every system steps with random actions drawn up front; autoreset is on for all of them.

    python bench/bench_cartpole_envs.py --sizes 4096 65536
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import tempfile
import time

import numpy as np
import torch

HERE = pathlib.Path(__file__).resolve().parent


def timed(step, actions, seconds: float) -> float:
    """Env-batch steps/s of ``step`` over at least ``seconds`` after a warm-up."""
    for i in range(5):
        step(actions[i % len(actions)])
    n, t0 = 0, time.perf_counter()
    while True:
        for _ in range(10):
            step(actions[n % len(actions)])
            n += 1
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return n / dt


def msrl_native(n: int, impl: str, seconds: float) -> float:
    from msrl.envs.native import CartPole

    env = CartPole(n, impl=impl)
    env.reset(seed=0)
    acts = [torch.randint(0, 2, (n,)) for _ in range(8)]

    def step(a):
        env.step(a)
        if len(env._finished) > 64:  # drop the per-step episode logs (peers keep no statistics)
            env._finished.clear()

    return n * timed(step, acts, seconds)


def gymnasium_vector(n: int, seconds: float) -> float:
    import gymnasium

    env = gymnasium.make_vec("CartPole-v1", num_envs=n, vectorization_mode="vector_entry_point")
    env.reset(seed=0)
    acts = [np.random.default_rng(i).integers(0, 2, n) for i in range(8)]
    return n * timed(env.step, acts, seconds)


def envpool_cartpole(n: int, seconds: float) -> float | None:
    try:
        import envpool
    except Exception:  # noqa: BLE001 - envpool is optional
        return None
    env = envpool.make_gymnasium("CartPole-v1", num_envs=n, num_threads=2, seed=0)
    env.reset()
    acts = [np.random.default_rng(i).integers(0, 2, n) for i in range(8)]
    return n * timed(env.step, acts, seconds)


def plain_c(n: int, seconds: float) -> float:
    with tempfile.TemporaryDirectory() as d:
        exe = pathlib.Path(d) / "cartpole_loop"
        subprocess.run(["gcc", "-O3", "-fopenmp", "-ffp-contract=off", str(HERE / "cartpole_loop.c"), "-lm", "-o", str(exe)],
                       check=True)
        steps = 10
        while True:  # grow until one run lasts long enough
            t = time.perf_counter()
            out = subprocess.run([str(exe), str(n), str(steps)], check=True, capture_output=True, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "2"})
            if time.perf_counter() - t >= seconds:
                return float(out.stdout)
            steps *= 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 65536])
    p.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args()
    torch.set_num_threads(2)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    print("| envs | system | env steps/s | vs plain C | vs gymnasium vector |")
    print("| --- | --- | --- | --- | --- |")
    for n in args.sizes:
        r = {
            "msrl host kernel": msrl_native(n, "kernel", args.seconds),
            "msrl torch reference": msrl_native(n, "torch", args.seconds),
            "gymnasium vector": gymnasium_vector(n, args.seconds),
            "envpool": envpool_cartpole(n, args.seconds),
            "plain C loop": plain_c(n, args.seconds),
        }
        for name, v in r.items():
            if v is None:
                print(f"| {n} | {name} | not installed | | |")
                continue
            print(f"| {n} | {name} | {v / 1e6:.2f}M | {v / r['plain C loop']:.2f}x | {v / r['gymnasium vector']:.1f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
