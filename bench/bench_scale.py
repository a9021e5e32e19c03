"""msrl at N replicas on one machine: start-up against its floor, an actor's replacement, and
scaling efficiency with an env that sleeps (issue "At the scale msrl promises").

On one 2-core machine a scale run measures msrl's own overhead, not speed-up: the actors'
env is ``SleepCartPole-v1`` (``bench/sleep_env.py``: each step sleeps ``--delay-ms``, standing for
a remote simulator), one env per actor, so N actors wait on N simulators at once and what does not
scale is msrl's. The job: IMPALA under ``async_learner`` with N actor processes on local Ray
(``cluster.cpus_per_replica`` 1, Ray declaring as many CPUs as bundles).

Rows, per N (``--replicas``):

* ``start-up``: from ``RayJob`` construction (Ray already running) to the end of the first
  iteration (trace, probe, partition, N+1 replica processes started, connected, reset, one
  iteration), the env's step sleeping 0 ms here, against ``floor``: N+1 bare Ray actors that import torch and gymnasium and build
  the same networks (a 64-64 actor-critic and its Adam optimiser; the actors their CartPole env),
  in the same Ray, measured just before;
* ``env steps/s``: steady-state throughput (iterations 6..6+``--iterations``), and ``efficiency``:
  that over N x the throughput at N=1 (the first N of the list should be 1);
* ``replacement``: at the largest N (``--kill``), actor replica 0 SIGKILLed mid-run: the seconds
  from its loss noticed to its replacement rejoined (``RayJob.replacements.replacement_s``), the other
  replicas running throughout.

* ``--hierarchical NODES``: instead, ``multi_learner`` with ``2 x NODES`` learners (the README's
  CartPole PPO) packed two to a node on a namespace cluster of ``NODES`` nodes
  (``cluster/local_cluster.py``, 4 logical CPUs each, 2 per replica): each iteration's gradient
  all-reduce through shared memory within each node and over Gloo among the node leaders
  (``cluster.intra_node=shm``), against the same job all-reducing over Gloo among all ranks
  (``cluster.intra_node=gloo``); per run its env steps/s, the all-reduce's seconds per iteration
  (mean over replicas, waiting for the slowest included) and whether every replica's learner
  (weights and optimiser state) holds the same bits after the run.

    PYTHONPATH=bench python bench/bench_scale.py --replicas 1 4 16 32 --kill
    python bench/bench_scale.py --hierarchical 4
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import signal
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


class Bare:
    """A bare replica: imports torch (and gymnasium) and builds what an msrl replica builds."""

    def __init__(self, with_env: bool) -> None:
        import torch
        from torch import nn

        torch.set_num_threads(1)
        self.net = nn.ModuleDict({
            "actor": nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2)),
            "critic": nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))})
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=6e-4)
        if with_env:
            import gymnasium
            import sleep_env  # noqa: F401 - registers SleepCartPole-v1

            self.env = gymnasium.make_vec("sleep_env:SleepCartPole-v1", num_envs=1, vectorization_mode="sync")
            self.env.reset(seed=0)

    def ready(self) -> bool:
        return True


def floor(n: int) -> float:
    """Seconds until N+1 bare actors (N with an env) answer, in the running Ray."""
    import ray

    remote = ray.remote(num_cpus=1)(Bare)
    t0 = time.perf_counter()
    actors = [remote.remote(i < n) for i in range(n + 1)]
    ray.get([a.ready.remote() for a in actors])
    dt = time.perf_counter() - t0
    for a in actors:
        ray.kill(a)
    return dt


def spec_of(n: int, delay_ms: float):
    from msrl.config import build_job_spec, load_config

    cfg = load_config(str(ROOT / "configs/impala_cartpole.yaml"), [
        "name=scale", "env.id=sleep_env:SleepCartPole-v1", f"env.num_envs={n}", f"env.kwargs.delay_s={delay_ms / 1000}",
        f"distribution_policy.replicas.actor={n}", "runtime=ray", "train.total_env_steps=100000000"])
    return build_job_spec(cfg), cfg


def startup(n: int) -> float:
    """Seconds from ``RayJob`` construction to the end of the first iteration, the env's steps
    costing nothing (``delay_s=0``: the probe and the iteration step it too)."""
    from msrl.cluster.options import RayOptions
    from msrl.run.driver import ray_job

    spec, _ = spec_of(n, 0.0)
    t0 = time.perf_counter()
    job = ray_job(spec, RayOptions(cpus_per_replica=1.0, on_replica_loss="auto"))
    try:
        job.reset()
        job.run(1)
        return time.perf_counter() - t0
    finally:
        job.close()


def measure(n: int, delay_ms: float, iterations: int, kill: bool) -> dict:
    from msrl.cluster.options import RayOptions
    from msrl.run.driver import ray_job

    spec, cfg = spec_of(n, delay_ms)
    job = ray_job(spec, RayOptions(cpus_per_replica=1.0, on_replica_loss="auto"))
    try:
        job.reset()
        job.run(6)
        s0, w0 = job.env_steps, time.perf_counter()
        job.run(iterations)
        sps = (job.env_steps - s0) / (time.perf_counter() - w0)
        out = {"sps": sps}
        if kill:
            victim = job.pids()[0]  # actor replica 0
            timer = threading.Timer(1.0, os.kill, (victim, signal.SIGKILL))
            timer.start()
            job.run(max(iterations, int(3.0 / max(1e-3, iterations / sps * spec.env_steps_per_iteration / iterations))))
            timer.join()
            job.run(3)  # it runs on
            out["replacement_s"] = job.replacements.replacement_s[0] if job.replacements.replacement_s else float("nan")
        return out
    finally:
        job.close()


def hierarchical(nodes: int, iterations: int) -> None:
    """multi_learner x(2 x ``nodes``) packed over ``nodes`` namespace nodes, shm-hierarchical
    against flat Gloo (see the module docstring): the cluster started here, each row measured by
    :func:`hierarchical_row` in a process joined to it as a user's driver joins (its token)."""
    import subprocess

    from msrl.cluster.local_cluster import LocalCluster

    print(f"# {platform.node()}: {os.cpu_count()} cores; multi_learner x{2 * nodes} (PPO CartPole, "
          f"{4 * nodes} envs) packed over {nodes} namespace nodes, {iterations} iterations after 5")
    print("| all-reduce | replicas per node | env steps/s | all-reduce (ms/iteration) | every replica the same bits |")
    print("|---|---|---|---|---|", flush=True)
    with LocalCluster(nodes=nodes, cpus=4) as c:
        for intra in ("shm", "gloo"):
            subprocess.run([sys.executable, __file__, "--row", c.address, intra, str(nodes), str(iterations)],
                           env=c.client_env(), check=True)


