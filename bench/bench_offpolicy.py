"""PPO, A2C, DQN and SAC: msrl's algorithms vs Stable-Baselines3 with the same hyperparameters, same run.

For each seed, both systems train until a deterministic evaluation (20 episodes, envs seeded
10000..10019, every ``eval_every`` env steps) reaches the threshold, or the budget runs out:

=====  =============  =========  ===========  ==========
algo   env            threshold  budget       eval every
=====  =============  =========  ===========  ==========
ppo    CartPole-v1    475        300,000      10,000
a2c    CartPole-v1    475        200,000      5,000
dqn    CartPole-v1    475        100,000      5,120
sac    Pendulum-v1    -200       20,000       1,000
=====  =============  =========  ===========  ==========

Reported per system as medians over seeds, with the interquartile range:

* ``time to threshold`` -- training wall time (s) until that evaluation, evaluations excluded
  (for msrl: the whole training loop -- steps, metrics rows -- with periodic checkpoints off,
  as SB3 takes none);
* ``env steps to threshold`` and ``env steps/s`` (training env steps over training wall time).

msrl runs ``configs/{ppo_cartpole,a2c_cartpole,dqn_cartpole,sac_pendulum}.yaml`` under ``single``
(or ``--policy``); SB3 runs the same hyperparameters (listed in :data:`SB3_KWARGS`: rl-zoo's for
A2C, DQN and SAC, which msrl's configs ship; msrl's own for PPO). With ``whole_budget`` (see
``bench/bench_learning.py``) a run trains its whole budget and ends with a final greedy
evaluation. Both use one torch thread. The learning curves (eval return vs env steps, and the
fraction of seeds at the threshold vs wall time) go to ``--plot``.

    python bench/bench_offpolicy.py dqn --seeds 1 2 3
    python bench/bench_offpolicy.py a2c --seeds $(seq 1 10) --json a2c.json --plot bench/a2c_cartpole.png
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import pathlib
import platform
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable

import gymnasium
import numpy as np
import torch

EVAL_EPISODES = 20
EVAL_SEED = 10_000


@dataclasses.dataclass(frozen=True)
class Task:
    """One benchmark: an msrl config and the SB3 run it is measured against."""

    config: str
    env_id: str
    threshold: float
    budget: int
    eval_every: int
    sb3_algo: str
    n_envs: int


TASKS = {
    "ppo": Task("configs/ppo_cartpole.yaml", "CartPole-v1", 475.0, 300_000, 10_000, "PPO", 16),
    "a2c": Task("configs/a2c_cartpole.yaml", "CartPole-v1", 475.0, 200_000, 5_000, "A2C", 8),
    # PG's peer is Tianshou's Reinforce (bench/peer_tianshou_pg.py): SB3 has none
    "pg": Task("configs/pg_cartpole.yaml", "CartPole-v1", 475.0, 500_000, 20_000, "Reinforce", 8),
    # C51's peer is Tianshou's C51 (bench/peer_tianshou_c51.py): SB3 has none
    "c51": Task("configs/c51_cartpole.yaml", "CartPole-v1", 475.0, 500_000, 10_000, "C51", 1),
    "dqn": Task("configs/dqn_cartpole.yaml", "CartPole-v1", 475.0, 100_000, 5_120, "DQN", 1),
    "sac": Task("configs/sac_pendulum.yaml", "Pendulum-v1", -200.0, 20_000, 1_000, "SAC", 1),
    "ddpg": Task("configs/ddpg_pendulum.yaml", "Pendulum-v1", -200.0, 20_000, 1_000, "DDPG", 1),
    "td3": Task("configs/td3_pendulum.yaml", "Pendulum-v1", -200.0, 20_000, 1_000, "TD3", 1),
    # CleanRL's {ddpg,td3}_continuous_action.py budget and settings on MuJoCo (threshold: a run gait)
    "ddpg_halfcheetah": Task("configs/ddpg_halfcheetah.yaml", "HalfCheetah-v5", 3000.0, 1_000_000, 50_000, "TD3", 1),
    "td3_halfcheetah": Task("configs/td3_halfcheetah.yaml", "HalfCheetah-v5", 3000.0, 1_000_000, 50_000, "TD3", 1),
}


def _linear(v: float) -> Callable[[float], float]:
    """SB3's schedule annealed linearly from ``v`` to 0 (rl-zoo's ``lin_<v>``; msrl's ``anneal_*``)."""
    return lambda progress_remaining: progress_remaining * v


