"""Central inference with dynamic batching (single_learner_fine with distribution_policy.inference):
the batcher, the buffer shards, the served programs, every algorithm under it, and what it refuses."""

import math
import pathlib
import threading
import time

import pytest
import torch
from tensordict import TensorDict
from test_matrix import ENV_KWARGS, ITERATIONS, TINY, run, spec

from msrl.errors import PartitionError
from msrl.graph import NodeKind
from msrl.policy import load_policy
from msrl.run.job import Job, JobSpec
from msrl.runtime.channels import ChannelClosed
from msrl.runtime.inference import Batcher, ShardedComponent, batch_args, inference_metrics, split_rows
from msrl.runtime.replica import FragmentError


class _Doubler:
    """A served component: one row in, one row out; counts its calls."""

    def __init__(self):
        self.calls = []

    def act(self, obs, scale=1.0):
        self.calls.append(obs.shape[0])
        return obs * 2 * scale, obs.sum(-1)


def _clients(batcher, n, steps, rows=1, delay=None):
    """``n`` client threads, each making ``steps`` requests of ``rows`` rows; returns their results."""
    out = [[] for _ in range(n)]

    def client(i):
        try:
            for t in range(steps):
                if delay is not None:
                    time.sleep(delay(i))
                obs = torch.full((rows, 3), float(10 * i + t))
                out[i].append(batcher.call(i, "act", (obs,), {}))
        finally:
            batcher.leave()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    batcher.serve()
    for t in threads:
        t.join(10)
    return out


def test_a_full_batch_holds_every_client_in_client_order_and_each_gets_its_rows():
    comp = _Doubler()
    b = Batcher(comp, clients=3, max_batch=3, timeout_s=None)
    out = _clients(b, 3, steps=4, rows=2)
    assert b.sizes == [3] * 4 and comp.calls == [6] * 4  # lockstep: every client's rows at once
    for i in range(3):
        for t, (doubled, summed) in enumerate(out[i]):
            assert torch.equal(doubled, torch.full((2, 3), 2.0 * (10 * i + t)))
            assert torch.equal(summed, torch.full((2,), 3.0 * (10 * i + t)))
    assert len(b.latencies) == 12 and all(x >= 0 for x in b.latencies)


def test_max_batch_one_serves_each_request_alone():
    comp = _Doubler()
    b = Batcher(comp, clients=2, max_batch=1, timeout_s=None)
    _clients(b, 2, steps=5)
    assert b.sizes == [1] * 10 and comp.calls == [1] * 10


def test_a_deadline_closes_a_partial_batch_and_a_finished_client_is_not_waited_for():
    comp = _Doubler()
    b = Batcher(comp, clients=2, max_batch=2, timeout_s=0.005)
    # client 1 is slow (40 ms a step): client 0's requests go alone once the deadline passes
    t0 = time.perf_counter()
    _clients(b, 2, steps=3, delay=lambda i: 0.04 if i == 1 else 0.0)
    assert sum(b.sizes) == 6 and 1 in b.sizes
    assert time.perf_counter() - t0 < 120  # (a finished client waited for: the run would never end)
    # without a deadline, the batch closes once the only client still running waits
    b2 = Batcher(_Doubler(), clients=2, max_batch=2, timeout_s=None)
    _clients(b2, 2, steps=1)
    assert b2.sizes == [2]


def test_an_error_in_the_served_call_is_raised_in_every_requester_of_its_batch():
    class Broken:
        def act(self, obs):
            raise FloatingPointError("NaN in the policy")

    b = Batcher(Broken(), clients=2, max_batch=2, timeout_s=None)
    errors = []

    def client(i):
        try:
            b.call(i, "act", (torch.zeros(1, 2),), {})
        except Exception as e:  # noqa: BLE001
            errors.append(e)
            b.fail(e)
        finally:
            b.leave()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    b.serve()
    for t in threads:
        t.join(5)
    assert len(errors) == 2 and all(isinstance(e, FloatingPointError) for e in errors)
    with pytest.raises(ChannelClosed, match="central inference stopped"):
        b.call(0, "act", (torch.zeros(1, 2),), {})


def test_batch_args_and_split_rows_round_trip_and_refuse_what_cannot_batch():
    a = (torch.arange(6.0).view(2, 3), {"mask": torch.ones(2, dtype=torch.bool)}, 0.5)
    b = (torch.arange(3.0).view(1, 3), {"mask": torch.zeros(1, dtype=torch.bool)}, 0.5)
    obs, extra, eps = batch_args([a, b])
    assert obs.shape == (3, 3) and extra["mask"].tolist() == [True, True, False] and eps == 0.5
    td = TensorDict({"x": torch.arange(3)}, batch_size=[3])
    parts = split_rows((obs, td), [2, 1])
    assert torch.equal(parts[0][0], a[0]) and parts[1][1]["x"].tolist() == [2]
    with pytest.raises(ValueError, match="different non-tensor arguments"):
        batch_args([(torch.zeros(1), 0.1), (torch.zeros(1), 0.2)])
    with pytest.raises(TypeError, match="only tensors with one row per env"):
        split_rows("text", [1, 1])


