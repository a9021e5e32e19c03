"""The replica wiring (``msrl/runtime/wiring.py``) without Ray: four processes standing for two
nodes of two replicas each join one Gloo group through a file store; the fragment all-reduces
hierarchically (shared memory within each "node", Gloo between the two leaders) and every
replica ends with the same bits, the mean of the four."""

from __future__ import annotations

import queue
import time
import types

import pytest
import torch
import torch.multiprocessing as mp

from msrl.graph import NodeKind
from msrl.runtime import wiring
from msrl.runtime.transports.shm import available as shm_available
from msrl.runtime.transports.unix_link import available as unix_link_available

KEYS = [("main", r) for r in range(4)]
RANKS = {k: i for i, k in enumerate(KEYS)}


def _peers(pids: list[int]) -> dict:
    return {k: {"node_id": "node-a" if k[1] < 2 else "node-b", "node": "127.0.0.1", "pid": pids[i]}
            for i, k in enumerate(KEYS)}


def test_node_leaders_are_the_first_replica_of_the_fragment_on_each_node():
    peers = _peers([1, 2, 3, 4])
    assert wiring.node_leaders("main", RANKS, peers) == [("main", 0), ("main", 2)]
    assert wiring.node_leaders("main", RANKS, None) == []


def _replica(rank: int, store_path: str, pids: list[int], out: "mp.Queue") -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    spec = types.SimpleNamespace(policy=types.SimpleNamespace(fragments=[types.SimpleNamespace(name="main", device="cpu")]))
    key = KEYS[rank]
    store = dist.FileStore(store_path, len(KEYS))
    groups = wiring.join(spec, key, RANKS, _peers(pids), store, 120.0, "shm", token="test-token")
    ep = wiring.endpoint(spec, types.SimpleNamespace(boundaries=[]), key, RANKS, groups)
    g = torch.Generator().manual_seed(rank)
    flat = torch.randn(1000, generator=g, dtype=torch.float32)
    total = ep._reduce_flat("grads", flat.clone())
    out.put((rank, groups.hierarchical, groups.leaders_group is not None, groups.local_group is not None,
             total.numpy().tobytes()))
    ep.close()
    dist.destroy_process_group()


