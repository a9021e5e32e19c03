"""Cooperative MARL: QMIX, VDN and independent Q-learners (``qmix``'s ``mixer: qmix | vdn | none``,
one file) on the QMIX paper's two-step game and on MPE's simple_spread beside MAPPO.

``two_step``: the two-step cooperative matrix game (Rashid et al. 2018, Section 6.1;
``tests/two_step_game.py``), trained from uniformly random play as the paper does; the greedy
team return of each mixer (the optimum 8 needs a decomposition that represents game 2B's
payoffs; an additive one settles for 2A's 7)::

    python bench/bench_marl.py two_step --seeds 1 2 3

``matching``: MADDPG on a one-step cooperative game (``tests/matching_game.py``): with Box actions
each agent must find its own target (team return 0 at best), with Discrete ones both must
coordinate on the better of two equilibria (2.0; the other pays 1.0)::

    python bench/bench_marl.py matching --seeds 1 2 3

``adversary``: MADDPG on MPE's simple_adversary (2 good agents, one adversary; continuous
actions; ``configs/maddpg_simple_adversary.yaml``), then 100 episodes of each matchup of trained
and uniformly random sides: the adversary's and a good agent's mean return (the good agents share
theirs). Trained good agents should earn more than random ones against either adversary, and a
trained adversary more than a random one against either team::

    python bench/bench_marl.py adversary --seeds 1 --budget 300000

``spread``: MPE's simple_spread (3 agents, 25 steps), each algorithm as ``msrl train`` runs its
shipped config, and a uniform random policy measured in the same run.

Reported per algorithm and seed: the training return (the team's: the 3 agents' rewards summed
over the episode; the mean of the last 20 iterations' finished episodes), the final greedy
evaluation (20 episodes; MAPPO's greedy actions, QMIX's argmax ``Q_i``), env steps/s and the
training time. One torch thread per process::

    python bench/bench_marl.py spread --algos qmix vdn iql maddpg mappo --seeds 1 2 3 --budget 1000000 --json marl.json

The peer on the same task and budget is ``bench/peer_torchrl_marl.py`` (TorchRL's QMIX, VDN and
MADDPG), run in its own venv beside this one.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: name -> (config, overrides)
ALGOS = {
    "qmix": ("qmix_simple_spread.yaml", {"algorithm__hparams__mixer": "qmix"}),
    "vdn": ("qmix_simple_spread.yaml", {"algorithm__hparams__mixer": "vdn"}),
    "iql": ("qmix_simple_spread.yaml", {"algorithm__hparams__mixer": "none"}),
    "mappo": ("mappo_simple_spread.yaml", {}),
    "maddpg": ("maddpg_simple_spread.yaml", {}),
    # the paper's actor loss (the other agents' replayed actions); the config moves them with current ones
    "maddpg_replayed": ("maddpg_simple_spread.yaml", {"algorithm__hparams__actor_actions": "replayed"}),
}


def random_policy_return(episodes: int = 200, seed: int = 0) -> float:
    """The team return of uniformly random actions on the configs' simple_spread (3 agents, 25 steps)."""
    from mpe2 import simple_spread_v3

    env = simple_spread_v3.parallel_env(N=3, local_ratio=0.5, max_cycles=25, continuous_actions=False)
    rng, total = np.random.default_rng(seed), []
    for k in range(episodes):
        env.reset(seed=seed + k)
        ret = 0.0
        while env.agents:
            _, rew, _, _, _ = env.step({a: int(rng.integers(env.action_space(a).n)) for a in env.agents})
            ret += sum(rew.values())
        total.append(ret)
    return float(np.mean(total))


def run(algo: str, seed: int, budget: int, eval_every: int, workdir: str) -> dict:
    """One seed of ``algo``: its curve of training returns, evaluations, and the final figures."""
    import msrl

    config, over = ALGOS[algo]
    r = msrl.train(os.path.join(ROOT, "configs", config), runs_dir=workdir, seed=seed, train__total_env_steps=budget,
                   train__progress=False, train__eval_every=eval_every, train__checkpoint_every=10**9,
                   eval__episodes=20, **over)
    curve, evals, last = [], [], []
    with open(r.run_dir / "metrics.csv") as f:
        for row in csv.DictReader(f):
            ret, ev = row.get("charts/episodic_return"), row.get("eval/mean_return")
            if ret and ret != "nan":
                curve.append((int(row["env_steps"]), float(ret)))
            if ev and ev != "nan":
                evals.append((int(row["env_steps"]), float(ev)))
    last = [x for _, x in curve[-20:]]
    return {"algo": algo, "seed": seed, "curve": curve, "evals": evals, "train_return_last20": float(np.mean(last)),
            "final_eval": r.eval_mean, "sps": r.env_steps / r.time_s, "time_s": r.time_s}


#: the two-step game's settings: uniform exploration throughout (the paper's), whole 2-step episodes
TWO_STEP = {"env__id": "pettingzoo/two_step_game", "env__kwargs": {}, "algorithm__hparams__episode_limit": 2,
            "algorithm__hparams__steps_per_iteration": 2, "algorithm__hparams__learning_starts": 64,
            "algorithm__hparams__start_e": 1.0, "algorithm__hparams__end_e": 1.0, "algorithm__hparams__hidden_dim": 32,
            "algorithm__hparams__target_network_frequency": 200, "algorithm__hparams__buffer_size": 500,
            "algorithm__hparams__gradient_steps": 4, "train__total_env_steps": 8000, "train__eval_every": 0,
            "eval__episodes": 2, "train__progress": False}


