"""Offline RL against d3rlpy on the same Minari dataset and budget, from datasets msrl makes
itself: BC on CartPole-v1 from an expert's episodes, discrete CQL on CartPole-v1 and IQL, CQL and
AWAC (offline then online) on Pendulum-v1 from a noisy expert's.

===============  ==============  ===============================================  ======  ==========  ====
algo             env             dataset (msrl collect, 100 episodes)             steps   eval every  gate
===============  ==============  ===============================================  ======  ==========  ====
bc               CartPole-v1     the README's PPO main job (seed 1), greedy       5,000   1,000       350
discrete_cql     CartPole-v1     the README's PPO main job (seed 1), epsilon 0.3  5,000   1,000       475
iql              Pendulum-v1     configs/sac_pendulum.yaml (seed 1), noise 0.3    10,000  2,000       -200
cql              Pendulum-v1     configs/sac_pendulum.yaml (seed 1), noise 0.3    10,000  2,000       -700
awac             Pendulum-v1     configs/sac_pendulum.yaml (seed 1), noise 0.3    10,000  1,000       -200
iql_halfcheetah  HalfCheetah-v5  configs/sac_halfcheetah.yaml (100k), noise 0.2   50,000  10,000      -
cql_halfcheetah  HalfCheetah-v5  configs/sac_halfcheetah.yaml (100k), noise 0.2   50,000  10,000      -
===============  ==============  ===============================================  ======  ==========  ====

The HalfCheetah-v5 tasks (``iql_halfcheetah``, ``cql_halfcheetah``) learn from a dataset of
msrl's own SAC (CleanRL's settings) after 100k of its env steps (greedy: about 6,800) acting with
Gaussian noise: their figure is the return against the dataset's own and d3rlpy's (RLlib has no
gate there).

AWAC trains offline then online: the first half of its gradient steps on the dataset alone, then
each iteration one env step (one env) and one gradient step, the env's transitions added to the
replay buffer that starts with the dataset's (d3rlpy: ``fit`` then ``fit_online`` on a
``ReplayBuffer`` holding the dataset's episodes).

1. The expert trains (``msrl train``) and ``msrl collect`` writes 100 of its episodes under a
   datasets root of the benchmark's own (``--dataset DIR`` reuses a dataset instead).
2. Per seed, msrl's algorithm (its shipped config, the dataset by path) and d3rlpy's
   (``bench/peer_d3rlpy.py``: ``DiscreteBC``, ``DiscreteCQL``, ``IQL``, ``CQL``, ``AWAC``; in a
   Python that has d3rlpy: ``--d3rlpy-python``) train the same number of gradient steps, each evaluated greedily every
   ``eval every`` gradient steps and at the end (20 episodes, envs seeded 10000..10019;
   evaluation time out of the clock).

msrl trains in the benchmark's process, which is msrl's own as the ``msrl train`` command's is
(:func:`msrl.runtime.startup.own_process`, from be3f20f: its heap kept between gradient steps); the
figures of earlier commits were measured without it.

Reported per system: the final greedy evaluation (median and IQR over seeds, the seeds at or
above the task's gate: RLlib's for BC, IQL and CQL; CartPole's solved threshold, 475, for
discrete CQL; the online learners' Pendulum gate, -200, for AWAC), the seeds that reached the
gate at some evaluation (RLlib's stop rule: its offline examples stop training at the first
evaluation at the gate) with the median gradient steps of the first, and gradient steps per
second of training time; the ratio row msrl / d3rlpy. One torch thread per process::

    python bench/bench_offline.py bc --seeds 1 2 3 --d3rlpy-python /tmp/d3/bin/python
    python bench/bench_offline.py discrete_cql --seeds 1 2 3 --d3rlpy-python /tmp/d3/bin/python
    python bench/bench_offline.py iql --seeds 1 2 3 --d3rlpy-python /tmp/d3/bin/python
    python bench/bench_offline.py cql --seeds 1 2 3 --d3rlpy-python /tmp/d3/bin/python
    python bench/bench_offline.py awac --seeds 1 2 3 --d3rlpy-python /tmp/d3/bin/python --plot bench/awac_learning.png
    python bench/bench_offline.py iql_halfcheetah --seeds 1 --d3rlpy-python /tmp/d3/bin/python
    python bench/bench_offline.py cql_halfcheetah --seeds 1 --dataset DIR --d3rlpy-python /tmp/d3/bin/python --parallel

A run longer than a sitting (CQL on HalfCheetah: 2.5-3 h a system at 50,000 gradient steps on a
CPU core) keeps its state with ``--state-dir DIR`` (msrl: its run directory, checkpointed at every
evaluation, continued exactly by ``resume``; d3rlpy: its networks and optimisers by
``save_model``, continued by ``load_model``) and the same command run again continues it::

    python bench/bench_offline.py cql_halfcheetah --seeds 1 --dataset DIR --d3rlpy-python PY --parallel --state-dir hc

``--json FILE`` keeps the results, written again after every seed; ``--from-json FILE [FILE ...]
--plot PNG`` tabulates and plots them again, joining the seeds of runs made in separate sittings on
one dataset (ten seeds of a short task, a few at a time)::

    python bench/bench_offline.py awac --seeds 1 2 3 4 5 --dataset DIR --d3rlpy-python PY --parallel --json a.json
    python bench/bench_offline.py awac --seeds 6 7 8 9 10 --dataset DIR --d3rlpy-python PY --parallel --json b.json
    python bench/bench_offline.py awac --from-json a.json b.json --plot bench/awac_learning.png
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import signal
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_offpolicy import _quartiles, kept_run  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: algo -> the expert's config, the dataset's id and noise, msrl's config, gradient steps,
#: evaluation interval, RLlib's gate, the env and d3rlpy's algorithm
TASKS = {
    "bc": dict(expert="ppo_cartpole.yaml", dataset="msrl/cartpole/expert-v0", noise=0.0, config="bc_cartpole.yaml",
               steps=5_000, eval_every=1_000, gate=350.0, env="CartPole-v1", peer="d3rlpy DiscreteBC"),
    "discrete_cql": dict(expert="ppo_cartpole.yaml", dataset="msrl/cartpole/ppo-noisy-v0", noise=0.3,
                         config="discrete_cql_cartpole.yaml", steps=5_000, eval_every=1_000, gate=475.0, env="CartPole-v1",
                         peer="d3rlpy DiscreteCQL"),
    "iql": dict(expert="sac_pendulum.yaml", dataset="msrl/pendulum/sac-noisy-v0", noise=0.3, config="iql_pendulum.yaml",
                steps=10_000, eval_every=2_000, gate=-200.0, env="Pendulum-v1", peer="d3rlpy IQL"),
    "cql": dict(expert="sac_pendulum.yaml", dataset="msrl/pendulum/sac-noisy-v0", noise=0.3, config="cql_pendulum.yaml",
                steps=10_000, eval_every=2_000, gate=-700.0, env="Pendulum-v1", peer="d3rlpy CQL"),
    # the first half of the gradient steps on the dataset alone, then one env step and one gradient step an iteration
    "awac": dict(expert="sac_pendulum.yaml", dataset="msrl/pendulum/sac-noisy-v0", noise=0.3, config="awac_pendulum.yaml",
                 steps=10_000, eval_every=1_000, gate=-200.0, env="Pendulum-v1", peer="d3rlpy AWAC", online_half=True),
    "iql_halfcheetah": dict(expert="sac_halfcheetah.yaml", expert_steps=100_000, dataset="msrl/halfcheetah/sac-noisy-v0",
                            noise=0.2, config="iql_halfcheetah.yaml", steps=50_000, eval_every=10_000, gate=float("nan"),
                            env="HalfCheetah-v5", peer="d3rlpy IQL", d3rlpy="iql"),
    "cql_halfcheetah": dict(expert="sac_halfcheetah.yaml", expert_steps=100_000, dataset="msrl/halfcheetah/sac-noisy-v0",
                            noise=0.2, config="cql_halfcheetah.yaml", steps=50_000, eval_every=10_000, gate=float("nan"),
                            env="HalfCheetah-v5", peer="d3rlpy CQL", d3rlpy="cql"),
}


def expert_dataset(algo: str, workdir: str) -> str:
    """Trains ``algo``'s expert (seed 1) and writes 100 of its episodes as a Minari dataset under
    ``workdir``; returns the dataset's directory."""
    import msrl
    from msrl.run.collect import collect

    task = TASKS[algo]
    budget = {"train__total_env_steps": task["expert_steps"]} if "expert_steps" in task else {}
    run = msrl.train(os.path.join(ROOT, "configs", task["expert"]), runs_dir=os.path.join(workdir, "runs"),
                     train__progress=False, seed=1, **budget)
    print(f"expert: {run.run_dir}, greedy evaluation {run.eval_mean:.1f}", flush=True)
    return str(collect([run.run_dir], task["dataset"], 100, noise=task["noise"], seed=0,
                       root=os.path.join(workdir, "datasets")))


