"""Channel semantics: the comm ops between fragment replicas, one suite for both transports --
``local`` (threads of one process, LocalHub) and ``dist`` (one process per replica over a Gloo
process group, DistEndpoint with the codec; ``dist_split``: the GPU protocol's header + payload;
``dist_shm``: all-reduces through shared memory) -- plus the in-process runtime's failure handling."""

import threading

import pytest
import torch
from channel_suite import run_dist, run_local
from channel_suite import run_threads as run_all
from tensordict import TensorDict

from msrl.graph import NodeKind
from msrl.graph.fragmented import Boundary
from msrl.runtime.channels import ChannelClosed, LocalHub
from msrl.runtime.transports.shm import available as shm_available

TRANSPORTS = ["local", "dist", "dist_split", "dist_shm"]


def boundary(name, op, src_r, dst_r, axis=None, kind="sharded"):
    return Boundary(name, "train_step", "x", op, "a", "b", src_r, dst_r, kind, axis, False)


def test_gather_concatenates_in_replica_order_along_the_axis():
    hub = LocalHub([boundary("g", NodeKind.GATHER, 3, 1, axis=1)])
    shards = [TensorDict({"r": torch.full((2, 2), float(i))}, batch_size=[2, 2]) for i in range(3)]
    fns = {("a", i): (lambda i=i: hub.endpoint("a", i).gather("g", shards[i])) for i in (2, 0, 1)}
    fns[("b", 0)] = lambda: hub.endpoint("b", 0).gather("g")
    out = run_all(fns)[("b", 0)]
    assert out.batch_size == (2, 6)
    assert out["r"][0].tolist() == [0, 0, 1, 1, 2, 2]


def test_scatter_splits_and_broadcast_copies():
    hub = LocalHub([boundary("s", NodeKind.SCATTER, 1, 2, axis=0), boundary("w", NodeKind.BROADCAST, 1, 2, kind="replicated")])
    w = {"p": torch.zeros(3)}
    out = run_all({
        "src": lambda: (hub.endpoint("a", 0).scatter("s", torch.arange(4)), hub.endpoint("a", 0).broadcast("w", w)),
        0: lambda: (hub.endpoint("b", 0).scatter("s"), hub.endpoint("b", 0).broadcast("w")),
        1: lambda: (hub.endpoint("b", 1).scatter("s"), hub.endpoint("b", 1).broadcast("w")),
    })
    assert out[0][0].tolist() == [0, 1] and out[1][0].tolist() == [2, 3]
    out[0][1]["p"] += 1  # a receiver's copy is its own
    assert w["p"].tolist() == [0, 0, 0] and out[1][1]["p"].tolist() == [0, 0, 0]


def test_send_recv_pairs_replicas():
    hub = LocalHub([boundary("t", NodeKind.SEND, 2, 2)])
    out = run_all({
        "s0": lambda: hub.endpoint("a", 0).send("t", torch.tensor(10)),
        "s1": lambda: hub.endpoint("a", 1).send("t", torch.tensor(11)),
        0: lambda: hub.endpoint("b", 0).recv("t"),
        1: lambda: hub.endpoint("b", 1).recv("t"),
    })
    assert (int(out[0]), int(out[1])) == (10, 11)


def test_close_wakes_a_waiting_receiver():
    hub = LocalHub([boundary("g", NodeKind.GATHER, 2, 1, axis=0)])
    threading.Timer(0.2, lambda: hub.close("fragment a replica 1 failed: boom")).start()
    with pytest.raises(ChannelClosed, match="boundary g: fragment a replica 1 failed: boom"):
        hub.endpoint("b", 0).gather("g")


def test_failure_in_one_replica_stops_the_job_with_its_node(spec_factory):
    from msrl.run.job import Job
    from msrl.runtime.local import FragmentError

    job = Job(spec_factory("single_learner_coarse"))
    job.reset()

    def broken(batch):
        raise RuntimeError("learner exploded")

    job.component("learner").learn = broken
    with pytest.raises(FragmentError) as info:
        job.train_step()
    e = info.value
    assert (e.fragment, e.replica) == ("learner", 0)
    assert "learner exploded" in str(e) and "call learner.learn(trajectory)" in str(e) and "ppo.py" in str(e)
    job.close()


# -- one suite, both transports ----------------------------------------------------------------
# Each scenario is (boundaries, (fragment, replica) -> fn(comm)); fns are module-level so the
# spawned processes of the dist transport can import them. The dist transport runs every
# scenario in one world of processes (spawning is the slow part).


def _td(i):
    return TensorDict({"r": torch.full((2, 2), float(i)), "n": TensorDict({"k": torch.full((2, 2), i)}, [2, 2])}, [2, 2])


def _gather_src0(comm):
    return comm.gather("g", _td(0))


def _gather_src1(comm):
    return comm.gather("g", _td(1))


def _gather_src2(comm):
    return comm.gather("g", _td(2))


def _gather_dst(comm):
    return comm.gather("g")


