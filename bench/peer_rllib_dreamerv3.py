"""RLlib's DreamerV3 (torch, new API stack) on a gymnasium env, for ``bench/bench_dreamerv3.py``:
started the way RLlib's docs start it (``DreamerV3Config().environment(...).training(...)``,
``build_algo()``, then ``train()`` in a loop) until ``--budget`` env steps; prints one JSON line:
the curve of (env steps, training seconds, mean return of the last 10 finished episodes), the env
steps and seconds at which that mean first reached ``--threshold``, env steps/s.

RLlib pins its own gymnasium; run it from a venv with ``ray[rllib]``::

    python -m venv /tmp/rl && /tmp/rl/bin/pip install torch==2.13.0 "ray[rllib]==2.60.0"
    /tmp/rl/bin/python bench/peer_rllib_dreamerv3.py --env-id CartPole-v1 --model-size XS --training-ratio 1024 \\
        --budget 20000 --seed 1
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env-id", default="CartPole-v1")
    p.add_argument("--model-size", default="XS")
    p.add_argument("--training-ratio", type=int, default=1024)
    p.add_argument("--budget", type=int, default=20_000)
    p.add_argument("--threshold", type=float, default=450.0)
    p.add_argument("--seed", type=int, default=1)
    for k in ("world-model-lr", "actor-lr", "critic-lr"):
        p.add_argument(f"--{k}", type=float, default=None, help="replaces RLlib's default")
    args = p.parse_args()
    lrs = {k: getattr(args, k) for k in ("world_model_lr", "actor_lr", "critic_lr") if getattr(args, k) is not None}
    import torch

    torch.set_num_threads(1)
    import ray
    from ray.rllib.algorithms.dreamerv3.dreamerv3 import DreamerV3Config

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = (DreamerV3Config().environment(args.env_id).framework("torch")
              .training(model_size=args.model_size, training_ratio=args.training_ratio, **lrs)
              .reporting(metrics_num_episodes_for_smoothing=10)  # msrl's bench: the mean of the last 10 episodes
              .debugging(seed=args.seed))
    algo = config.build_algo()
    curve, reached, train_s, steps = [], None, 0.0, 0
    while steps < args.budget:
        t0 = time.perf_counter()
        result = algo.train()
        train_s += time.perf_counter() - t0
        steps = int(result.get("num_env_steps_sampled_lifetime", 0) or result["env_runners"].get(
            "num_env_steps_sampled_lifetime", 0))
        ret = result.get("env_runners", {}).get("episode_return_mean")
        if ret is not None and ret == ret:
            curve.append((steps, train_s, float(ret)))
            if reached is None and ret >= args.threshold:
                reached = (steps, train_s)
    algo.stop()
    ray.shutdown()
    print(json.dumps({"curve": curve, "steps_to_threshold": reached and reached[0],
                      "time_to_threshold": reached and reached[1], "sps": steps / train_s}))


if __name__ == "__main__":
    main()
