"""Values cross a boundary onto their consumer's device (the delivery rule, DESIGN.md §3).

The CPU-only tests give the consumer fragment the ``meta`` device (a device other than the
producer's that every torch build has) and check every boundary pattern and transport: the value
arrives on the consumer's device, each tensor copied once, the sender's value untouched. The CUDA
tests run whole jobs with the learner on ``cuda:0`` and the actors on the CPU (skipped without
CUDA).
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch.utils._python_dispatch import TorchDispatchMode

from msrl.cluster.grpc_transport import ITEM, deliver_frame, encode_frame
from msrl.graph import NodeKind
from msrl.graph.fragmented import Boundary
from msrl.runtime.asynchronous import AsyncEndpoint, LocalTransport, Mailbox
from msrl.runtime.channels import LocalHub, deliver
from msrl.runtime.transports.codec import encode

_COPIES = {"aten._to_copy.default", "aten.clone.default", "aten.copy_.default"}


class _CountCopies(TorchDispatchMode):
    """Counts the aten ops that copy a tensor (and where each one's result lives)."""

    def __init__(self):
        super().__init__()
        self.copies: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) in _COPIES:
            self.copies.append((str(func), str(out.device)))
        return out


def _boundary(name, pattern, src_replicas=1, dst_replicas=1, channel="sync", capacity=1):
    op = pattern if channel == "sync" else NodeKind.PUT
    kind = "replicated" if pattern is NodeKind.BROADCAST else "sharded"
    return Boundary(name, "train_step", "v", op, "actor", "learner", src_replicas, dst_replicas, kind, 0, False,
                    pattern=pattern, channel=channel, capacity=capacity)


def _value(number=False):
    """A boundary value of every leaf kind: a tensor, a TensorDict, a nested dict/list (and a
    number, which only a ``send`` or ``broadcast`` carries)."""
    return {"obs": torch.arange(8, dtype=torch.float32).reshape(4, 2),
            "td": TensorDict({"a": torch.ones(4, 3), "b": {"c": torch.zeros(4, dtype=torch.int64)}}, batch_size=[4]),
            "more": [torch.full((4,), 2.0), *([7] if number else [])]}


def _leaves(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, TensorDict):
        return list(value.values(include_nested=True, leaves_only=True))
    if isinstance(value, dict):
        return [t for v in value.values() for t in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _leaves(v)]
    return []


def _assert_on(value, device):
    leaves = _leaves(value)
    assert leaves and all(t.device == torch.device(device) for t in leaves), [t.device for t in leaves]


def test_deliver_moves_each_tensor_once_onto_the_consumers_device():
    value = _value(number=True)
    with _CountCopies() as mode:
        got = deliver(value, "meta")
    _assert_on(got, "meta")
    assert got["td"].device == torch.device("meta") and got["more"][1] == 7
    assert mode.copies == [("aten._to_copy.default", "meta")] * 4  # one move per tensor, no clone first
    with _CountCopies() as mode:
        same = deliver(value, "cpu")
    assert len(mode.copies) == 4 and same["obs"].data_ptr() != value["obs"].data_ptr()  # the receiver's own copy
    same["obs"].add_(1)
    assert value["obs"][0, 0] == 0  # the sender's value never changes


@pytest.mark.parametrize("pattern", ["send", "gather", "scatter", "broadcast"])
def test_a_synchronous_boundary_delivers_on_the_consumers_device(pattern):
    kind = NodeKind(pattern)
    replicas = {"gather": (2, 1), "scatter": (1, 2), "broadcast": (1, 2), "send": (2, 2)}[pattern]
    b = _boundary("traj", kind, src_replicas=replicas[0], dst_replicas=replicas[1])
    hub = LocalHub([b], {"actor": replicas[0], "learner": replicas[1]}, devices={"actor": "cpu", "learner": "meta"})
    value = _value()
    op = "send" if pattern == "send" else pattern
    for r in range(replicas[0]):
        getattr(hub.endpoint("actor", r), op)("traj", value)
    recv = "recv" if pattern == "send" else pattern
    with _CountCopies() as mode:
        got = [getattr(hub.endpoint("learner", r), recv)("traj") for r in range(replicas[1])]
    for g in got:
        _assert_on(g, "meta")
    if pattern != "gather":
        assert mode.copies == []  # moved when it was sent: the receiver takes it as it is
    assert got[0]["obs"].shape == {"gather": (8, 2), "scatter": (2, 2)}.get(pattern, (4, 2))
    _assert_on(value, "cpu")


@pytest.mark.parametrize("mode", ["fifo", "latest"])
def test_an_asynchronous_boundary_delivers_on_the_consumers_device(mode):
    b = _boundary("traj", NodeKind.SEND, channel=mode, capacity=2)
    mailboxes = {("learner", 0): Mailbox({"traj": 2}, timeout_s=60, device="meta")}
    transport = LocalTransport(mailboxes)
    producer = AsyncEndpoint([b], "actor", 0, Mailbox({}), transport)
    consumer = AsyncEndpoint([b], "learner", 0, mailboxes[("learner", 0)], transport)
    with _CountCopies() as count:
        producer.put("traj", _value())
    assert count.copies == [("aten._to_copy.default", "meta")] * 4
    _assert_on(consumer.get("traj"), "meta")