def _scatter_bcast_src(comm):
    comm.scatter("s", {"x": torch.arange(4), "y": torch.arange(8.0).view(4, 2)})
    comm.broadcast("w", {"p": torch.zeros(3), "step": 7})
    comm.send("t", torch.tensor(10))


def _scatter_bcast_src1(comm):
    comm.send("t", torch.tensor(11))


def _scatter_bcast_dst(comm):
    shard = comm.scatter("s")
    w = comm.broadcast("w")
    w["p"] += 1  # a receiver's copy is its own
    got = comm.recv("t")
    return shard["x"].tolist(), shard["y"].tolist(), w["p"].tolist(), w["step"], int(got)


def _allreduce(comm):
    r = comm.replica
    grads = [torch.full((3,), float(r + 1)), torch.full((2, 2), 10.0 * r)]
    for _ in range(3):  # repeated rounds stay in step
        comm.allreduce("grads", grads)
    return [g.tolist() for g in grads]


def _many_messages_src(comm):
    # every send before any receive on the other side, two boundaries interleaved
    for i in range(50):
        comm.send("t", torch.tensor(i))
        comm.broadcast("w", torch.tensor(-i))


def _many_messages_dst(comm):
    return [(int(comm.recv("t")), int(comm.broadcast("w"))) for _ in range(50)]


def _sizes_src(comm):
    # a channel's values change size: grow, shrink, grow past every earlier size, empty
    for n in (3, 1000, 2, 5000, 0, 7):
        comm.send("t", {"x": torch.arange(n), "tag": "v" * (n % 5)})


def _sizes_dst(comm):
    out = []
    for _ in range(6):
        v = comm.recv("t")
        out.append((v["x"].tolist() == list(range(v["x"].numel())), v["x"].numel(), v["tag"]))
    return out


SCENARIOS = {
    "gather": (
        [boundary("g", NodeKind.GATHER, 3, 1, axis=1)],
        {("a", 0): _gather_src0, ("a", 1): _gather_src1, ("a", 2): _gather_src2, ("b", 0): _gather_dst},
    ),
    "scatter_broadcast_send": (
        [boundary("s", NodeKind.SCATTER, 1, 2, axis=0), boundary("w", NodeKind.BROADCAST, 1, 2, kind="replicated"),
         boundary("t", NodeKind.SEND, 2, 2)],
        {("a", 0): _scatter_bcast_src, ("a", 1): _scatter_bcast_src1, ("b", 0): _scatter_bcast_dst, ("b", 1): _scatter_bcast_dst},
    ),
    "allreduce": ([], {("m", r): _allreduce for r in range(3)}),
    "ordering": (
        [boundary("t", NodeKind.SEND, 1, 1), boundary("w", NodeKind.BROADCAST, 1, 1, kind="replicated")],
        {("a", 0): _many_messages_src, ("b", 0): _many_messages_dst},
    ),
    "sizes": ([boundary("t", NodeKind.SEND, 1, 1)], {("a", 0): _sizes_src, ("b", 0): _sizes_dst}),
}


@pytest.fixture(scope="module", params=TRANSPORTS)
def results(request):
    """scenario -> (fragment, replica) -> result, for one transport."""
    if request.param == "local":
        return {name: run_local(*sc) for name, sc in SCENARIOS.items()}
    if request.param == "dist_shm" and not shm_available():
        pytest.skip("shared-memory all-reduce needs Linux")
    names = list(SCENARIOS)
    return dict(zip(names, run_dist([SCENARIOS[n] for n in names], split_payload=request.param == "dist_split",
                                    shm=request.param == "dist_shm")))


def test_gather_concatenates_replicas_in_order(results):
    out = results["gather"][("b", 0)]
    assert out.batch_size == (2, 6)
    assert out["r"][0].tolist() == [0, 0, 1, 1, 2, 2]
    assert out["n", "k"].dtype == torch.int64 and out["n", "k"][1].tolist() == [0, 0, 1, 1, 2, 2]


def test_scatter_splits_broadcast_copies_send_pairs_replicas(results):
    out = results["scatter_broadcast_send"]
    assert out[("b", 0)] == ([0, 1], [[0.0, 1.0], [2.0, 3.0]], [1.0, 1.0, 1.0], 7, 10)
    assert out[("b", 1)] == ([2, 3], [[4.0, 5.0], [6.0, 7.0]], [1.0, 1.0, 1.0], 7, 11)


def test_allreduce_averages_a_fragments_replicas_identically(results):
    out = results["allreduce"]
    assert out[("m", 0)] == [[2.0, 2.0, 2.0], [[10.0, 10.0], [10.0, 10.0]]]
    assert out[("m", 0)] == out[("m", 1)] == out[("m", 2)]


def test_two_boundaries_between_one_pair_keep_their_order(results):
    assert results["ordering"][("b", 0)] == [(i, -i) for i in range(50)]


