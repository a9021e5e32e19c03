"""Multi-agent PPO on native Tag: do the taggers' returns rise above a random policy's?

1. Plays ``--random-games`` games with uniformly random actions for every agent, with the env
   settings of the config, and takes the taggers' mean return per game: the random baseline.
2. Trains ``configs/ma_ppo_tag.yaml`` (taggers and runners both learn, one shared policy per
   type) for ``--env-steps`` env steps.
3. Writes the curve (taggers' and runners' mean return per game against env steps, with the
   random baseline) to ``--out`` (PNG) and prints the table: the random baseline, the first and
   last tenth of training.

    python bench/bench_tag_learning.py --env-steps 320000 --out bench/tag_learning.png
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile

import torch

from msrl.config import load_config
from msrl.envs.native.tag import Tag
from msrl.run.training import train


def random_baseline(kwargs: dict, games: int, seed: int = 123) -> float:
    """Taggers' mean return per game under uniformly random actions."""
    envs = 64
    env = Tag(envs, **kwargs)
    env.reset(seed=seed)
    p = env.params
    g = torch.Generator().manual_seed(seed)
    returns: list[float] = []
    while len(returns) < games:
        act = torch.stack([torch.randint(0, p.num_acceleration_levels + 1, (envs, env.num_agents), generator=g),
                           torch.randint(0, p.num_turn_levels + 1, (envs, env.num_agents), generator=g)], dim=2)
        env.step(act)
        if len(env._finished) >= p.episode_length:
            env.pop_episode_stats()
            returns += env.last_type_returns["tagger"]
    return statistics.mean(returns)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/ma_ppo_tag.yaml")
    p.add_argument("--env-steps", type=int, default=320_000)
    p.add_argument("--random-games", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="tag_learning.png")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as runs:
        cfg = load_config(args.config, [f"runs_dir={runs}", "train.progress=false", f"seed={args.seed}",
                                        f"train.total_env_steps={args.env_steps}", *args.overrides])
        baseline = random_baseline(dict(cfg.env.kwargs), args.random_games)
        result = train(cfg)
        with open(result.run_dir / "metrics.csv", newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("charts/tagger_return")]
    steps = [int(r["env_steps"]) for r in rows]
    tagger = [float(r["charts/tagger_return"]) for r in rows]
    runner = [float(r["charts/runner_return"]) for r in rows]
    tenth = max(1, len(rows) // 10)
    first, last = statistics.mean(tagger[:tenth]), statistics.mean(tagger[-tenth:])
    print(f"env {cfg.env.id} {dict(cfg.env.kwargs)}, {cfg.env.num_envs} envs, {args.env_steps} env steps, "
          f"{result.time_s:.0f} s training")
    print("| taggers' mean return per game | value |")
    print("| --- | --- |")
    print(f"| random policy ({args.random_games} games) | {baseline:.3f} |")
    print(f"| MA-PPO, first tenth of training | {first:.3f} |")
    print(f"| MA-PPO, last tenth of training | {last:.3f} ({last / baseline:.2f}x random) |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(v: list[float], k: int = 10) -> list[float]:
        return [statistics.mean(v[max(0, i - k + 1) : i + 1]) for i in range(len(v))]

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    trained = cfg.algorithm.hparams.get("trained_types")
    who = {1: "taggers", 0: "runners"}
    for t, values, color in ((1, tagger, "tab:red"), (0, runner, "tab:blue")):
        how = "MA-PPO" if trained is None or t in trained else "untrained policy"
        ax.plot(steps, smooth(values), label=f"{who[t]} ({how})", color=color)
    ax.axhline(baseline, color="tab:red", ls="--", lw=1, label="taggers (random policy)")
    ax.set_xlabel("env steps")
    ax.set_ylabel("mean return per game (10-iteration moving mean)")
    ax.set_title("MA-PPO on native Tag")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"curve: {args.out}")


if __name__ == "__main__":
    main()
