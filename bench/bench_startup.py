"""Start-up of the main job: from the command to its first training iteration, against the floor
``python -c "import torch"`` measured in the same run.

Rows (medians over ``--repeats`` runs, each a fresh process):

* ``python -c "import torch"``: the floor any PyTorch program pays;
* ``python -c "import msrl.run"``: what the driver imports before it reads the config;
* ``msrl train`` to its first iteration: from the command until the line ``msrl: run
  directory ...``, which the driver prints once the job is traced, probed, partitioned, built
  and reset, just before the first iteration;
* ``msrl train`` whole process for one iteration (256 env steps, no evaluation; the final
  evaluation and the learning curve included);
* with ``--solved-seeds``: the whole process from the command until the main job is solved
  (an evaluation every 5,000 env steps reaches 475 and the run stops), per seed.

    python bench/bench_startup.py --repeats 5 --solved-seeds 1 2 3 4 5
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import time


def _wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def _to_first_iteration(runs_dir: str) -> tuple[float, float]:
    """Seconds from the command to the ``run directory`` line, and to the process's end."""
    cmd = [sys.executable, "-m", "msrl.cli", "train", "configs/ppo_cartpole.yaml", "train.total_env_steps=256",
           "train.eval_every=0", "train.progress=false", f"runs_dir={runs_dir}"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    first = None
    assert proc.stderr is not None
    for line in proc.stderr:
        if first is None and line.startswith("msrl: run directory"):
            first = time.perf_counter() - t0
    proc.wait()
    if proc.returncode or first is None:
        raise RuntimeError(f"msrl train failed (exit {proc.returncode})")
    return first, time.perf_counter() - t0


def _to_solved(runs_dir: str, seed: int) -> tuple[float, bool]:
    """Seconds from the command to the end of a run that stops at a mean return of 475, and
    whether it got there."""
    import json
    import pathlib

    name = f"solved{seed}"
    cmd = [sys.executable, "-m", "msrl.cli", "train", "configs/ppo_cartpole.yaml", f"seed={seed}", f"name={name}",
           "train.stop_at_return=475", "train.eval_every=5000", "train.progress=false", f"runs_dir={runs_dir}"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    dt = time.perf_counter() - t0
    ev = json.loads((pathlib.Path(runs_dir) / name / "eval.json").read_text())
    return dt, ev["time_to_threshold_s"] is not None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--solved-seeds", type=int, nargs="*", default=[])
    args = p.parse_args()
    torch_s, msrl_s, first_s, whole_s = [], [], [], []
    with tempfile.TemporaryDirectory() as runs_dir:
        for _ in range(args.repeats):  # interleaved, so a slow moment of the machine hits every row
            torch_s.append(_wall([sys.executable, "-c", "import torch"]))
            msrl_s.append(_wall([sys.executable, "-c", "import msrl.run"]))
            first, whole = _to_first_iteration(runs_dir)
            first_s.append(first)
            whole_s.append(whole)
    floor = statistics.median(torch_s)
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"{args.repeats} runs each (medians)")
    print("| row | seconds (median) | runs | vs the floor |")
    print("| --- | --- | --- | --- |")
    for name, xs in (("python -c 'import torch' (floor)", torch_s), ("python -c 'import msrl.run'", msrl_s),
                     ("msrl train: command to first iteration", first_s),
                     ("msrl train: whole process, one iteration", whole_s)):
        m = statistics.median(xs)
        print(f"| {name} | {m:.2f} | {', '.join(f'{x:.2f}' for x in xs)} | {m / floor:.2f}x |")
    if args.solved_seeds:
        with tempfile.TemporaryDirectory() as runs_dir:
            solved = [_to_solved(runs_dir, seed) for seed in args.solved_seeds]
        times = [t for t, _ in solved]
        print(f"| msrl train: whole process to solved (475), seeds {args.solved_seeds} | {statistics.median(times):.2f} "
              f"| {', '.join(f'{t:.2f}' for t in times)} ({sum(ok for _, ok in solved)}/{len(solved)} solved) "
              f"| {statistics.median(times) / floor:.2f}x |")


if __name__ == "__main__":
    main()
