"""DreamerV3 against RLlib's DreamerV3 in the same run, same model size, training ratio, learning
rates and env-step budget, the two systems side by side (each on a core of its own): the training
return (both systems: the mean of the last 10 finished episodes, RLlib's read from the env's own
episodes) against env steps and training time, env steps/s, and msrl's final greedy evaluation.

``--env cartpole``: CartPole-v1, msrl's ``configs/dreamerv3_cartpole.yaml`` (RLlib's own gate,
``tuned_examples/dreamerv3/cartpole_dreamerv3.py``: the mean return of the last 100 training
episodes -- its ``metrics_num_episodes_for_smoothing`` -- reaches 450 within 10M env steps, XS at
ratio 1024; this benchmark's window is 10 episodes). ``--env pong``: Atari Pong from 64x64 grayscale frames, one a step (msrl's
``configs/dreamerv3_pong.yaml``, its ``atari64`` wrapper; RLlib's
``wrap_atari_for_new_api_stack(dim=64, framestack=None)`` on ``ALE/Pong-v5`` with
``frameskip=1``), learning from the first 1,024 env steps in both (RLlib's start: one batch of
16 x 64 stored).

msrl runs the config with ``model_size``, ``train_ratio``, the learning rates and the budget
overridden where given; RLlib runs ``bench/peer_rllib_dreamerv3.py`` with the same size, ratio and
learning rates (the config's unless overridden; its defaults otherwise: batch 16 x 64, horizon
15, gamma 0.997, one env) in a Python that has ``ray[rllib]`` (and ``ale-py`` for Pong;
``--rllib-python``). RLlib's DreamerV3 has no replay value loss (the 2024 code's ``repval``, msrl's
``replay_value_scale``, 0.3 in the CartPole config): ``--replay-value-scale 0`` runs msrl's
without it, the two algorithms alike. At RLlib's XS size and ratio 1024 an update takes seconds of one CPU core
here (both systems); the XS figure belongs to a GPU machine::

    python bench/bench_dreamerv3.py --budget 7000 --seeds 1 --train-ratio 1024 --rllib-python /tmp/rl/bin/python
    python bench/bench_dreamerv3.py --env pong --budget 5000 --seeds 1 --rllib-python /tmp/rl/bin/python
    python bench/bench_dreamerv3.py --env pong --budget 1300 --train-ratio 1024 --device cuda:0   # msrl on a GPU

``--runs DIR...`` trains nothing: it reads runs made with ``msrl train`` (their ``metrics.csv``)
and prints RLlib's gate for each -- the mean of the last ``GATE_WINDOW`` (100) training episodes
at the run's end, the first env step at which a full window's mean reached ``--threshold`` --
and its last greedy evaluations::

    python bench/bench_dreamerv3.py --runs runs/dreamerv3_cartpole
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


LRS = ("world_model_lr", "actor_lr", "critic_lr")
#: the training return of both systems: the mean of the last WINDOW finished episodes
WINDOW = 10
#: RLlib's gate: the mean of the last GATE_WINDOW training episodes (its CartPole example's
#: ``metrics_num_episodes_for_smoothing``)
GATE_WINDOW = 100
#: --env -> (msrl's config, the env id RLlib's script makes, overrides of msrl's config)
ENVS = {"cartpole": ("dreamerv3_cartpole.yaml", "CartPole-v1", {}),
        "pong": ("dreamerv3_pong.yaml", "ALE/Pong-v5", {"algorithm__hparams__learning_starts": 1024})}


def run_msrl(env: str, model_size: str, ratio: int, budget: int, seed: int, threshold: float, workdir: str,
             lrs: dict[str, float], replay_value_scale: float, device: str = "cpu") -> dict:
    """One seed of msrl's DreamerV3: the training-return curve, env steps and seconds to
    ``threshold``, env steps/s and the final greedy evaluation; ``lrs``: learning rates that
    replace the config's (``world_model_lr``, ``actor_lr``, ``critic_lr``);
    ``replay_value_scale``: the replay value loss's weight (0: none, as RLlib's); ``device``: the
    job's one fragment (``single``'s ``main``: the world model, the actor-critic and the acting
    network) on it, the env on the host."""
    import msrl
    from msrl.config import load_config

    config, _, over = ENVS[env]
    r = msrl.train(os.path.join(ROOT, "configs", config), runs_dir=workdir, seed=seed, **over,
                   algorithm__hparams__model_size=model_size, algorithm__hparams__train_ratio=ratio,
                   train__total_env_steps=budget, train__progress=False, train__stop_at_return=None,
                   train__eval_every=0, train__checkpoint_every=10**9,
                   algorithm__hparams__replay_value_scale=replay_value_scale,
                   **{f"algorithm__hparams__{k}": v for k, v in lrs.items()},
                   **({} if device == "cpu" else {"distribution_policy__devices__main": device}))
    curve, reached, episodes, learned, before, last_s = [], None, [], 0, 0.0, 0.0
    with open(r.run_dir / "metrics.csv") as f:
        for row in csv.DictReader(f):
            if row.get("losses/world_model"):
                learned += 1
                last_s = float(row["time_s"])
            elif not learned:  # (the clock at the end of the last iteration without updates)
                before = float(row["time_s"])
            ret = row.get("charts/episodic_return")
            if ret and ret != "nan":
                episodes.append(float(ret))
                last = episodes[-WINDOW:]
                point = (int(row["env_steps"]), float(row["time_s"]), sum(last) / len(last))
                curve.append(point)
                if reached is None and len(last) == WINDOW and point[2] >= threshold:
                    reached = point[:2]
    cfg = load_config(r.run_dir / "config.yaml", [])
    hp = cfg.algorithm.hparams  # (DreamerV3Trainer's updates an iteration)
    updates = learned * (hp["steps_per_iteration"] * cfg.env.num_envs * hp["train_ratio"]
                         // (hp["batch_size"] * hp["batch_length"]))
    return {"curve": curve, "steps_to_threshold": reached and reached[0], "time_to_threshold": reached and reached[1],
            "sps": r.env_steps / r.time_s, "final_eval": r.eval_mean, "env_steps": r.env_steps, "updates": updates,
            "updates_per_s": updates / r.time_s, "s_per_update": (last_s - before) / updates if updates else None}


def run_gate(run_dir: str, threshold: float, window: int = GATE_WINDOW) -> dict:
    """RLlib's gate read from an msrl run's ``metrics.csv``: ``episodes`` (training episodes
    finished), ``env_steps`` (the run's last row), ``mean`` (the mean return of the last
    ``window`` episodes, fewer if fewer finished), ``reached`` (the first env step at which a
    full window's mean was >= ``threshold``, or None) and ``evals`` (``[(env steps, greedy
    evaluation)]``).

    Raises:
        FileNotFoundError: ``run_dir`` has no ``metrics.csv``.
        ValueError: no training episode finished in it.
    """
    episodes: list[float] = []
    evals, reached, env_steps = [], None, 0
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        for row in csv.DictReader(f):
            env_steps = int(row["env_steps"])
            ret = row.get("charts/episodic_return")
            if ret and ret != "nan":
                episodes.append(float(ret))
                if reached is None and len(episodes) >= window and sum(episodes[-window:]) / window >= threshold:
                    reached = env_steps
            if row.get("eval/mean_return"):
                evals.append((env_steps, float(row["eval/mean_return"])))
    if not episodes:
        raise ValueError(f"{run_dir}: no training episode finished (metrics.csv has no charts/episodic_return)")
    last = episodes[-window:]
    return {"episodes": len(episodes), "env_steps": env_steps, "mean": sum(last) / len(last), "reached": reached,
            "evals": evals}


def start_rllib(python: str, env: str, model_size: str, ratio: int, budget: int, seed: int, threshold: float,
                lrs: dict[str, float]) -> tuple[subprocess.Popen, Any]:
    """One seed of RLlib's DreamerV3 (``bench/peer_rllib_dreamerv3.py``) in ``python``, started in
    the background (it runs beside msrl's seed, each on a core of its own): the process and the
    file its stderr goes to, for :func:`rllib_result`."""
    cmd = [python, os.path.join(HERE, "peer_rllib_dreamerv3.py"), "--env-id", ENVS[env][1], "--model-size", model_size,
           "--training-ratio",
           str(ratio), "--budget", str(budget), "--seed", str(seed), "--threshold", str(threshold)]
    for k, v in lrs.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    # (stderr to a file: RLlib's warnings would fill a pipe nobody reads while msrl's seed runs; its
    # progress lines, "peer: <env steps> env steps, <updates> updates, ...", can be followed there)
    err = tempfile.NamedTemporaryFile("w+", prefix="peer_rllib_dreamerv3_", suffix=".err", delete=False)
    print(f"RLlib's DreamerV3: its stderr and progress in {err.name}", flush=True)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True), err


def rllib_result(proc: subprocess.Popen, err: Any) -> dict:
    """The JSON line the RLlib run ``proc`` printed last (``err``: its stderr file).

    Raises:
        RuntimeError: the run failed (its last lines of stderr in the message).
    """
    out, _ = proc.communicate()
    if proc.returncode != 0:
        err.seek(0)
        raise RuntimeError(f"RLlib's DreamerV3 exited {proc.returncode}: {err.read()[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", choices=sorted(ENVS), default="cartpole")
    p.add_argument("--model-size", default=None, help="the config's unless given")
    p.add_argument("--train-ratio", type=int, default=None, help="the config's unless given")
    p.add_argument("--budget", type=int, default=20_000)
    p.add_argument("--threshold", type=float, default=450.0)
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--rllib-python", default=None, help="the Python that has ray[rllib] (none: msrl alone)")
    for k in LRS:
        p.add_argument(f"--{k.replace('_', '-')}", type=float, default=None,
                       help="replaces the config's in both systems")
    p.add_argument("--replay-value-scale", type=float, default=None,
                   help="msrl's replay value loss weight, the config's unless given (RLlib's DreamerV3 has none: 0)")
    p.add_argument("--runs", nargs="+", default=None, metavar="DIR",
                   help="train nothing: print RLlib's gate (the last 100 training episodes) of these msrl runs")
    p.add_argument("--device", default="cpu", help="msrl's job on this device (e.g. cuda:0; the env on the host); "
                                                   "msrl alone: RLlib's side runs on the CPU")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.device != "cpu" and args.rllib_python:
        raise SystemExit(f"--device {args.device} places msrl's side only (RLlib's runs on the CPU): the two would not "
                         "run on the same hardware; leave out --rllib-python")
    if args.runs:
        for d in args.runs:
            try:
                g = run_gate(d, args.threshold)
            except (FileNotFoundError, ValueError) as e:
                raise SystemExit(f"--runs: {e}") from None
            print(f"{d}: {g['episodes']} training episodes to {g['env_steps']} env steps; mean of the last "
                  f"{min(GATE_WINDOW, g['episodes'])} {g['mean']:.1f}; {args.threshold:g} reached at "
                  f"{g['reached']} env steps; last greedy evaluations "
                  + ", ".join(f"{v:.1f} ({s})" for s, v in g["evals"][-5:]), flush=True)
        return
    from msrl.algorithms.dreamerv3 import DreamerV3Config
    from msrl.config import load_config

    hp = DreamerV3Config(**load_config(os.path.join(ROOT, "configs", ENVS[args.env][0])).algorithm.hparams)
    args.model_size = args.model_size or hp.model_size
    args.train_ratio = args.train_ratio or hp.train_ratio
    lrs = {k: getattr(args, k) if getattr(args, k) is not None else getattr(hp, k) for k in LRS}
    if args.replay_value_scale is None:
        args.replay_value_scale = hp.replay_value_scale
    torch.set_num_threads(1)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
          f"command: {' '.join(sys.argv)}; msrl's replay_value_scale {args.replay_value_scale:g} (RLlib: none)",
          flush=True)
    results: dict[str, list] = {"msrl": [], "RLlib DreamerV3": []}
    with tempfile.TemporaryDirectory() as workdir:
        for seed in args.seeds:
            peer = args.rllib_python and start_rllib(args.rllib_python, args.env, args.model_size, args.train_ratio,
                                                     args.budget, seed, args.threshold, lrs)
            results["msrl"].append(run_msrl(args.env, args.model_size, args.train_ratio, args.budget, seed,
                                            args.threshold, workdir, lrs, args.replay_value_scale, args.device))
            if peer:
                results["RLlib DreamerV3"].append(rllib_result(*peer))
            for system, runs in results.items():
                if runs:
                    r = runs[-1]
                    last = r["curve"][-1][2] if r["curve"] else float("nan")
                    print(f"seed {seed} {system}: training return (last {WINDOW} episodes) {last:.1f}; "
                          f"{args.threshold:g} at {r['steps_to_threshold']} env steps / {r['time_to_threshold']} s; "
                          f"{r['sps']:.1f} env steps/s; {r['updates']} updates in {r['env_steps']} env steps "
                          f"({r['updates_per_s']:.2f}/s of training; {r['s_per_update'] or float('nan'):.3f} s an update "
                          "while learning)" + (f"; final greedy evaluation {r['final_eval']:.1f}"
                                                          if "final_eval" in r else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
