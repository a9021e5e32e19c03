"""Central inference (``single_learner_fine``) on Ray: env steps/s, request latency and batch sizes
at 2 and 4 env replicas, against ``single`` in the same run and against the floor of a request's
latency, the actor's own ``act`` on a batch of that size (no crossing, no batching).

Rows (PPO, configs/ppo_cartpole.yaml, 16 envs x 16 steps an iteration):

* ``single``: one process, the peer for env steps/s.
* lockstep: every step one gather of every env replica's observations and one scatter of the
  actions over Gloo (no ``distribution_policy.inference``).
* ``inference full``: central inference, a batch of every env replica, no deadline (the same
  numbers as lockstep, through per-replica gRPC queues and the batcher).
* ``inference max_batch=B, timeout_ms=D``: dynamic batches.

Latency: from a client run's ``actor.act`` request to its rows' results, over every request of
the measured iterations (p50, p99); batch: requests per batch (mean).

    python bench/bench_inference.py --iterations 60
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from bench_runtime import measure as measure_policy

ROWS = [
    (2, None), (2, {}), (2, {"max_batch": 1, "timeout_ms": 1.0}),
    (4, None), (4, {}), (4, {"max_batch": 2, "timeout_ms": 1.0}), (4, {"max_batch": 1, "timeout_ms": 1.0}),
]


def measure(envs: int | None, inference: dict | None, iterations: int, warmup: int) -> dict:
    """Env steps/s over ``iterations`` and the central inference statistics (``envs=None``: single)."""
    if envs is None:
        r = measure_policy("single", {}, "ray", iterations, warmup)
    else:
        over = [] if inference is None else ["distribution_policy.inference={}"] + [
            f"distribution_policy.inference.{k}={v}" for k, v in inference.items()]
        r = measure_policy("single_learner_fine", {"env": envs}, "ray", iterations, warmup, overrides=tuple(over), chunk=16)
    records = r["records"]
    lat = sorted(x for rec in records if rec.get("inference") for x in rec["inference"]["latencies_s"])
    sizes = [s for rec in records if rec.get("inference") for s in rec["inference"]["batch_sizes"]]
    return {"sps": r["sps"], "spec": r["spec"],
            "p50_ms": 1000 * lat[len(lat) // 2] if lat else None,
            "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
            "batch": statistics.mean(sizes) if sizes else None}


def act_floor_ms(spec, rows: int, calls: int = 2000) -> float:
    """Median ms of the actor's ``act`` on ``rows`` observations, in this process."""
    from msrl.runtime.replica import build_standalone_actor

    actor, es = build_standalone_actor(spec)
    obs = torch.randn(rows, *es.observation_space.shape)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        actor.act(obs)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    import ray

    single = measure(None, None, args.iterations, args.warmup)
    ray.shutdown()
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, ray {ray.__version__}, "
          f"{args.iterations} iterations of configs/ppo_cartpole.yaml (16 envs x 16 steps); single {single['sps']:.0f} env steps/s")
    print("| env replicas | inference | env steps/s | vs single | requests per batch (mean) | latency p50 ms | "
          "latency p99 ms | floor: act on the batch, ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for envs, inference in ROWS:
        r = measure(envs, inference, args.iterations, args.warmup)
        ray.shutdown()
        if inference is None:
            how = "lockstep (none)"
        elif not inference:
            how = "full batch, no deadline"
        else:
            how = ", ".join(f"{k}={v:g}" for k, v in inference.items())
        floor = act_floor_ms(r["spec"], round((r["batch"] or envs) * 16 / envs)) if r["batch"] else None
        fmt = lambda x, f=".3f": "-" if x is None else format(x, f)  # noqa: E731
        print(f"| {envs} | {how} | {r['sps']:.0f} | {r['sps'] / single['sps']:.2f}x | {fmt(r['batch'], '.2f')} | "
              f"{fmt(r['p50_ms'])} | {fmt(r['p99_ms'])} | {fmt(floor)} |", flush=True)


if __name__ == "__main__":
    main()
