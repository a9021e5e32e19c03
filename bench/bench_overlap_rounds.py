"""Overlapped coarse PPO against ``single`` on Ray, alternating rounds (the main job, steady state).

``bench_runtime.py`` measures every policy once each; on this 2-core VM a row's figure moves by
up to a third from run to run, so the headline ratio of the asynchronous boundaries is taken here
from rounds that alternate ``single``, overlapped coarse x1 and x2 (their boundaries between
processes of this machine over Unix sockets, ``cluster.boundary_transport=auto``, and over gRPC,
``grpc``; x2 also with ``cluster.learner_priority=off``: under ``auto`` its three replicas
outnumber the two cores and the actors run at niceness 10), each row's median over the rounds.

    python bench/bench_overlap_rounds.py --rounds 3
"""

from __future__ import annotations

import argparse
import platform
import statistics

import torch
from bench_runtime import OVERLAP, measure

#: (policy, replicas, boundary kinds, cluster.boundary_transport, cluster.learner_priority)
ROWS = [("single", {}, {}, "auto", "auto"),
        ("single_learner_coarse", {"actor": 1}, OVERLAP, "auto", "auto"),
        ("single_learner_coarse", {"actor": 2}, OVERLAP, "auto", "auto"),
        ("single_learner_coarse", {"actor": 2}, OVERLAP, "auto", "off"),
        ("single_learner_coarse", {"actor": 1}, OVERLAP, "grpc", "auto"),
        ("single_learner_coarse", {"actor": 2}, OVERLAP, "grpc", "auto")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    import ray

    sps: dict[int, list[float]] = {i: [] for i in range(len(ROWS))}
    for r in range(args.rounds):
        for i, (policy, replicas, boundaries, transport, priority) in enumerate(ROWS):
            sps[i].append(measure(policy, replicas, "ray", args.iterations, args.warmup, boundaries=boundaries,
                                  boundary_transport=transport, learner_priority=priority)["sps"])
            if ray.is_initialized():
                ray.shutdown()
        print(f"round {r + 1}: " + ", ".join(f"{s[-1]:.0f}" for s in sps.values()), flush=True)
    base = statistics.median(sps[0])
    print(f"\nmachine: {platform.processor() or platform.machine()}, torch {torch.__version__}, ray {ray.__version__}, "
          f"{args.rounds} rounds x {args.iterations} iterations")
    print("| row | env steps/s per round | median | vs single |")
    print("| --- | --- | --- | --- |")
    for i, (policy, replicas, boundaries, transport, priority) in enumerate(ROWS):
        name = policy + (f" x{replicas['actor']}, overlapped, {'Unix sockets' if transport == 'auto' else 'gRPC'}"
                         + (", learner_priority=off" if priority == "off" else "") if boundaries else "")
        m = statistics.median(sps[i])
        print(f"| {name} | {', '.join(f'{x:.0f}' for x in sps[i])} | {m:.0f} | {m / base:.2f}x |")


if __name__ == "__main__":
    main()
