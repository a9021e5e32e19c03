"""Self-play on tic-tac-toe (``configs/ppo_selfplay_tictactoe.yaml``): how a policy trained only
against frozen snapshots of itself plays a uniformly random legal player, over seeds, for three
ways of choosing the opponent -- the shipped pool (the newest snapshot or an older one), pure
latest-self-play (``pool_size=1``), and a fixed near-random opponent (the untrained policy:
``snapshot_every`` past the run's length) -- and an untrained policy as the floor.

    python bench/bench_selfplay.py --seeds 1 2 3 --json selfplay.json
    python bench/bench_selfplay.py --seeds 1 --variants pool --steps 100000   # a quick look
    python bench/bench_selfplay.py --run runs/ppo_selfplay_tictactoe          # a trained run, as it is

Each trained policy plays ``--games`` games against the random player, half in each seat, taking
its most probable legal move; the table gives the mean win, draw and loss rates over seeds and
the training time (s).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "ppo_selfplay_tictactoe.yaml"
GAME = "pettingzoo/pettingzoo.classic.tictactoe_v3"
VARIANTS = {
    "pool": [],
    "latest": ["algorithm.hparams.pool_size=1", "algorithm.hparams.latest_prob=1.0"],
    "fixed_random": ["algorithm.hparams.snapshot_every=1000000000"],
}


def run(variant: str, seed: int, steps: int | None, games: int, runs_dir: pathlib.Path) -> dict:
    """Trains one variant with one seed; returns its rates against the random player and its time."""
    import msrl
    from msrl.algorithms import ppo_selfplay
    from msrl.config import load_config
    from msrl.run.training import train

    overrides = [f"runs_dir={runs_dir}", f"name={variant}_{seed}", f"seed={seed}", "train.progress=false",
                 *VARIANTS[variant], *([f"train.total_env_steps={steps}"] if steps else [])]
    result = train(load_config(CONFIG, overrides))
    net = msrl.load(result.run_dir).actor.net
    rates = ppo_selfplay.play_against_random(net, GAME, games=games, seed=10_000 + seed)
    return {"variant": variant, "seed": seed, "time_s": result.time_s, "env_steps": result.env_steps, **rates}


def untrained(seed: int, games: int) -> dict:
    """The floor: the config's network as built (near-uniform over legal moves), sampled."""
    import torch

    from msrl.algorithms import ppo_selfplay
    from msrl.config import load_config
    from msrl.envs.pettingzoo_env import make_parallel

    cfg = load_config(CONFIG, [])
    env = make_parallel(GAME, {})
    torch.manual_seed(seed)
    net = ppo_selfplay.SelfPlayNet(env.agent_observation_space, env.agent_action_space,
                                   tuple(cfg.algorithm.hparams["hidden_sizes"]), turn_based=True)
    rates = ppo_selfplay.play_against_random(net, GAME, games=games, seed=10_000 + seed, deterministic=False)
    return {"variant": "untrained", "seed": seed, "time_s": 0.0, "env_steps": 0, **rates}


def evaluate_run(run_dir: pathlib.Path, games: int, seed: int) -> dict:
    """A trained run's policy (``msrl.load``) against the random player, ``games`` games."""
    import msrl
    from msrl.algorithms import ppo_selfplay

    policy = msrl.load(run_dir)
    rates = ppo_selfplay.play_against_random(policy.actor.net, GAME, games=games, seed=10_000 + seed)
    return {"variant": f"run {run_dir}", "seed": seed, **rates}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--steps", type=int, default=None, help="train.total_env_steps (default: the config's)")
    ap.add_argument("--games", type=int, default=1000)
    ap.add_argument("--json", type=pathlib.Path, default=None)
    ap.add_argument("--run", type=pathlib.Path, default=None,
                    help="a trained run directory of configs/ppo_selfplay_tictactoe.yaml: play its policy only")
    args = ap.parse_args()
    if args.run is not None:
        rates = evaluate_run(args.run, args.games, args.seeds[0])
        print(f"{args.run}: against a random player over {args.games} games: win {rates['win']:.3f}, "
              f"draw {rates['draw']:.3f}, loss {rates['loss']:.3f}")
        return 0
    rows = [untrained(s, args.games) for s in args.seeds]
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants:
            for seed in args.seeds:
                rows.append(run(variant, seed, args.steps, args.games, pathlib.Path(tmp)))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print("| opponent in training | seeds | win | draw | loss | training (s) |\n| --- | --- | --- | --- | --- | --- |")
    for variant in ["untrained", *args.variants]:
        rs = [r for r in rows if r["variant"] == variant]
        mean = {k: statistics.mean(r[k] for r in rs) for k in ("win", "draw", "loss", "time_s")}
        print(f"| {variant} | {len(rs)} | {mean['win']:.3f} | {mean['draw']:.3f} | {mean['loss']:.3f} | {mean['time_s']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