def two_step(seeds: list[int]) -> dict:
    """Each mixer's greedy team return on the two-step game, per seed."""
    import msrl

    sys.path.insert(0, os.path.join(ROOT, "tests"))  # the game's PettingZoo module
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mixer in ("qmix", "vdn", "none"):
            out[mixer] = [msrl.train(os.path.join(ROOT, "configs", "qmix_simple_spread.yaml"), runs_dir=tmp, seed=seed,
                                     algorithm__hparams__mixer=mixer, **TWO_STEP).eval_mean for seed in seeds]
            print(f"two-step game, mixer {mixer}: greedy team return {out[mixer]} (seeds {seeds}; optimum 8)", flush=True)
    return out


#: the matching game's settings: one-step episodes of 8 envs, an update per iteration, the paper's
#: actor loss (with the config's ``current``: the discrete game's worse equilibrium on seed 2 of
#: 1-3, the box game -0.0011 / -0.0103 / -0.0137)
MATCHING = {"env__id": "pettingzoo/matching_game", "algorithm__hparams__steps_per_iteration": 1,
            "algorithm__hparams__learning_starts": 64, "algorithm__hparams__batch_size": 64,
            "algorithm__hparams__hidden_sizes": [16, 16], "algorithm__hparams__gradient_steps": 1, "env__num_envs": 8,
            "train__total_env_steps": 4000, "train__eval_every": 0, "eval__episodes": 2, "train__progress": False,
            "algorithm__hparams__actor_actions": "replayed"}


def matching(seeds: list[int]) -> dict:
    """MADDPG's greedy team return on the matching game, Box and Discrete actions, per seed."""
    import msrl

    sys.path.insert(0, os.path.join(ROOT, "tests"))  # the game's PettingZoo module
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, continuous in (("box", True), ("discrete", False)):
            out[kind] = [msrl.train(os.path.join(ROOT, "configs", "maddpg_simple_spread.yaml"), runs_dir=tmp, seed=seed,
                                    env__kwargs={"continuous": continuous}, **MATCHING).eval_mean for seed in seeds]
            best = "0" if continuous else "2.0"
            print(f"matching game, {kind} actions: greedy team return {[round(x, 4) for x in out[kind]]} (seeds {seeds}; "
                  f"best {best})", flush=True)
    return out


def adversary(seeds: list[int], budget: int) -> dict:
    """MADDPG on simple_adversary, then each matchup's per-side returns (see the module docstring)."""
    import msrl
    from msrl.envs.single_env import make_single_env

    out = {}
    kwargs = {"N": 2, "max_cycles": 25, "continuous_actions": True}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            r = msrl.train(os.path.join(ROOT, "configs", "maddpg_simple_adversary.yaml"), runs_dir=tmp, seed=seed,
                           train__total_env_steps=budget, train__eval_every=0, train__progress=False,
                           train__checkpoint_every=10**9)
            policy = msrl.load(r.run_dir)
            env = make_single_env("pettingzoo/mpe2.simple_adversary_v3", kwargs, ["pad_observations"])
            adv = env.agents.index("adversary_0")
            rng = np.random.default_rng(1000 + seed)
            table = {}
            for trained_team in (True, False):
                for trained_adversary in (True, False):
                    totals = np.zeros(len(env.agents))
                    for k in range(100):
                        obs, _ = env.reset(seed=10_000 + k)
                        done = False
                        while not done:
                            action = policy.act(obs)
                            random = rng.uniform(0.0, 1.0, action.shape).astype(np.float32)
                            for i in range(len(env.agents)):
                                if (i == adv and not trained_adversary) or (i != adv and not trained_team):
                                    action[i] = random[i]
                            obs, reward, terminated, truncated, _ = env.step(action)
                            totals += reward
                            done = terminated or truncated
                    key = f"team {'trained' if trained_team else 'random'} vs adversary " \
                          f"{'trained' if trained_adversary else 'random'}"
                    good = [i for i in range(len(env.agents)) if i != adv][0]
                    table[key] = {"adversary": totals[adv] / 100, "good_agent": totals[good] / 100}
                    print(f"simple_adversary seed {seed}, {key}: adversary {totals[adv] / 100:.2f}, good agent "
                          f"{totals[good] / 100:.2f} (mean return, 100 episodes)", flush=True)
            out[seed] = table
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", choices=["two_step", "matching", "adversary", "spread"])
    p.add_argument("--algos", nargs="+", default=["qmix", "vdn", "iql"], choices=list(ALGOS))
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--budget", type=int, default=1_000_000)
    p.add_argument("--eval-every", type=int, default=250_000)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
          f"command: {' '.join(sys.argv)}", flush=True)
    if args.task in ("two_step", "matching", "adversary"):
        results = {"two_step": lambda: two_step(args.seeds), "matching": lambda: matching(args.seeds),
                   "adversary": lambda: adversary(args.seeds, args.budget)}[args.task]()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f)
        return
    results = {"random": random_policy_return(), "runs": []}
    print(f"uniform random policy: team return {results['random']:.1f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for algo in args.algos:
                res = run(algo, seed, args.budget, args.eval_every, tmp)
                results["runs"].append(res)
                print(f"{algo} seed {seed}: training return (last 20 iterations) {res['train_return_last20']:.1f}, "
                      f"final greedy eval {res['final_eval']:.1f}, evals {[(s, round(v, 1)) for s, v in res['evals']]}, "
                      f"{res['sps']:.0f} env steps/s, {res['time_s']:.0f} s", flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(results, f)


if __name__ == "__main__":
    main()
