"""The floor of overlapped PPO on this machine: the same overlapped program written by hand in
plain processes, against msrl's overlapped ``single_learner_coarse`` in the same run.

``bench_async.py``'s floor runs the actor's and the learner's work side by side with nothing
between them: no waiting for each other, no data moved, each process's caches its own. This
bench keeps the dependencies of the real overlapped program and takes away msrl's runtime:

* ``hand, single``: one plain process, the main job's loop (16 envs x 16 steps of act, env step,
  buffer insert; one PPO update) -- what msrl's ``single`` runs;
* ``hand, overlapped xK``: K actor processes (16/K envs each) and a learner process, started with
  ``multiprocessing``; each actor owns a trajectory slot in shared memory with room for one
  rollout (``fifo`` of capacity 1: an actor may roll out one iteration ahead of the learner) and
  two POSIX semaphores (full/free); the learner publishes its weights into shared memory under a
  lock with a version number (``latest``), and an actor loads them before each rollout when the
  version moved. The learner takes every actor's rollout, concatenates them along the env axis,
  frees the slots, learns and publishes -- the program msrl's overlapped coarse PPO runs, with a
  copy of 7.5 KB per rollout and a futex wake-up as its only crossings;
* ``hand, overlapped x2, learner priority``: the same with the actor processes at niceness 10,
  so that with three processes on two cores the learner, which every actor waits on, runs
  whenever it can.

Then msrl's rows on Ray (``bench_runtime.measure``, the main job, Unix-socket boundaries), every
row alternating over ``--rounds`` rounds; medians.

    python bench/bench_overlap_floor.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.multiprocessing as mp
from bench_runtime import OVERLAP, measure

CONFIG = "configs/ppo_cartpole.yaml"


def _trainer(num_envs: int, nice: int = 0):
    """The main job's trainer (actor, env, buffer, learner) in this process, ``num_envs`` envs,
    the process at niceness ``nice``."""
    torch.set_num_threads(1)
    if nice:
        os.setpriority(os.PRIO_PROCESS, 0, nice)  # lower priority: raising one's own nice needs no privilege
    from msrl.config import build_job_spec, load_config
    from msrl.run.job import Job

    job = Job(build_job_spec(load_config(CONFIG, ["distribution_policy.name=single", f"env.num_envs={num_envs}"])),
              probe=False)
    return job, job.replica("main", 0).trainer


def _rollout(t, obs):
    """One rollout of ``num_steps`` steps into ``t.buffer``; returns (its batch, the next obs)."""
    for _ in range(t.hparams.num_steps):
        action, log_prob, value = t.actor.act(obs)
        next_obs, reward, terminated, truncated, info = t.env.step(action)
        t.buffer.insert(obs=obs, action=action, log_prob=log_prob, value=value, reward=reward,
                        terminated=terminated, truncated=truncated, next_obs=info["final_obs"])
        obs = next_obs
    return t.buffer.gather(), obs


def _single(iterations: int, warmup: int, out) -> None:
    job, t = _trainer(16)
    obs = t.env.reset(seed=1)
    for i in range(warmup + iterations):
        if i == warmup:
            t0 = time.perf_counter()
        batch, obs = _rollout(t, obs)
        t.learner.learn(batch)
    out.put(("single", time.perf_counter() - t0))
    job.close()


def _actor(k: int, num_envs: int, total: int, slot_q, full, free, weights, version, lock, nice: int) -> None:
    job, t = _trainer(num_envs, nice)
    obs = t.env.reset(seed=1 + k)
    batch, obs = _rollout(t, obs)
    slot = batch.clone()
    slot["_version"] = torch.zeros(slot.batch_size, dtype=torch.int64)
    slot.share_memory_()
    slot_q.put((k, slot))  # the learner maps the same memory
    mine = 0
    for _ in range(total):
        if version.value != mine:  # the newest weights, if they moved
            with lock:
                t.actor.set_weights(weights)
                mine = version.value
        batch, obs = _rollout(t, obs)
        free.acquire()  # room for one rollout: wait until the learner took the last one
        slot.update_(batch)
        slot["_version"].fill_(mine)
        full.release()
    job.close()


def _learner(actors: int, iterations: int, warmup: int, slot_q, full, free, weights_q, version, lock, out) -> None:
    job, t = _trainer(16)
    w = {k: v.clone().share_memory_() for k, v in t.learner.get_weights().items()}
    weights_q.put(w)
    slots = {}
    for _ in range(actors):
        k, s = slot_q.get()
        slots[k] = s
    lags = []
    for i in range(warmup + iterations):
        if i == warmup:
            t0 = time.perf_counter()
        parts = []
        for k in range(actors):
            full[k].acquire()
            parts.append(slots[k].clone())  # taken: the slot is free again
            free[k].release()
        lags += [version.value - int(p["_version"].flatten()[0]) for p in parts]
        batch = torch.cat([p.exclude("_version") for p in parts], dim=1) if actors > 1 else parts[0].exclude("_version")
        t.learner.learn(batch)
        with lock:
            for k, v in t.learner.get_weights().items():
                w[k].copy_(v)
            version.value += 1
    out.put((f"overlapped x{actors}", time.perf_counter() - t0, statistics.mean(lags)))
    job.close()


def hand(actors: int, iterations: int, warmup: int, actor_nice: int = 0) -> tuple[float, float | None]:
    """Env steps/s (and the mean policy lag) of the hand-written loop: ``actors=0`` for the
    single-process one; ``actor_nice``: the actor processes' niceness (the learner keeps 0)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    if actors == 0:
        p = ctx.Process(target=_single, args=(iterations, warmup, out))
        p.start()
        _, dt = out.get(timeout=600)
        p.join()
        return iterations * 256 / dt, None
    slot_q, weights_q = ctx.Queue(), ctx.Queue()
    full = [ctx.Semaphore(0) for _ in range(actors)]
    free = [ctx.Semaphore(1) for _ in range(actors)]
    version, lock = ctx.Value("q", 0, lock=False), ctx.Lock()
    learner = ctx.Process(target=_learner, args=(actors, iterations, warmup, slot_q, full, free, weights_q, version,
                                                 lock, out))
    learner.start()
    weights = weights_q.get(timeout=600)
    # every rollout an actor makes is taken, so each makes exactly the learner's iterations (+1
    # ahead, which it puts once the learner stopped taking: it is given no more than it can put)
    procs = [ctx.Process(target=_actor, args=(k, 16 // actors, warmup + iterations, slot_q, full[k], free[k],
                                              weights, version, lock, actor_nice)) for k in range(actors)]
    for p in procs:
        p.start()
    _, dt, lag = out.get(timeout=600)
    for p in [learner, *procs]:
        p.join(timeout=60)
    return iterations * 256 / dt, lag


