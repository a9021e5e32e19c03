"""The shared-memory all-reduce of a fragment's replicas on one machine (msrl.runtime.transports.shm)."""

import multiprocessing as mp
import os
import threading
import time
import uuid

import pytest
import torch

from msrl.runtime.transports import shm
from msrl.runtime.transports.shm import ShmGroup, ShmGroupError

pytestmark = pytest.mark.skipif(not shm.available(), reason="ShmGroup needs Linux")

#: (numel, dtype) of the successive all-reduces: growth, shrinking, other dtypes
CALLS = [(10, torch.float32), (9000, torch.float32), (3, torch.float32), (50_000, torch.float64),
         (7, torch.int64), (9000, torch.float32), (9000, torch.float32)]


def _inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(-1000, 1000, (n,), generator=g, dtype=dt) if not dt.is_floating_point
            else torch.randn(n, generator=g, dtype=dt) for n, dt in CALLS]


def _rank_main(uid: str, rank: int, world: int, barrier, out) -> None:
    torch.set_num_threads(1)
    group = ShmGroup(uid, rank, world, pids=None, timeout_s=60, barrier=barrier.wait)
    try:
        out.put((rank, [group.allreduce_(x).numpy() for x in _inputs(rank)]))
    finally:
        group.close()


def test_three_processes_sum_in_rank_order_and_agree_bitwise():
    ctx = mp.get_context("spawn")
    world, uid = 3, f"test-{uuid.uuid4().hex[:8]}"
    barrier, out = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(uid, r, world, barrier, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    inputs = [_inputs(r) for r in range(world)]
    for i, (n, dt) in enumerate(CALLS):
        expected = inputs[0][i].clone()
        for r in range(1, world):
            expected += inputs[r][i]  # rank order
        for r in range(world):
            got = torch.from_numpy(results[r][i])
            assert got.dtype == dt and got.shape == (n,)
            assert torch.equal(got, expected), f"call {i}, rank {r}"


def _pair(uid: str, **kw) -> tuple[ShmGroup, ShmGroup]:
    return ShmGroup(uid, 0, 2, **kw), ShmGroup(uid, 1, 2, **kw)


def test_two_threads_many_calls_no_cross_talk_between_calls():
    # one rank runs ahead by a call at times: its arrival must count for the next call only
    a, b = _pair(f"thr-{uuid.uuid4().hex[:8]}", timeout_s=30)
    xs = [torch.full((1000,), float(i)) for i in range(200)]
    ys = [torch.full((1000,), float(10 * i)) for i in range(200)]
    errors = []

    def run(group, values):
        try:
            for v in values:
                group.allreduce_(v)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=run, args=(b, ys))
    t.start()
    run(a, xs)
    t.join(30)
    a.close(), b.close()
    assert not errors
    for i in range(200):
        assert torch.equal(xs[i], torch.full((1000,), 11.0 * i))
        assert torch.equal(ys[i], xs[i])


def test_world_of_one_is_the_identity():
    g = ShmGroup(f"one-{uuid.uuid4().hex[:8]}", 0, 1)
    x = torch.arange(5.0)
    assert g.allreduce_(x) is x and torch.equal(x, torch.arange(5.0))
    g.close()


def test_bad_arguments_are_errors():
    with pytest.raises(ValueError, match="rank 2 of world 2"):
        ShmGroup("bad", 2, 2)
    with pytest.raises(ValueError, match="3 pids for a world of 2"):
        ShmGroup("bad", 0, 2, pids=[1, 2, 3])
    a, b = _pair(f"bad-{uuid.uuid4().hex[:8]}")
    try:
        with pytest.raises(ValueError, match="contiguous 1-D CPU tensor"):
            a.allreduce_(torch.zeros(2, 3))
        with pytest.raises(ValueError, match="contiguous 1-D CPU tensor"):
            a.allreduce_(torch.zeros(6)[::2])
        with pytest.raises(RuntimeError, match="socket name is taken"):
            ShmGroup(a.uid, 0, 2)
    finally:
        a.close(), b.close()


def test_a_dead_peer_is_named():
    dead = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join()
    uid = f"dead-{uuid.uuid4().hex[:8]}"
    a = ShmGroup(uid, 0, 2, pids=[os.getpid(), dead.pid], timeout_s=60)
    # its socket was never bound (the process ended): the first send says so
    with pytest.raises(ShmGroupError, match="rank 1 has no socket"):
        a.allreduce_(torch.ones(4))
    a.close()
    # bound but never arriving, and its process gone: found by the liveness check
    a, b = ShmGroup(uid, 0, 2, pids=[os.getpid(), dead.pid], timeout_s=60), ShmGroup(uid, 1, 2)
    t0 = time.monotonic()
    with pytest.raises(ShmGroupError, match=rf"rank 1 \(pid {dead.pid}\) died"):
        a.allreduce_(torch.ones(4))
    assert time.monotonic() - t0 < 50  # found before the group's 60 s timeout
    a.close(), b.close()


def test_a_peer_that_never_arrives_times_out():
    a, b = _pair(f"late-{uuid.uuid4().hex[:8]}", timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(ShmGroupError, match="waited more than 1 s"):
        a.allreduce_(torch.ones(4))
    assert 0.9 < time.monotonic() - t0 < 120
    a.close(), b.close()


@pytest.mark.parametrize("sizes", [(4, 9000), (9000, 4)])
def test_buffers_of_different_sizes_are_an_error(sizes):
    # rank 1 larger: it needs a bigger segment than rank 0 made; smaller: the arrivals disagree
    a, b = _pair(f"size-{uuid.uuid4().hex[:8]}", timeout_s=2)
    errors = {}

    def run(rank, group, n):
        try:
            group.allreduce_(torch.ones(n))
        except ShmGroupError as e:
            errors[rank] = str(e)

    t = threading.Thread(target=run, args=(1, b, sizes[1]))
    t.start()
    run(0, a, sizes[0])
    t.join(20)
    a.close(), b.close()
    assert any("different sizes" in e for e in errors.values()), errors


def _forge(address: bytes, message: bytes) -> None:
    """Another process on this machine sends ``message`` to an abstract socket."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(message, address)


def test_a_forged_arrival_from_another_process_is_dropped():
    """A local process that is not the group's sends rank 0 an "ARRV" claiming to be rank 1
    (before rank 1 wrote its slot): rank 0 drops it, counts it, and sums the real values (3.0,
    not the 1.0 a trusted forgery would make it return)."""
    import struct

    uid = f"forge-{uuid.uuid4().hex[:8]}"
    a, b = _pair(uid, pids=[os.getpid(), os.getpid()], timeout_s=30)
    try:
        forger = mp.get_context("spawn").Process(
            target=_forge, args=(b"\0msrl-" + f"{uid}-0".encode(), struct.pack("<4siqq", b"ARRV", 1, 0, 4 * 3)))
        forger.start()
        forger.join(30)
        assert forger.exitcode == 0
        out = {}

        def late_rank_1():
            time.sleep(0.5)  # rank 0 waits first, with the forgery in its queue
            out["b"] = b.allreduce_(torch.full((3,), 2.0)).tolist()

        t = threading.Thread(target=late_rank_1)
        t.start()
        out["a"] = a.allreduce_(torch.full((3,), 1.0)).tolist()
        t.join(30)
        assert out == {"a": [3.0, 3.0, 3.0], "b": [3.0, 3.0, 3.0]}
        assert a.rejected == 1 and b.rejected == 0
    finally:
        a.close()
        b.close()