def test_a_network_transport_decodes_onto_the_consumers_device():
    b = _boundary("traj", NodeKind.SEND, channel="fifo", capacity=2)
    mailbox = Mailbox({"traj": 2}, timeout_s=60, device="meta")
    frame = encode_frame(ITEM, 0, 0, 0, {}, encode(_value()).numpy().tobytes())
    deliver_frame([b], "learner", mailbox, frame, ("actor", 0))
    item = mailbox.take("traj", 0)
    _assert_on(item.value, "meta")


# -- whole jobs: learner on cuda:0, actors on the CPU ------------------------------------------------

_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

_POLICIES = {
    "coarse": ["distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2"],
    "overlapped": ["distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2",
                   "distribution_policy.boundaries.trajectories=fifo", "distribution_policy.boundaries.weights=latest"],
    "async_learner": ["distribution_policy.name=async_learner", "distribution_policy.replicas.actor=2"],
    "single_learner_fine": ["distribution_policy.name=single_learner_fine", "distribution_policy.replicas.env=2"],
    "single_learner_fine_batched": ["distribution_policy.name=single_learner_fine", "distribution_policy.replicas.env=2",
                                    "distribution_policy.inference.max_batch=1", "distribution_policy.inference.timeout_ms=5"],
}


def _cuda_job(config, policy, extra=()):
    from msrl.config import build_job_spec, load_config
    from msrl.run.job import Job

    cfg = load_config(config, [*_POLICIES[policy], "runtime=local", "distribution_policy.devices.learner=cuda:0",
                               "train.progress=false", *extra])
    return Job(build_job_spec(cfg))


def _parameter_devices(job):
    """fragment -> the device types of its actors' and learners' weights."""
    return {key[0]: {w.device.type for c in t.components.values() if hasattr(c, "get_weights")
                     for w in c.get_weights().values()} for key, t in ((k, r.trainer) for k, r in job.replicas.items())}


@_CUDA
@pytest.mark.parametrize("policy", list(_POLICIES))
def test_a_cuda_learner_trains_on_values_from_cpu_actors(policy):
    config = "configs/impala_cartpole.yaml" if policy == "async_learner" else "configs/ppo_cartpole.yaml"
    job = _cuda_job(config, policy, ["env.num_envs=8"])
    try:
        job.reset()
        devices = _parameter_devices(job)
        assert devices["learner"] == {"cuda"}, devices
        assert all(d == {"cpu"} for f, d in devices.items() if f != "learner" and d), devices
        records = job.run(3)
        assert records[-1]["env_steps"] > 0
        losses = {k: v for k, v in records[-1]["output"].items() if "loss" in k}
        assert losses and all(v == v and abs(v) != float("inf") for v in losses.values()), records[-1]["output"]
    finally:
        job.close()


@_CUDA
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["coarse", "overlapped"])
def test_a_cuda_learner_with_cpu_actors_reaches_475(tmp_path, policy):
    from msrl.config import load_config
    from msrl.run.python_api import train

    cfg = load_config("configs/ppo_cartpole.yaml", [*_POLICIES[policy], "runtime=local", "distribution_policy.devices.learner=cuda:0",
                                                    "train.progress=false", f"runs_dir={tmp_path}"])
    assert train(cfg).eval_mean >= 475


@_CUDA
def test_multi_learner_replicas_on_cuda_average_their_gradients():
    """The graph's gradient all-reduce on CUDA gradients (the local hub, threads): the two learner
    replicas hold the same weights after every update."""
    from msrl.config import build_job_spec, load_config
    from msrl.run.job import Job

    cfg = load_config("configs/ppo_cartpole.yaml", ["distribution_policy.name=multi_learner", "distribution_policy.replicas.main=2",
                                                    "runtime=local", "distribution_policy.devices.main=cuda:0", "env.num_envs=8"])
    job = Job(build_job_spec(cfg))
    try:
        assert len(job.fragment_graph.collectives) == 1
        job.reset()
        job.run(3)
        w = [t.components["learner"].get_weights() for t in job.replicas_with("learner")]
        assert all(v.device.type == "cuda" for v in w[0].values())
        assert all(torch.equal(w[0][k], w[1][k]) for k in w[0])
    finally:
        job.close()


def test_one_walk_of_boundary_values_counts_and_reduces_tensordicts():
    """The all-reduce and the byte counts walk a value the same way: a TensorDict's tensors are
    reduced and counted (the walk the all-reduce used skipped them)."""
    from msrl.runtime.channels import payload_bytes, tensor_leaves

    value = _value()
    leaves = tensor_leaves(value)
    assert [t.shape for t in leaves] == [(4, 2), (4, 3), (4,), (4,)]
    assert payload_bytes(value) == sum(t.numel() * t.element_size() for t in leaves) == 4 * (8 + 12 + 4) + 8 * 4
    b = _boundary("g", NodeKind.SEND)
    hub = LocalHub([b], {"learner": 2})
    got = {}

    def reduce(r):
        td = TensorDict({"w": torch.full((3,), float(r))}, batch_size=[])
        got[r] = hub.endpoint("learner", r).allreduce("g", td)

    import threading

    threads = [threading.Thread(target=reduce, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert torch.equal(got[0]["w"], torch.full((3,), 0.5)) and torch.equal(got[1]["w"], torch.full((3,), 0.5))