def test_buffer_shards_concatenate_along_their_env_axis_and_checkpoint_as_shards():
    class Shard:
        def __init__(self, v):
            self.v = v

        def gather(self):
            return torch.full((4, 2), float(self.v))  # (T, N/R): env axis 1

        def reset(self):
            self.v = 0

        def state_dict(self):
            return {"v": self.v}

        def load_state_dict(self, s):
            self.v = s["v"]

    comp = ShardedComponent([Shard(1), Shard(2)], {"gather": (1,), "reset": ()})
    assert torch.equal(comp.gather()[:, 2:], torch.full((4, 2), 2.0)) and comp.gather().shape == (4, 4)
    state = comp.state_dict()
    other = ShardedComponent([Shard(0), Shard(0)], {"gather": (1,)})
    other.load_state_dict(state)
    assert [s.v for s in other.shards] == [1, 2]
    with pytest.raises(KeyError, match="a checkpoint of 2 buffer shards for 3 env replicas"):
        ShardedComponent([Shard(0)] * 3, {}).load_state_dict(state)
    comp.reset()
    assert [s.v for s in comp.shards] == [0, 0]
    with pytest.raises(AttributeError, match="sample is not called outside the rollout"):
        getattr(comp, "sample")  # noqa: B009 - the attribute lookup is what raises


def _served(algo, envs, num_envs=4, **inference):
    algorithm, hp, env = TINY[algo]
    pol = load_policy("single_learner_fine").with_overrides(replicas={"env": envs}, inference=inference)
    return JobSpec(algorithm, algorithm.hparams(**hp), env, num_envs, pol, seed=7, total_env_steps=5_000,
                   env_kwargs=ENV_KWARGS.get(algo, {}))


SERVED = ["ppo", "a2c", "a3c", "impala", "ppo_norm", "mappo"]


@pytest.mark.parametrize("envs", [1, 2, 4])
@pytest.mark.parametrize("algo", SERVED)
def test_every_on_policy_algorithm_served_in_full_batches_equals_single_bitwise(algo, envs):
    """Central inference with a batch of every env replica and no deadline acts on exactly the
    lockstep collective's batches: the same weights and metrics as single, bit for bit, while
    the central replica runs the rollout once per env replica on its own buffer shard."""
    a = run(spec(algo, "single", None, None, 4), ITERATIONS[algo])
    b = run(_served(algo, envs), ITERATIONS[algo])
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    assert [{k: float(v) for k, v in m.items()} for m in a[0]] == [{k: float(v) for k, v in m.items()} for m in b[0]]
    ops = {(op, src, dst) for m, _, op, src, dst in b[2] if m == "train_step"}
    assert ops == {(NodeKind.PUT, "env", "learner"), (NodeKind.PUT, "learner", "env")}  # per-replica queues


def _line_of(algo: str, code: str) -> str:
    """``"<algo>.py:<line>"`` of the first line of ``algorithms/<algo>.py`` that contains ``code``."""
    lines = (pathlib.Path(__file__).resolve().parents[1] / "algorithms" / f"{algo}.py").read_text().splitlines()
    return f"{algo}.py:{next(i for i, line in enumerate(lines, 1) if code in line)}"


@pytest.mark.parametrize("algo, where, what", [
    # the first of DQN's two samples in program order: the prioritized branch's
    ("dqn", "batch = self.buffer.sample_many(hp.gradient_steps)", "buffer.sample_many(_t5) -> batch at"),
    ("sac", "action = self.actor.random_action(self.obs)", "'self.obs', written by"),
])
def test_what_cannot_be_served_exactly_is_an_error_naming_the_line(algo, where, what):
    """Off-policy algorithms sample a replay batch from one buffer: shards per env replica would
    sample another batch, so central inference refuses, naming the call and the setting."""
    where = _line_of(algo, where)
    with pytest.raises(PartitionError) as info:
        Job(_served(algo, 2))
    msg = str(info.value)
    assert where in msg and what in msg and "dropping distribution_policy.inference" in msg


def test_dynamic_batches_and_their_statistics():
    """max_batch=1: every request is served alone (an env replica never waits for another);
    the records carry each batch's size and each request's latency, and the job trains."""
    job = Job(_served("ppo", 2, max_batch=1, timeout_ms=1.0))
    try:
        job.reset()
        records = job.run(3)
        T = TINY["ppo"][1]["num_steps"]
        for r in records:
            inf = r["inference"]
            assert inf["batch_sizes"] == [1] * (2 * T) and len(inf["latencies_s"]) == 2 * T
            m = inference_metrics(inf)
            assert m["inference/batch_mean"] == 1.0 and 0 <= m["inference/latency_p50_ms"] <= m["inference/latency_p99_ms"]
            assert all(math.isfinite(v) for k, v in r["output"].items() if k.startswith("losses/"))
        assert job.env_steps == 3 * T * 4
    finally:
        job.close()


