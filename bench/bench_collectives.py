"""The coarse learner's boundaries at 8-64 actors against the Gloo floor of the same bytes (issue
"At the scale msrl promises", item 4).

Under ``single_learner_coarse`` each iteration the learner gathers every actor's trajectory
(``gather`` along the env axis) and sends every actor its new weights (``broadcast``). Both go
through :class:`msrl.runtime.transports.dist.DistEndpoint` over a Gloo process group: the value encoded by
msrl's codec (:mod:`msrl.runtime.transports.codec`) into one message per peer, posted point to point
(``isend``/``recv``), decoded and concatenated at the learner. The floor moves the same bytes with
Gloo's own collectives in the same processes and the same process group: ``dist.gather`` of one
flat uint8 buffer of the encoded trajectory's size from every actor, ``dist.broadcast`` of one flat
buffer of the weights' encoded size, no encoding, no decoding.

The values are the README's CartPole PPO's at its size: per actor a trajectory of 16 steps x 2 envs
(obs, actions, log-probs, rewards, dones, values; a TensorDict) and the 64-64 actor-critic's weights
(a dict of 10 parameter tensors, ~37 KB).

Each round: every rank at a barrier, the op, a barrier again, timed at the learner (rank 0); the
median of ``--rounds`` rounds after ``--warmup``. ``barrier`` is two barriers alone: what both
columns carry besides the op. On one 2-core machine N+1 processes share 2 cores: the figures are
the cost of the pattern with every process runnable, not of a network.

    python bench/bench_collectives.py --actors 8 32 64
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trajectory(seed: int, t: int = 16):
    """One actor's shard of the README PPO's rollout: ``(t, 2)`` steps x envs."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    n = 2
    return TensorDict({"obs": torch.randn(t, n, 4, generator=g), "actions": torch.randint(0, 2, (t, n), generator=g),
                       "logprobs": torch.randn(t, n, generator=g), "rewards": torch.ones(t, n),
                       "dones": torch.zeros(t, n), "values": torch.randn(t, n, generator=g)}, batch_size=[t, n])


def weights() -> dict[str, torch.Tensor]:
    """The 64-64 actor-critic's parameters (CartPole: 4 observations, 2 actions)."""
    from torch import nn

    torch.manual_seed(0)
    net = nn.ModuleDict({
        "actor": nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2)),
        "critic": nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))})
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _worker(rank: int, world: int, port: int, rounds: int, warmup: int, out: "mp.Queue", steps: int = 16) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from msrl.graph import NodeKind
    from msrl.graph.fragmented import Boundary
    from msrl.runtime.transports.codec import encode
    from msrl.runtime.transports.dist import DistEndpoint

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    n = world - 1
    traj = Boundary("train_step/b0:trajectory", "train_step", "trajectory", NodeKind.GATHER, "actor", "learner", n, 1,
                    "sharded", 1, False)
    bcast = Boundary("train_step/b1:weights", "train_step", "weights", NodeKind.BROADCAST, "learner", "actor", 1, n,
                     "replicated", None, False)
    ranks = {("learner", 0): 0, **{("actor", i): i + 1 for i in range(n)}}
    frag, rep = ("learner", 0) if rank == 0 else ("actor", rank - 1)
    ep = DistEndpoint([traj, bcast], frag, rep, ranks)
    # the same endpoint over Unix links (every pair on this machine: cluster.sync_transport=auto)
    from msrl.runtime.transports.unix_link import UnixLink, UnixLinkServer

    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    server = UnixLinkServer(f"bench-{port}", rank, {r: p for r, p in enumerate(pids) if r != rank})
    dist.barrier()
    ep_unix = DistEndpoint([traj, bcast], frag, rep, ranks, links={r: UnixLink(server, r) for r in range(world) if r != rank},
                           link_server=server)
    mine, w = trajectory(rank, steps), weights()
    traj_bytes, w_bytes = encode(mine).numel(), encode(w).numel()
    flat_t, flat_w = torch.zeros(traj_bytes, dtype=torch.uint8), torch.zeros(w_bytes, dtype=torch.uint8)
    gather_list = [torch.empty_like(flat_t) for _ in range(world)] if rank == 0 else None

    def msrl_gather(ep=ep):
        out = ep.gather(traj.name, None if rank == 0 else mine)
        if rank == 0:
            assert out.batch_size == (steps, 2 * n)
        ep.flush()

    def msrl_broadcast(ep=ep):
        got = ep.broadcast(bcast.name, w if rank == 0 else None)
        if rank != 0:
            assert torch.equal(got["actor.0.weight"], w["actor.0.weight"])
        ep.flush()

    ops = {"msrl gather": msrl_gather,
           "unix gather": lambda: msrl_gather(ep_unix),
           "gloo gather": lambda: dist.gather(flat_t, gather_list, dst=0),
           "msrl broadcast": msrl_broadcast,
           "unix broadcast": lambda: msrl_broadcast(ep_unix),
           "gloo broadcast": lambda: dist.broadcast(flat_w, src=0),
           "barrier": lambda: None}
    times: dict[str, list[float]] = {k: [] for k in ops}
    for i in range(warmup + rounds):
        for name, op in ops.items():  # interleaved: each round measures every op once
            dist.barrier()
            t0 = time.perf_counter()
            op()
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    if rank == 0:
        out.put({"times": {k: statistics.median(v) for k, v in times.items()}, "traj_bytes": traj_bytes,
                 "w_bytes": w_bytes})
    dist.barrier()
    ep_unix.close()
    dist.destroy_process_group()


def measure(n: int, rounds: int, warmup: int, steps: int = 16) -> dict:
    """Medians (seconds) of each op with ``n`` actors and one learner, ``n + 1`` processes."""
    ctx = mp.get_context("fork")  # the torch import shared: 65 processes fit in memory
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, n + 1, port, rounds, warmup, out, steps)) for r in range(n + 1)]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=1800)
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--actors", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=16, help="steps of each actor's trajectory (2 envs)")
    args = p.parse_args()
    print(f"# {platform.node()}: {os.cpu_count()} cores, torch {torch.__version__}, Python {sys.version.split()[0]}; "
          f"median of {args.rounds} rounds (each op between two barriers, at the learner)")
    print("| actors N | trajectory bytes/actor | weights bytes | gather msrl Gloo links (ms) | gather msrl Unix links (ms) "
          "| gather Gloo floor (ms) | ratios Gloo / Unix links | broadcast msrl Gloo links (ms) | broadcast msrl Unix "
          "links (ms) | broadcast Gloo floor (ms) | ratios Gloo / Unix links | two barriers (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.actors:
        r = measure(n, args.rounds, args.warmup, args.steps)
        t = {k: v * 1e3 for k, v in r["times"].items()}
        print(f"| {n} | {r['traj_bytes']} | {r['w_bytes']} | {t['msrl gather']:.2f} | {t['unix gather']:.2f} | "
              f"{t['gloo gather']:.2f} | {t['msrl gather'] / t['gloo gather']:.2f}x / {t['unix gather'] / t['gloo gather']:.2f}x | "
              f"{t['msrl broadcast']:.2f} | {t['unix broadcast']:.2f} | {t['gloo broadcast']:.2f} | "
              f"{t['msrl broadcast'] / t['gloo broadcast']:.2f}x / {t['unix broadcast'] / t['gloo broadcast']:.2f}x | "
              f"{t['barrier']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
