"""GAIL against its expert: an expert trained by msrl (CartPole: the main PPO job; Pendulum: the SAC
config run to its budget; HalfCheetah: the SAC config's first 100k env steps, about 40 minutes here,
or a run already trained, ``--expert-run``), ``msrl collect`` writing ``--episodes`` of its greedy play as a Minari
dataset, then GAIL (``configs/gail_<task>.yaml``) over seeds, evaluated greedily (20 episodes)
every ``--eval-every`` env steps; a uniformly random policy measured in the same run.

Reported per seed: the expert's return, GAIL's evaluations, the first env step at which an
evaluation's normalised score ``(R - R_random) / (R_expert - R_random)`` reaches 0.9 (the issue's
"90% of the expert"; on CartPole, where R_random is 22, about 0.9 of the expert's return), the final
evaluation and its score, and GAIL's env steps/s (its discriminator's steps included). One torch
thread::

    python bench/bench_gail.py cartpole --seeds 1 2 3 --episodes 10
    python bench/bench_gail.py pendulum --seeds 1 2 3 --episodes 10
    python bench/bench_gail.py halfcheetah --seeds 1 2 3 --episodes 10 [--expert-run runs/sac_halfcheetah]

``--plot PNG`` draws each seed's evaluations, the expert's own evaluations during its training (its
curve, where its run kept them) and the expert's and random policy's returns.
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

#: task -> the expert's config and overrides, GAIL's config, the dataset id, budget, evaluation interval
TASKS = {
    "cartpole": {"expert": ("ppo_cartpole.yaml", {}), "gail": "gail_cartpole.yaml",
                 "dataset": "msrl/cartpole/expert10-v0", "env": "CartPole-v1", "budget": 300_000, "eval_every": 20_000},
    "pendulum": {"expert": ("sac_pendulum.yaml", {"train__stop_at_return": None}), "gail": "gail_pendulum.yaml",
                 "dataset": "msrl/pendulum/expert10-v0", "env": "Pendulum-v1", "budget": 500_000, "eval_every": 50_000},
    "halfcheetah": {"expert": ("sac_halfcheetah.yaml", {"train__total_env_steps": 100_000}),
                    "gail": "gail_halfcheetah.yaml", "dataset": "msrl/halfcheetah/expert10-v0",
                    "env": "HalfCheetah-v5", "budget": 1_000_000, "eval_every": 100_000},
}


def random_return(env_id: str, episodes: int = 100, seed: int = 0) -> float:
    """The mean return of uniformly random actions on ``env_id`` over ``episodes`` episodes."""
    import gymnasium

    env, total = gymnasium.make(env_id), []
    env.action_space.seed(seed)
    for k in range(episodes):
        env.reset(seed=seed + k)
        ret, done = 0.0, False
        while not done:
            _, r, term, trunc, _ = env.step(env.action_space.sample())
            ret, done = ret + float(r), term or trunc
        total.append(ret)
    return sum(total) / len(total)


def evaluations(run_dir: str | os.PathLike) -> list[tuple[int, float]]:
    """``(env steps, greedy mean return)`` of each evaluation in a run's ``metrics.csv``."""
    evals = []
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        for row in csv.DictReader(f):
            ev = row.get("eval/mean_return")
            if ev and ev != "nan":
                evals.append((int(row["env_steps"]), float(ev)))
    return evals