def hierarchical_row(address: str, intra: str, nodes: int, iterations: int) -> None:
    """One row of :func:`hierarchical`: the job on the cluster at ``address``, all-reducing with
    ``cluster.intra_node=intra``."""
    import collections

    from msrl.cluster.bootstrap import init_ray
    from msrl.cluster.options import RayOptions
    from msrl.config import build_job_spec, load_config
    from msrl.run.driver import ray_job
    from msrl.runtime.values import same_bits

    learners = 2 * nodes
    init_ray(address, 1)
    cfg = load_config(str(ROOT / "configs/ppo_cartpole.yaml"), [
        "name=hier", "distribution_policy.name=multi_learner", f"distribution_policy.replicas.main={learners}",
        f"env.num_envs={2 * learners}", "runtime=ray", "train.total_env_steps=100000000"])
    job = ray_job(build_job_spec(cfg), RayOptions(address=address, cpus_per_replica=2.0, strategy="PACK",
                                                                 intra_node=intra))
    try:
        per_node = sorted(collections.Counter(r["node"] for r in job.replica_table()).values())
        job.reset()
        job.run(5)
        before = [s["op_s"].get("allreduce", 0.0) for s in job.comm_stats()]
        s0, t0 = job.env_steps, time.perf_counter()
        job.run(iterations)
        sps = (job.env_steps - s0) / (time.perf_counter() - t0)
        after = [s["op_s"].get("allreduce", 0.0) for s in job.comm_stats()]
        reduce_ms = 1e3 * sum(a - b for a, b in zip(after, before)) / len(after) / iterations
        states = job.state_dict()["replicas"]
        same = len(states) == learners and all(
            same_bits(v["components"]["learner"], states["main/0"]["components"]["learner"]) for v in states.values())
    finally:
        job.close()
    name = "shm within nodes, Gloo among leaders" if intra == "shm" else "Gloo among all ranks"
    print(f"| {name} | {per_node} | {sps:.0f} | {reduce_ms:.2f} | {'yes' if same else 'NO'} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--delay-ms", type=float, default=5.0)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--kill", action="store_true", help="replace an actor at the largest N")
    p.add_argument("--no-startup", action="store_true", help="skip the start-up and floor columns")
    p.add_argument("--hierarchical", type=int, metavar="NODES", help="multi_learner x2 NODES over NODES nodes instead")
    p.add_argument("--row", nargs=4, metavar=("ADDRESS", "INTRA", "NODES", "ITERATIONS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.row:
        return hierarchical_row(args.row[0], args.row[1], int(args.row[2]), int(args.row[3]))
    if args.hierarchical:
        return hierarchical(args.hierarchical, args.iterations)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")])
    import ray

    from msrl.cluster.bootstrap import init_ray

    init_ray(None, max(os.cpu_count() or 1, max(args.replicas) + 1))
    print(f"# {platform.node()}: {os.cpu_count()} cores; IMPALA async_learner, SleepCartPole-v1 "
          f"({args.delay_ms:g} ms a step), 1 env per actor")
    print("| actors N | replicas | start-up (s) | floor (s) | ratio | env steps/s | efficiency | replacement (s) |")
    print("|---|---|---|---|---|---|---|---|")
    base = None
    for n in args.replicas:
        f = float("nan") if args.no_startup else floor(n)
        m = {"start_s": float("nan") if args.no_startup else startup(n),
             **measure(n, args.delay_ms, args.iterations, args.kill and n == max(args.replicas))}
        base = base or m["sps"] / n
        rep = f"{m['replacement_s']:.1f}" if "replacement_s" in m else ""
        print(f"| {n} | {n + 1} | {m['start_s']:.1f} | {f:.1f} | {m['start_s'] / f:.2f}x | {m['sps']:.0f} | "
              f"{m['sps'] / (n * base):.2f} | {rep} |", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