# rl-zoo (hyperparams/{a2c,dqn,sac}.yml) for these envs, which msrl's configs ship; for PPO msrl's
# configs/ppo_cartpole.yaml (SB3's MlpPolicy is msrl's network: separate 64-64 tanh MLPs,
# orthogonal init, Adam eps 1e-5; one difference: msrl clips the value loss as CleanRL does,
# SB3 does not by default). Everything else SB3's defaults.
SB3_KWARGS: dict[str, dict[str, Any]] = {
    "ppo": {
        "n_steps": 16, "batch_size": 256, "n_epochs": 2, "learning_rate": _linear(2.5e-3), "clip_range": _linear(0.2),
        "gamma": 0.98, "gae_lambda": 0.95, "ent_coef": 0.0, "vf_coef": 0.5, "max_grad_norm": 0.5,
    },
    "a2c": {"ent_coef": 0.0},
    "dqn": {
        "learning_rate": 2.3e-3, "batch_size": 64, "buffer_size": 100_000, "learning_starts": 1000, "gamma": 0.99,
        "target_update_interval": 10, "train_freq": 256, "gradient_steps": 128, "exploration_fraction": 0.16,
        "exploration_final_eps": 0.04, "policy_kwargs": {"net_arch": [256, 256]},
    },
    "sac": {"learning_rate": 1e-3},
    # rl-zoo's Pendulum-v1 DDPG and TD3 (hyperparams/{ddpg,td3}.yml), which msrl's configs ship;
    # the acting noise (normal, 0.1 of the half-width) is added in run_sb3, which knows the env
    "ddpg": {"learning_rate": 1e-3, "buffer_size": 200_000, "learning_starts": 10_000, "gamma": 0.98, "batch_size": 256,
             "tau": 0.005, "policy_kwargs": {"net_arch": [400, 300]}},
    "td3": {"learning_rate": 1e-3, "buffer_size": 200_000, "learning_starts": 10_000, "gamma": 0.98, "batch_size": 256,
            "tau": 0.005, "policy_delay": 2, "policy_kwargs": {"net_arch": [400, 300]}},
    # CleanRL's HalfCheetah settings, which msrl's configs ship; CleanRL's DDPG (one critic, the
    # policy every 2nd step, no target smoothing) is SB3's TD3 so configured (SB3's DDPG updates
    # its policy every step)
    "ddpg_halfcheetah": {"learning_rate": 3e-4, "buffer_size": 1_000_000, "learning_starts": 25_000, "gamma": 0.99,
                         "batch_size": 256, "tau": 0.005, "policy_delay": 2, "target_policy_noise": 0.0,
                         "target_noise_clip": 0.0, "policy_kwargs": {"net_arch": [256, 256], "n_critics": 1}},
    "td3_halfcheetah": {"learning_rate": 3e-4, "buffer_size": 1_000_000, "learning_starts": 25_000, "gamma": 0.99,
                        "batch_size": 256, "tau": 0.005, "policy_delay": 2, "target_policy_noise": 0.2,
                        "target_noise_clip": 0.5, "policy_kwargs": {"net_arch": [256, 256]}},
}

#: the algorithms whose SB3 peer acts with Gaussian noise of this std (in SB3's [-1, 1] action scale)
ACTION_NOISE = {"ddpg": 0.1, "td3": 0.1, "ddpg_halfcheetah": 0.1, "td3_halfcheetah": 0.1}


