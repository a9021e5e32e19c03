"""Learning quality over many seeds: msrl's shipped algorithms against their peers, whole budget.

For each algorithm and seed, msrl (the shipped config, as ``msrl train`` runs it) and its peer
with the same hyperparameters each train their **whole** env-step budget, evaluating greedily
(20 episodes, envs seeded 10000..10019) every ``eval every`` env steps, and end with a **final
greedy evaluation** of the final weights. Reported per system, as medians with the interquartile
range over seeds:

* ``final eval``: the final greedy evaluation's mean return (what a user gets at the end);
* ``env steps to threshold`` / ``time to threshold``: the first evaluation at or above the
  threshold (training wall time, evaluations and start-up excluded); a seed that never gets
  there counts as infinitely slow;
* ``env steps/s``: env steps over training wall time;
* on the ratio row, the two-sided Mann-Whitney U test's p-value of the final evaluations and of
  the env steps to the threshold (a small p: one system tends to be higher; a large one: the
  difference is within the seeds' spread).

=======  ===========  =========  =========  ===========  =========================================
algo     env          threshold  budget     eval every   peer (same hyperparameters)
=======  ===========  =========  =========  ===========  =========================================
ppo      CartPole-v1  475        300,000    10,000       SB3 PPO (msrl's config)
a2c      CartPole-v1  475        200,000    10,000       SB3 A2C (rl-zoo's, which msrl ships)
pg       CartPole-v1  475        500,000    20,000       Tianshou Reinforce (msrl's settings)
c51      CartPole-v1  475        500,000    10,000       Tianshou C51 (CleanRL's c51.py settings, which msrl ships)
dqn      CartPole-v1  475        100,000    5,120        SB3 DQN (rl-zoo's, which msrl ships)
sac      Pendulum-v1  -200       20,000     2,000        SB3 SAC (rl-zoo's, which msrl ships)
ddpg     Pendulum-v1  -200       20,000     2,000        SB3 DDPG (rl-zoo's, which msrl ships)
td3      Pendulum-v1  -200       20,000     2,000        SB3 TD3 (rl-zoo's, which msrl ships)
ddpg_hc  HalfCheetah  3000       1,000,000  50,000       SB3 TD3, one critic, no smoothing (CleanRL's DDPG settings)
td3_hc   HalfCheetah  3000       1,000,000  50,000       SB3 TD3 (CleanRL's td3_continuous_action.py settings)
impala   CartPole-v1  475        300,000    10,000       RLlib IMPALA (msrl's config), 2 env runners
=======  ===========  =========  =========  ===========  =========================================

The budgets and evaluation intervals are the shipped configs' (``--budget`` overrides them).
msrl's rows run under the config's policy (``single``; IMPALA: ``async_learner`` with 2 actor
processes on Ray). One torch thread per process. The SB3 runs and the evaluation are
``bench/bench_offpolicy.py``'s; the RLlib run is ``bench/bench_rllib.py``'s. RLlib pins an older
gymnasium, so run ``impala`` from an environment that has RLlib (``pip install -e ".[bench,rllib]"``);
Tianshou pins its own numpy/pandas range, so ``pg``'s and ``c51``'s peers run in a Python of
its own (``--tianshou-python``, see ``bench/peer_tianshou_pg.py``)::

    python bench/bench_learning.py ppo a2c dqn sac --seeds $(seq 1 10) --json learning.json
    python bench/bench_learning.py impala --seeds $(seq 1 10) --json impala.json
    python bench/bench_learning.py pg --seeds $(seq 1 10) --tianshou-python /tmp/ts/bin/python
    python bench/bench_learning.py impala --msrl-only --override algorithm.hparams.gamma=0.99   # a variant
    python bench/bench_learning.py td3_halfcheetah --seeds 1 --budget 100000 --eval-every 25000   # a part of CleanRL's 1M

CleanRL's whole 1M env steps on HalfCheetah take ~2.5 h a system on a CPU core: ``--state-dir
DIR`` keeps each run's state there (msrl: its run directory, checkpointed at the config's
``train.checkpoint_every``; SB3: its model and replay buffer after every evaluation) and the same
command run again continues every unfinished run and reads back the finished ones; with
``--msrl-only`` and ``--peer-only`` in two processes the systems run side by side::

    python bench/bench_learning.py td3_halfcheetah --seeds 1 --msrl-only --state-dir hc --json m.json
    python bench/bench_learning.py td3_halfcheetah --seeds 1 --peer-only --state-dir hc --json p.json
    python bench/bench_learning.py td3_halfcheetah --tables-from m.json p.json --plot bench/td3_halfcheetah_learning.png

``ddpg_hc`` and ``td3_hc`` are ``ddpg_halfcheetah`` and ``td3_halfcheetah`` on HalfCheetah-v5.
CleanRL's own scripts (``cleanrl==1.2.0``) run gym 0.23's mujoco-py HalfCheetah, which does not
install beside gymnasium 1.x, so SB3 runs CleanRL's settings instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_offpolicy import TASKS, Task, _quartiles, plot, run_msrl, run_sb3  # noqa: E402

IMPALA = Task("configs/impala_cartpole.yaml", "CartPole-v1", 475.0, 300_000, 10_000, "IMPALA", 16)


def shipped(algo: str) -> Task:
    """``algo``'s task with the budget (``train.total_env_steps``) and evaluation interval
    (``train.eval_every``, env steps) of its shipped config, read from the config itself."""
    from msrl.config import load_config

    task = IMPALA if algo == "impala" else TASKS[algo]
    train = load_config(task.config).train
    return dataclasses.replace(task, budget=train.total_env_steps, eval_every=train.eval_every)


def _peer(algo: str) -> str:
    return {"impala": "RLlib IMPALA", "pg": "Tianshou Reinforce", "c51": "Tianshou C51",
            "ddpg_halfcheetah": "SB3 TD3 as CleanRL's DDPG", "td3_halfcheetah": "SB3 TD3"}.get(algo, f"SB3 {algo.upper()}")


#: the Python that has tianshou, for PG's and C51's peers (``--tianshou-python``)
TIANSHOU_PYTHON = [sys.executable]
#: the algorithms whose peer is Tianshou's, each run by ``bench/peer_tianshou_<algo>.py``
TIANSHOU = ("pg", "c51")


def run_tianshou(algo: str, task: Task, seed: int) -> dict:
    """One seed of Tianshou's ``algo`` (``bench/peer_tianshou_<algo>.py``) on ``task``'s budget,
    in the Python of :data:`TIANSHOU_PYTHON`; its JSON line parsed."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"peer_tianshou_{algo}.py")
    extra = ["--num-envs", str(task.n_envs)] if algo == "pg" else []
    out = subprocess.run([TIANSHOU_PYTHON[0], script, "--seed", str(seed), "--budget", str(task.budget),
                          "--eval-every", str(task.eval_every), "--env-id", task.env_id, *extra],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run_name(algo: str, seed: int, overrides: list[str]) -> str:
    """msrl's run name in a ``--state-dir``: ``<algo>_s<seed>``, and for a config variant a digest
    of its overrides after it, so a variant never continues (or collides with) the shipped run."""
    import hashlib

    tag = hashlib.sha1("\n".join(overrides).encode()).hexdigest()[:8] if overrides else ""
    return f"{algo}_s{seed}" + (f"_{tag}" if tag else "")


def run_seed(algo: str, task: Task, seed: int, runs_dir: str, overrides: list[str] = (),
             peer_too: bool = True, msrl_too: bool = True, state_dir: str | None = None) -> dict[str, dict]:
    """One seed of ``algo``: msrl's run (with config ``overrides``) and, with ``peer_too``, its
    peer's, each with the whole budget (``msrl_too=False``: the peer's alone). ``state_dir``
    (SB3's peers only): each run keeps its state there and continues from it when run again
    (msrl: the run directory ``<algo>_s<seed>``, a variant's with a digest of its ``overrides``;
    SB3: ``sb3_<algo>_s<seed>/``)."""
    if state_dir is not None and (algo == "impala" or algo in TIANSHOU):
        raise SystemExit(f"--state-dir: {algo}'s peer cannot continue a run; it is for the SB3 peers' algorithms")
    sb3_state = os.path.join(state_dir, f"sb3_{algo}_s{seed}") if state_dir else None
    if not msrl_too:
        peer = run_tianshou(algo, task, seed) if algo in TIANSHOU else run_sb3(
            algo, task, seed, whole_budget=True, state_dir=sb3_state)
        return {_peer(algo): peer}
    if algo == "impala":
        import ray

        ours = run_msrl(task, seed, None, runs_dir, ["runtime=ray", *overrides], whole_budget=True)
        if ray.is_initialized():
            ray.shutdown()
        if not peer_too:
            return {"msrl": ours}
        from bench_rllib import run_rllib

        peer = run_rllib(seed, task.eval_every, task.budget, "impala_msrl", whole_budget=True)
        peer = {"time_to_threshold": peer["time_to_475"], "steps_to_threshold": peer["steps_to_475"],
                "sps": peer["sps"], "final_eval": peer["final_eval"], "curve": peer["curve"]}
    else:
        ours = run_msrl(task, seed, None, state_dir or runs_dir, list(overrides), whole_budget=True,
                        resumable=_run_name(algo, seed, overrides) if state_dir else None)
        if not peer_too:
            return {"msrl": ours}
        peer = run_tianshou(algo, task, seed) if algo in TIANSHOU else run_sb3(
            algo, task, seed, whole_budget=True, state_dir=sb3_state)
    return {"msrl": ours, _peer(algo): peer}


def _fmt(q: tuple[float, float, float] | None, digits: int) -> str:
    """``median [Q1, Q3]``; a quartile among the seeds that never reached the threshold is ``never``."""
    if q is None:
        return "never"
    return "{1} [{0}, {2}]".format(*("never" if x == float("inf") else f"{x:.{digits}f}" for x in q))


def _mann_whitney(a: list[dict], b: list[dict], key: str) -> str:
    """The two-sided Mann-Whitney U test of the two systems' ``key`` over seeds (Mann & Whitney
    1947; ``scipy.stats.mannwhitneyu``): whether one tends to be higher than the other, with no
    assumption on the distributions' shape; a seed that never reached the threshold ranks last."""
    from scipy.stats import mannwhitneyu

    x, y = ([float("inf") if r[key] is None else r[key] for r in runs] for runs in (a, b))
    if len(set(x) | set(y)) == 1:
        return "equal on every seed"
    return f"p = {mannwhitneyu(x, y, alternative='two-sided').pvalue:.2f}"


def table(algo: str, task: Task, results: dict[str, list[dict]]) -> str:
    """The Markdown table of one algorithm (see the module docstring)."""
    th = f"{task.threshold:g}"
    lines = [f"| system | final greedy eval: median [IQR] (mean) | reached {th} | env steps to {th}: median [IQR] "
             f"| time to {th} (s): median [IQR] | env steps/s (median) |", "| --- | --- | --- | --- | --- | --- |"]
    for system, runs in results.items():
        final = sorted(r["final_eval"] for r in runs)
        reached = sum(r["steps_to_threshold"] is not None for r in runs)
        lines.append(
            f"| {system} | {_fmt(_quartiles(final), 1)} ({sum(final) / len(final):.1f}) | {reached}/{len(runs)} "
            f"| {_fmt(_quartiles([r['steps_to_threshold'] for r in runs]), 0)} "
            f"| {_fmt(_quartiles([r['time_to_threshold'] for r in runs]), 2)} "
            f"| {_quartiles([r['sps'] for r in runs])[1]:.0f} |")
    peer = _peer(algo)
    if len(results) == 1:  # --msrl-only, --peer-only
        (system, runs), = results.items()
        return "\n".join(lines) + f"\n\n{system}, final greedy eval per seed: " + ", ".join(
            f"{r['final_eval']:.1f}" for r in runs)
    a, b = results["msrl"], results[peer]
    qa, qb = (_quartiles([r["time_to_threshold"] for r in x]) for x in (a, b))
    finite = qa and qb and float("inf") not in (qa[1], qb[1])
    ratio = f"{qa[1] / qb[1]:.2f}x time to {th}" if finite else "n/a (a median seed never got there)"
    sps = _quartiles([r["sps"] for r in a])[1] / _quartiles([r["sps"] for r in b])[1]
    lines.append(f"| msrl / {peer} (Mann-Whitney U) | {_mann_whitney(a, b, 'final_eval')} | "
                 f"| {_mann_whitney(a, b, 'steps_to_threshold')} | {ratio} | {sps:.2f}x throughput |")
    for system, runs in results.items():
        lines.append(f"\n{system}, final greedy eval per seed: " + ", ".join(f"{r['final_eval']:.1f}" for r in runs))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("algos", nargs="+", choices=["ppo", "a2c", "pg", "dqn", "c51", "sac", "ddpg", "td3", "ddpg_halfcheetah",
                                                 "td3_halfcheetah", "impala"])
    p.add_argument("--tianshou-python", default=sys.executable,
                   help="the Python that has tianshou, for pg's and c51's peers (default: this one)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(1, 11)))
    p.add_argument("--budget", type=int, default=None, help="env-step budget of every algorithm (default: the config's)")
    p.add_argument("--eval-every", type=int, default=None, help="env steps between evaluations (default: the config's)")
    p.add_argument("--json", default=None, help="also write the raw results (curves included) here")
    p.add_argument("--override", nargs="+", default=[], metavar="KEY=VALUE",
                   help="config overrides of msrl's runs (e.g. algorithm.hparams.gamma=0.99)")
    p.add_argument("--msrl-only", action="store_true", help="run msrl's rows only (a config variant's seeds)")
    p.add_argument("--peer-only", action="store_true",
                   help="run the peer's rows only (with --msrl-only in another process: both systems at once)")
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="keep every run's state in DIR and continue unfinished runs from it when the same command "
                        "runs again (runs longer than a sitting: the HalfCheetah tasks' 1M env steps); SB3 peers only")
    p.add_argument("--tables-from", nargs="+", default=None, metavar="JSON",
                   help="train nothing: print the tables of these --json files, seeds of one algorithm merged "
                        "(runs of one algorithm split over processes)")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="also draw the evaluation curves and the time to the threshold of every system (one algo)")
    args = p.parse_args()
    if args.msrl_only and args.peer_only:
        p.error("--msrl-only and --peer-only leave nothing to run; give one of them")
    if args.plot and len(args.algos) != 1:
        p.error(f"--plot draws one algorithm's curves; give one algo (got {len(args.algos)})")
    if args.tables_from:
        merged: dict[str, dict] = {}
        for path in args.tables_from:
            with open(path) as f:
                for algo, part in json.load(f).items():
                    m = merged.setdefault(algo, {"task": part["task"], "seeds": [], "results": {}})
                    m["seeds"] += part["seeds"]
                    for system, runs in part["results"].items():
                        m["results"].setdefault(system, []).extend(runs)
        for algo in args.algos:
            m = merged[algo]
            print(f"\n{algo}, seeds {sorted(set(m['seeds']))}: {m['task']}\n\n{table(algo, Task(**m['task']), m['results'])}\n")
            if args.plot:
                plot(args.plot, algo, Task(**m["task"]), m["results"])
        return
    TIANSHOU_PYTHON[0] = args.tianshou_python
    torch.set_num_threads(1)
    everything: dict[str, dict] = {}
    for algo in args.algos:
        task = shipped(algo)
        if args.budget is not None:
            task = dataclasses.replace(task, budget=args.budget)
        if args.eval_every is not None:
            task = dataclasses.replace(task, eval_every=args.eval_every)
        results: dict[str, list[dict]] = ({"msrl": []} if args.msrl_only else {_peer(algo): []} if args.peer_only
                                          else {"msrl": [], _peer(algo): []})
        with tempfile.TemporaryDirectory() as runs_dir:
            for seed in args.seeds:
                for system, r in run_seed(algo, task, seed, runs_dir, args.override, not args.msrl_only,
                                          not args.peer_only, args.state_dir).items():
                    results[system].append(r)
                print(f"{algo} seed {seed}: " + "  ".join(
                    f"{k}: final {v[-1]['final_eval']:.1f}, steps to threshold {v[-1]['steps_to_threshold']}, "
                    f"{v[-1]['sps']:.0f} env steps/s" for k, v in results.items()), flush=True)
        everything[algo] = {"task": dataclasses.asdict(task), "seeds": args.seeds, "results": results}
        print(f"\n{algo} on {task.env_id}, threshold {task.threshold:g}, budget {task.budget}, eval every "
              f"{task.eval_every}; machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
              f"torch {torch.__version__}, seeds {args.seeds}\n\n{table(algo, task, results)}\n", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(everything, f, indent=1)
        if args.plot:
            plot(args.plot, algo, task, results)


if __name__ == "__main__":
    main()
