"""Offline RL against d3rlpy on the same Minari dataset and budget: BC on CartPole-v1 from an
expert dataset msrl makes itself.

1. The expert: ``msrl train configs/ppo_cartpole.yaml seed=1`` (the README's main job), then
   ``msrl collect RUN --episodes 100 [--noise N] -o msrl/cartpole/expert-v0`` under a datasets
   root of the benchmark's own (``--dataset DIR`` reuses a dataset instead).
2. Per seed, msrl's BC (``configs/bc_cartpole.yaml``, the dataset by path) and d3rlpy's
   ``DiscreteBC`` (``bench/peer_d3rlpy_bc.py``, in a Python that has d3rlpy: ``--d3rlpy-python``)
   train the same number of gradient steps, each evaluated greedily every 1,000 gradient steps
   and at the end (20 episodes, envs seeded 10000..10019; evaluation time out of the clock).

Reported per system: the final greedy evaluation (median and IQR over seeds, the seeds at or
above RLlib's BC gate of 350) and gradient steps per second of training time; the ratio row
msrl / d3rlpy. One torch thread per process::

    python bench/bench_offline.py --seeds 1 2 3 --d3rlpy-python /tmp/d3/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_offpolicy import _quartiles  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GATE = 350.0  # RLlib's BC-on-CartPole learning test


def expert_dataset(workdir: str, noise: float) -> str:
    """Trains the README's main job (seed 1) and writes 100 of its episodes as a Minari dataset
    under ``workdir``; returns the dataset's directory."""
    import msrl
    from msrl.run.collect import collect

    run = msrl.train(os.path.join(ROOT, "configs", "ppo_cartpole.yaml"), runs_dir=os.path.join(workdir, "runs"),
                     train__progress=False, seed=1)
    print(f"expert: {run.run_dir}, greedy evaluation {run.eval_mean:.1f}", flush=True)
    return str(collect([run.run_dir], "msrl/cartpole/expert-v0", 100, noise=noise, seed=0,
                       root=os.path.join(workdir, "datasets")))


def run_msrl(dataset: str, seed: int, steps: int, eval_every: int, workdir: str) -> dict:
    """One seed of msrl's BC on ``dataset``; its final evaluation, gradient steps/s and curve."""
    import csv

    import msrl

    r = msrl.train(os.path.join(ROOT, "configs", "bc_cartpole.yaml"), runs_dir=os.path.join(workdir, "bc"), seed=seed,
                   dataset__id=None, dataset__path=dataset, train__total_gradient_steps=steps,
                   train__eval_every=eval_every, train__progress=False, train__checkpoint_every=10**9)
    with open(r.run_dir / "metrics.csv") as f:
        curve = [(int(row["gradient_steps"]), float(row["time_s"]), float(row["eval/mean_return"]))
                 for row in csv.DictReader(f) if row.get("eval/mean_return")]
    return {"final_eval": r.eval_mean, "grad_steps_per_s": r.iterations / r.time_s, "curve": curve}


def run_d3rlpy(python: str, dataset: str, seed: int, steps: int, eval_every: int) -> dict:
    """One seed of d3rlpy's DiscreteBC (``bench/peer_d3rlpy_bc.py``) in ``python``."""
    out = subprocess.run([python, os.path.join(HERE, "peer_d3rlpy_bc.py"), "--dataset", dataset, "--seed", str(seed),
                          "--steps", str(steps), "--eval-every", str(eval_every)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: dict[str, list[dict]]) -> str:
    """The markdown table of the seeds' results (and the ratio row)."""
    lines = ["| system | final greedy eval: median [IQR] (mean) | seeds >= 350 | gradient steps/s (median) |",
             "| --- | --- | --- | --- |"]
    med = {}
    for system, runs in results.items():
        finals = [r["final_eval"] for r in runs]
        q1, m, q3 = _quartiles(finals)
        sps = _quartiles([r["grad_steps_per_s"] for r in runs])[1]
        med[system] = sps
        lines.append(f"| {system} | {m:.1f} [{q1:.1f}, {q3:.1f}] ({sum(finals) / len(finals):.1f}) | "
                     f"{sum(f >= GATE for f in finals)}/{len(finals)} | {sps:.0f} |")
    if len(med) == 2:
        lines.append(f"| msrl / d3rlpy | | | {med['msrl'] / med['d3rlpy DiscreteBC']:.2f}x |")
    for system, runs in results.items():
        lines.append(f"\n{system}, final greedy eval per seed: " + ", ".join(f"{r['final_eval']:.1f}" for r in runs))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=5_000, help="gradient steps of each run (default: the config's 5,000)")
    p.add_argument("--eval-every", type=int, default=1_000)
    p.add_argument("--noise", type=float, default=0.0, help="the expert's exploration noise while collecting")
    p.add_argument("--dataset", default=None, help="a Minari dataset's directory to use instead of making one")
    p.add_argument("--d3rlpy-python", default=None, help="the Python that has d3rlpy (none: msrl alone)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as workdir:
        dataset = args.dataset or expert_dataset(workdir, args.noise)
        results: dict[str, list[dict]] = {"msrl": []}
        if args.d3rlpy_python:
            results["d3rlpy DiscreteBC"] = []
        for seed in args.seeds:
            results["msrl"].append(run_msrl(dataset, seed, args.steps, args.eval_every, workdir))
            if args.d3rlpy_python:
                results["d3rlpy DiscreteBC"].append(run_d3rlpy(args.d3rlpy_python, dataset, seed, args.steps,
                                                               args.eval_every))
            print(f"seed {seed}: " + "  ".join(f"{k}: final {v[-1]['final_eval']:.1f}, {v[-1]['grad_steps_per_s']:.0f} "
                                                 "gradient steps/s" for k, v in results.items()), flush=True)
        print(f"\nBC on CartPole-v1 from {dataset}, {args.steps} gradient steps; machine: "
              f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, seeds "
              f"{args.seeds}\n\n{table(results)}\n", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"seeds": args.seeds, "steps": args.steps, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