def test_a_served_job_resumes_exactly_from_its_state():
    """The buffer shards and the rest of the central replica's state round-trip through
    state_dict: 2 + 2 iterations equal 4 uninterrupted ones."""
    whole = Job(_served("ppo", 2))
    whole.reset()
    whole.run(4)
    first = Job(_served("ppo", 2))
    first.reset()
    first.run(2)
    state = first.state_dict()
    second = Job(_served("ppo", 2))
    second.load_state_dict(state)
    second.run(2)
    try:
        a, b = whole.component("learner").get_weights(), second.component("learner").get_weights()
        assert all(torch.equal(a[k], b[k]) for k in a)
    finally:
        for j in (whole, first, second):
            j.close()


def test_an_error_in_a_served_call_stops_the_job_naming_the_line(monkeypatch):
    job = Job(_served("ppo", 2, max_batch=1))
    try:
        job.reset()
        actor = job.component("actor")

        def broken(obs):
            raise FloatingPointError("observation holds NaN")

        monkeypatch.setattr(actor, "act", broken)
        t0 = time.perf_counter()
        with pytest.raises(FragmentError) as info:
            job.run(1)
        assert time.perf_counter() - t0 < 300  # (the other requester waited for: never)
        assert "observation holds NaN" in str(info.value) and "ppo.py" in str(info.value)
    finally:
        job.close()


def test_msrl_graph_describes_central_inference():
    from msrl.run.printer import format_job

    text = format_job(Job(_served("ppo", 2, max_batch=1, timeout_ms=2.0)))
    assert "## central inference" in text and "fifo queue of 1 per env replica (central inference)" in text
    assert "a batch closes at 1 request(s)" in text and "after 2 ms" in text and "buffer.gather (axis 1)" in text
    assert "_msrl_comm.serve(self, _msrl_served)" in text


def test_msrl_graph_shows_the_serve_region_with_its_bytes():
    """Central inference is a region of the IR (``serve``), lowered to the served function, and
    ``msrl graph`` shows it and what it moves per iteration."""
    from msrl.config import build_job_spec, load_config
    from msrl.graph import NodeKind
    from msrl.run.job import Job
    from msrl.run.printer import format_boundary_bytes, format_job

    job = Job(build_job_spec(load_config("configs/ppo_cartpole.yaml", [
        "distribution_policy.name=single_learner_fine", "runtime=local", "env.num_envs=4",
        "distribution_policy.inference.max_batch=1"])))
    try:
        program = job.fragment_graph.fragment("learner").programs["train_step"]
        serve = [n for n in program if n.kind is NodeKind.SERVE]
        assert len(serve) == 1 and list(program)[0] is serve[0] and serve[0].target == "actor"
        assert any(n.kind is NodeKind.GET for n in serve[0].body.walk())  # the requests are inside it
        text = format_job(job)
        assert "serve actor to env (x2), once per client replica" in text
        measured = format_boundary_bytes(job, job.measure_boundary_bytes())
        line = next(x for x in measured.splitlines() if x.startswith("- serve region"))
        assert line.startswith("- serve region (learner serving actor to env x2): ") and "over its 7 boundaries" in line
        assert not line.startswith("- serve region (learner serving actor to env x2): 0 B "), line
    finally:
        job.close()


def test_a_mailbox_redo_drops_the_lost_producers_items_and_wakes_its_run():
    """Mailbox.redo: the replaced producer's queued items are dropped (another producer's kept), a
    take or check under the old generation raises ProducerReplaced -- at once, and in a take
    already waiting -- and the new generation takes what the replacement sends."""
    from msrl.runtime.asynchronous import Item, Mailbox
    from msrl.runtime.channels import ProducerReplaced

    box = Mailbox({"obs": 4}, timeout_s=60.0)
    for p in (0, 1):
        box.deliver("obs", p, Item(torch.tensor([float(p)]), {}))
    lost = ("env", 1)
    assert box.redo(lost, ["obs"], 1) and not box.redo(lost, ["obs"], 1)  # an old order is not applied twice
    with pytest.raises(ProducerReplaced):
        box.check((lost, 0))
    box.check((lost, 1))
    assert box.take("obs", 0, generation=(("env", 0), 0)).value.item() == 0.0  # the other producer's item kept
    raised = []

    def waiting():  # a run under generation 1 waits; the next redo wakes it
        try:
            box.take("obs", 1, generation=(lost, 1))
        except ProducerReplaced as e:
            raised.append(e)

    t = threading.Thread(target=waiting)
    t.start()
    time.sleep(0.2)
    assert box.redo(lost, ["obs"], 2)
    t.join(30)
    assert not t.is_alive() and len(raised) == 1
    box.deliver("obs", 1, Item(torch.tensor([7.0]), {}))
    assert box.take("obs", 1, generation=(lost, 2)).value.item() == 7.0
    assert box.counts()["generations"] == {"env/1": 2}


