"""PPO on HalfCheetah-v5: msrl (``configs/ppo_halfcheetah.yaml``, envs in the env engine's worker
processes) vs Stable-Baselines3 with the same (CleanRL ``ppo_continuous_action``)
hyperparameters, one run, one seed after another (never side by side).

Both: 2,048 env steps per update, 10 epochs of 32 minibatches (64 samples), lr 3e-4 annealed
linearly, gamma 0.99, GAE lambda 0.95, clip 0.2, no entropy bonus, value coefficient 0.5, grad
norm 0.5, 64x64 tanh actor and critic, observations normalized and clipped to 10, rewards scaled
by the discounted return's std and clipped to 10 (SB3: ``VecNormalize``; msrl: the PPO hparams
``normalize_obs``/``normalize_reward``). msrl steps 8 envs x 256 steps, SB3 1 env x 2,048 (as
CleanRL). Reported per seed:

* ``return_at_1M`` -- mean training return of the episodes of the last 10 iterations (msrl) /
  the last 10 episodes (SB3) at the end of the budget (raw rewards, not the scaled ones);
* ``time_to_1400`` -- training wall time until that running mean first reaches 1,400;
* ``env_steps_per_s`` -- over the whole run.

    python bench/bench_ppo_halfcheetah.py --seeds 1 2 3 --systems msrl sb3
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import tempfile
import time
from collections import deque

import torch

THRESHOLD = 1400.0


def run_msrl(seed: int, budget: int, runs_dir: str) -> dict:
    from msrl.config import load_config
    from msrl.run.training import train

    cfg = load_config("configs/ppo_halfcheetah.yaml", [f"seed={seed}", f"runs_dir={runs_dir}", f"name=s{seed}",
                                                       "train.progress=false", "train.eval_every=0",
                                                       f"train.total_env_steps={budget}"])
    r = train(cfg)
    rows = list(csv.DictReader(open(r.run_dir / "metrics.csv")))
    window: deque[float] = deque(maxlen=10)
    time_to = None
    for row in rows:
        v = float(row["charts/episodic_return"])
        if not math.isnan(v):
            window.append(v)
        if time_to is None and len(window) == 10 and sum(window) / 10 >= THRESHOLD:
            time_to = float(row["time_s"])
    final = sum(window) / len(window) if window else float("nan")  # no episode finished within a tiny budget
    return {"return_at_1M": final, "time_to_1400": time_to, "env_steps_per_s": r.env_steps / r.time_s}


def run_sb3(seed: int, budget: int) -> dict:
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    env = VecNormalize(make_vec_env("HalfCheetah-v5", n_envs=1, seed=seed), gamma=0.99, clip_obs=10.0, clip_reward=10.0)

    class Clock(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.time_to: float | None = None
            self.t0 = 0.0

        def _on_training_start(self) -> None:
            self.t0 = time.perf_counter()

        def _on_step(self) -> bool:
            buf = self.model.ep_info_buffer
            if self.time_to is None and len(buf) >= 10:
                last = [e["r"] for e in list(buf)[-10:]]
                if sum(last) / 10 >= THRESHOLD:
                    self.time_to = time.perf_counter() - self.t0
            return True

    model = PPO("MlpPolicy", env, n_steps=2048, batch_size=64, n_epochs=10, learning_rate=lambda f: 3e-4 * f,
                gamma=0.99, gae_lambda=0.95, clip_range=0.2, ent_coef=0.0, vf_coef=0.5, max_grad_norm=0.5,
                policy_kwargs={"net_arch": {"pi": [64, 64], "vf": [64, 64]}, "activation_fn": torch.nn.Tanh},
                seed=seed, device="cpu", verbose=0)
    clock = Clock()
    t0 = time.perf_counter()
    model.learn(total_timesteps=budget, callback=clock)
    dt = time.perf_counter() - t0
    last = [e["r"] for e in list(model.ep_info_buffer)[-10:]]
    return {"return_at_1M": sum(last) / len(last) if last else float("nan"), "time_to_1400": clock.time_to, "env_steps_per_s": budget / dt}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--budget", type=int, default=1_000_000)
    p.add_argument("--systems", nargs="+", default=["msrl", "sb3"], choices=["msrl", "sb3"])
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as runs:
        for seed in args.seeds:
            for system in args.systems:
                res = run_msrl(seed, args.budget, runs) if system == "msrl" else run_sb3(seed, args.budget)
                print(json.dumps({"system": system, "seed": seed, **{k: (round(v, 1) if v is not None else None)
                                                                     for k, v in res.items()}}), flush=True)


if __name__ == "__main__":
    main()
