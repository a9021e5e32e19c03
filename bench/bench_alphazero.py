"""AlphaZero (``algorithms/alphazero.py``): how well it plays, and how fast it self-plays.

``play`` -- train the shipped config per seed, then play its network with its search against
fixed opponents, half the games with each colour:

* tic-tac-toe (``configs/alphazero_tictactoe.yaml``) against OpenSpiel's exact solver
  (alpha-beta) and a random player: the gate is no loss to the solver in 100 games;
* Connect Four (``configs/alphazero_connect_four.yaml``) against OpenSpiel's ``MCTSBot`` with
  1,000 random-rollout simulations (UCT constant 2, solving subtrees), msrl's search at an equal
  or smaller simulation budget: the gate is >= 90% wins.

``selfplay`` -- the self-play rate (positions/s and leaf evaluations/s, learning off) at 1, 4
and 16 actors on Ray, under ``single_learner_fine`` (each env replica searches its games, the
central replica evaluates every replica's leaves in the batches its server forms: SEED RL's
dynamic batching, the replay in a fragment of its own) against ``single_learner_coarse`` (each
actor replica evaluates its own leaves), same run; with the requests per batch the server formed.

    python bench/bench_alphazero.py play tic_tac_toe --seeds 1 2 3 --games 100
    python bench/bench_alphazero.py play connect_four --seeds 1 --games 100 --budget 400000
    python bench/bench_alphazero.py play connect_four --runs runs/alphazero_connect_four --games 100
    python bench/bench_alphazero.py play connect_four --runs runs/alphazero_connect_four --kept-from 737000
    python bench/bench_alphazero.py play connect_four --runs RUN --kept-from 900000 --kept-to 950000 --opponents mcts
    python bench/bench_alphazero.py play connect_four --runs RUN --games 200 --match-seed 20000 --opponents mcts
    python bench/bench_alphazero.py selfplay --actors 1 4 16 --iterations 6

``search`` -- the PUCT search alone (``PUCTSearch``, fixed random network outputs, the games at
random openings), microseconds a leaf, the median of ``--rounds``; run against an older checkout
with ``PYTHONPATH=<that checkout>`` to compare implementations:

    python bench/bench_alphazero.py search connect_four --games 64 --simulations 100 [--tower 32x2 [--dtype bfloat16]]
    python bench/bench_alphazero.py search connect_four --games 64 256 --tower 64x3 --device cuda   # leaves on a GPU
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time

import torch

CONFIGS = {"tic_tac_toe": "configs/alphazero_tictactoe.yaml", "connect_four": "configs/alphazero_connect_four.yaml"}
#: the opponents each game is measured against
OPPONENTS = {"tic_tac_toe": ("solver", "random"), "connect_four": ("mcts", "random")}


def trained_run(game: str, seed: int, budget: int | None) -> tuple[str, float]:
    """Trains ``game``'s shipped config with ``seed`` (``budget`` env steps, default the
    config's); returns its run directory and the training time in seconds."""
    import msrl
    from msrl.config import load_config

    over = [f"seed={seed}", "train.progress=false", "eval.episodes=2", f"runs_dir={tempfile.mkdtemp()}"]
    if budget:
        over.append(f"train.total_env_steps={budget}")
    t0 = time.perf_counter()
    result = msrl.train(load_config(CONFIGS[game], over))
    return str(result.run_dir), time.perf_counter() - t0


def kept_weights(run_dir: str, from_steps: int, to_steps: int | None = None) -> list[str]:
    """The paths of the policy weights ``run_dir`` kept (``train.keep_weights``) from
    ``from_steps`` env steps on (to ``to_steps``, inclusive, if given), oldest first.

    Raises:
        SystemExit: it kept none in that range.
    """
    import pathlib

    from msrl.run.checkpoints import WEIGHTS_DIR

    kept = sorted(pathlib.Path(run_dir, WEIGHTS_DIR).glob("*.pt"), key=lambda p: int(p.stem))
    last = float("inf") if to_steps is None else to_steps
    kept = [str(p) for p in kept if from_steps <= int(p.stem) <= last]
    if not kept:
        upto = "" if to_steps is None else f" to {to_steps}"
        raise SystemExit(f"{run_dir}: no weights kept from {from_steps} env steps{upto} (train with train.keep_weights=true)")
    return kept