class _Rows:
    """A buffer shard keeping what its run inserted; its state is the rows so far."""

    def __init__(self):
        self.rows = []

    def insert(self, x):
        self.rows.append(float(x.item()))

    def state_dict(self):
        return {"rows": list(self.rows)}

    def load_state_dict(self, state):
        self.rows = list(state["rows"])


def test_a_replaced_clients_run_starts_again_from_its_shards_start_and_serves_only_the_replacement():
    """InferenceServer with replaceable clients: client 1's process is lost two steps into its
    run; once the server's mailbox is told (redo), the run stops, its buffer shard goes back to
    the run's start, no action is sent for the lost steps again, and the run serves the
    replacement's fresh steps from the first: the shard holds exactly the replacement's rows, the
    other client's run is untouched, and each client counts one completed run."""
    import types

    from procs import EVENT_TIMEOUT_S, wait_for

    from msrl.runtime.asynchronous import Item, Mailbox
    from msrl.runtime.inference import InferenceServer

    steps = 4
    box = Mailbox({"obs": steps}, timeout_s=60.0)
    sent = []

    class _Async:  # the server's asynchronous side: its mailbox, and what it puts to each client
        mailbox = box
        transport = types.SimpleNamespace(flush=lambda: None)

        def take_from(self, name, producer, cancel=None, generation=None):
            gen = (("env", producer), generation) if generation is not None else None
            return box.take(name, producer, cancel, generation=gen).value

        def put_to(self, name, consumer, value):
            sent.append((consumer, float(value.item())))

    class _Trainer:
        def __init__(self):
            self._components = {"actor": _Doubler(), "buffer": ShardedComponent([_Rows(), _Rows()], {})}

    comm = types.SimpleNamespace(fragment="learner", replica=0, boundaries={}, asynchronous=_Async(),
                                 _fragment_size=lambda: 1)
    plan = types.SimpleNamespace(server="learner", clients="env", clients_count=2, role="actor", max_batch=1,
                                 timeout_ms=None, shard_roles=("buffer",), state_writes=(), sharded_state=(),
                                 sharded_outs=(), live_outs=())

    def served(view, ep):
        for _ in range(steps):
            obs = ep.asynchronous.get("obs")
            action, _ = view._components["actor"].act(obs.reshape(1, 1))
            ep.asynchronous.put("action", action)
            view._components["buffer"].insert(obs)

    trainer = _Trainer()
    server = InferenceServer(plan)
    server.replaceable = True
    done = []
    failed = []

    def serve():
        try:
            done.append(server.serve(trainer, served, comm))
        except BaseException as e:  # noqa: BLE001 - the waits below fail at once, naming it
            failed.append(e)

    def alive(what):  # a wait that fails at once when the serve itself failed
        def check():
            assert not failed, f"the serve failed: {failed[0]!r}"
            return what()
        return check

    t = threading.Thread(target=serve)
    t.start()
    for s in range(steps):
        box.deliver("obs", 0, Item(torch.tensor(float(s)), {}))
    for s in range(2):  # the lost process's first two steps
        box.deliver("obs", 1, Item(torch.tensor(100.0 + s), {}))
    wait_for(alive(lambda: len([c for c, _ in sent if c == 1]) == 2), "client 1's two actions")
    assert server.client_states(box)["env/1"] == {"runs": 0, "stale": False}
    assert box.redo(("env", 1), ["obs"], 1)
    wait_for(alive(lambda: server.redone == 1), "client 1's run to start again")
    wait_for(alive(lambda: not server.client_states(box)["env/1"]["stale"]), "no stale run")
    assert trainer._components["buffer"].shards[1].rows == []  # back at the run's start
    for s in range(steps):  # the replacement's fresh episodes
        box.deliver("obs", 1, Item(torch.tensor(200.0 + s), {}))
    t.join(EVENT_TIMEOUT_S)
    assert not t.is_alive() and done == [None]
    shards = trainer._components["buffer"].shards
    assert shards[1].rows == [200.0, 201.0, 202.0, 203.0] and shards[0].rows == [0.0, 1.0, 2.0, 3.0]
    assert [v for c, v in sent if c == 1] == [200.0, 202.0, 400.0, 402.0, 404.0, 406.0]
    assert server.runs_done == [1, 1] and server.client_states(box)["env/1"] == {"runs": 1, "stale": False}
