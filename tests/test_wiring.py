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

from msrl.runtime import wiring
from msrl.runtime.shm import available as shm_available

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
def test_two_nodes_of_two_replicas_all_reduce_hierarchically_to_the_same_bits(tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    # the pids are the replicas' own: each names its node mates' processes for the shared-memory
    # group, so they are started first and told after (a pipe of pids)
    conns = [ctx.Pipe() for _ in KEYS]
    procs = [ctx.Process(target=_start, args=(r, str(tmp_path / "store"), conns[r][1], out)) for r in range(len(KEYS))]
    for p in procs:
        p.start()
    pids = [p.pid for p in procs]
    for parent, _ in conns:
        parent.send(pids)
    results = []
    try:
        deadline = time.monotonic() + 600
        while len(results) < len(KEYS) and time.monotonic() < deadline:
            try:
                results.append(out.get(timeout=1.0))
            except queue.Empty:
                assert all(p.exitcode in (None, 0) for p in procs), [p.exitcode for p in procs]  # a replica failed
        results.sort()
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * len(KEYS)
    assert [r[1] for r in results] == [True] * 4  # every replica all-reduces hierarchically
    assert [r[2] for r in results] == [True, False, True, False]  # one leader a node
    assert [r[3] for r in results] == [True] * 4  # each node's pair through shared memory
    expected = sum(torch.randn(1000, generator=torch.Generator().manual_seed(r), dtype=torch.float32)
                   for r in range(4)) / 4
    first = torch.frombuffer(bytearray(results[0][4]), dtype=torch.float32)
    assert torch.allclose(first, expected, atol=1e-6)
    assert all(r[4] == results[0][4] for r in results)  # the same bits on every replica


def _start(rank: int, store_path: str, conn, out) -> None:
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