@pytest.mark.skipif(not shm_available(), reason="no shared-memory group on this machine")
def _spawn(target, n: int, *args) -> list:
    """Runs ``target(rank, conn, out, *args)`` in ``n`` spawned processes and returns what each
    put on ``out``, by rank. The pids are the replicas' own: each names its peers' processes (the
    shared-memory group, the Unix links), so they are started first and told after (``conn``, a
    pipe of pids)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    conns = [ctx.Pipe() for _ in range(n)]
    procs = [ctx.Process(target=target, args=(r, conns[r][1], out, *args)) for r in range(n)]
    for p in procs:
        p.start()
    for parent, _ in conns:
        parent.send([p.pid for p in procs])
    results = []
    try:
        deadline = time.monotonic() + 600
        while len(results) < n and time.monotonic() < deadline:
            try:
                results.append(out.get(timeout=1.0))
            except queue.Empty:
                assert all(p.exitcode in (None, 0) for p in procs), [p.exitcode for p in procs]  # a replica failed
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * n
    return sorted(results, key=lambda r: r[0])


def test_two_nodes_of_two_replicas_all_reduce_hierarchically_to_the_same_bits(tmp_path):
    results = _spawn(_start, len(KEYS), str(tmp_path / "store"))
    assert [r[1] for r in results] == [True] * 4  # every replica all-reduces hierarchically
    assert [r[2] for r in results] == [True, False, True, False]  # one leader a node
    assert [r[3] for r in results] == [True] * 4  # each node's pair through shared memory
    expected = sum(torch.randn(1000, generator=torch.Generator().manual_seed(r), dtype=torch.float32)
                   for r in range(4)) / 4
    first = torch.frombuffer(bytearray(results[0][4]), dtype=torch.float32)
    assert torch.allclose(first, expected, atol=1e-6)
    assert all(r[4] == results[0][4] for r in results)  # the same bits on every replica


def _start(rank: int, conn, out, store_path: str) -> None:
    _replica(rank, store_path, conn.recv(), out)


def test_same_bits_tells_bit_identical_learner_states_from_any_difference():
    """``msrl.runtime.values.same_bits``, how replicas are checked bit-identical: a one-ulp
    change, another dtype, another hyperparameter or another structure is a difference."""
    import copy

    from msrl.runtime.values import same_bits

    a = {"w": torch.ones(3), "opt": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2)}},
                                     "param_groups": [{"lr": 0.1, "params": [0]}]}}
    assert same_bits(a, copy.deepcopy(a))
    ulp = copy.deepcopy(a)
    ulp["w"][0] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    wider = copy.deepcopy(a)
    wider["w"] = wider["w"].double()
    lr = copy.deepcopy(a)
    lr["opt"]["param_groups"][0]["lr"] = 0.2
    extra = copy.deepcopy(a)
    extra["b"] = torch.zeros(1)
    assert not any(same_bits(a, x) for x in (ulp, wider, lr, extra))


# -- the links of synchronous boundaries, per peer pair ---------------------------------------
LINK_KEYS = [("actor", 0), ("actor", 1), ("actor", 2), ("learner", 0)]
LINK_RANKS = {k: i for i, k in enumerate(LINK_KEYS)}


def _link_boundaries():
    from msrl.graph.fragmented import Boundary

    gather = Boundary("train_step/b0:traj", "train_step", "traj", NodeKind.GATHER, "actor", "learner", 3, 1, "sharded",
                      0, False, pattern=NodeKind.GATHER)
    broadcast = Boundary("train_step/b1:w", "train_step", "w", NodeKind.BROADCAST, "learner", "actor", 1, 3,
                         "replicated", None, False, pattern=NodeKind.BROADCAST)
    return [gather, broadcast]


def _link_replica(rank: int, conn, out, store_path: str, choice: str) -> None:
    import torch.distributed as dist

    pids = conn.recv()
    torch.set_num_threads(1)
    spec = types.SimpleNamespace(policy=types.SimpleNamespace(fragments=[
        types.SimpleNamespace(name="actor", device="cpu"), types.SimpleNamespace(name="learner", device="cpu")]))
    key = LINK_KEYS[rank]
    # actors 0 and 1 share the learner's "node"; actor 2 is on another
    peers = {k: {"node_id": "node-b" if k == ("actor", 2) else "node-a", "node": "127.0.0.1", "pid": pids[i]}
             for i, k in enumerate(LINK_KEYS)}
    groups = wiring.join(spec, key, LINK_RANKS, peers, dist.FileStore(store_path, len(LINK_KEYS)), 120.0, "shm",
                         token="test-token", sync_transport=choice)
    ep = wiring.endpoint(spec, types.SimpleNamespace(boundaries=_link_boundaries()), key, LINK_RANKS, groups)
    gathered, weights = [], []
    for it in range(5):
        if key[0] == "actor":
            # a value larger each iteration: the channel grows (GROW) over every link kind
            ep.gather("train_step/b0:traj", torch.arange(4 * (it + 1), dtype=torch.float64) + 1000 * key[1] + it)
            weights.append(ep.broadcast("train_step/b1:w").numpy().tobytes())
        else:
            gathered.append(ep.gather("train_step/b0:traj").numpy().tobytes())
            ep.broadcast("train_step/b1:w", torch.full((3,), float(it), dtype=torch.float32))
    ep.flush()
    out.put((rank, {r: link.name for r, link in ep.links.items()}, gathered, weights))
    dist.barrier()
    ep.close()
    dist.destroy_process_group()


def _run_links(tmp_path, choice: str) -> list:
    return _spawn(_link_replica, len(LINK_KEYS), str(tmp_path / f"store-{choice}"), choice)


@pytest.mark.skipif(not unix_link_available(), reason="no Unix links on this machine")
def test_synchronous_boundaries_ride_a_unix_link_within_a_node_and_gloo_across_with_the_same_bits(tmp_path):
    """Three actors gather to a learner and get its broadcast: the pairs on one "node" use a Unix
    socket, the pair across nodes Gloo (``cluster.sync_transport=auto``); every value equals, bit
    for bit, what Gloo alone carries."""
    auto, gloo = _run_links(tmp_path, "auto"), _run_links(tmp_path, "gloo")
    learner = LINK_RANKS[("learner", 0)]
    assert auto[learner][1] == {0: "unix", 1: "unix", 2: "gloo"}  # actor 2 is on the other node
    assert auto[0][1] == {1: "unix", 2: "gloo", 3: "unix"} and auto[2][1] == {0: "gloo", 1: "gloo", 3: "gloo"}
    assert all(set(r[1].values()) == {"gloo"} for r in gloo)
    for a, g in zip(auto, gloo):
        assert a[2] == g[2] and a[3] == g[3]  # the same bytes, whichever link carried them
    expected = [torch.cat([torch.arange(4 * (it + 1), dtype=torch.float64) + 1000 * r + it for r in range(3)])
                for it in range(5)]
    assert auto[learner][2] == [e.numpy().tobytes() for e in expected]
    assert auto[0][3][-1] == torch.full((3,), 4.0).numpy().tobytes()