def plot(path: str, out: dict) -> None:
    """GAIL's evaluations per seed, the expert's curve, and the expert's and random returns, to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in out["runs"]:
        ax.plot(*zip(*run["evals"]), marker="o", ms=3, lw=1.5, label=f"GAIL, seed {run['seed']}")
    if out.get("expert_curve"):
        ax.plot(*zip(*out["expert_curve"]), color="black", marker="s", ms=3, lw=1.5,
                label=f"the expert ({out['expert_made']}) during its training")
    ax.axhline(out["expert"], color="gray", ls="--", lw=1, label=f"the expert: {out['expert']:.1f}")
    ax.axhline(out["random"], color="gray", ls=":", lw=1, label=f"random: {out['random']:.1f}")
    ax.set_xlabel("env steps")
    ax.set_ylabel("greedy evaluation return")
    ax.set_title(f"GAIL on {TASKS[out['task']]['env']} from {out['episodes']} expert episodes")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", choices=sorted(TASKS))
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--episodes", type=int, default=10, help="expert episodes in the dataset")
    p.add_argument("--budget", type=int, default=None, help="GAIL's env steps (default: the task's)")
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--expert-run", default=None,
                   help="a run directory of the task's expert config already trained: used (evaluated greedily "
                        "over 20 episodes) instead of training one")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="write the curves here (PNG)")
    p.add_argument("--from-json", default=None, help="plot a --json file of an earlier run (with --plot) and stop")
    args = p.parse_args()
    if args.from_json:
        if not args.plot:
            p.error("--from-json only plots: give --plot PNG")
        with open(args.from_json) as f:
            out = json.load(f)
        plot(args.plot, out)
        return
    torch.set_num_threads(1)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
          f"command: {' '.join(sys.argv)}", flush=True)
    import msrl
    from msrl.run.collect import collect

    task = TASKS[args.task]
    budget, eval_every = args.budget or task["budget"], args.eval_every or task["eval_every"]
    out = {"task": args.task, "episodes": args.episodes, "runs": [], "random": random_return(task["env"])}
    with tempfile.TemporaryDirectory() as tmp:
        config, over = task["expert"]
        if args.expert_run:
            returns = msrl.evaluate(args.expert_run, episodes=20)
            expert_dir, expert_return, made = args.expert_run, sum(returns) / len(returns), args.expert_run
        else:
            expert = msrl.train(os.path.join(ROOT, "configs", config), runs_dir=os.path.join(tmp, "runs"),
                                train__progress=False, train__eval_every=0, **over)
            expert_dir, expert_return, made = expert.run_dir, expert.eval_mean, f"configs/{config}, seed 1"
        out["expert"], out["expert_made"] = expert_return, made
        if os.path.exists(os.path.join(expert_dir, "metrics.csv")):
            out["expert_curve"] = evaluations(expert_dir)
        collect([expert_dir], task["dataset"], args.episodes, seed=0, root=os.path.join(tmp, "root"))
        print(f"expert ({made}): greedy return {expert_return:.1f}; random policy "
              f"{out['random']:.1f}; {args.episodes} episodes collected", flush=True)

        def score(ret: float) -> float:
            return (ret - out["random"]) / (expert_return - out["random"])

        for seed in args.seeds:
            r = msrl.train(os.path.join(ROOT, "configs", task["gail"]), runs_dir=os.path.join(tmp, "runs"),
                           seed=seed, dataset__root=os.path.join(tmp, "root"), train__total_env_steps=budget,
                           train__eval_every=eval_every, train__progress=False)
            evals = evaluations(r.run_dir)
            if not evals or evals[-1][0] != r.env_steps:  # the final evaluation, at the budget's end
                evals.append((r.env_steps, r.eval_mean))
            reached = next((s for s, v in evals if score(v) >= 0.9), None)
            res = {"seed": seed, "evals": evals, "steps_to_90pct": reached, "final": r.eval_mean,
                   "final_score": score(r.eval_mean), "sps": r.env_steps / r.time_s}
            out["runs"].append(res)
            print(f"GAIL seed {seed}: evaluations {[(s, round(v, 1)) for s, v in evals]}; a score of 0.9 first at "
                  f"{reached} env steps; final {r.eval_mean:.1f} (score {res['final_score']:.2f}); "
                  f"{res['sps']:.0f} env steps/s", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(out, f)
            if args.plot:
                plot(args.plot, out)


if __name__ == "__main__":
    main()
