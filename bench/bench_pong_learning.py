"""Pong learned on this machine (the CPU): a run of ``configs/ppo_pong.yaml`` (or another Atari
config) to a training return >= 0 within 4M env steps, split over as many sittings as it takes.

Each call trains for at most ``--hours`` and stops as Ctrl-C stops a run (``SIGTERM``: the last
checkpoint kept); the next call resumes it (``msrl train --resume``). Then, and with
``--report`` alone, it reports from the run's ``metrics.csv``: the first env step (and the
training time there, summed over the sittings) at which the mean training return of the last
``--window`` iterations with finished episodes reached the target, the return at the end, and
the curve (``<--out>/<run name>_learning.png``, default ``bench/``).

    python bench/bench_pong_learning.py --runs-dir ~/pong_runs --hours 2         # start, or go on
    python bench/bench_pong_learning.py --runs-dir ~/pong_runs --report          # the figures so far
    python bench/bench_pong_learning.py --config configs/impala_pong.yaml --runs-dir ~/pong_runs --hours 2
    python bench/bench_pong_learning.py --runs-dir /tmp/p --hours 0.13 distribution_policy.name=single_learner_coarse \
        distribution_policy.devices.learner=cuda:0 env.num_envs=64 env.num_workers=8     # a GPU learner (gpu_check.sh)

"Env steps" are agent steps (4 ALE frames each), as CleanRL's ``global_step`` counts them.
"""

from __future__ import annotations

import argparse
import csv
import math
import pathlib
import signal
import subprocess
import sys

from plot_seeds import curve

from msrl.run.checkpoints import CHECKPOINT

ROOT = pathlib.Path(__file__).resolve().parent.parent


def train(config: pathlib.Path, runs_dir: pathlib.Path, steps: int, hours: float,
          overrides: list[str] | None = None) -> pathlib.Path:
    """Starts the run (with the config ``overrides``), or resumes it when its directory has a
    checkpoint; stops it after ``hours``. Returns the run directory."""
    import yaml

    name = yaml.safe_load(config.read_text())["name"]
    run_dir = runs_dir / name
    if (run_dir / CHECKPOINT).is_file():
        cmd = [sys.executable, "-m", "msrl.run.cli", "train", "--resume", str(run_dir)]
    else:
        cmd = [sys.executable, "-m", "msrl.run.cli", "train", str(config), f"runs_dir={runs_dir}",
               f"train.total_env_steps={steps}", "train.progress=false", *(overrides or [])]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    # SIGTERM to this script stops the run as the time limit does (the run keeps its checkpoint),
    # rather than leaving it training on without its driver
    signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signal.SIGTERM))
    try:
        proc.wait(timeout=hours * 3600)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # as Ctrl-C: the run keeps its last checkpoint
        proc.wait()
    return run_dir


def report(run_dir: pathlib.Path, target: float, window: int, out_dir: pathlib.Path = ROOT / "bench") -> dict:
    """The figures above from ``run_dir/metrics.csv``; the curve to ``<out_dir>/<name>_learning.png``."""
    xs, ys = curve(run_dir, window)
    with open(run_dir / "metrics.csv", newline="") as f:
        times = {int(r["env_steps"]): float(r["time_s"]) for r in csv.DictReader(f)}
    first = next(((x, y) for x, y in zip(xs, ys) if y >= target), None)
    out = {"run": str(run_dir), "env_steps": max(times, default=0), "training_s": max(times.values(), default=0.0),
           "return_at_end": ys[-1] if ys else math.nan,
           "reached_at_env_steps": first[0] if first else None, "reached_at_training_s": times[first[0]] if first else None}
    png = out_dir / f"{run_dir.name}_learning.png"
    subprocess.run([sys.executable, str(ROOT / "bench" / "plot_seeds.py"), str(run_dir), "--out", str(png),
                    "--title", f"{run_dir.name} on this machine's CPU", "--window", str(window),
                    "--hline", str(target), f"target ({target:g})"], check=True)
    out["curve"] = str(png)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=pathlib.Path, default=ROOT / "configs" / "ppo_pong.yaml")
    ap.add_argument("--runs-dir", type=pathlib.Path, required=True, help="kept between sittings")
    ap.add_argument("--steps", type=int, default=4_000_000, help="the run's budget (its learning-rate schedule's)")
    ap.add_argument("--hours", type=float, default=2.0, help="this sitting's most")
    ap.add_argument("--report", action="store_true", help="only report the run so far")
    ap.add_argument("--target", type=float, default=0.0)
    ap.add_argument("--window", type=int, default=20, help="iterations with finished episodes in the mean")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "bench", help="where the curve goes")
    ap.add_argument("overrides", nargs="*", help="config overrides of a new run (key.sub=value)")
    args = ap.parse_args()
    if args.report:
        import yaml

        run_dir = args.runs_dir / yaml.safe_load(args.config.read_text())["name"]
    else:
        run_dir = train(args.config, args.runs_dir, args.steps, args.hours, args.overrides)
    print(report(run_dir, args.target, args.window, args.out))


if __name__ == "__main__":
    main()
