"""GAIL against its expert: msrl's main PPO job trained to an expert, ``msrl collect`` writing
``--episodes`` of its greedy play as a Minari dataset, then GAIL (``configs/gail_cartpole.yaml``)
over seeds, evaluated greedily (20 episodes) every ``--eval-every`` env steps.

Reported per seed: the expert's return, GAIL's evaluations, the first env step at which an
evaluation reaches 90% of the expert's return (the issue's gate), the final evaluation as a
fraction of the expert's, and GAIL's env steps/s (its discriminator's steps included). One torch
thread::

    python bench/bench_gail.py --seeds 1 2 3 --episodes 10
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--episodes", type=int, default=10, help="expert episodes in the dataset")
    p.add_argument("--budget", type=int, default=300_000)
    p.add_argument("--eval-every", type=int, default=20_000)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
          f"command: {' '.join(sys.argv)}", flush=True)
    import msrl
    from msrl.run.collect import collect

    out = {"runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        expert = msrl.train(os.path.join(ROOT, "configs", "ppo_cartpole.yaml"), runs_dir=os.path.join(tmp, "runs"),
                            train__progress=False, train__eval_every=0)
        out["expert"] = expert.eval_mean
        collect([expert.run_dir], "msrl/cartpole/expert10-v0", args.episodes, seed=0, root=os.path.join(tmp, "root"))
        print(f"expert (configs/ppo_cartpole.yaml, seed 1): greedy return {expert.eval_mean:.1f}; "
              f"{args.episodes} episodes collected", flush=True)
        gate = 0.9 * expert.eval_mean
        for seed in args.seeds:
            r = msrl.train(os.path.join(ROOT, "configs", "gail_cartpole.yaml"), runs_dir=os.path.join(tmp, "runs"),
                           seed=seed, dataset__root=os.path.join(tmp, "root"), train__total_env_steps=args.budget,
                           train__eval_every=args.eval_every, train__progress=False)
            evals = []
            with open(r.run_dir / "metrics.csv") as f:
                for row in csv.DictReader(f):
                    ev = row.get("eval/mean_return")
                    if ev and ev != "nan":
                        evals.append((int(row["env_steps"]), float(ev)))
            reached = next((s for s, v in evals if v >= gate), None)
            res = {"seed": seed, "evals": evals, "steps_to_90pct": reached, "final": r.eval_mean,
                   "final_fraction": r.eval_mean / expert.eval_mean, "sps": r.env_steps / r.time_s}
            out["runs"].append(res)
            print(f"GAIL seed {seed}: evaluations {[(s, round(v, 1)) for s, v in evals]}; 90% of the expert "
                  f"({gate:.0f}) first at {reached} env steps; final {r.eval_mean:.1f} "
                  f"({res['final_fraction']:.2f} of the expert); {res['sps']:.0f} env steps/s", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(out, f)


if __name__ == "__main__":
    main()