def play(game: str, run_dir: str, train_s: float | None, games: int, simulations: int | None,
         weights: str | None = None, opponents: tuple[str, ...] | None = None,
         match_seed: int | None = None, search: tuple[str, ...] = ()) -> dict:
    """Plays the latest checkpoint of the AlphaZero run in ``run_dir`` (or the policy weights
    file ``weights`` it kept), with its config's search, ``games`` games against each of
    ``opponents`` (default: every opponent of ``game``, :data:`OPPONENTS`), game ``g`` seeded
    ``match_seed + g`` (default ``10_000`` + the run's seed), the search's hyperparameters
    overridden by ``search`` (``KEY=VALUE`` of ``algorithm.hparams``, e.g. ``puct_q=unit``), in
    the run's denormal mode; returns the rates, the positions and the run's seed, and
    ``train_s`` (``None``: the run was trained elsewhere, e.g. by ``msrl train``)."""
    import os

    from msrl.algorithms import alphazero
    from msrl.config import load_config
    from msrl.run.checkpoints import CHECKPOINT
    from msrl.runtime.host import flushed_denormals

    cfg = load_config(os.path.join(run_dir, "config.yaml"), [f"algorithm.hparams.{kv}" for kv in search])
    if cfg.algorithm.name != "alphazero":
        raise SystemExit(f"{run_dir}: a run of {cfg.algorithm.name!r}, not of alphazero")
    hp = alphazero.AlphaZeroConfig(**cfg.algorithm.hparams)
    ckpt = torch.load(weights or os.path.join(run_dir, CHECKPOINT), weights_only=False)
    net = alphazero.policy_value_net(hp, cfg.env.id)
    net.load_state_dict(ckpt["actor_weights"])
    match_seed = 10_000 + cfg.seed if match_seed is None else match_seed
    out = {"game": game, "seed": cfg.seed, "run_dir": run_dir, "weights": weights, "train_s": train_s,
           "env_steps": ckpt["env_steps"], "simulations": simulations or hp.num_simulations,
           "match_seed": match_seed, "search": list(search)}
    for opponent in opponents or OPPONENTS[game]:
        t1 = time.perf_counter()
        with flushed_denormals(cfg.train.flush_denormal):  # as the run's fragments computed
            out[opponent] = alphazero.play_match(net, game, opponent, hp, games, seed=match_seed,
                                                 num_simulations=simulations)
        out[f"{opponent}_play_s"] = time.perf_counter() - t1
    return out


def selfplay_rate(policy: str, actors: int, games_per_actor: int, iterations: int, simulations: int) -> dict:
    """Positions/s of ``iterations`` self-play iterations (after one of warm-up), learning off,
    on Ray: ``policy`` with ``actors`` searching replicas of ``games_per_actor`` games each."""
    from msrl.cluster.options import RayOptions
    from msrl.config import build_job_spec, load_config
    from msrl.run.driver import ray_job

    replicas = "env" if policy == "single_learner_fine" else "actor"
    over = [f"distribution_policy.name={policy}", f"distribution_policy.replicas.{replicas}={actors}",
            f"env.num_envs={actors * games_per_actor}", "algorithm.hparams.learning_starts=1000000000",
            f"algorithm.hparams.num_simulations={simulations}", "algorithm.hparams.eval_interval=0", "runtime=ray"]
    if policy == "single_learner_fine":
        over += ["distribution_policy.placement.buffer=replay",
                 f"distribution_policy.inference={{max_batch: {actors}, timeout_ms: 2}}"]
    spec = build_job_spec(load_config(CONFIGS["tic_tac_toe"], over))
    job = ray_job(spec, RayOptions())
    try:
        job.reset()
        job.run(1)
        t0 = time.perf_counter()
        records = job.run(iterations)
        dt = time.perf_counter() - t0
    finally:
        job.close()
    sizes = [s for r in records if r.get("inference") for s in r["inference"]["batch_sizes"]]
    positions = iterations * spec.env_steps_per_iteration
    return {"policy": policy, "actors": actors, "positions_per_s": positions / dt,
            "evaluations_per_s": positions * simulations / dt,
            "requests_per_batch": statistics.mean(sizes) if sizes else None,
            "rows_per_batch": statistics.mean(sizes) * games_per_actor if sizes else None}


