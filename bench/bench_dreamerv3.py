"""DreamerV3 on CartPole-v1 against RLlib's DreamerV3 in the same run, same model size, training
ratio and env-step budget: the training return (the mean of the episodes each system finished
since its last report; RLlib's own gate is 450 for its XS model) against env steps and training
time, env steps/s, and msrl's final greedy evaluation.

msrl runs ``configs/dreamerv3_cartpole.yaml`` with ``model_size``, ``train_ratio`` and the budget
overridden; RLlib runs ``bench/peer_rllib_dreamerv3.py`` (its defaults otherwise: batch 16 x 64,
horizon 15, gamma 0.997, one env) in a Python that has ``ray[rllib]`` (``--rllib-python``). At the
XS size and ratio 1024 an update takes seconds of one CPU core here (both systems), so the CPU
rows use smaller sizes; the XS figure belongs to a GPU machine::

    python bench/bench_dreamerv3.py --model-size mini --train-ratio 256 --budget 20000 --seeds 1 \\
        --rllib-python /tmp/rl/bin/python
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_msrl(model_size: str, ratio: int, budget: int, seed: int, threshold: float, workdir: str) -> dict:
    """One seed of msrl's DreamerV3: the training-return curve, env steps and seconds to
    ``threshold``, env steps/s and the final greedy evaluation."""
    import msrl

    r = msrl.train(os.path.join(ROOT, "configs", "dreamerv3_cartpole.yaml"), runs_dir=workdir, seed=seed,
                   algorithm__hparams__model_size=model_size, algorithm__hparams__train_ratio=ratio,
                   train__total_env_steps=budget, train__progress=False, train__stop_at_return=None,
                   train__eval_every=0, train__checkpoint_every=10**9)
    curve, reached = [], None
    with open(r.run_dir / "metrics.csv") as f:
        for row in csv.DictReader(f):
            ret = row.get("charts/episodic_return")
            if ret and ret != "nan":
                point = (int(row["env_steps"]), float(row["time_s"]), float(ret))
                curve.append(point)
                if reached is None and point[2] >= threshold:
                    reached = point[:2]
    return {"curve": curve, "steps_to_threshold": reached and reached[0], "time_to_threshold": reached and reached[1],
            "sps": r.env_steps / r.time_s, "final_eval": r.eval_mean}


def run_rllib(python: str, model_size: str, ratio: int, budget: int, seed: int, threshold: float) -> dict:
    """One seed of RLlib's DreamerV3 (``bench/peer_rllib_dreamerv3.py``) in ``python``."""
    out = subprocess.run([python, os.path.join(HERE, "peer_rllib_dreamerv3.py"), "--model-size", model_size,
                          "--training-ratio", str(ratio), "--budget", str(budget), "--seed", str(seed),
                          "--threshold", str(threshold)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _smoothed(curve: list, k: int = 10) -> list:
    """The mean of each point's last ``k`` returns (the systems report at different paces)."""
    return [(s, t, sum(p[2] for p in curve[max(0, i - k + 1):i + 1]) / len(curve[max(0, i - k + 1):i + 1]))
            for i, (s, t, _) in enumerate(curve)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-size", default="mini")
    p.add_argument("--train-ratio", type=int, default=256)
    p.add_argument("--budget", type=int, default=20_000)
    p.add_argument("--threshold", type=float, default=450.0)
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--rllib-python", default=None, help="the Python that has ray[rllib] (none: msrl alone)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
          f"command: {' '.join(sys.argv)}", flush=True)
    results: dict[str, list] = {"msrl": [], "RLlib DreamerV3": []}
    with tempfile.TemporaryDirectory() as workdir:
        for seed in args.seeds:
            results["msrl"].append(run_msrl(args.model_size, args.train_ratio, args.budget, seed, args.threshold, workdir))
            if args.rllib_python:
                results["RLlib DreamerV3"].append(run_rllib(args.rllib_python, args.model_size, args.train_ratio,
                                                            args.budget, seed, args.threshold))
            for system, runs in results.items():
                if runs:
                    r = runs[-1]
                    last = _smoothed(r["curve"])[-1][2] if r["curve"] else float("nan")
                    print(f"seed {seed} {system}: training return (last 10 reports) {last:.1f}; "
                          f"{args.threshold:g} at {r['steps_to_threshold']} env steps / {r['time_to_threshold']} s; "
                          f"{r['sps']:.1f} env steps/s" + (f"; final greedy evaluation {r['final_eval']:.1f}"
                                                          if "final_eval" in r else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
