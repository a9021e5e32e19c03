"""A/B of two msrl checkouts on the runtime paths the runtime seam rebuilt, in alternating rounds.

Each case is ``msrl train configs/ppo_cartpole.yaml`` with overrides, run as a user runs it (a
fresh process per run, its own run directory), once per round by each checkout's Python (an
environment where that checkout is installed), the two alternating so a drift of the machine hits
both. The figure is the run's own ``steps/s`` line (env steps over training wall time), its
median over the rounds per checkout, and after / before.

    python bench/bench_seam_ab.py --before /tmp/wtvenv/bin/python --rounds 2

Cases: the Ray runtime (coarse, 2 actor processes), overlapped coarse (``fifo`` trajectories,
``latest`` weights; local threads), central inference (``single_learner_fine`` x2 env replicas,
dynamic batching).
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]

CASES = {
    "Ray runtime, coarse x2": ["distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2",
                               "runtime=ray"],
    "overlapped coarse x2 (local)": ["distribution_policy.name=single_learner_coarse",
                                     "distribution_policy.replicas.actor=2", "runtime=local",
                                     "distribution_policy.boundaries.trajectories=fifo",
                                     "distribution_policy.boundaries.weights=latest"],
    "central inference x2 (local)": ["distribution_policy.name=single_learner_fine", "distribution_policy.replicas.env=2",
                                     "runtime=local", "distribution_policy.inference.max_batch=2"],
}


def run_once(python: str, overrides: list[str], steps: int, runs_dir: str) -> float:
    """Env steps/s of one ``msrl train`` run by ``python`` (its ``steps/s`` line).

    Raises:
        RuntimeError: the run failed, or printed no ``steps/s`` line.
    """
    cmd = [python, "-m", "msrl.run.cli", "train", str(ROOT / "configs/ppo_cartpole.yaml"), *overrides,
           f"train.total_env_steps={steps}", "train.eval_every=0", f"runs_dir={runs_dir}", "train.progress=false"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=runs_dir)
    m = re.search(r"\(([\d.]+) steps/s\)", out.stdout)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return float(m.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="Python of an environment with the baseline checkout installed")
    p.add_argument("--after", default=sys.executable, help="Python of the checkout under test (default: this one)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=100_000, help="train.total_env_steps of each run")
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES), metavar="CASE",
                   help=f"which cases (default: all of {list(CASES)})")
    args = p.parse_args()
    cases = {name: CASES[name] for name in args.cases}
    sps: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="msrl-ab-") as runs_dir:
        for r in range(args.rounds):
            for name, overrides in cases.items():
                order = [("before", args.before), ("after", args.after)]
                if r % 2:
                    order.reverse()  # alternate which goes first
                for side, python in order:
                    sps.setdefault((name, side), []).append(run_once(python, overrides, args.steps, runs_dir))
                print(f"round {r + 1}, {name}: before {sps[(name, 'before')][-1]:.0f}, after {sps[(name, 'after')][-1]:.0f}",
                      flush=True)
    print(f"\nmachine: {platform.processor() or platform.machine()}, {args.rounds} rounds x {args.steps} env steps")
    print("| case | before (env steps/s per round) | after | median after / before |")
    print("| --- | --- | --- | --- |")
    for name in cases:
        b, a = sps[(name, "before")], sps[(name, "after")]
        print(f"| {name} | {', '.join(f'{x:,.0f}' for x in b)} | {', '.join(f'{x:,.0f}' for x in a)} | "
              f"{statistics.median(a) / statistics.median(b):.2f}x |")


if __name__ == "__main__":
    main()