def search_time(game: str, games: int, simulations: int, rounds: int, tower: str | None = None,
                dtype: str = "float32", device: str = "cpu") -> float:
    """The median over ``rounds`` of one move's search of ``simulations`` over ``games`` games at
    random openings (up to 11 random moves), the network's outputs drawn once (or, with ``tower``
    ``CxB``, a residual tower of ``C`` filters and ``B`` blocks evaluating the leaves in
    ``dtype``, AlphaZeroConfig.inference_dtype, on ``device``: each simulation's leaves copied
    there and the outputs back, as the ``MCTS`` wrapper does): microseconds a leaf. The first
    round is a warm-up on a GPU (its kernels' first launches) and not counted."""
    import numpy as np
    import pyspiel

    from msrl.algorithms.alphazero import AlphaZeroConfig, PUCTSearch, infer

    g = pyspiel.load_game(game)
    A, hp, rng = g.num_distinct_actions(), AlphaZeroConfig(num_simulations=simulations), np.random.default_rng(0)
    states = []
    for _ in range(games):
        s = g.new_initial_state()
        for _ in range(int(rng.integers(0, 12))):
            s.apply_action(int(rng.choice(s.legal_actions())))
            if s.is_terminal():
                s = g.new_initial_state()
        states.append(s)
    logits = rng.normal(size=(simulations, games, A)).astype(np.float32)
    values = np.tanh(rng.normal(size=(simulations, games))).astype(np.float32)
    net = None
    if tower:
        from msrl.algorithms.alphazero import policy_value_net

        channels, blocks = (int(x) for x in tower.split("x"))
        net = policy_value_net(AlphaZeroConfig(network="resnet", channels=channels, residual_blocks=blocks),
                               f"openspiel/{game}").eval().to(device)
    warm_up = torch.device(device).type != "cpu"  # (a GPU's first round launches its kernels the first time)
    times = []
    for r in range(rounds + warm_up):
        t = time.perf_counter()
        search = PUCTSearch(A, hp, noise=True)
        leaves = search.begin(states, [np.random.default_rng(i) for i in range(games)])
        for k in range(simulations):
            if net is None:
                search.step(logits[k], values[k])
                continue
            with torch.no_grad():
                out_logits, out_value = infer(net, torch.from_numpy(leaves).to(device), dtype)
            leaves = search.step(out_logits.cpu().numpy(), out_value.cpu().numpy())
        search.result()
        if r or not warm_up:
            times.append((time.perf_counter() - t) / (games * simulations) * 1e6)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("play")
    a.add_argument("game", choices=sorted(CONFIGS))
    a.add_argument("--seeds", type=int, nargs="+", default=[1])
    a.add_argument("--games", type=int, default=100)
    a.add_argument("--budget", type=int, default=None, help="env steps (self-play positions) of training")
    a.add_argument("--simulations", type=int, default=None, help="msrl's simulations per move in the matches")
    a.add_argument("--runs", nargs="+", default=None,
                   help="run directories of AlphaZero runs already trained (msrl train): play their latest "
                        "checkpoints instead of training one per seed")
    a.add_argument("--kept-from", type=int, default=None, metavar="STEPS",
                   help="with --runs: play every policy each run kept (train.keep_weights=true) from STEPS env "
                        "steps on, and report the mean over them")
    a.add_argument("--kept-to", type=int, default=None, metavar="STEPS",
                   help="with --kept-from: only the policies kept up to STEPS env steps (inclusive), e.g. to split "
                        "a run's policies over processes")
    a.add_argument("--opponents", nargs="+", default=None,
                   help="play only these of the game's opponents (tic_tac_toe: solver, random; connect_four: "
                        "mcts, random; default: both)")
    a.add_argument("--match-seed", type=int, default=None, metavar="SEED",
                   help="seed of the matches' first game (game g: SEED + g; default 10000 + the run's seed), "
                        "e.g. to split one policy's games over processes with disjoint seeds")
    a.add_argument("--search", nargs="+", default=(), metavar="KEY=VALUE",
                   help="override the run's search hyperparameters in the matches (algorithm.hparams.KEY), "
                        "e.g. puct_q=unit c_init=2")
    b = sub.add_parser("selfplay")
    b.add_argument("--actors", type=int, nargs="+", default=[1, 4, 16])
    b.add_argument("--games-per-actor", type=int, default=4)
    b.add_argument("--iterations", type=int, default=6)
    b.add_argument("--simulations", type=int, default=50)
    c = sub.add_parser("search")
    c.add_argument("game", choices=sorted(CONFIGS))
    c.add_argument("--games", type=int, nargs="+", default=[64])
    c.add_argument("--simulations", type=int, default=100)
    c.add_argument("--rounds", type=int, default=5)
    c.add_argument("--tower", default=None, metavar="CxB",
                   help="evaluate the leaves with a residual tower of C filters and B blocks (e.g. 32x2, the "
                        "Connect Four config's) instead of fixed outputs")
    c.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the tower's evaluations: algorithm.hparams.inference_dtype")
    c.add_argument("--device", default="cpu", help="where the tower evaluates the leaves (e.g. cuda); the search "
                                                   "itself runs on the host")
    p.add_argument("--json", default=None, help="also write the raw results here")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"command: {' '.join(sys.argv)}")
    rows = []
    if args.what == "play":
        if args.kept_from is not None and not args.runs:
            raise SystemExit("--kept-from plays the weights runs kept: give their directories with --runs")
        if args.kept_to is not None and args.kept_from is None:
            raise SystemExit("--kept-to bounds --kept-from's range: give --kept-from too")
        opponents = tuple(args.opponents or OPPONENTS[args.game])
        unknown = [o for o in opponents if o not in OPPONENTS[args.game]]
        if unknown:
            raise SystemExit(f"--opponents: {', '.join(unknown)} not an opponent of {args.game} "
                             f"(its opponents: {', '.join(OPPONENTS[args.game])})")
        runs = [(d, None) for d in args.runs] if args.runs else \
            [trained_run(args.game, seed, args.budget) for seed in args.seeds]
        plays = [(d, t, w) for d, t in runs for w in
                 ([None] if args.kept_from is None else kept_weights(d, args.kept_from, args.kept_to))]
        for run_dir, train_s, weights in plays:
            r = play(args.game, run_dir, train_s, args.games, args.simulations, weights, opponents, args.match_seed,
                     tuple(args.search))
            rows.append(r)
            rates = "; ".join(f"{o}: {r[o]['win']:.1%} won, {r[o]['draw']:.1%} drawn, {r[o]['loss']:.1%} lost "
                              f"({r[o + '_play_s']:.0f} s)" for o in opponents)
            trained = "" if train_s is None else f" in {train_s:.0f} s of training"
            print(f"seed {r['seed']} ({weights or run_dir}): {r['env_steps']} positions{trained}; {args.games} games "
                  f"at {r['simulations']} simulations a move{' (' + ' '.join(args.search) + ')' if args.search else ''}"
                  f" -- {rates}", flush=True)
        if len(rows) > 1:
            means = "; ".join(f"{o}: {statistics.mean(r[o]['win'] for r in rows):.1%} won, "
                              f"{statistics.mean(r[o]['draw'] for r in rows):.1%} drawn"
                              for o in opponents)
            print(f"mean over {len(rows)} policies x {args.games} games -- {means}", flush=True)
    elif args.what == "search":
        if (args.dtype != "float32" or args.device != "cpu") and not args.tower:
            raise SystemExit("--dtype and --device are where and how --tower evaluates the leaves: give --tower CxB too")
        try:
            device = torch.device(args.device)
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as e:
            raise SystemExit(f"--device {args.device}: {str(e).splitlines()[0]}") from None
        from msrl.algorithms import alphazero

        print(f"search: {alphazero.PUCTSearch.__module__}.PUCTSearch")
        for games in args.games:
            us = search_time(args.game, games, args.simulations, args.rounds, args.tower, args.dtype, str(device))
            rows.append({"game": args.game, "games": games, "simulations": args.simulations, "us_per_leaf": us,
                         "tower": args.tower, "dtype": args.dtype, "device": str(device)})
            print(f"{args.game}, {games} games, {args.simulations} simulations"
                  f"{', tower ' + args.tower + ' in ' + args.dtype + ' on ' + str(device) if args.tower else ''}: "
                  f"{us:.1f} us a leaf "
                  f"(median of {args.rounds})", flush=True)
    else:
        import ray

        print("| actors | policy | positions/s | leaf evaluations/s | requests (rows) per batch |")
        print("| --- | --- | --- | --- | --- |")
        for actors in args.actors:
            for policy in ("single_learner_coarse", "single_learner_fine"):
                r = selfplay_rate(policy, actors, args.games_per_actor, args.iterations, args.simulations)
                if ray.is_initialized():
                    ray.shutdown()
                rows.append(r)
                batch = "-" if r["requests_per_batch"] is None else \
                    f"{r['requests_per_batch']:.2f} ({r['rows_per_batch']:.1f})"
                print(f"| {actors} | {policy} | {r['positions_per_s']:.1f} | {r['evaluations_per_s']:.0f} | {batch} |",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