def run_msrl(algo: str, dataset: str, seed: int, steps: int, eval_every: int, workdir: str,
             state_dir: str | None = None) -> dict:
    """One seed of msrl's ``algo`` on ``dataset``; its final evaluation, gradient steps/s and curve.

    ``state_dir``: the run is kept there as ``<algo>_s<seed>``, checkpointed at every evaluation;
    a run left unfinished continues from its last checkpoint (``resume``: exactly, training
    time and curve carried over), a finished one is read back without training."""
    import csv

    import msrl

    online = {"algorithm__hparams__offline_steps": steps // 2} if TASKS[algo].get("online_half") else {}
    config = os.path.join(ROOT, "configs", TASKS[algo]["config"])
    kw = dict(seed=seed, dataset__id=None, dataset__path=dataset, train__total_gradient_steps=steps,
              train__eval_every=eval_every, train__progress=False, **online)
    if state_dir is None:
        r = msrl.train(config, runs_dir=os.path.join(workdir, algo), train__checkpoint_every=10**9, **kw)
        run_dir, time_s, iterations, final = r.run_dir, r.time_s, r.iterations, r.eval_mean
    else:
        run_dir = pathlib.Path(state_dir) / f"{algo}_s{seed}"
        done = kept_run(run_dir, lambda resume: msrl.train(config, resume=resume, runs_dir=state_dir, name=run_dir.name,
                                                           train__checkpoint_every=eval_every, **kw))
        time_s, iterations, final = done["time_s"], done["iterations"], done["mean_return"]
    with open(run_dir / "metrics.csv") as f:
        curve = [(int(row["gradient_steps"]), float(row["time_s"]), float(row["eval/mean_return"]))
                 for row in csv.DictReader(f) if row.get("eval/mean_return")]
    return {"final_eval": final, "grad_steps_per_s": iterations / time_s, "curve": curve}


def peer_settings(algo: str) -> list[str]:
    """The command-line flags that give ``bench/peer_d3rlpy.py`` the settings of msrl's config for
    ``algo`` where d3rlpy's defaults differ by task: IQL's expectile and inverse temperature
    (``--expectile``, ``--weight-temp``; Pendulum's are RLlib's, HalfCheetah's the paper's). Empty
    for the other algorithms, whose peer settings are fixed in ``peer_d3rlpy.py``."""
    if TASKS[algo].get("d3rlpy", algo) != "iql":
        return []
    from msrl.config import load_config

    hparams = load_config(os.path.join(ROOT, "configs", TASKS[algo]["config"])).algorithm.hparams
    return ["--expectile", str(hparams["expectile"]), "--weight-temp", str(hparams["beta"])]


def start_d3rlpy(algo: str, python: str, dataset: str, seed: int, steps: int, eval_every: int, workdir: str,
                 state_dir: str | None = None) -> tuple[subprocess.Popen, str]:
    """Starts one seed of d3rlpy's ``algo`` (``bench/peer_d3rlpy.py``) in ``python`` as a
    background process; returns it and the file its stderr goes to (:func:`d3rlpy_result`).
    ``state_dir``: the peer keeps its state in ``d3rlpy_<algo>_s<seed>/`` there and continues it."""
    peer = TASKS[algo].get("d3rlpy", algo)
    keep = ["--state-dir", os.path.join(state_dir, f"d3rlpy_{algo}_s{seed}")] if state_dir else []
    err = os.path.join(workdir, f"d3rlpy_{algo}_{seed}.err")
    with open(err, "w") as f:
        proc = subprocess.Popen([python, os.path.join(HERE, "peer_d3rlpy.py"), peer, "--dataset", dataset, "--seed",
                                 str(seed), "--steps", str(steps), "--eval-every", str(eval_every), "--env-id",
                                 TASKS[algo]["env"],
                                 *(["--offline-steps", str(steps // 2)] if TASKS[algo].get("online_half") else []),
                                 *peer_settings(algo), *keep],
                                stdout=subprocess.PIPE, stderr=f, text=True)
    return proc, err


def stop_peer(proc: subprocess.Popen) -> None:
    """Kills a :func:`start_d3rlpy` process and reaps it (the benchmark stopping or msrl's seed
    failing: no peer left training beside the next run)."""
    proc.kill()
    proc.wait()


def d3rlpy_result(proc: subprocess.Popen, err: str) -> dict:
    """Waits for a :func:`start_d3rlpy` process; its JSON line.

    Raises:
        RuntimeError: the peer failed (the tail of its stderr in the message).
    """
    try:
        out, _ = proc.communicate()
    except BaseException:  # the benchmark stopped (Ctrl-C, SIGTERM): the peer stops with it
        stop_peer(proc)
        raise
    if proc.returncode != 0:
        with open(err) as f:
            raise RuntimeError(f"d3rlpy's run failed (exit {proc.returncode}):\n{f.read()[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def run_d3rlpy(algo: str, python: str, dataset: str, seed: int, steps: int, eval_every: int, workdir: str,
               state_dir: str | None = None) -> dict:
    """One seed of d3rlpy's ``algo`` (``bench/peer_d3rlpy.py``) in ``python``, to its end."""
    return d3rlpy_result(*start_d3rlpy(algo, python, dataset, seed, steps, eval_every, workdir, state_dir))


def first_reach(curve: list, gate: float) -> int | None:
    """The gradient steps of the first evaluation of ``curve`` (``[(gradient_steps, time_s,
    mean_return), ...]``) at or above ``gate``, RLlib's stop rule for its offline examples (it stops
    training there); ``None`` if none reached it."""
    return next((int(c[0]) for c in curve if c[2] >= gate), None)


def table(algo: str, results: dict[str, list[dict]]) -> str:
    """The markdown table of the seeds' results (and the ratio row): the final evaluation, the
    seeds whose final evaluation is at or above the task's gate, the seeds that reached it at
    some evaluation (:func:`first_reach`, with the median gradient steps of the first; a seed that
    never did counts as infinitely slow), gradient steps/s."""
    gate = TASKS[algo]["gate"]
    gated = gate == gate  # (NaN: no gate)
    lines = [f"| system | final greedy eval: median [IQR] (mean) | {f'final >= {gate:g}' if gated else 'gate'} "
             f"| {f'an evaluation >= {gate:g} (first at, median)' if gated else '-'} | gradient steps/s (median) |",
             "| --- | --- | --- | --- | --- |"]
    med = {}
    for system, runs in results.items():
        finals = [r["final_eval"] for r in runs]
        q1, m, q3 = _quartiles(finals)
        sps = _quartiles([r["grad_steps_per_s"] for r in runs])[1]
        med[system] = sps
        at = "-"
        if gated:
            reached = [first_reach(r["curve"], gate) for r in runs]
            first = _quartiles(reached)  # None: no seed reached it; median inf: half or more did not
            at = f"{sum(x is not None for x in reached)}/{len(runs)}" + (
                f" ({first[1]:,.0f})" if first and first[1] < float("inf") else "")
        lines.append(f"| {system} | {m:.1f} [{q1:.1f}, {q3:.1f}] ({sum(finals) / len(finals):.1f}) | "
                     f"{f'{sum(f >= gate for f in finals)}/{len(finals)}' if gated else '-'} | {at} | {sps:.0f} |")
    if len(med) == 2:
        lines.append(f"| msrl / d3rlpy | | | | {med['msrl'] / med[TASKS[algo]['peer']]:.2f}x |")
    for system, runs in results.items():
        lines.append(f"\n{system}, final greedy eval per seed: " + ", ".join(f"{r['final_eval']:.1f}" for r in runs))
    return "\n".join(lines)


def plot(path: str, algo: str, results: dict[str, list[dict]], steps: int) -> None:
    """Greedy evaluation return vs gradient steps: one thin line per seed, the median bold, one
    colour per system; the task's gate dashed (AWAC's online phase shaded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    task = TASKS[algo]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (system, runs), colour in zip(results.items(), ("tab:blue", "tab:orange")):
        grid = sorted({int(c[0]) for run in runs for c in run["curve"]})
        rows = []
        for run in runs:
            xs, ys = [c[0] for c in run["curve"]], [c[2] for c in run["curve"]]
            ax.plot(xs, ys, color=colour, alpha=0.25, lw=0.8)
            by_step = dict(zip(xs, ys))
            rows.append([by_step.get(g, np.nan) for g in grid])
        if rows:
            ax.plot(grid, np.nanmedian(np.array(rows, dtype=float), axis=0), color=colour, lw=2,
                    label=f"{system} (median of {len(runs)})")
    ax.axhline(task["gate"], color="grey", ls="--", lw=0.8)
    if task.get("online_half"):
        ax.axvspan(steps // 2, steps, color="grey", alpha=0.08, label="online phase")
    ax.set(xlabel="gradient steps", ylabel="greedy evaluation return (20 episodes)",
           title=f"{algo} on {task['env']} from {task['dataset']}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_json(path: str, algo: str, seeds: list[int], steps: int, results: dict[str, list[dict]]) -> None:
    """Writes the finished seeds' results to ``path`` whole: into a temporary file beside it, then renamed
    over it, so that a run stopped while writing leaves the previous seeds' file, never half of one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"algo": algo, "seeds": seeds, "steps": steps, "results": results}, f, indent=1)
    os.replace(tmp, path)


def merge_json(paths: list[str]) -> dict:
    """The ``--json`` files of ``paths`` as one: their seeds and each system's runs joined in order.

    Raises:
        ValueError: the files hold different tasks or gradient-step budgets, different systems, or a
            seed twice.
    """
    merged: dict = {}
    for path in paths:
        with open(path) as f:
            saved = json.load(f)
        if not merged:
            merged = {"algo": saved["algo"], "seeds": list(saved["seeds"]), "steps": saved["steps"],
                      "results": {k: list(v) for k, v in saved["results"].items()}}
            continue
        for key in ("algo", "steps"):
            if saved[key] != merged[key]:
                raise ValueError(f"{path} has {key} {saved[key]!r}, {paths[0]} has {merged[key]!r}")
        if set(saved["results"]) != set(merged["results"]):
            raise ValueError(f"{path} has the systems {sorted(saved['results'])}, {paths[0]} has "
                             f"{sorted(merged['results'])}")
        twice = set(saved["seeds"]) & set(merged["seeds"])
        if twice:
            raise ValueError(f"{path} repeats seeds {sorted(twice)}")
        merged["seeds"] += saved["seeds"]
        for k, v in saved["results"].items():
            merged["results"][k] += v
    return merged


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("algo", choices=sorted(TASKS))
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=None, help="gradient steps of each run (default: the task's)")
    p.add_argument("--dataset", default=None, help="a Minari dataset's directory to use instead of making one")
    p.add_argument("--d3rlpy-python", default=None, help="the Python that has d3rlpy (none: msrl alone)")
    p.add_argument("--parallel", action="store_true",
                   help="run d3rlpy's seed beside msrl's (one core each; for the long HalfCheetah tasks)")
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="keep every run's state in DIR and continue unfinished runs from it when the same command runs "
                        "again (runs longer than a sitting: CQL on HalfCheetah); not for awac's online phase")
    p.add_argument("--json", default=None, help="write the results here, again after every seed (a stopped run "
                                               "keeps the seeds it finished)")
    p.add_argument("--plot", default=None, help="write the learning curves here (PNG)")
    p.add_argument("--from-json", default=None, nargs="+", metavar="JSON",
                   help="plot and tabulate --json files of earlier runs (one task, same steps; their seeds joined) "
                        "instead of running")
    args = p.parse_args()
    if args.from_json:
        try:
            saved = merge_json(args.from_json)
        except ValueError as e:
            p.error(f"--from-json: {e}")
        print(table(args.algo, saved["results"]))
        if args.plot:
            plot(args.plot, args.algo, saved["results"], saved["steps"])
        return
    torch.set_num_threads(1)
    # the benchmark's process is msrl's own, as the ``msrl train`` command's is: its figures are the command's
    from msrl.runtime.startup import own_process

    own_process()
    # SIGTERM (kill, a session's end) stops the benchmark as Ctrl-C does: its d3rlpy process is stopped too
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    task = TASKS[args.algo]
    steps, eval_every, peer = args.steps or task["steps"], task["eval_every"], task["peer"]
    if steps % eval_every or (task.get("online_half") and (steps // 2) % eval_every):
        p.error(f"--steps {steps}: {args.algo} is evaluated every {eval_every} gradient steps; give a multiple of it"
                + (" in each half" if task.get("online_half") else ""))
    if args.state_dir and task.get("online_half"):
        p.error(f"--state-dir: {args.algo}'s online phase cannot continue a run (d3rlpy's online buffer is not kept)")
    if args.state_dir and not args.dataset:
        p.error("--state-dir needs --dataset: a continued run must read the dataset it started on")
    st = args.state_dir
    with tempfile.TemporaryDirectory() as workdir:
        dataset = args.dataset or expert_dataset(args.algo, workdir)
        results: dict[str, list[dict]] = {"msrl": []}
        if args.d3rlpy_python:
            results[peer] = []
        for seed in args.seeds:
            if args.d3rlpy_python and args.parallel:  # d3rlpy's seed on the other core while msrl's runs
                proc = start_d3rlpy(args.algo, args.d3rlpy_python, dataset, seed, steps, eval_every, workdir, st)
                try:
                    results["msrl"].append(run_msrl(args.algo, dataset, seed, steps, eval_every, workdir, st))
                except BaseException:  # msrl's run failed or the benchmark stopped: the peer stops with it
                    stop_peer(proc[0])
                    raise
                results[peer].append(d3rlpy_result(*proc))
            else:
                results["msrl"].append(run_msrl(args.algo, dataset, seed, steps, eval_every, workdir, st))
                if args.d3rlpy_python:
                    results[peer].append(run_d3rlpy(args.algo, args.d3rlpy_python, dataset, seed, steps, eval_every,
                                                    workdir, st))
            print(f"seed {seed}: " + "  ".join(f"{k}: final {v[-1]['final_eval']:.1f}, {v[-1]['grad_steps_per_s']:.0f} "
                                                 "gradient steps/s" for k, v in results.items()), flush=True)
            if args.json:
                write_json(args.json, args.algo, args.seeds[:len(results["msrl"])], steps, results)
        print(f"\n{args.algo} on {task['env']} from {dataset}, {steps} gradient steps; machine: "
              f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, seeds "
              f"{args.seeds}\n\n{table(args.algo, results)}\n", flush=True)
        if args.plot:
            plot(args.plot, args.algo, results, steps)


if __name__ == "__main__":
    main()
