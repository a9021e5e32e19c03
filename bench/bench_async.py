"""Asynchronous boundaries on the main job (configs/ppo_cartpole.yaml): overlapped coarse PPO and
IMPALA against ``single``, measured in one run, with the floor that bounds them on this machine.

Rows, each trained until a deterministic evaluation (20 episodes, every ``--eval-every`` env
steps) reaches 475, per seed; medians over seeds:

* ``single``: the main job in one process (the reference);
* ``coarse x1 / x2, overlapped``: ``single_learner_coarse`` on Ray with ``trajectories: fifo``
  and ``weights: latest`` -- actors roll out iteration k+1 while the learner learns iteration k;
* ``coarse x1 / x2, sync``: the same policy with synchronous boundaries, for comparison;
* ``coarse x2, lockstep``: the same in lockstep over streams (``trajectories: fifo``, ``weights:
  fresh``: synchronous coarse's values over Unix sockets instead of Gloo, its actors replaceable);
* ``impala, async_learner`` and ``impala, single``: ``configs/impala_cartpole.yaml``.

The floor: the same actor work (16 envs x 16 steps of act, env step, buffer insert) and learner
work (one PPO update on such a rollout) run concurrently in two plain processes, with no msrl
runtime, boundary or Ray between them: ``256 / max(actor iteration, learner iteration)`` env
steps/s is what any overlapped split of this job can reach on this machine.

    python bench/bench_async.py --seeds 1 2 3 4 5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import statistics
import tempfile
import time

import torch
from bench_ppo_cartpole import _median  # medians over the seeds that reached a figure

THRESHOLD = 475.0
OVERLAP = ["distribution_policy.boundaries.trajectories=fifo", "distribution_policy.boundaries.weights=latest"]
ROWS = {
    "single": ("configs/ppo_cartpole.yaml", ["distribution_policy.name=single"]),
    "coarse x1, overlapped": ("configs/ppo_cartpole.yaml", ["distribution_policy.name=single_learner_coarse",
                                                            "distribution_policy.replicas.actor=1", *OVERLAP]),
    "coarse x2, overlapped": ("configs/ppo_cartpole.yaml", ["distribution_policy.name=single_learner_coarse",
                                                            "distribution_policy.replicas.actor=2", *OVERLAP]),
    "coarse x1, sync": ("configs/ppo_cartpole.yaml", ["distribution_policy.name=single_learner_coarse",
                                                      "distribution_policy.replicas.actor=1"]),
    "coarse x2, sync": ("configs/ppo_cartpole.yaml", ["distribution_policy.name=single_learner_coarse",
                                                      "distribution_policy.replicas.actor=2"]),
    "coarse x2, lockstep": ("configs/ppo_cartpole.yaml", ["distribution_policy.name=single_learner_coarse",
                                                          "distribution_policy.replicas.actor=2",
                                                          "distribution_policy.boundaries.trajectories=fifo",
                                                          "distribution_policy.boundaries.weights=fresh"]),
    "impala, async_learner x2": ("configs/impala_cartpole.yaml", ["distribution_policy.name=async_learner"]),
    "impala, single": ("configs/impala_cartpole.yaml", ["distribution_policy.name=single"]),
}


def run(config: str, over: list[str], seed: int, eval_every: int, budget: int, runs_dir: str) -> dict:
    from msrl.config import load_config
    from msrl.run.training import train

    cfg = load_config(config, [*over, f"seed={seed}", f"runs_dir={runs_dir}", "train.progress=false",
                               f"train.eval_every={eval_every}", f"train.stop_at_return={THRESHOLD}",
                               f"train.total_env_steps={budget}", "eval.episodes=20", "eval.seed=10000"])
    r = train(cfg)
    lags = [m["async/policy_lag_mean"] for m in r.metrics() if "async/policy_lag_mean" in m]
    return {"time_to_475": r.time_to_threshold_s, "steps_to_475": r.steps_to_threshold, "sps": r.env_steps / r.time_s,
            "lag": statistics.mean(lags) if lags else None}


def _floor_worker(role: str, iterations: int, barrier, out, num_envs: int = 16) -> None:
    """One side of the floor: the actor's work on ``num_envs`` envs, or the learner's on a
    rollout of 16, ``iterations`` times."""
    torch.set_num_threads(1)
    from msrl.config import build_job_spec, load_config
    from msrl.run.job import Job

    envs = num_envs if role.startswith("actor") else 16
    job = Job(build_job_spec(load_config("configs/ppo_cartpole.yaml", ["distribution_policy.name=single",
                                                                       f"env.num_envs={envs}"])), probe=False)
    t = job.replica("main", 0).trainer
    hp = t.hparams
    obs = t.env.reset(seed=1)

    def rollout():
        nonlocal obs
        for _ in range(hp.num_steps):
            action, log_prob, value = t.actor.act(obs)
            next_obs, reward, terminated, truncated, info = t.env.step(action)
            t.buffer.insert(obs=obs, action=action, log_prob=log_prob, value=value, reward=reward,
                            terminated=terminated, truncated=truncated, next_obs=info["final_obs"])
            obs = next_obs
        return t.buffer.gather()

    batch = rollout().clone()
    for _ in range(10):  # warm-up
        rollout() if role.startswith("actor") else t.learner.learn(batch)
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(iterations):
        if role.startswith("actor"):
            rollout()
            t.actor.set_weights(t.learner.get_weights())
        else:
            t.learner.learn(batch)
            t.learner.get_weights()
    out.put((role, (time.perf_counter() - t0) / iterations))
    job.close()


def floor(iterations: int, together: bool, actors: int = 1) -> dict[str, float]:
    """Seconds per iteration of the work of ``actors`` actor processes (16 envs split between
    them) and of the learner, all concurrently (``together``) or one after the other."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    times = {}
    names = [f"actor{i}" for i in range(actors)]
    roles = [[*names, "learner"]] if together else [[n] for n in names] + [["learner"]]
    for group in roles:
        barrier = ctx.Barrier(len(group))
        procs = [ctx.Process(target=_floor_worker, args=(r, iterations, barrier, out, 16 // actors)) for r in group]
        for p in procs:
            p.start()
        for _ in group:
            role, dt = out.get(timeout=600)
            times[role] = dt
        for p in procs:
            p.join()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--eval-every", type=int, default=5000)
    p.add_argument("--budget", type=int, default=300_000)
    p.add_argument("--rows", nargs="+", default=list(ROWS), help=f"rows to run (of {list(ROWS)})")
    p.add_argument("--floor-iterations", type=int, default=300)
    args = p.parse_args()
    torch.set_num_threads(1)
    import ray

    alone = floor(args.floor_iterations, together=False)
    both = floor(args.floor_iterations, together=True)
    both2 = floor(args.floor_iterations, together=True, actors=2)
    results: dict[str, list[dict]] = {k: [] for k in args.rows}
    with tempfile.TemporaryDirectory() as runs_dir:
        for seed in args.seeds:
            for name in args.rows:
                config, over = ROWS[name]
                results[name].append(run(config, over, seed, args.eval_every, args.budget, runs_dir))
                if ray.is_initialized():
                    ray.shutdown()
            print(f"seed {seed}: " + "  ".join(f"{k} {v[-1]}" for k, v in results.items()), flush=True)
    med = {k: {m: _median([r[m] for r in v]) for m in ("time_to_475", "steps_to_475", "sps", "lag")}
           for k, v in results.items()}
    print(f"\nmachine: {platform.processor() or platform.machine()}, torch {torch.__version__}, ray {ray.__version__}, "
          f"seeds {args.seeds}")
    base = med.get("single")
    print("| row | reached | time to 475 (s, median) | env steps to 475 (median) | env steps/s (median) | "
          "vs single: time | vs single: env steps/s | policy lag (mean) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for k, m in med.items():
        reached = sum(r["time_to_475"] is not None for r in results[k])
        tt = f"{m['time_to_475']:.2f}" if m["time_to_475"] is not None else "-"
        vt = f"{m['time_to_475'] / base['time_to_475']:.2f}x" if base and m["time_to_475"] and base["time_to_475"] else "-"
        vs = f"{m['sps'] / base['sps']:.2f}x" if base else "-"
        lag = f"{m['lag']:.2f}" if m["lag"] is not None else "-"
        print(f"| {k} | {reached}/{len(results[k])} | {tt} | {m['steps_to_475']} | {m['sps']:.0f} | {vt} | {vs} | {lag} |")
    fl, fl2 = 256 / max(both.values()), 256 / max(both2.values())
    print(f"\nfloor x1: actor {1e3 * alone['actor0']:.2f} ms and learner {1e3 * alone['learner']:.2f} ms per iteration "
          f"alone; {1e3 * both['actor0']:.2f} ms and {1e3 * both['learner']:.2f} ms side by side -> {fl:.0f} env steps/s"
          + (f" ({fl / base['sps']:.2f}x single)" if base else ""))
    print(f"floor x2: two actors (8 envs each) {1e3 * both2['actor0']:.2f} / {1e3 * both2['actor1']:.2f} ms and learner "
          f"{1e3 * both2['learner']:.2f} ms side by side on this machine -> {fl2:.0f} env steps/s"
          + (f" ({fl2 / base['sps']:.2f}x single)" if base else ""))


if __name__ == "__main__":
    main()
