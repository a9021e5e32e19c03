"""msrl's main job vs Stable-Baselines3 PPO on CartPole-v1, measured in one run.

For each seed, both train until a deterministic evaluation (20 episodes on CartPole-v1, envs
seeded 10000..10019, every ``--eval-every`` env steps) reaches a mean return >= 475, or the
budget runs out. Reported per system, as medians over seeds:

* ``time to 475`` -- training wall time (s) until that evaluation, evaluations excluded;
* ``env steps/s`` -- training env steps per second of training wall time.

msrl runs ``configs/ppo_cartpole.yaml`` (policy ``single`` unless ``--policy``; with ``--gpu-only``
also ``configs/ppo_cartpole_gpu_only.yaml``, the same hyperparameters on native CartPole); SB3 runs
rl-zoo's CartPole-v1 hyperparameters (n_envs 8, n_steps 32, batch 256, gae_lambda 0.8,
gamma 0.98, n_epochs 20, lr 1e-3 linear, clip 0.2 linear, ent 0). Both use one torch thread.

    python bench/bench_ppo_cartpole.py --seeds 1 2 3
    python bench/bench_ppo_cartpole.py --seeds 1 2 3 4 5 6 7 8 9 10 --gpu-only
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time

import torch

THRESHOLD = 475.0
GPU_ONLY = "configs/ppo_cartpole_gpu_only.yaml"
EVAL_EPISODES = 20
EVAL_SEED = 10_000


def run_msrl(seed: int, eval_every: int, budget: int, policy: str | None, runs_dir: str,
             config: str = "configs/ppo_cartpole.yaml") -> dict:
    from msrl.config import load_config
    from msrl.run.training import train

    over = [] if policy is None else [f"distribution_policy.name={policy}"]
    cfg = load_config(
        config,
        over + [
            f"seed={seed}",
            f"runs_dir={runs_dir}",
            "train.progress=false",
            f"train.eval_every={eval_every}",
            f"train.stop_at_return={THRESHOLD}",
            f"train.total_env_steps={budget}",
            f"eval.episodes={EVAL_EPISODES}",
            f"eval.seed={EVAL_SEED}",
        ],
    )
    r = train(cfg)
    return {"time_to_475": r.time_to_threshold_s, "steps_to_475": r.steps_to_threshold, "sps": r.env_steps / r.time_s}


def run_sb3(seed: int, eval_every: int, budget: int) -> dict:
    from bench_offpolicy import _sb3_evaluate  # the same deterministic evaluation as every SB3 row
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    def evaluate(model) -> float:
        return _sb3_evaluate(model, "CartPole-v1")

    class Timer(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.eval_time = 0.0
            self.done_eval = 0
            self.hit: tuple[float, int] | None = None
            self.t0 = 0.0

        def _on_training_start(self) -> None:
            self.t0 = time.perf_counter()

        def _on_step(self) -> bool:
            if self.num_timesteps // eval_every > self.done_eval:
                self.done_eval = self.num_timesteps // eval_every
                s = time.perf_counter()
                mean = evaluate(self.model)
                self.eval_time += time.perf_counter() - s
                if mean >= THRESHOLD:
                    self.hit = (time.perf_counter() - self.t0 - self.eval_time, self.num_timesteps)
                    return False
            return True

    env = make_vec_env("CartPole-v1", n_envs=8, seed=seed)
    lin = lambda v: (lambda progress: progress * v)  # noqa: E731 - rl-zoo's lin_<v>
    model = PPO("MlpPolicy", env, n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20,
                ent_coef=0.0, learning_rate=lin(1e-3), clip_range=lin(0.2), seed=seed, device="cpu", verbose=0)
    cb = Timer()
    t0 = time.perf_counter()
    model.learn(budget, callback=cb)
    train_time = time.perf_counter() - t0 - cb.eval_time
    return {
        "time_to_475": cb.hit[0] if cb.hit else None,
        "steps_to_475": cb.hit[1] if cb.hit else None,
        "sps": model.num_timesteps / train_time,
    }


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--eval-every", type=int, default=5000)
    p.add_argument("--budget", type=int, default=300_000)
    p.add_argument("--policy", default="single", help="policy of the main job's row")
    p.add_argument("--gpu-only", action="store_true",
                   help="add a row for configs/ppo_cartpole_gpu_only.yaml (native CartPole under gpu_only; host kernels on CPU)")
    p.add_argument("--json", default=None, help="also write the raw results here")
    args = p.parse_args()
    torch.set_num_threads(1)
    results: dict[str, list[dict]] = {"msrl": [], "sb3": []}
    if args.gpu_only:
        results = {"msrl": [], "msrl gpu_only": [], "sb3": []}
    with tempfile.TemporaryDirectory() as runs_dir:
        for seed in args.seeds:
            results["msrl"].append(run_msrl(seed, args.eval_every, args.budget, args.policy, runs_dir))
            if args.gpu_only:
                results["msrl gpu_only"].append(run_msrl(seed, args.eval_every, args.budget, None, runs_dir, GPU_ONLY))
            results["sb3"].append(run_sb3(seed, args.eval_every, args.budget))
            print(f"seed {seed}: " + "  ".join(f"{k} {v[-1]}" for k, v in results.items()), flush=True)
    med = {k: {m: _median([r[m] for r in v]) for m in ("time_to_475", "steps_to_475", "sps")} for k, v in results.items()}
    machine = platform.processor() or platform.machine()
    print(f"\nmachine: {machine}, torch {torch.__version__}, 1 torch thread, seeds {args.seeds}, policy {args.policy}")
    print("| system | time to 475 (s, median) | env steps to 475 (median) | env steps/s (median) |")
    print("| --- | --- | --- | --- |")
    for k in results:
        m = med[k]
        tt = f"{m['time_to_475']:.2f}" if m["time_to_475"] is not None else "not reached"
        print(f"| {k} | {tt} | {m['steps_to_475']} | {m['sps']:.0f} |")
    for k in results:
        if k == "sb3":
            continue
        a, b = med[k], med["sb3"]
        t_ratio = f"{a['time_to_475'] / b['time_to_475']:.2f}x time" if a["time_to_475"] and b["time_to_475"] else "n/a"
        print(f"| {k} / sb3 | {t_ratio} | | {a['sps'] / b['sps']:.2f}x throughput |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "medians": med}, f, indent=2)


if __name__ == "__main__":
    main()
