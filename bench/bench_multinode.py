"""Every policy on a real 3-node cluster against the same job on one node, in the same run.

The cluster is ``cluster/local_cluster.py``'s (worker nodes in network namespaces of this machine,
each with its own address; root and iproute2 needed). Each row trains the main job
(``configs/ppo_cartpole.yaml``; IMPALA's ``configs/impala_cartpole.yaml``) with a policy for ``--steps`` env steps, once on the 3 nodes
(``cluster.strategy=SPREAD``) and once on a Ray of one node the run starts itself, and reports the
run's env steps/s and its replicas' communication share (``charts/comm_share``: time moving values
over busy time, medians over the iterations after the first 10). On one machine the nodes share
its cores: the figure is what crossing node addresses (veth, bridge, Gloo/gRPC on them instead of
loopback/Unix sockets) costs, not what more machines would add.

    sudo python bench/bench_multinode.py --steps 60000
    sudo python bench/bench_multinode.py --node-death      # the time a node's death costs

``--node-death`` instead trains coarse x2 on the 3 nodes, SIGKILLs every process of the node
holding an actor once 25 iterations are logged, and reports the seconds from the kill to the
first iteration logged after the restart (the restart resumes from the last checkpoint: its
iterations are logged again), with the run's ``faults/...`` columns.
"""

from __future__ import annotations

import argparse
import csv
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile

from msrl.cluster.local_cluster import LocalCluster, unavailable

ROOT = pathlib.Path(__file__).resolve().parents[1]

POLICIES = {
    "single_learner_coarse x2": ["distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2"],
    "overlapped coarse x2": ["distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2",
                             "distribution_policy.boundaries.trajectories=fifo",
                             "distribution_policy.boundaries.weights=latest"],
    "async_learner x2 (IMPALA)": ["CONFIG=configs/impala_cartpole.yaml", "distribution_policy.name=async_learner",
                                  "distribution_policy.replicas.actor=2"],
    "single_learner_fine x2": ["distribution_policy.name=single_learner_fine", "distribution_policy.replicas.env=2"],
    "multi_learner x3": ["distribution_policy.name=multi_learner", "distribution_policy.replicas.main=3", "env.num_envs=18"],
}


def train(runs: pathlib.Path, name: str, over: list[str], steps: int, env: dict[str, str]) -> tuple[float, float]:
    """(env steps/s, median comm share) of one ``msrl train`` run.

    Raises:
        RuntimeError: the run failed.
    """
    config = next((o.split("=", 1)[1] for o in over if o.startswith("CONFIG=")), "configs/ppo_cartpole.yaml")
    over = [o for o in over if not o.startswith("CONFIG=")]
    cmd = [sys.executable, "-m", "msrl.run.cli", "train", config, f"runs_dir={runs}", f"name={name}",
           "runtime=ray", "train.eval_every=0", "train.progress=false", f"train.total_env_steps={steps}", *over]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{out.stderr[-3000:]}")
    with open(runs / name / "metrics.csv") as f:
        rows = list(csv.DictReader(f))[10:]
    sps = float(rows[-1]["env_steps"]) / float(rows[-1]["time_s"]) if rows else float("nan")
    share = statistics.median(float(r["charts/comm_share"]) for r in rows) if rows else float("nan")
    return sps, share


def node_death(steps: int) -> None:
    """Times a node's death: from the SIGKILL to the first metrics row written after it."""
    import threading
    import time

    with tempfile.TemporaryDirectory(prefix="msrl-bench-death-") as tmp, LocalCluster(nodes=3, cpus=2) as cluster:
        runs = pathlib.Path(tmp)
        metrics = runs / "death" / "metrics.csv"
        seen: dict[str, float] = {}

        def watch() -> None:
            while "killed" not in seen:
                if metrics.is_file() and metrics.read_text().count("\n") > 25:
                    rows = metrics.read_text().count("\n")
                    cluster.kill_node(2)
                    seen["killed"], seen["rows"] = time.monotonic(), rows
                time.sleep(0.02)
            size = metrics.stat().st_size
            while time.monotonic() - seen["killed"] < 600:
                if metrics.stat().st_size != size:
                    seen["next_row"] = time.monotonic()
                    return
                time.sleep(0.02)

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        over = [*POLICIES["single_learner_coarse x2"], f"cluster.address={cluster.address}", "cluster.strategy=SPREAD",
                "train.checkpoint_every=10"]
        train(runs, "death", over, steps, cluster.client_env())
        t.join(60)
        with open(metrics) as f:
            last = list(csv.DictReader(f))[-1]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; coarse x2 on 3 nodes, "
          f"node 2 killed after {seen.get('rows', 0) - 1} iterations")
    print(f"kill -> first iteration logged after the restart: {seen['next_row'] - seen['killed']:.1f} s; "
          f"faults/replica_restarts {last['faults/replica_restarts']}, "
          f"faults/dropped_env_steps {last['faults/dropped_env_steps']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60_000)
    p.add_argument("--policies", nargs="*", default=list(POLICIES), choices=list(POLICIES), metavar="POLICY")
    p.add_argument("--node-death", action="store_true", help="time a node's death instead (coarse x2)")
    args = p.parse_args()
    why = unavailable()
    if why is not None:
        sys.exit(f"bench_multinode: {why}")
    if args.node_death:
        node_death(args.steps)
        return
    one_node_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    results = {}
    with tempfile.TemporaryDirectory(prefix="msrl-bench-multinode-") as tmp, LocalCluster(nodes=3, cpus=2) as cluster:
        runs = pathlib.Path(tmp)
        for i, name in enumerate(args.policies):
            over = POLICIES[name]
            three = train(runs, f"three{i}", [*over, f"cluster.address={cluster.address}", "cluster.strategy=SPREAD"],
                          args.steps, cluster.client_env())
            one = train(runs, f"one{i}", over, args.steps, one_node_env)
            results[name] = (three, one)
            print(f"{name}: 3 nodes {three[0]:,.0f} env steps/s (comm {three[1]:.2f}), "
                  f"1 node {one[0]:,.0f} (comm {one[1]:.2f})", flush=True)
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.steps} env steps a run")
    print("| policy | 3 nodes: env steps/s | comm share | 1 node: env steps/s | comm share | 3 nodes / 1 node |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, ((s3, c3), (s1, c1)) in results.items():
        print(f"| {name} | {s3:,.0f} | {c3:.2f} | {s1:,.0f} | {c1:.2f} | {s3 / s1:.2f}x |")


if __name__ == "__main__":
    main()
