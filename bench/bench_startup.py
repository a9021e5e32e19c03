"""Start-up of the main job: from the command to its first training iteration, against the floor
``python -c "import torch"`` measured in the same run.

Rows (medians over ``--repeats`` runs, each a fresh process):

* ``python -c "import torch"``: the floor any PyTorch program pays;
* ``python -c "import msrl.run.training"`` in a user's process (plain torch: tensordict's compile marks
  import TorchDynamo there, as in any process that imports tensordict), and the same in a process
  msrl owns (:func:`msrl.runtime.startup.own_process` first, as the ``msrl`` command does);
* ``msrl train`` to its first iteration: from the command until the line ``msrl: run
  directory ...``, which the driver prints once the job is traced, probed, partitioned, built
  and reset, just before the first iteration;
* ``msrl train`` whole process for one iteration (256 env steps, no evaluation during training;
  the final 20-episode evaluation included; the learning curve is drawn by a background process
  the command does not wait for, and the bench waits for it before the next row);
* the issue's command, ``msrl train configs/ppo_cartpole.yaml train.total_env_steps=256
  eval.episodes=1``, whole process (the acceptance row: <= 1.3x ``import torch``);
* the floor of a plain torch PPO script's start-up: ``import torch, gymnasium``, CartPole's
  vector env and the same actor-critic's Adam optimiser built (which imports TorchDynamo in
  torch 2.13, as msrl's learner did before ``msrl.runtime.startup.own_process``);
* with ``--solved-seeds``: the whole process from the command until the main job is solved
  (an evaluation every 5,000 env steps reaches 475 and the run stops), per seed.

    python bench/bench_startup.py --repeats 5 --solved-seeds 1 2 3 4 5
"""

from __future__ import annotations

import argparse
import pathlib
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


PLAIN_PPO_START = """
import gymnasium, torch
from torch import nn
envs = gymnasium.make_vec("CartPole-v1", num_envs=4, vectorization_mode="sync")
net = nn.ModuleDict({"actor": nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2)),
                     "critic": nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))})
optimizer = torch.optim.Adam(net.parameters(), lr=2.5e-4, eps=1e-5)
envs.reset(seed=1)
"""


def _wait_for_curve(run_dir: pathlib.Path) -> None:
    """Waits (up to 120 s) for the background process that draws the run's learning curve."""
    deadline = time.monotonic() + 120
    while not (run_dir / "learning_curve.png").is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # its exit


def _issue_command(runs_dir: str, k: int) -> float:
    """The whole ``msrl train configs/ppo_cartpole.yaml train.total_env_steps=256 eval.episodes=1``."""
    cmd = [sys.executable, "-m", "msrl.run.cli", "train", "configs/ppo_cartpole.yaml", "train.total_env_steps=256",
           "eval.episodes=1", f"runs_dir={runs_dir}", f"name=issue{k}"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    dt = time.perf_counter() - t0
    _wait_for_curve(pathlib.Path(runs_dir) / f"issue{k}")
    return dt


def _to_first_iteration(runs_dir: str, k: int) -> tuple[float, float]:
    """Seconds from the command to the ``run directory`` line, and to the process's end."""
    cmd = [sys.executable, "-m", "msrl.run.cli", "train", "configs/ppo_cartpole.yaml", "train.total_env_steps=256",
           "train.eval_every=0", "train.progress=false", f"runs_dir={runs_dir}", f"name=first{k}"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    first = None
    assert proc.stderr is not None
    for line in proc.stderr:
        if first is None and line.startswith("msrl: run directory"):
            first = time.perf_counter() - t0
    proc.wait()
    whole = time.perf_counter() - t0
    if proc.returncode or first is None:
        raise RuntimeError(f"msrl train failed (exit {proc.returncode})")
    _wait_for_curve(pathlib.Path(runs_dir) / f"first{k}")
    return first, whole


def _to_solved(runs_dir: str, seed: int) -> tuple[float, bool]:
    """Seconds from the command to the end of a run that stops at a mean return of 475, and
    whether it got there."""
    import json
    import pathlib

    name = f"solved{seed}"
    cmd = [sys.executable, "-m", "msrl.run.cli", "train", "configs/ppo_cartpole.yaml", f"seed={seed}", f"name={name}",
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
    torch_s, plain_s, msrl_s, owned_s, first_s, whole_s, issue_s = [], [], [], [], [], [], []
    with tempfile.TemporaryDirectory() as runs_dir:
        for k in range(args.repeats):  # interleaved, so a slow moment of the machine hits every row
            torch_s.append(_wall([sys.executable, "-c", "import torch"]))
            plain_s.append(_wall([sys.executable, "-c", PLAIN_PPO_START]))
            msrl_s.append(_wall([sys.executable, "-c", "import msrl.run.training"]))
            owned_s.append(_wall([sys.executable, "-c", "from msrl.runtime.startup import own_process; own_process(); "
                                  "import msrl.run.training"]))
            first, whole = _to_first_iteration(runs_dir, k)
            first_s.append(first)
            whole_s.append(whole)
            issue_s.append(_issue_command(runs_dir, k))
    floor = statistics.median(torch_s)
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"{args.repeats} runs each (medians)")
    print("| row | seconds (median) | runs | vs the floor |")
    print("| --- | --- | --- | --- |")
    for name, xs in (("python -c 'import torch' (floor)", torch_s),
                     ("plain torch PPO script: imports, vector env, Adam built", plain_s),
                     ("python -c 'import msrl.run.training' (a user's process: plain torch)", msrl_s),
                     ("the same in a process msrl owns (own_process() first)", owned_s),
                     ("msrl train: command to first iteration", first_s),
                     ("msrl train: whole process, one iteration, 20 eval episodes", whole_s),
                     ("msrl train ... train.total_env_steps=256 eval.episodes=1 (whole process)", issue_s)):
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