def run_msrl(task: Task, seed: int, policy: str | None, runs_dir: str, extra: list[str] = (),
             whole_budget: bool = False, resumable: str | None = None) -> dict:
    """One msrl run; returns time/steps to the threshold, env steps/s and the eval curve; with
    ``whole_budget`` it trains the whole budget (the threshold read off the curve: the first
    evaluation at or above it) and adds ``final_eval``, the final greedy evaluation's mean return.

    ``resumable``: the run's name under ``runs_dir``, which then keeps it: checkpoints at the
    config's ``train.checkpoint_every`` (else none, as SB3 takes none), a run left unfinished
    continues from its last checkpoint (``msrl train --resume``: training time and curve carry
    over), and a finished one (its ``eval.json``) is read back without training."""
    from msrl.config import load_config
    from msrl.run.training import train

    over = ([] if policy is None else [f"distribution_policy.name={policy}"]) + list(extra)
    cfg = load_config(
        task.config,
        over + [
            f"seed={seed}",
            f"runs_dir={runs_dir}",
            "train.progress=false",
            f"train.eval_every={task.eval_every}",
            f"train.stop_at_return={'null' if whole_budget else task.threshold}",
            f"train.total_env_steps={task.budget}",
            f"eval.episodes={EVAL_EPISODES}",
            f"eval.seed={EVAL_SEED}",
        ] + ([f"name={resumable}"] if resumable else [f"train.checkpoint_every={10**9}"]),
    )
    if resumable:
        run_dir = pathlib.Path(runs_dir) / resumable
        done = kept_run(run_dir, lambda resume: train(cfg, resume=resume))
    else:
        r = train(cfg)
        run_dir = r.run_dir
        done = {"env_steps": r.env_steps, "time_s": r.time_s, "mean_return": r.eval_mean,
                "time_to_threshold_s": r.time_to_threshold_s, "steps_to_threshold": r.steps_to_threshold}
    curve: list[tuple[int, float, float]] = []
    with open(run_dir / "metrics.csv") as f:
        for row in csv.DictReader(f):
            if row.get("eval/mean_return"):
                curve.append((int(row["env_steps"]), float(row["time_s"]), float(row["eval/mean_return"])))
    out = {"time_to_threshold": done["time_to_threshold_s"], "steps_to_threshold": done["steps_to_threshold"],
           "sps": done["env_steps"] / done["time_s"], "curve": curve}
    if whole_budget:
        hit = next(((t, s) for s, t, ret in curve if ret >= task.threshold), (None, None))
        out.update(time_to_threshold=hit[0], steps_to_threshold=hit[1], final_eval=done["mean_return"])
    return out


def kept_run(run_dir: pathlib.Path, start: Callable[[pathlib.Path | None], Any]) -> dict[str, Any]:
    """A msrl run kept in ``run_dir`` across sittings: ``start(None)`` trains it from the start
    when there is none, ``start(run_dir)`` continues it from its last checkpoint (a resume), a
    finished one is left as it is; returns its ``eval.json`` (final evaluation, ``time_s``,
    ``env_steps``, ``iterations``, the threshold's time and steps).

    Raises:
        RuntimeError: ``run_dir`` holds a run stopped before its first checkpoint (nothing to
            continue from; remove it to start over).
    """
    if not (run_dir / "eval.json").exists():
        if run_dir.exists() and not (run_dir / "checkpoints" / "latest.pt").exists():
            raise RuntimeError(f"{run_dir}: a run stopped before its first checkpoint; remove it to start over")
        start(run_dir if run_dir.exists() else None)
    return json.loads((run_dir / "eval.json").read_text())


def _sb3_evaluate(model, env_id: str) -> float:
    env = gymnasium.make_vec(env_id, num_envs=EVAL_EPISODES, vectorization_mode="sync",
                             vector_kwargs={"autoreset_mode": gymnasium.vector.AutoresetMode.SAME_STEP})
    obs, _ = env.reset(seed=EVAL_SEED)
    ret = np.zeros(EVAL_EPISODES)
    done = np.zeros(EVAL_EPISODES, dtype=bool)
    while not done.all():
        action, _ = model.predict(obs, deterministic=True)
        obs, r, te, tr, _ = env.step(action)
        ret += np.where(done, 0.0, r)
        done |= te | tr
    env.close()
    return float(ret.mean())


