"""The peers of msrl's offline algorithms: d3rlpy's (2.8) ``DiscreteBC`` for BC on CartPole
(``configs/bc_cartpole.yaml``'s settings), ``DiscreteCQL`` for discrete CQL on CartPole
(``configs/discrete_cql_cartpole.yaml``'s: Adam 1e-3, batch 256, target copied every 500
gradient steps, alpha 1, one critic, double DQN's target and Huber loss as d3rlpy's), ``IQL`` and ``CQL`` for IQL and CQL on Pendulum
(``configs/iql_pendulum.yaml``'s and ``configs/cql_pendulum.yaml``'s), trained on the same
Minari dataset.

Runs in an environment that has d3rlpy and minari (d3rlpy pins gymnasium 1.0, so keep it out of
msrl's)::

    python -m venv /tmp/d3 && /tmp/d3/bin/pip install torch==2.13.0 d3rlpy==2.8.1 "minari[hdf5]==0.5.4"
    /tmp/d3/bin/python bench/peer_d3rlpy.py bc --dataset ROOT/msrl/cartpole/expert-v0 --seed 1 --steps 5000
    /tmp/d3/bin/python bench/peer_d3rlpy.py iql --dataset ROOT/msrl/pendulum/sac-noisy-v0 --env-id Pendulum-v1 --steps 10000

BC: Adam 1e-3, batch 256, d3rlpy's default encoder (two 256-unit ReLU layers), and ``beta=0``
(d3rlpy's default 0.5 adds an L2 penalty on the logits, which msrl's BC has not). IQL: d3rlpy's
defaults, which are msrl's (Adam 3e-4, batch 256, gamma 0.99, tau 0.005, weights clipped at 100,
two critics, 256-256 ReLU encoders), with the expectile and the inverse temperature of msrl's config
(``--expectile``, ``--weight-temp``: the paper's 0.7 and 3 by default; ``bench/bench_offline.py``
passes its config's). CQL: d3rlpy's
defaults, which are msrl's (critic 3e-4, actor and temperature 1e-4, conservative weight 5, 10
sampled actions of each kind), but ``alpha_learning_rate=0``: d3rlpy's default tunes a Lagrange
multiplier on the penalty, which msrl's CQL (CQL(H) with a fixed weight) has not. Both with
a ``MinMaxActionScaler`` of the env's action bounds (d3rlpy's policies act in [-1, 1]).
The dataset's episodes go in as d3rlpy's ``MDPDataset`` (observations without the final one,
``terminals`` = terminations, ``timeouts`` = truncations). The evaluation is
``bench/bench_offpolicy.py``'s: greedy (``predict``), 20 episodes on envs seeded
10000..10019, after every ``--eval-every`` gradient steps and at the end; its time is out of the
clock. Prints one JSON object: ``grad_steps_per_s``, ``curve`` ``[(gradient_steps, train_s,
mean_return)]``, ``final_eval``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import d3rlpy
import gymnasium
import minari
import numpy as np
import torch

EVAL_EPISODES, EVAL_SEED = 20, 10_000


def evaluate(algo, env_id: str) -> float:
    """Greedy mean return over 20 episodes, env i seeded 10000 + i (one env at a time: gymnasium
    1.0, which d3rlpy pins, has no same-step autoreset for a vector env; the episodes are the same)."""
    returns = []
    env = gymnasium.make(env_id)
    for i in range(EVAL_EPISODES):
        obs, _ = env.reset(seed=EVAL_SEED + i)
        done, ret = False, 0.0
        while not done:
            action = algo.predict(obs[None].astype(np.float32))[0]
            obs, r, te, tr, _ = env.step(int(action) if np.ndim(action) == 0 else action)
            ret += float(r)
            done = te or tr
        returns.append(ret)
    env.close()
    return float(np.mean(returns))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("algo", choices=["bc", "discrete_cql", "iql", "cql", "awac"])
    p.add_argument("--dataset", required=True, help="a Minari dataset's directory (holding data/)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=5_000)
    p.add_argument("--eval-every", type=int, default=1_000)
    p.add_argument("--env-id", default="CartPole-v1")
    p.add_argument("--offline-steps", type=int, default=None,
                   help="AWAC: gradient steps on the dataset before the online phase (default: all of --steps)")
    p.add_argument("--expectile", type=float, default=0.7, help="IQL: the value network's expectile")
    p.add_argument("--weight-temp", type=float, default=3.0, help="IQL: the advantage weights' inverse temperature")
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="keep the run's state here after every evaluation (d3rlpy's save_model: networks and "
                        "optimisers; the curve and training time) and continue from it when run again; offline only")
    args = p.parse_args()
    offline = args.steps if args.offline_steps is None else args.offline_steps
    if offline % args.eval_every or (args.steps - offline) % args.eval_every:
        p.error(f"--steps {args.steps} (offline {offline}) must be whole multiples of --eval-every {args.eval_every}: "
                "d3rlpy trains whole epochs of that many steps")
    torch.set_num_threads(1)
    d3rlpy.seed(args.seed)
    ds = minari.MinariDataset(str(pathlib.Path(args.dataset) / "data"))
    obs, act, rew, term, trunc = [], [], [], [], []
    for ep in ds.iterate_episodes():
        obs.append(ep.observations[:-1])
        act.append(ep.actions)
        rew.append(ep.rewards)
        term.append(ep.terminations)
        trunc.append(ep.truncations)
    dataset = d3rlpy.dataset.MDPDataset(
        np.concatenate(obs).astype(np.float32), np.concatenate(act), np.concatenate(rew).astype(np.float32),
        np.concatenate(term).astype(np.float32), timeouts=np.concatenate(trunc).astype(np.float32),
        action_space=(d3rlpy.constants.ActionSpace.DISCRETE if args.algo in ("bc", "discrete_cql")
                      else d3rlpy.constants.ActionSpace.CONTINUOUS))
    if args.algo == "bc":
        algo = d3rlpy.algos.DiscreteBCConfig(batch_size=256, learning_rate=1e-3, beta=0.0).create(device="cpu:0")
    elif args.algo == "discrete_cql":
        algo = d3rlpy.algos.DiscreteCQLConfig(learning_rate=1e-3, batch_size=256, gamma=0.99, target_update_interval=500,
                                              alpha=1.0).create(device="cpu:0")
    else:
        # d3rlpy's continuous policies act in [-1, 1]: the action scaler maps the env's bounds
        # there and back, as msrl's policies squash into the bounds themselves
        space = gymnasium.make(args.env_id).action_space
        scaler = d3rlpy.preprocessing.MinMaxActionScaler(minimum=space.low, maximum=space.high)
        if args.algo == "iql":
            algo = d3rlpy.algos.IQLConfig(expectile=args.expectile, weight_temp=args.weight_temp,
                                          action_scaler=scaler).create(device="cpu:0")
        elif args.algo == "awac":
            algo = d3rlpy.algos.AWACConfig(actor_learning_rate=3e-4, critic_learning_rate=3e-4, batch_size=256,
                                           lam=1.0, action_scaler=scaler).create(device="cpu:0")
        else:
            algo = d3rlpy.algos.CQLConfig(alpha_learning_rate=0.0, action_scaler=scaler).create(device="cpu:0")
    state = pathlib.Path(args.state_dir) if args.state_dir else None
    if state is not None:
        if args.steps > offline:
            p.error("--state-dir: an online phase cannot be continued (d3rlpy's online buffer is not kept)")
        if (state / "result.json").exists():  # finished: read back
            print((state / "result.json").read_text().strip())
            return
    train_s, curve, done = 0.0, [], 0
    if state is not None and (state / "progress.json").exists():  # continued: networks, optimisers, curve, clock
        kept = json.loads((state / "progress.json").read_text())
        train_s, curve, done = kept["train_s"], [tuple(c) for c in kept["curve"]], kept["steps"]
        algo.build_with_dataset(dataset)
        algo.load_model(str(state / f"{done}.pt"))
    t0 = time.perf_counter()
    if offline > done:
        for epoch, _ in algo.fitter(dataset, n_steps=offline - done, n_steps_per_epoch=args.eval_every,
                                    show_progress=False, logger_adapter=d3rlpy.logging.NoopAdapterFactory(),
                                    save_interval=10**9):
            train_s += time.perf_counter() - t0
            curve.append((done + epoch * args.eval_every, train_s, evaluate(algo, args.env_id)))
            if state is not None:
                keep_state(state, algo, curve, train_s)
            t0 = time.perf_counter()
    if args.steps > offline:  # AWAC's online phase: the dataset's episodes are the replay buffer's first
        env = gymnasium.make(args.env_id)
        env.reset(seed=args.seed)
        buffer = d3rlpy.dataset.ReplayBuffer(d3rlpy.dataset.InfiniteBuffer(), episodes=dataset.episodes)

        def evaluate_due(algo_: object, epoch: int, total_step: int) -> None:
            nonlocal train_s, t0
            if total_step % args.eval_every == 0:
                train_s += time.perf_counter() - t0
                curve.append((offline + total_step, train_s, evaluate(algo, args.env_id)))
                t0 = time.perf_counter()

        t0 = time.perf_counter()
        algo.fit_online(env, buffer, n_steps=args.steps - offline, n_steps_per_epoch=args.eval_every, update_start_step=0,
                        show_progress=False, logger_adapter=d3rlpy.logging.NoopAdapterFactory(), save_interval=10**9,
                        callback=evaluate_due)
    result = json.dumps({"grad_steps_per_s": args.steps / train_s, "curve": curve, "final_eval": curve[-1][2]})
    if state is not None:
        (state / "result.json").write_text(result)
    print(result)


def keep_state(state: pathlib.Path, algo, curve: list, train_s: float) -> None:
    """Writes the networks and optimisers at the curve's last step (``<step>.pt``), then
    ``progress.json`` naming it (through a rename), then removes the older ``.pt``: a run killed
    while writing leaves its previous state whole."""
    state.mkdir(parents=True, exist_ok=True)
    step = int(curve[-1][0])
    algo.save_model(str(state / f"{step}.pt"))
    (state / "progress.tmp.json").write_text(json.dumps({"steps": step, "curve": curve, "train_s": train_s}))
    (state / "progress.tmp.json").replace(state / "progress.json")
    for old in state.glob("*.pt"):
        if old.name != f"{step}.pt":
            old.unlink()


if __name__ == "__main__":
    main()
