"""The Ray runtime: env steps/s and the share of iteration time spent in communication, per
policy and replica count, on the main job's PPO (configs/ppo_cartpole.yaml).

Each row trains ``--iterations`` iterations (after ``--warmup`` untimed ones) with
``runtime: ray`` (every replica its own process) and, for reference, the same policy with
``runtime: local`` (threads of one process). ``comm share`` is the replicas' time moving values
(encoding, sending, receiving, decoding, all-reduce) over their iteration time, summed over
replicas; ``wait share`` is their time blocked until a peer reached its side of a boundary (in
synchronous PPO the actor idles while the learner updates and vice versa: that is the
algorithm's dependency, not transport).

    python bench/bench_runtime.py
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

#: (policy, replicas, cluster.intra_node, boundary kinds): multi_learner's last row all-reduces over
#: Gloo instead of shared memory, for comparison; "overlapped" coarse makes its boundaries
#: asynchronous (trajectories: fifo, weights: latest), so actors roll out while the learner learns
OVERLAP = {"trajectories": "fifo", "weights": "latest"}
ROWS = [
    ("single", {}, "shm", {}),
    ("single_learner_coarse", {"actor": 1}, "shm", {}),
    ("single_learner_coarse", {"actor": 2}, "shm", {}),
    ("single_learner_coarse", {"actor": 1}, "shm", OVERLAP),
    ("single_learner_coarse", {"actor": 2}, "shm", OVERLAP),
    ("async_learner", {"actor": 2}, "shm", {}),
    ("multi_learner", {"main": 1}, "shm", {}),
    ("multi_learner", {"main": 2}, "shm", {}),
    ("multi_learner", {"main": 2}, "gloo", {}),
]


def measure(policy: str, replicas: dict[str, int], runtime: str, iterations: int, warmup: int,
            intra_node: str = "shm", boundaries: dict[str, str] | None = None, overrides: tuple[str, ...] = (),
            chunk: int = 64, boundary_transport: str = "auto", learner_priority: str = "auto") -> dict:
    """Env steps/s over ``iterations`` iterations, the median comm share (Ray only), the
    iterations' records and the job's spec (``overrides``: more YAML overrides)."""
    from msrl.config import build_job_spec, load_config
    from msrl.run.job import Job

    over = [f"distribution_policy.name={policy}", *(f"distribution_policy.replicas.{k}={v}" for k, v in replicas.items()),
            *(f"distribution_policy.boundaries.{k}={v}" for k, v in (boundaries or {}).items()), *overrides]
    cfg = load_config("configs/ppo_cartpole.yaml", [*over, f"runtime={runtime}"])
    spec = build_job_spec(cfg)
    if runtime == "ray":
        from msrl.cluster.options import RayOptions
        from msrl.run.driver import ray_job

        job = ray_job(spec, RayOptions(intra_node=intra_node, boundary_transport=boundary_transport,
                                              learner_priority=learner_priority))
    else:
        job = Job(spec)
    try:
        job.reset()
        job.run(warmup)
        t0 = time.perf_counter()
        records = []
        while len(records) < iterations:  # chunks of ~0.5 s, as msrl.run.training.train runs them
            records += job.run(min(chunk, iterations - len(records)))
        dt = time.perf_counter() - t0
    finally:
        job.close()
    shares = [r["comm_share"] for r in records if "comm_share" in r]
    waits = [r["wait_share"] for r in records if "wait_share" in r]
    return {"sps": iterations * spec.env_steps_per_iteration / dt,
            "comm_share": statistics.median(shares) if shares else None,
            "wait_share": statistics.median(waits) if waits else None, "records": records, "spec": spec}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    import ray

    print(f"machine: {platform.processor() or platform.machine()}, {torch.__version__}, ray {ray.__version__}, "
          f"{args.iterations} iterations of configs/ppo_cartpole.yaml (16 envs x 16 steps)")
    print("| policy | replicas | boundaries | all-reduce | env steps/s, ray | vs single, ray | comm share, ray (median) "
          "| wait share, ray (median) | env steps/s, local threads |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    single = None
    for policy, replicas, intra_node, boundaries in ROWS:
        r = measure(policy, replicas, "ray", args.iterations, args.warmup, intra_node, boundaries)
        if ray.is_initialized():
            ray.shutdown()
        loc = measure(policy, replicas, "local", args.iterations, args.warmup, boundaries=boundaries)
        single = single or r["sps"]
        rep = ", ".join(f"{k}={v}" for k, v in replicas.items()) or "-"
        kinds = ", ".join(f"{k}: {v}" for k, v in boundaries.items()) or (
            "fifo, latest" if policy == "async_learner" else "sync" if policy != "single" else "-")
        share = f"{100 * r['comm_share']:.1f}%" if r["comm_share"] is not None else "-"
        wait = f"{100 * r['wait_share']:.1f}%" if r["wait_share"] is not None else "-"
        reduce = intra_node if policy == "multi_learner" and sum(replicas.values()) > 1 else "-"
        print(f"| {policy} | {rep} | {kinds} | {reduce} | {r['sps']:.0f} | {r['sps'] / single:.2f}x | {share} | {wait} "
              f"| {loc['sps']:.0f} |", flush=True)


if __name__ == "__main__":

    main()