#: (row, actor processes or "single", the hand-written actors' niceness)
ROWS = [("hand, single", 0, 0), ("hand, overlapped x1", 1, 0), ("hand, overlapped x2", 2, 0),
        ("hand, overlapped x2, learner priority", 2, 10),
        ("msrl single", "single", 0), ("msrl overlapped x1", 1, 0), ("msrl overlapped x2", 2, 0)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=600)
    p.add_argument("--warmup", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(1)
    import ray

    sps: dict[str, list[float]] = {name: [] for name, _, _ in ROWS}
    lag: dict[str, list[float]] = {name: [] for name, _, _ in ROWS}
    for r in range(args.rounds):
        for name, what, nice in ROWS:
            if name.startswith("hand"):
                s, lg = hand(what, args.iterations, args.warmup, nice)
            else:
                policy, replicas = ("single", {}) if what == "single" else ("single_learner_coarse", {"actor": what})
                m = measure(policy, replicas, "ray", args.iterations, args.warmup,
                            boundaries=OVERLAP if policy != "single" else None)
                lags = [x for rec in m["records"] for x in rec.get("policy_lags") or []]
                s, lg = m["sps"], (statistics.mean(lags) if lags else None)
                if ray.is_initialized():
                    ray.shutdown()
            sps[name].append(s)
            if lg is not None:
                lag[name].append(lg)
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.0f}" for n, v in sps.items()), flush=True)
    print(f"\nmachine: {platform.processor() or platform.machine()}, torch {torch.__version__}, ray {ray.__version__}, "
          f"{args.rounds} rounds x {args.iterations} iterations")
    hs, ms = statistics.median(sps["hand, single"]), statistics.median(sps["msrl single"])
    print("| row | env steps/s per round | median | vs its single | msrl / hand | policy lag (mean) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, _, _ in ROWS:
        m = statistics.median(sps[name])
        base = hs if name.startswith("hand") else ms
        twin = name.replace("msrl", "hand,") if name.startswith("msrl") else None
        vs = f"{m / statistics.median(sps[twin]):.2f}x" if twin else "-"
        lg = f"{statistics.mean(lag[name]):.2f}" if lag[name] else "-"
        print(f"| {name} | {', '.join(f'{x:.0f}' for x in sps[name])} | {m:.0f} | {m / base:.2f}x | {vs} | {lg} |")


if __name__ == "__main__":
    main()
