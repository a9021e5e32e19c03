"""Learning curves of several runs (seeds) in one figure: each run's training episodic return
(mean over the episodes of the last ``--window`` iterations) against env steps, with optional
reference lines (a target, a random policy's return).

    python bench/plot_seeds.py runs/hc_s1 runs/hc_s2 runs/hc_s3 --out bench/ppo_halfcheetah_learning.png \\
        --title "PPO on HalfCheetah-v5" --hline 1400 "target (1,400)"
"""

from __future__ import annotations

import argparse
import csv
import math
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def curve(run_dir: pathlib.Path, window: int) -> tuple[list[int], list[float]]:
    """(env steps, moving mean of the per-iteration episodic return) of one run's metrics.csv."""
    xs, ys, recent = [], [], []
    with open(run_dir / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            v = float(row["charts/episodic_return"] or "nan")
            recent = (recent + ([] if math.isnan(v) else [v]))[-window:]
            if recent:
                xs.append(int(row["env_steps"]))
                ys.append(sum(recent) / len(recent))
    return xs, ys


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=pathlib.Path)
    p.add_argument("--out", required=True, type=pathlib.Path)
    p.add_argument("--title", default="")
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--hline", nargs=2, action="append", default=[], metavar=("Y", "LABEL"))
    args = p.parse_args()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for run in args.runs:
        xs, ys = curve(run, args.window)
        ax.plot(xs, ys, lw=1.5, label=run.name)
    for y, label in args.hline:
        ax.axhline(float(y), color="gray", ls="--", lw=1, label=label)
    ax.set_xlabel("env steps")
    ax.set_ylabel(f"training episodic return (mean of {args.window} iterations)")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out)


if __name__ == "__main__":
    main()