def run_sb3(name: str, task: Task, seed: int, whole_budget: bool = False, state_dir: str | None = None) -> dict:
    """One SB3 run with :data:`SB3_KWARGS`; evaluation time is excluded from its clock. With
    ``whole_budget`` it trains the whole budget (time/steps to the threshold: the first
    evaluation at or above it) and adds ``final_eval`` (a greedy evaluation of the final model).

    ``state_dir``: where the run keeps its state after every evaluation (the model and the replay
    buffer, and ``progress.json``: the curve, the training time so far), so that a run left unfinished
    continues there (SB3's ``load`` and ``load_replay_buffer``, then ``learn`` with its step count
    kept) and a finished one (``result.json``) is read back without training. A continued run
    starts its env from a reset and its noise and random streams afresh: the same algorithm, not
    the same random draws as one unbroken run. Keep the interval a multiple of the env's episode
    length (HalfCheetah: 1,000 env steps) and no episode is cut."""
    import stable_baselines3
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    state = pathlib.Path(state_dir) if state_dir else None
    if state is not None and (state / "result.json").exists():
        return json.loads((state / "result.json").read_text())
    before = json.loads((state / "progress.json").read_text()) if state and (state / "progress.json").exists() else None

    class Timer(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.eval_time = 0.0
            self.done_eval = before["done_eval"] if before else 0
            self.hit: tuple[float, int] | None = tuple(before["hit"]) if before and before["hit"] else None
            self.curve: list[tuple[int, float, float]] = [tuple(c) for c in before["curve"]] if before else []
            self.train_before = before["train_s"] if before else 0.0
            self.keep_due = False
            self.t0 = 0.0

        def _on_training_start(self) -> None:
            self.t0 = time.perf_counter()

        def train_s(self, now: float) -> float:
            return self.train_before + now - self.t0 - self.eval_time

        def _on_step(self) -> bool:
            if self.num_timesteps // task.eval_every > self.done_eval:
                self.done_eval = self.num_timesteps // task.eval_every
                s = time.perf_counter()
                train_s = self.train_s(s)
                mean = _sb3_evaluate(self.model, task.env_id)
                self.curve.append((self.num_timesteps, train_s, mean))
                if mean >= task.threshold and self.hit is None:
                    self.hit = (train_s, self.num_timesteps)
                self.eval_time += time.perf_counter() - s
                self.keep_due = state is not None
                if self.hit is not None and not whole_budget:
                    return False
            return True

        def _on_rollout_start(self) -> None:
            # kept here, not at the evaluation: SB3 stores a step's transition and takes its
            # gradient steps after the step's callback, and before the next rollout starts
            if self.keep_due:
                s = time.perf_counter()
                _keep_sb3_state(state, self.model, {"done_eval": self.done_eval, "hit": self.hit, "curve": self.curve,
                                                    "train_s": self.train_s(s)})
                self.eval_time += time.perf_counter() - s
                self.keep_due = False

    env = make_vec_env(task.env_id, n_envs=task.n_envs, seed=seed)
    algo: Callable = getattr(stable_baselines3, task.sb3_algo)
    kwargs = dict(SB3_KWARGS[name])
    if name in ACTION_NOISE:
        from stable_baselines3.common.noise import NormalActionNoise

        n = int(np.prod(env.action_space.shape))
        kwargs["action_noise"] = NormalActionNoise(np.zeros(n), ACTION_NOISE[name] * np.ones(n))
    if before:
        noise = {"action_noise": kwargs["action_noise"]} if "action_noise" in kwargs else {}
        model = algo.load(state / before["at"] / "model.zip", env=env, device="cpu", **noise)
        if hasattr(model, "load_replay_buffer"):
            model.load_replay_buffer(state / before["at"] / "replay.pkl")
    else:
        model = algo("MlpPolicy", env, seed=seed, device="cpu", verbose=0, **kwargs)
    cb = Timer()
    model.learn(task.budget - (model.num_timesteps if before else 0), callback=cb, reset_num_timesteps=not before)
    train_time = cb.train_s(time.perf_counter())
    out = {"time_to_threshold": cb.hit[0] if cb.hit else None, "steps_to_threshold": cb.hit[1] if cb.hit else None,
           "sps": model.num_timesteps / train_time, "curve": cb.curve}
    if whole_budget:
        out["final_eval"] = _sb3_evaluate(model, task.env_id)
    if state is not None:
        (state / "result.json").write_text(json.dumps(out))
        for kept in state.iterdir():  # finished: the model and replay buffer are no longer needed
            if kept.is_dir():
                shutil.rmtree(kept)
    return out


def _keep_sb3_state(state: pathlib.Path, model, progress: dict[str, Any]) -> None:
    """Writes an SB3 run's model and replay buffer into ``state/<env step>/``, then
    ``progress.json`` (through a temporary file and a rename) naming that directory, then removes
    the older ones: a run killed while writing leaves the previous state whole and named."""
    step = state / str(model.num_timesteps)
    step.mkdir(parents=True, exist_ok=True)
    model.save(step / "model.zip")
    if hasattr(model, "save_replay_buffer"):
        model.save_replay_buffer(step / "replay.pkl")
    (state / "progress.tmp.json").write_text(json.dumps({**progress, "at": step.name}))
    os.replace(state / "progress.tmp.json", state / "progress.json")
    for old in state.iterdir():
        if old.is_dir() and old != step:
            shutil.rmtree(old)


def _quartiles(xs: list) -> tuple[float, float, float] | None:
    """(Q1, median, Q3) with the inclusive method; a run that never reached the threshold
    (``None``) counts as infinitely slow, so failures move the median instead of vanishing."""
    xs = sorted(float("inf") if x is None else x for x in xs)
    if not xs or xs[0] == float("inf"):
        return None
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    if float("inf") in xs:  # statistics.quantiles interpolates: inf - inf is nan
        n = len(xs) - 1
        return xs[round(0.25 * n)], statistics.median(xs), xs[round(0.75 * n)]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def plot(path: str, name: str, task: Task, results: dict[str, list[dict]]) -> None:
    """Eval return vs env steps (one thin line per seed, median bold) and the fraction of seeds
    at the threshold vs training wall time, one colour per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (system, runs), colour in zip(results.items(), ("tab:blue", "tab:orange", "tab:green")):
        grid = np.arange(task.eval_every, task.budget + 1, task.eval_every)
        rows = []
        for run in runs:
            steps = np.array([c[0] for c in run["curve"]])
            rets = np.array([c[2] for c in run["curve"]])
            if len(steps) == 0:
                continue
            ax1.plot(steps, rets, color=colour, alpha=0.2, lw=0.8)
            # a run that stopped at the threshold keeps its last evaluation
            idx = np.clip(np.searchsorted(steps, grid, side="right") - 1, 0, len(steps) - 1)
            rows.append(np.where(grid >= steps[0], rets[idx], np.nan))
        if rows:
            ax1.plot(grid, np.nanmedian(np.array(rows), axis=0), color=colour, lw=2, label=f"{system} (median)")
        times = sorted(r["time_to_threshold"] for r in runs if r["time_to_threshold"] is not None)
        if times:
            ax2.step([0.0, *times], np.arange(len(times) + 1) / len(runs), where="post", color=colour, label=system)
    ax1.axhline(task.threshold, color="grey", ls="--", lw=0.8)
    ax1.set(xlabel="env steps", ylabel=f"eval mean return ({EVAL_EPISODES} episodes)", title=f"{name.upper()} on {task.env_id}")
    ax1.legend(loc="lower right", fontsize=8)
    ax2.set(xlabel="training wall time (s, evaluations excluded)", ylabel=f"fraction of seeds at {task.threshold:g}",
            ylim=(0, 1.05), title="time to threshold")
    ax2.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("algo", choices=sorted(k for k in TASKS if k in SB3_KWARGS))
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--policy", default="single", help="msrl's distribution policy")
    p.add_argument("--budget", type=int, default=None, help="env-step budget (default: the task's)")
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--plot", default=None, help="write the learning curves here (PNG)")
    p.add_argument("--variant-name", default=None, help="the variant row's name (default: its overrides)")
    p.add_argument("--variant", nargs="+", default=None, metavar="KEY=VALUE",
                   help="add a row: msrl with these config overrides (e.g. env.id=msrl/CartPole-v1 "
                        "distribution_policy.name=gpu_only: native CartPole, host kernels on a CPU)")
    args = p.parse_args()
    task = TASKS[args.algo]
    if args.budget is not None:
        task = dataclasses.replace(task, budget=args.budget)
    torch.set_num_threads(1)
    results: dict[str, list[dict]] = {"msrl": [], "sb3": []}
    variant = (args.variant_name or "msrl " + " ".join(args.variant)) if args.variant else None
    if variant:
        results = {"msrl": [], variant: [], "sb3": []}
    with tempfile.TemporaryDirectory() as runs_dir:
        for seed in args.seeds:
            results["msrl"].append(run_msrl(task, seed, args.policy, runs_dir))
            if variant:
                results[variant].append(run_msrl(task, seed, None, runs_dir, args.variant))
            results["sb3"].append(run_sb3(args.algo, task, seed))
            print(f"seed {seed}: " + "  ".join(
                f"{k} t={v[-1]['time_to_threshold']} steps={v[-1]['steps_to_threshold']} sps={v[-1]['sps']:.0f}"
                for k, v in results.items()), flush=True)
    import stable_baselines3

    machine = platform.processor() or platform.machine()
    print(f"\n{args.algo} on {task.env_id}, threshold {task.threshold:g}, budget {task.budget}; machine: {machine}, "
          f"torch {torch.__version__}, SB3 {stable_baselines3.__version__}, 1 torch thread, seeds {args.seeds}, "
          f"policy {args.policy}")
    print(f"| system | reached | time to {task.threshold:g} (s): median [IQR] | env steps to it: median [IQR] | env steps/s (median) |")
    print("| --- | --- | --- | --- | --- |")
    q = {k: {m: _quartiles([r[m] for r in v]) for m in ("time_to_threshold", "steps_to_threshold", "sps")}
         for k, v in results.items()}
    for k, v in results.items():
        reached = sum(r["time_to_threshold"] is not None for r in v)
        t, s = q[k]["time_to_threshold"], q[k]["steps_to_threshold"]
        ts = f"{t[1]:.2f} [{t[0]:.2f}, {t[2]:.2f}]" if t else "not reached"
        ss = f"{s[1]:.0f} [{s[0]:.0f}, {s[2]:.0f}]" if s else "-"
        print(f"| {k} | {reached}/{len(v)} | {ts} | {ss} | {q[k]['sps'][1]:.0f} |")
    for k in results:
        if k == "sb3":
            continue
        a, b = q[k], q["sb3"]
        ratio = f"{a['time_to_threshold'][1] / b['time_to_threshold'][1]:.2f}x time" \
            if a["time_to_threshold"] and b["time_to_threshold"] else "n/a"
        print(f"| {k} / sb3 | | {ratio} | | {a['sps'][1] / b['sps'][1]:.2f}x throughput |")
    for k, v in results.items():
        print(f"{k} per seed (s): " + ", ".join("-" if r["time_to_threshold"] is None else f"{r['time_to_threshold']:.2f}" for r in v))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"algo": args.algo, "task": dataclasses.asdict(task), "seeds": args.seeds, "results": results}, f, indent=1)
    if args.plot:
        plot(args.plot, args.algo, task, results)


if __name__ == "__main__":
    main()
