"""Ape-X DQN (``configs/apex_dqn_cartpole.yaml``) against the shipped DQN's uniform replay
(``configs/dqn_cartpole.yaml``) on CartPole-v1: env steps to a greedy evaluation of 475, over seeds.

Two questions, two modes:

* ``--mode learning``: does Ape-X's learning (3-step returns, double Q, a dueling network,
  prioritized replay, per-env epsilons over 8 envs) reach 475 in fewer env steps than uniform
  replay (rl-zoo's DQN, 1 env)? Both run in one process (``distribution_policy.name=single``) so
  only the algorithm differs; the same budget (100,000 env steps), the same 128 gradient steps of
  64 per 256 env steps, the same evaluation (20 greedy episodes every 5,120 env steps).
* ``--mode layout``: the Ape-X layout as shipped (4 actor replicas, 2 replay shards in their own
  fragment, the learner; on Ray) against the shipped DQN under ``single_learner_coarse`` with 4
  actor replicas and its uniform replay beside the learner, 8 envs each: env steps/s and the
  learning, in the same run (alternating per seed).

Each seed trains the whole budget; reported: the final greedy evaluation, the seeds that reached
475, env steps and training time to 475 (median [IQR]; a seed that never got there counts as
infinitely slow), env steps/s, and the two-sided Mann-Whitney U test of env steps to 475.

    python bench/bench_apex.py --mode learning --seeds 1 2 3 4 5 --json apex_learning.json
    python bench/bench_apex.py --mode layout --seeds 1 2 3 --json apex_layout.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_learning import _fmt, _mann_whitney  # noqa: E402
from bench_offpolicy import Task, _quartiles, run_msrl  # noqa: E402

UNIFORM = Task("configs/dqn_cartpole.yaml", "CartPole-v1", 475.0, 100_000, 5_120, "DQN", 1)
APEX = Task("configs/apex_dqn_cartpole.yaml", "CartPole-v1", 475.0, 100_000, 5_120, "DQN", 8)

#: (name, task, config overrides) per mode
SYSTEMS = {
    "learning": [("uniform replay (rl-zoo DQN), single", UNIFORM, []),
                 ("Ape-X DQN, single", APEX, ["distribution_policy.name=single", "distribution_policy.replicas={}",
                                              "distribution_policy.placement={}"])],
    "layout": [("DQN, coarse x4, uniform replay at the learner", UNIFORM,
                ["distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=4",
                 "distribution_policy.placement.buffer=learner", "env.num_envs=8", "algorithm.hparams.train_frequency=32",
                 "runtime=ray"]),
               ("Ape-X DQN, 4 actors x 2 replay shards", APEX, ["runtime=ray"])],
}


def table(results: dict[str, list[dict]]) -> str:
    """The Markdown table of one mode's systems."""
    lines = ["| system | final greedy eval: median [IQR] | reached 475 | env steps to 475: median [IQR] "
             "| time to 475 (s): median [IQR] | env steps/s (median) |", "| --- | --- | --- | --- | --- | --- |"]
    for name, runs in results.items():
        lines.append(f"| {name} | {_fmt(_quartiles(sorted(r['final_eval'] for r in runs)), 1)} "
                     f"| {sum(r['steps_to_threshold'] is not None for r in runs)}/{len(runs)} "
                     f"| {_fmt(_quartiles([r['steps_to_threshold'] for r in runs]), 0)} "
                     f"| {_fmt(_quartiles([r['time_to_threshold'] for r in runs]), 1)} "
                     f"| {_quartiles([r['sps'] for r in runs])[1]:.0f} |")
    (a, ra), (b, rb) = results.items()
    lines.append(f"\n{b} against {a}, env steps to 475: Mann-Whitney U {_mann_whitney(rb, ra, 'steps_to_threshold')}")
    for name, runs in results.items():
        lines.append(f"\n{name}, env steps to 475 per seed: "
                     + ", ".join("never" if r["steps_to_threshold"] is None else str(r["steps_to_threshold"]) for r in runs))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=list(SYSTEMS), default="learning")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    p.add_argument("--json", default=None, help="also write the raw results (curves included) here")
    args = p.parse_args()
    results: dict[str, list[dict]] = {name: [] for name, _, _ in SYSTEMS[args.mode]}
    with tempfile.TemporaryDirectory() as runs_dir:
        for seed in args.seeds:  # alternating systems per seed: a busy spell hits both
            for name, task, overrides in SYSTEMS[args.mode]:
                r = run_msrl(task, seed, None, runs_dir, [f"name=s{seed}_{len(results[name])}_{task.n_envs}", *overrides],
                             whole_budget=True)
                results[name].append({"seed": seed, **r})
                print(f"{name} seed {seed}: steps to 475 {r['steps_to_threshold']}, final {r['final_eval']:.1f}, "
                      f"{r['sps']:.0f} env steps/s", file=sys.stderr, flush=True)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