def test_values_of_changing_size_cross_one_channel_intact(results):
    assert results["sizes"][("b", 0)] == [(True, n, "v" * (n % 5)) for n in (3, 1000, 2, 5000, 0, 7)]


def _hostile_control_src(comm):
    import struct

    import torch.distributed as dist

    # a control buffer announcing a 2**40-byte channel, as a corrupt or hostile peer might send
    control = torch.zeros(16, dtype=torch.uint8)
    control[:12] = torch.frombuffer(bytearray(struct.pack("<4sQ", b"GROW", 1 << 40)), dtype=torch.uint8)
    dist.send(control, comm.ranks[("b", 0)], tag=comm.tags["t"])


def _hostile_control_dst(comm):
    from msrl.runtime.transports.codec import CodecError

    try:
        comm.recv("t")
    except CodecError as e:
        return str(e)
    return "accepted"


def test_a_malformed_control_buffer_is_a_codec_error_not_an_allocation():
    [out] = run_dist([([boundary("t", NodeKind.SEND, 1, 1)], {("a", 0): _hostile_control_src, ("b", 0): _hostile_control_dst})])
    assert "malformed message on boundary t" in out[("b", 0)] and "1099511627776" in out[("b", 0)]


def test_grow_sizes_are_bounded_by_the_limit_before_any_allocation():
    """hypothesis: any received buffer is a message (``None``), a size in ``(0, limit]``, or a
    CodecError naming the boundary and ``cluster.max_message_mb``."""
    import struct

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from msrl.runtime.transports.codec import CodecError
    from msrl.runtime.transports.dist import grow_size

    grow = st.tuples(st.integers(min_value=0, max_value=2**64 - 1), st.binary(max_size=8)).map(
        lambda p: struct.pack("<4sQ", b"GROW", p[0]) + p[1])

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(st.binary(max_size=32), grow), st.integers(min_value=1, max_value=2**40))
    def fuzz(raw, limit):
        buffer = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        try:
            n = grow_size(buffer, limit, "t")
        except CodecError as e:
            assert "boundary t" in str(e) and "cluster.max_message_mb" in str(e)
            return
        assert n is None or 0 < n <= limit
        if raw[:4] == b"GROW" and len(raw) >= 12:
            assert n == struct.unpack("<Q", raw[4:12])[0]

    fuzz()


def test_a_value_over_the_message_limit_is_refused_by_its_sender():
    from msrl.runtime.transports.codec import CodecError
    from msrl.runtime.transports.dist import DistEndpoint

    comm = DistEndpoint([boundary("t", NodeKind.SEND, 1, 1)], "a", 0, {("a", 0): 0, ("b", 0): 1}, max_message=4096)
    with pytest.raises(CodecError, match="over the 4096-byte limit.*cluster.max_message_mb"):
        comm.send("t", torch.zeros(2048))
    assert not comm._pending  # nothing was sent


def _cuda_src(comm):
    x = torch.arange(6.0, device=comm.device).view(2, 3) + comm.replica
    comm.gather("g", {"x": x})
    comm.broadcast("w", {"p": torch.full((4,), 2.5, device=comm.device)})


def _cuda_dst(comm):
    g = comm.gather("g")
    w = comm.broadcast("w")
    return g["x"].device.type, g["x"].cpu().tolist(), w["p"].device.type, w["p"].cpu().tolist()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between two processes needs two GPUs")
def test_cuda_values_move_gpu_to_gpu_over_nccl():
    # a boundary between two CUDA fragments: header over Gloo, tensor bytes over NCCL
    [out] = run_dist([(
        [boundary("g", NodeKind.GATHER, 1, 1, axis=0), boundary("w", NodeKind.BROADCAST, 1, 1, kind="replicated")],
        {("a", 0): _cuda_src, ("b", 0): _cuda_dst},
    )], cuda=True)
    assert out[("b", 0)] == ("cuda", [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], "cuda", [2.5] * 4)


class _Work:
    """A send's work handle: done once ``left`` (a Gloo send only reports it after wait())."""

    def __init__(self, left):
        self.left, self.polls, self.waited = left, 0, False

    def is_completed(self):
        self.polls += 1
        return self.left

    def wait(self):
        self.waited = True


def test_reap_forgets_the_oldest_sends_that_left_and_stops_at_the_first_in_flight():
    import torch

    from msrl.runtime.transports.dist import DistEndpoint

    comm = DistEndpoint([], "actor", 0, {("actor", 0): 0})
    works = [_Work(True), _Work(True), _Work(False), *[_Work(True) for _ in range(500)]]
    comm._pending.extend((w, torch.empty(0)) for w in works)
    comm.reap()
    assert [w for w, _ in comm._pending] == works[2:]  # a later send that left waits behind an earlier one
    assert sum(w.polls for w in works) == 3  # not a scan of every pending send
    comm.reap()
    assert sum(w.polls for w in works) == 4
    comm.flush()
    assert not comm._pending and all(w.waited for w in works[2:])
