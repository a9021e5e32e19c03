"""In-process channels: the comm ops' semantics between threads."""

import threading

import pytest
import torch
from tensordict import TensorDict

from msrl.channels import ChannelClosed, LocalHub
from msrl.graph import NodeKind
from msrl.partition import Boundary


def boundary(name, op, src_r, dst_r, axis=None, kind="sharded"):
    return Boundary(name, "train_step", "x", op, "a", "b", src_r, dst_r, kind, axis, False)


def run_all(fns):
    out, errs = {}, []

    def wrap(k, f):
        try:
            out[k] = f()
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=wrap, args=(k, f)) for k, f in fns.items()]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    if errs:
        raise errs[0]
    return out


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
    from msrl.job import Job
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
