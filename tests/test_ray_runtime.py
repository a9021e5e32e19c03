"""The Ray runtime: fragment replicas as processes, boundaries over Gloo with the codec.

One local Ray instance for the module (4 logical CPUs on the 2-core machine; one thread per
replica)."""

import dataclasses
import os
import signal
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from procs import EVENT_TIMEOUT_S, descendants, popen, stop_tree, tcp_listeners, wait_for  # noqa: E402

from msrl.cluster.bootstrap import init_ray  # noqa: E402
from msrl.graph import NodeKind  # noqa: E402
from msrl.policy import load_policy  # noqa: E402
from msrl.run.job import Job, JobSpec  # noqa: E402
from msrl.runtime.transports.shm import pid_alive  # noqa: E402


@pytest.fixture(scope="module")
def _module_ray():
    """Stops, at the module's end, the Ray that :func:`ray_local` started (one for the module)."""
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def ray_local(_module_ray):
    """A Ray of 4 CPUs on this machine, started once for the module (again after a test that
    stopped it): a job finds it running and leaves it running, as under a cluster it joined;
    every job frees its replicas and placement group when it ends (each test checks that its
    replica processes are gone)."""
    if not ray.is_initialized():
        init_ray(None, num_cpus=4)  # as msrl starts one: workers at niceness 0, a slow start tried again
    yield


def _learner_weights_local(job):
    return {k: v.clone() for k, v in job.component("learner").get_weights().items()}


@pytest.mark.parametrize("boundaries", [None, {"trajectories": "fifo", "weights": "fresh"}], ids=["sync", "lockstep"])
def test_coarse_on_ray_equals_the_local_runtime_bitwise(ray_local, spec_factory, boundaries):
    """Coarse on Ray (one process per replica) computes what the local runtime's synchronous
    coarse computes, bit for bit: over Gloo, and in lockstep over streams (trajectories queued,
    weights a fresh slot: what makes its actors replaceable alone)."""
    from msrl.run.driver import ray_job

    spec = spec_factory("single_learner_coarse")
    local = Job(spec)
    local.reset()
    local_metrics = [local.train_step() for _ in range(3)]
    # on Ray, the actor fragment runs on the cpu_process_group backend: the same program in processes
    remote = ray_job(dataclasses.replace(spec, policy=spec.policy.with_overrides(backends={"actor": "cpu_process_group"},
                                                                                  boundaries=boundaries)))
    try:
        pids = remote.pids()
        assert len(set(pids)) == 3 and os.getpid() not in pids  # one process per replica
        remote.reset()
        records = remote.run(3)
        assert [r["output"] for r in records] == local_metrics
        assert remote.env_steps == local.env_steps == 3 * 16 * 4
        w_remote, w_local = remote.weights("learner"), _learner_weights_local(local)
        assert w_remote.keys() == w_local.keys()
        assert all(torch.equal(w_remote[k], w_local[k]) for k in w_local)
        assert sorted(remote.pop_episode_stats().returns) == sorted(local.pop_episode_stats().returns)
    finally:
        remote.close()
        local.close()
    deadline = time.time() + 20
    while any(pid_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(pid_alive(p) for p in pids), "a replica process outlived its job"


@pytest.mark.parametrize("boundaries", [None, {"trajectories": "fifo", "weights": "fresh"}], ids=["sync", "lockstep"])
def test_a3c_gradients_reduce_across_processes_as_in_one(ray_local, boundaries):
    """A3C's partial gradients from 2 actor processes reach the learner's process through a
    ``reduce`` boundary, over Gloo and over streams, averaged in replica order: the learner's
    weights and the metrics equal the thread runtime's bit for bit."""
    from msrl.algorithms import a3c
    from msrl.run.driver import ray_job

    pol = load_policy("single_learner_coarse").with_overrides(replicas={"actor": 2})
    spec = JobSpec(a3c.ALGORITHM, a3c.A3CConfig(num_steps=5, hidden_sizes=(16,)), "CartPole-v1", 4, pol, seed=5,
                   total_env_steps=10_000)
    local = Job(spec)
    local.reset()
    local_metrics = [local.train_step() for _ in range(4)]
    remote = ray_job(dataclasses.replace(spec, policy=pol.with_overrides(backends={"actor": "cpu_process_group"},
                                                                        boundaries=boundaries)))
    try:
        assert {b.comm_kind if b.channel == "sync" else b.pattern for b in remote.fragment_graph.boundaries
                if b.method == "train_step" and b.src == "actor"} == {NodeKind.REDUCE}
        remote.reset()
        records = remote.run(4)
        assert [{k: float(v) for k, v in r["output"].items()} for r in records] == \
            [{k: float(v) for k, v in m.items()} for m in local_metrics]
        w_remote, w_local = remote.weights("learner"), _learner_weights_local(local)
        assert all(torch.equal(w_remote[k], w_local[k]) for k in w_local)
    finally:
        remote.close()
        local.close()


@pytest.mark.parametrize("intra_node, replicas", [("shm", 2), ("gloo", 2), ("shm", 3)])
def test_multi_learner_on_ray_keeps_replicas_identical_and_equals_local(ray_local, spec_factory, intra_node, replicas):
    from msrl.cluster.options import RayOptions
    from msrl.run.driver import ray_job

    spec = spec_factory("multi_learner", num_envs=2 * replicas)
    spec = dataclasses.replace(spec, policy=spec.policy.with_overrides(replicas={"main": replicas}))
    local = Job(spec)
    local.reset()
    for _ in range(2):
        local.train_step()
    remote = ray_job(spec, RayOptions(intra_node=intra_node))
    try:
        remote.reset()
        remote.run(2)
        w = [remote.weights("learner", r) for r in range(replicas)]
        assert all(torch.equal(w[0][k], w[r][k]) for r in range(1, replicas) for k in w[0])
        w_local = local.component("learner").get_weights()
        assert all(torch.equal(w[0][k], w_local[k]) for k in w_local)
        # the gradients crossed where intra_node says: shared memory, or Gloo
        stats = remote.comm_stats()
        assert {s["intra_node"] for s in stats} == {intra_node}
        assert all(s["op_s"].get("allreduce", 0) > 0 for s in stats)
    finally:
        remote.close()
        local.close()


EXPLODING = """
import dataclasses
from msrl.algorithms.ppo import ALGORITHM as PPO, PPOLearner

class ExplodingLearner(PPOLearner):
    calls = 0

    def learn(self, batch):
        self.calls += 1
        if self.calls >= 2:
            raise RuntimeError("learner exploded")
        return super().learn(batch)

ALGORITHM = dataclasses.replace(PPO, name="exploding", components={**PPO.components, "learner": ExplodingLearner})
"""


def test_a_ctrl_c_while_a_chunk_starts_leaves_no_started_call_unread():
    """A Ctrl-C between the start of the actor replica's call and the learner's is raised once both
    are started and held, so :meth:`~msrl.cluster.actor_manager.ReplicaGroup.kill` reads them: a call
    dropped unread (the actor's, failing at its boundary to a learner that never ran) would have Ray
    print its error as unhandled on the driver's stderr after msrl's interrupted line."""
    from msrl.cluster.actor_manager import ReplicaGroup

    started: list[tuple[str, int]] = []

    class Call:
        def __init__(self, key: tuple[str, int]) -> None:
            self.key = key

        def remote(self, *args: object) -> tuple[str, int]:
            started.append(self.key)  # the key stands for the call's future
            if len(started) == 1:
                os.kill(os.getpid(), signal.SIGINT)  # delivered now: before, it was raised here
            return self.key

    class Actor:
        def __init__(self, key: tuple[str, int]) -> None:
            self.run = Call(key)

    keys = [("actor", 0), ("learner", 0)]
    group = ReplicaGroup(keys, {"actor": ("actor",), "learner": ("learner",)})
    group.actors = [Actor(k) for k in keys]
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            group.call("run", "train_step", 1)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler put back as it was
    finally:
        signal.signal(signal.SIGINT, before)
    assert started == keys and group._abandoned == keys


def test_a_failing_replica_stops_the_job_with_its_node(ray_local, spec_factory, tmp_path):
    import dataclasses

    from msrl.registry import load_algorithm
    from msrl.run.driver import ray_job
    from msrl.runtime.replica import FragmentError

    path = tmp_path / "exploding.py"
    path.write_text(EXPLODING)
    spec = dataclasses.replace(spec_factory("single_learner_coarse", num_envs=4), algorithm=load_algorithm(str(path)))
    remote = ray_job(spec, algorithm_ref=str(path))  # each process imports the algorithm file
    try:
        remote.reset()
        with pytest.raises(FragmentError) as info:
            remote.run(3)
        e = info.value
        assert (e.fragment, e.replica) == ("learner", 0)
        assert "learner exploded" in str(e) and "call learner.learn(trajectory)" in str(e)
        assert remote.actors == []  # every replica process was stopped
    finally:
        remote.close()


def _sigkill_when(run_dir, fragment, rows, timeout_s=EVENT_TIMEOUT_S, sig=None, delay_s=0.0, logged=None):
    """Starts a thread that SIGKILLs (or sends ``sig`` to) replica 0 of ``fragment`` (its pid
    from the run's replicas.json) once the run's metrics.csv has more than ``rows`` lines
    (``delay_s`` later); returns the list the killed pid is appended to, the set of every replica
    pid of the table it read, and the thread. ``logged`` (a list) gets the number of rows
    metrics.csv held when the signal was sent."""
    import json
    import signal
    import threading

    killed: list[int] = []
    waited = {"rows": 0}

    done = threading.Event()

    def killer():
        deadline = time.time() + timeout_s
        while time.time() < deadline and not killed and not done.is_set():
            metrics, table = run_dir / "metrics.csv", run_dir / "replicas.json"
            waited["rows"] = metrics.read_text().count("\n") - 1 if metrics.is_file() else 0
            if waited["rows"] >= rows and table.is_file():
                replicas = json.loads(table.read_text())
                victim = next(r["pid"] for r in replicas if r["fragment"] == fragment)
                time.sleep(delay_s)
                if logged is not None:
                    logged.append(metrics.read_text().count("\n") - 1)
                os.kill(victim, sig if sig is not None else signal.SIGKILL)
                killed.append(victim)
                seen.update(r["pid"] for r in replicas)  # the run's first replicas, the victim's peers too
            done.wait(0.05)

    seen: set[int] = set()
    t = threading.Thread(target=killer, daemon=True)
    t.start()
    t.done = done  # type: ignore[attr-defined]  # set once the run ended: the thread stops looking
    t.never = (lambda: f"the test never signalled a replica: {run_dir / 'metrics.csv'} held {waited['rows']} rows "  # type: ignore[attr-defined]
               f"(waiting for {rows}, with {run_dir / 'replicas.json'}) when the run ended or {timeout_s:.0f} s passed")
    return killed, seen, t


def _alive(pids) -> list[int]:
    """The pids of ``pids`` whose processes still run (exited zombies excluded)."""
    from msrl.cluster.actor_manager import process_running as _running

    return [p for p in pids if _running(p)]


def _run_replica_pids(run_dir, *more) -> set[int]:
    """The replica pids a run's ``replicas.json`` names, with ``more`` pid collections: this
    run's own processes, never the machine's (other jobs may run Ray beside the tests)."""
    import json

    table = run_dir / "replicas.json"
    pids = {r["pid"] for r in json.loads(table.read_text())} if table.is_file() else set()
    for extra in more:
        pids |= set(extra)
    return pids


def _train_killing(tmp_path, capsys, config, overrides, fragment, budget):
    """Trains ``config`` on Ray while SIGKILLing replica 0 of ``fragment`` mid-run; checks what
    every such run must show (the restart announced and counted, the budget completed, each
    iteration once in metrics.csv, no replica process of the run left) and returns the rows."""
    import csv

    from msrl.config import load_config
    from msrl.run.training import train

    assert ray.is_initialized()  # the module's Ray (ray_local): the job runs on it and leaves it running
    cfg = load_config(config, [f"runs_dir={tmp_path}", "name=kill", "runtime=ray", "train.progress=false",
                               f"train.total_env_steps={budget}", "train.checkpoint_every=20", "train.eval_every=0",
                               *overrides])
    killed, seen, t = _sigkill_when(tmp_path / "kill", fragment, rows=30)  # mid-run
    try:
        result = train(cfg)
    finally:
        t.done.set()
    t.join(5)
    assert killed, t.never()
    err = capsys.readouterr().err
    assert "died" in err and "restarting every replica from the checkpoint" in err
    assert "(raylet)" not in err and "Token authentication is enabled" not in err  # msrl's own lines only
    with open(result.run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["iteration"]) for r in rows] == list(range(1, len(rows) + 1))  # each iteration once, in order
    assert result.env_steps == budget // 256 * 256
    assert float(rows[-1]["faults/replica_restarts"]) >= 1
    assert float(rows[-1]["faults/dropped_env_steps"]) >= 0
    assert not _alive(_run_replica_pids(result.run_dir, seen))  # no replica process of the run left behind
    return rows


@pytest.mark.slow  # (the default suite's restart of synchronous coarse: the killed learner's, compared exactly)
def test_a_killed_actor_replica_is_restarted_and_its_work_dropped(ray_local, tmp_path, capsys):
    """SIGKILL one replica process mid-run: the job restarts every replica from the last
    checkpoint, completes, counts the restart and the dropped env steps, and its metrics hold
    each iteration once."""
    _train_killing(tmp_path, capsys, "configs/ppo_cartpole.yaml", [
        "distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2"], "actor", 60000)


DETERMINISTIC = ("iteration", "env_steps", "charts/episodic_return", "losses/value_loss", "losses/policy_loss",
                 "losses/approx_kl", "charts/learning_rate")


def _rows(run_dir):
    import csv

    with open(run_dir / "metrics.csv") as f:
        return [{k: r[k] for k in DETERMINISTIC} for r in csv.DictReader(f)]


#: (budget, checkpoint_every, *overrides) -> (env steps, metrics rows) of an uninterrupted run
_UNINTERRUPTED: dict[tuple, tuple[int, list]] = {}


def _kill_and_compare(tmp_path, capsys, fragment, overrides, budget, every, rows, sig=None, timeout_s=None):
    """Trains the main job uninterrupted, then again sending ``sig`` (SIGKILL) to replica 0 of
    ``fragment`` mid-chunk: the second run restarts from its checkpoint, finishes, and its
    metrics equal the first's iteration by iteration; the dropped env steps count the chunk
    that was running. Returns the second run's last row and stderr."""
    import csv

    from msrl.config import load_config
    from msrl.run.training import train

    assert ray.is_initialized()  # the module's Ray (ray_local)
    over = [f"runs_dir={tmp_path}", "runtime=ray", "train.progress=false", "train.eval_every=0",
            f"train.total_env_steps={budget}", f"train.checkpoint_every={every}", *overrides]
    key = (budget, every, *overrides)
    if key not in _UNINTERRUPTED:  # tests of one config share its uninterrupted run
        # in this process (runtime=local, replicas as threads): the Ray run must equal it bitwise
        whole = train(load_config("configs/ppo_cartpole.yaml", [*over, "runtime=local", "name=whole"]))
        _UNINTERRUPTED[key] = (whole.env_steps, _rows(whole.run_dir))
    if timeout_s is not None:
        over.append(f"cluster.replica_timeout_s={timeout_s}")
    logged: list[int] = []
    killed, seen, t = _sigkill_when(tmp_path / "cut", fragment, rows=rows, sig=sig, delay_s=0.1, logged=logged)
    try:
        cut = train(load_config("configs/ppo_cartpole.yaml", [*over, "name=cut"]))
    finally:
        t.done.set()
    t.join(5)
    assert killed, t.never()
    err = capsys.readouterr().err
    assert "restarting every replica from the checkpoint" in err
    assert cut.env_steps == _UNINTERRUPTED[key][0] == budget // 256 * 256
    assert _rows(cut.run_dir) == _UNINTERRUPTED[key][1]  # the restart continued exactly
    with open(cut.run_dir / "metrics.csv") as f:
        last = list(csv.DictReader(f))[-1]
    assert float(last["faults/replica_restarts"]) == 1
    # the driver had logged `logged[0]` iterations, the checkpoint was at most at the last multiple
    # of `every` before them: the dropped steps hold every logged iteration after it (and whatever
    # of the running chunk the replicas had done, none if the signal came between two chunks)
    assert float(last["faults/dropped_env_steps"]) >= (logged[0] - logged[0] // every * every) * 256
    assert not _alive(_run_replica_pids(cut.run_dir, seen))
    return last, err


def test_a_killed_learner_is_restarted_and_continues_exactly(ray_local, tmp_path, capsys):
    """SIGKILL the learner's process under coarse: every replica restarts from the last
    checkpoint and the run's metrics equal an uninterrupted run's, iteration by iteration."""
    _, err = _kill_and_compare(tmp_path, capsys, "learner", [
        "distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2"], 30720, 10, 25)
    assert "fragment learner replica 0 died" in err


def test_a_killed_multi_learner_replica_is_restarted_and_continues_exactly(ray_local, tmp_path, capsys):
    """Under multi_learner every replica holds a learner: killing one restarts them all from the
    checkpoint, and they stay exact (metrics equal to an uninterrupted run's)."""
    _, err = _kill_and_compare(tmp_path, capsys, "main", [
        "distribution_policy.name=multi_learner", "distribution_policy.replicas.main=2"], 30720, 10, 25)
    assert "fragment main replica 0 died" in err


def test_a_stopped_replica_is_reported_hung_and_restarted(ray_local, tmp_path, capsys):
    """SIGSTOP an actor replica: within cluster.replica_timeout_s the driver names it (fragment,
    replica, pid) as hung, restarts every replica from the checkpoint, counts
    faults/replica_hangs, and the run ends as an uninterrupted one would."""
    import signal

    last, err = _kill_and_compare(tmp_path, capsys, "actor", [
        "distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2"], 30720, 10, 25,
        sig=signal.SIGSTOP, timeout_s=3)
    assert "fragment actor replica 0 (pid " in err and "gave no heartbeat for" in err and "hung" in err
    assert float(last["faults/replica_hangs"]) == 1


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["foreground", "background-job"])
def test_ctrl_c_leaves_no_process_behind(tmp_path, sigint_ignored):
    """SIGINT to ``msrl train`` of a distributed run: it exits, and no process of the run --
    its replicas (``replicas.json``) and every process below it in the process tree, Ray's own
    daemons included -- outlives it; also when it started with SIGINT ignored (a background job
    of a script). Only the run's own processes are looked at: other jobs may run Ray on the same
    machine."""
    import signal
    import subprocess
    import sys

    if ray.is_initialized():
        ray.shutdown()
    proc = popen(
        [sys.executable, "-m", "msrl.run.cli", "train", "configs/ppo_cartpole.yaml", f"runs_dir={tmp_path}", "name=c",
         "runtime=ray", "distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2",
         "train.progress=false", "train.total_env_steps=10000000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, sigint_ignored=sigint_ignored,
    )
    tree: set[int] = set()
    try:
        deadline = time.time() + EVENT_TIMEOUT_S
        metrics = tmp_path / "c" / "metrics.csv"
        while not (metrics.is_file() and metrics.read_text().count("\n") > 20):
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.time() < deadline, f"{metrics} never held 20 rows within {EVENT_TIMEOUT_S:.0f} s"
            time.sleep(0.2)
        replicas = _run_replica_pids(tmp_path / "c")
        assert _alive(replicas), f"no replica named in {tmp_path / 'c' / 'replicas.json'} runs after 20 rows"
        tree = descendants(proc.pid) | replicas
        assert len(tree) > len(replicas), "the run's Ray processes were not found below it"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)
    finally:
        stop_tree(proc)  # a failed test stops what it started, Ray's processes below it too
    assert proc.returncode == 130  # an interruption, not a crash
    deadline = time.time() + 20
    while _alive(tree) and time.time() < deadline:
        time.sleep(0.2)
    left = _alive(tree)
    assert not left, f"processes of the run outlived Ctrl-C: {[_cmdline(p) for p in left]}"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f"{pid}: " + f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return f"{pid}: (gone)"


def test_a_cuda_fragment_without_a_gpu_bundle_is_a_placement_error(spec_factory):
    from msrl.errors import PlacementError
    from msrl.run.driver import ray_job

    spec = spec_factory("single_learner_coarse")
    spec = dataclasses.replace(spec, policy=spec.policy.with_overrides(devices={"learner": "cuda:0"}))
    with pytest.raises(PlacementError, match=r"fragment\(s\) learner hold CUDA tensors but cluster.gpus_per_replica=0"):
        ray_job(spec)


def test_per_fragment_bundles_give_each_fragment_its_cpus_and_threads(ray_of_4_cpus, spec_factory):
    """``cpus_per_replica={"learner": 2}``: the learner's bundle holds 2 CPUs and its process 2
    torch threads, every actor's 1 (RLlib's per-learner and per-env-runner CPUs); a mapping the
    cluster cannot hold names each fragment's bundle; a fragment the policy lacks is refused."""
    from msrl.cluster.options import RayOptions
    from msrl.errors import PlacementError
    from msrl.run.driver import ray_job

    spec = spec_factory("async_learner")  # 2 actor replicas and a learner
    job = ray_job(spec, RayOptions(cpus_per_replica={"learner": 2}))
    try:
        assert job.bundles == [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 2.0}]
        rows = {(r["fragment"], r["replica"]): r for r in job.replica_table()}
        assert {k: r["threads"] for k, r in rows.items()} == {("actor", 0): 1, ("actor", 1): 1, ("learner", 0): 2}
        job.reset()
        assert job.run(2)[-1]["output"] is not None
    finally:
        job.close()
    with pytest.raises(PlacementError, match=r"^3 replicas \(3 bundles \(actor: 1 CPU x2, learner: 3 CPU\), "
                                             r"cluster.cpus_per_replica\) need 5 CPUs; the Ray cluster has 4$"):
        ray_job(spec, RayOptions(cpus_per_replica={"learner": 3}))
    with pytest.raises(ValueError, match=r"cluster.cpus_per_replica names fragment\(s\) learnr, which the policy does "
                                         r"not have; its fragments: actor, learner"):
        ray_job(spec, RayOptions(cpus_per_replica={"learnr": 2}))


def test_a_per_fragment_gpu_bundle_is_checked_against_the_cuda_fragments(spec_factory):
    """``gpus_per_replica`` per fragment: a CUDA fragment it leaves without a GPU is refused
    before Ray starts, naming the fragment and the mapping."""
    from msrl.cluster.options import RayOptions
    from msrl.errors import PlacementError
    from msrl.run.driver import ray_job

    spec = spec_factory("single_learner_coarse")
    spec = dataclasses.replace(spec, policy=spec.policy.with_overrides(devices={"learner": "cuda:0"}))
    with pytest.raises(PlacementError, match=r"fragment\(s\) learner hold CUDA tensors but cluster.gpus_per_replica "
                                             r"gives them none \(\{'actor': 1\}\).*\{learner: 1\}"):
        ray_job(spec, RayOptions(gpus_per_replica={"actor": 1}))


@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_overlapped_coarse_streams_between_its_processes(ray_local, spec_factory, transport):
    """Coarse with its boundaries made asynchronous, on Ray: the consumers' servers are Unix
    sockets (every replica on this machine, ``cluster.boundary_transport=auto``) or gRPC servers
    on the node's address, never a wildcard (``grpc``); the actors' streams carry every
    trajectory (no frame refused, none dropped), and the learner records each one's policy lag.
    With ``cluster.learner_priority=on`` the actors (producer-only) run at niceness 10 above the
    learner; with ``off`` all run at the driver's."""
    import ray

    from msrl.cluster.options import RayOptions
    from msrl.cluster.placement import PRODUCER_NICE
    from msrl.run.driver import ray_job

    spec = spec_factory("single_learner_coarse")
    policy = spec.policy.with_overrides(boundaries={"trajectories": "fifo", "weights": "latest"})
    priority = "on" if transport == "auto" else "off"
    job = ray_job(dataclasses.replace(spec, policy=policy),
                         RayOptions(boundary_transport=transport, learner_priority=priority))
    try:
        nice = dict(zip(job.keys, ray.get([a.priority.remote() for a in job.actors])))
        base = nice[("learner", 0)]
        want = min(19, base + PRODUCER_NICE) if priority == "on" else base
        assert nice == {("learner", 0): base, ("actor", 0): want, ("actor", 1): want}, nice
        job.reset()
        records = job.run(12)
        # one trajectory of each actor per iteration; a lag counts the learner's updates since the
        # weights its actor acted with, so in iteration k (from 0) it is at most k whatever the timing
        assert [len(r["policy_lags"]) for r in records] == [2] * 12
        assert all(0 <= lag <= k for k, r in enumerate(records) for lag in r["policy_lags"]), [
            r["policy_lags"] for r in records]
        stats = job.comm_stats()
        servers = [a for s in stats for a in s["async"]["servers"]]
        assert len(servers) == 3  # the learner (trajectories) and both actors (weights)
        if transport == "auto":
            assert all(a.startswith("unix:/") for a in servers)
        else:
            assert all(not a.startswith(("unix:", "0.0.0.0", "[::]")) for a in servers)
        assert all(s["async"]["rejected"] == [] and s["async"]["dropped"] == 0 for s in stats)
        assert all(s["op_s"].get("put", 0) > 0 or s["op_s"].get("get", 0) > 0 for s in stats)
        if transport == "auto":  # a SIGKILLed consumer's socket directory goes with the job
            os.kill(job.pids()[-1], signal.SIGKILL)
    finally:
        job.close()
    if transport == "auto":
        assert not any(os.path.exists(os.path.dirname(a[len("unix:"):])) for a in servers)


def test_central_inference_on_ray_equals_the_local_runtime_bitwise_and_serves_dynamic_batches(ray_local, spec_factory):
    """single_learner_fine with central inference on Ray: the env processes stream to the central
    replica's Unix-socket server (every replica on this machine), which runs one rollout per env
    replica. In full batches it computes what the local runtime computes, bit for bit; with max_batch=1 every
    request is served alone and the records carry the batches and latencies."""
    from msrl.run.driver import ray_job

    spec = spec_factory("single_learner_fine")
    full = dataclasses.replace(spec, policy=spec.policy.with_overrides(inference={}))
    local = Job(full)
    local.reset()
    local_metrics = [local.train_step() for _ in range(3)]
    job = ray_job(full)
    try:
        job.reset()
        records = job.run(3)
        assert [r["output"] for r in records] == local_metrics
        w_remote, w_local = job.weights("learner"), _learner_weights_local(local)
        assert all(torch.equal(w_remote[k], w_local[k]) for k in w_local)
        assert all(r["inference"]["batch_sizes"] == [2] * 16 for r in records)  # T=16 steps, both env replicas
        stats = job.comm_stats()
        servers = [a for s in stats for a in s["async"]["servers"]]
        assert len(servers) == 3 and all(a.startswith("unix:/") for a in servers)  # one machine
        assert all(s["async"]["rejected"] == [] and s["async"]["dropped"] == 0 for s in stats)
    finally:
        job.close()
        local.close()
    dynamic = dataclasses.replace(spec, policy=spec.policy.with_overrides(inference={"max_batch": 1, "timeout_ms": 1.0}))
    job = ray_job(dynamic)
    try:
        job.reset()
        records = job.run(3)
        assert all(r["inference"]["batch_sizes"] == [1] * 32 and len(r["inference"]["latencies_s"]) == 32
                   for r in records)
        assert job.env_steps == 3 * 16 * 4
    finally:
        job.close()


@pytest.mark.slow  # (central inference replaces a lost env replica alone by default; this is its restart mode)
def test_a_killed_env_replica_under_central_inference_is_restarted_and_its_work_dropped(ray_local, tmp_path, capsys):
    """PPO under single_learner_fine with dynamic batching and ``cluster.on_replica_loss:
    restart``, one env process SIGKILLed mid-run: the central replica, waiting on the dead
    replica's queue, is stopped with every replica; the job restarts from the last checkpoint in
    fresh processes, completes, and counts the restart and the dropped env steps; every
    iteration is in metrics.csv once."""
    rows = _train_killing(tmp_path, capsys, "configs/ppo_cartpole.yaml", [
        "distribution_policy.name=single_learner_fine", "distribution_policy.inference.max_batch=1",
        "distribution_policy.inference.timeout_ms=1", "cluster.on_replica_loss=restart"], "env", 40000)
    assert all(r["inference/batch_mean"] == "1.0" for r in rows)


@pytest.mark.slow  # (async_learner replaces a lost actor alone by default; this is its restart mode)
def test_a_killed_actor_under_async_learner_is_restarted_and_its_work_dropped(ray_local, tmp_path, capsys):
    """IMPALA under async_learner, one actor process SIGKILLed mid-run: the learner, waiting on
    the dead actor's queue, is stopped with every replica, the job restarts from the last
    checkpoint in fresh processes (new boundary servers, a new token), completes, and counts the
    restart and the dropped env steps; every iteration is in metrics.csv once."""
    rows = _train_killing(tmp_path, capsys, "configs/impala_cartpole.yaml", ["cluster.on_replica_loss=restart"], "actor",
                          60000)
    assert all(r["async/policy_lag_mean"] != "" for r in rows)


def test_replace_under_a_policy_that_cannot_is_one_config_error_naming_each_fragments_reason(tmp_path):
    """cluster.on_replica_loss=replace under synchronous coarse: refused before Ray starts or a
    run directory is made, naming the key, each fragment's reason and the policies that replace."""
    from msrl.config import ConfigError, load_config
    from msrl.run.training import train

    cfg = load_config("configs/ppo_cartpole.yaml", [f"runs_dir={tmp_path}", "name=x", "runtime=ray",
                                                    "distribution_policy.name=single_learner_coarse",
                                                    "distribution_policy.replicas.actor=2", "cluster.on_replica_loss=replace"])
    with pytest.raises(ConfigError) as info:
        train(cfg)
    msg = str(info.value)
    assert msg.startswith("cluster.on_replica_loss=replace: no fragment of policy single_learner_coarse can be replaced")
    assert "actor: a synchronous boundary: train_step/b0:trajectory" in msg and "learner: it holds the learner" in msg
    assert "async_learner, overlapped coarse" in msg and "trajectories=fifo, weights=fresh" in msg
    assert not (tmp_path / "x").exists()


def test_which_fragments_are_replaced_alone_per_policy():
    """msrl.runtime.elastic: under auto, async_learner's and overlapped coarse's actors and
    central inference's env replicas (with an ``inference:`` section) are replaced alone;
    synchronous coarse, multi_learner and the fine policy's lockstep collective restart (each
    reason named); restart replaces nothing."""
    from msrl.config import build_job_spec, load_config
    from msrl.run.job import compile_job
    from msrl.runtime.elastic import replaceable, replaced_fragments

    def fg(config, *over):
        return compile_job(build_job_spec(load_config(config, ["name=x", *over])), True, 1 << 20).fragment_graph

    impala = fg("configs/impala_cartpole.yaml")
    assert replaced_fragments("auto", impala) == {"actor"} and replaced_fragments("restart", impala) == set()
    overlapped = fg("configs/ppo_cartpole.yaml", "distribution_policy.name=single_learner_coarse",
                    "distribution_policy.boundaries.trajectories=fifo", "distribution_policy.boundaries.weights=latest")
    assert replaced_fragments("auto", overlapped) == {"actor"}
    lockstep = fg("configs/ppo_cartpole.yaml", "distribution_policy.name=single_learner_coarse",
                  "distribution_policy.boundaries.trajectories=fifo", "distribution_policy.boundaries.weights=fresh")
    assert replaced_fragments("auto", lockstep) == {"actor"} and replaceable(lockstep)["learner"] == "it holds the learner"
    fine = fg("configs/ppo_cartpole.yaml", "distribution_policy.name=single_learner_fine",
              "distribution_policy.inference.max_batch=1")
    assert replaceable(fine)["env"] is None and replaced_fragments("auto", fine) == {"env"}
    lockstep_fine = fg("configs/ppo_cartpole.yaml", "distribution_policy.name=single_learner_fine")
    assert replaceable(lockstep_fine)["env"].startswith("a synchronous boundary")  # no inference: section
    assert replaced_fragments("auto", lockstep_fine) == set()
    multi = fg("configs/ppo_cartpole.yaml", "distribution_policy.name=multi_learner", "distribution_policy.replicas.main=2")
    assert replaceable(multi) == {"main": "it holds the learner"} and replaced_fragments("auto", multi) == set()


def _train_replacing(tmp_path, capsys, config, overrides, sig=None, timeout_s=None, fragment="actor"):
    """Trains ``config`` on Ray (``cluster.on_replica_loss: auto``) while sending ``sig``
    (SIGKILL) to replica 0 of ``fragment`` mid-chunk; checks what every replacement must show: that
    replica alone started again and rejoined (the learner's and the other replica's processes the
    same from start to end, replicas.json naming the replacement), the learner's iteration count and the
    job's env steps never going back, the replacement counted (faults/replaced_replicas, no
    restart), the whole budget trained while learning went on, no replica process left. Returns
    the last metrics row and stderr."""
    import csv
    import json

    from msrl.config import load_config
    from msrl.run.training import train

    budget = 40960
    over = [f"runs_dir={tmp_path}", "name=elastic", "runtime=ray", "train.progress=false",
            f"train.total_env_steps={budget}", "train.checkpoint_every=20", "train.eval_every=0", *overrides]
    if timeout_s is not None:
        over.append(f"cluster.replica_timeout_s={timeout_s}")
    run_dir = tmp_path / "elastic"
    killed, seen, t = _sigkill_when(run_dir, fragment, rows=15, sig=sig, delay_s=0.2)
    try:
        result = train(load_config(config, over))
    finally:
        t.done.set()
    t.join(5)
    assert killed, t.never()
    err = capsys.readouterr().err
    assert "replaced it alone in " in err and f"fragment {fragment} replica 0" in err, err[-4000:]
    assert "restarting every replica" not in err and "(raylet)" not in err
    after = {(r["fragment"], r["replica"]): r["pid"] for r in json.loads((run_dir / "replicas.json").read_text())}
    assert after[(fragment, 0)] not in seen and killed[0] not in after.values()  # a new process for replica 0
    assert {after[(fragment, 1)], after[("learner", 0)]} <= seen  # the others never restarted
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["iteration"]) for r in rows] == list(range(1, len(rows) + 1))
    steps = [int(r["env_steps"]) for r in rows]
    assert steps == sorted(steps) and result.env_steps == budget // 512 * 512 == steps[-1]
    assert float(rows[-1]["faults/replaced_replicas"]) == 1 and float(rows[-1]["faults/replica_restarts"]) == 0
    assert float(rows[-1]["faults/dropped_env_steps"]) >= 0
    recent = [float(r["charts/episodic_return"]) for r in rows[-10:] if r["charts/episodic_return"] not in ("", "nan")]
    assert recent and sum(recent) / len(recent) > 30  # it kept learning (random: ~22)
    # no replica process left: the last ones were killed as the run ended, and a busy machine
    # reaps them a moment later (wait for the event, never a fixed delay)
    pids = _run_replica_pids(run_dir, seen, after.values())
    wait_for(lambda: not _alive(pids), f"the run's replica processes {sorted(_alive(pids))} ending", timeout=120)
    return rows[-1], err


def test_a_killed_actor_under_async_learner_is_replaced_alone(ray_local, tmp_path, capsys):
    """IMPALA under async_learner, one actor process SIGKILLed mid-run: replaced alone (see
    :func:`_train_replacing`)."""
    _train_replacing(tmp_path, capsys, "configs/impala_cartpole.yaml", [])


def test_a_killed_actor_under_lockstep_coarse_is_replaced_alone(ray_local, tmp_path, capsys):
    """PPO under coarse in lockstep over streams (``trajectories: fifo``, ``weights: fresh``:
    synchronous coarse's values while nothing fails), one actor SIGKILLed mid-run: replaced alone,
    the learner waiting at its queue for the replacement's rollout instead of restarting the job;
    every rollout it trained on was made with its newest weights (policy lag 0)."""
    import csv

    _train_replacing(tmp_path, capsys, "configs/ppo_cartpole.yaml", [
        "distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2",
        "distribution_policy.boundaries.trajectories=fifo", "distribution_policy.boundaries.weights=fresh"])
    with open(tmp_path / "elastic" / "metrics.csv") as f:
        lags = [float(r["async/policy_lag_max"]) for r in csv.DictReader(f)]
    assert lags and set(lags) == {0.0}, lags  # the replacement's rollouts too


def test_a_killed_env_replica_under_central_inference_is_replaced_alone(ray_local, tmp_path, capsys):
    """PPO under single_learner_fine with central inference in lockstep batches (``max_batch``:
    every env replica, no deadline), one env process SIGKILLed mid-run: replaced alone (see
    :func:`_train_replacing`) -- the server drops what the lost process sent and serves the
    replacement's fresh episodes from the start of the iteration it was in, the other env
    replica waiting for it at its batch; the learner never restarts."""
    last, _ = _train_replacing(tmp_path, capsys, "configs/ppo_cartpole.yaml", [
        "distribution_policy.name=single_learner_fine", "distribution_policy.inference.max_batch=2"], fragment="env")
    assert float(last["inference/batch_mean"]) > 1.0  # lockstep batches went on after the replacement


@pytest.mark.slow
def test_a_killed_actor_under_overlapped_coarse_is_replaced_alone(ray_local, tmp_path, capsys):
    """PPO -- written for synchronous policies -- under overlapped coarse (trajectories queued,
    weights in a latest slot), one actor SIGKILLed mid-run: replaced alone."""
    _train_replacing(tmp_path, capsys, "configs/ppo_cartpole.yaml", [
        "distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2",
        "distribution_policy.boundaries.trajectories=fifo", "distribution_policy.boundaries.weights=latest"])


@pytest.mark.slow
def test_a_stopped_actor_under_async_learner_is_reported_hung_and_replaced_alone(ray_local, tmp_path, capsys):
    """SIGSTOP an IMPALA actor: within cluster.replica_timeout_s the driver names it hung, kills
    it and replaces it alone; faults/replica_hangs counts it."""
    import signal

    last, err = _train_replacing(tmp_path, capsys, "configs/impala_cartpole.yaml", [], sig=signal.SIGSTOP, timeout_s=3)
    assert "gave no heartbeat for" in err and float(last["faults/replica_hangs"]) == 1


_tcp_listeners = tcp_listeners


LOOPBACK = "0100007F"  # 127.0.0.1


def test_replicas_on_one_machine_listen_on_loopback_only(ray_local, spec_factory):
    """Every replica on this machine: the process group opens no rendezvous port (it meets in
    Ray's key-value store) and Gloo's pairs listen on 127.0.0.1 only. The one other listener of a
    replica process is Ray's own worker server, which a replica without any process group has
    too (shown by a one-replica job). Asynchronous boundaries between them add no TCP listener
    at all (Unix sockets)."""
    from msrl.run.driver import ray_job

    alone = ray_job(spec_factory("single"))
    try:
        ray_own = [a for p in alone.pids() for a in _tcp_listeners(p)]
    finally:
        alone.close()
    assert len(ray_own) == 1 and ray_own[0] != LOOPBACK
    spec = spec_factory("single_learner_coarse")
    overlapped = dataclasses.replace(spec, policy=spec.policy.with_overrides(
        boundaries={"trajectories": "fifo", "weights": "latest"}))
    for s in (spec, overlapped):
        job = ray_job(s)
        try:
            job.reset()
            job.run(2)
            for pid in job.pids():
                listening = _tcp_listeners(pid)
                assert LOOPBACK in listening, listening  # Gloo's pairs
                assert [a for a in listening if a != LOOPBACK] == ray_own, listening  # else Ray's worker server only
            if s is overlapped:  # a stranger with a wrong token is refused, and the metrics count it
                assert job.run(1)[-1]["refused"] == {"connections": 0, "frames": 0, "datagrams": 0}
                _greet_with_a_wrong_token(next(a for st in job.comm_stats() for a in st["async"]["servers"]))
                assert job.run(1)[-1]["refused"] == {"connections": 1, "frames": 0, "datagrams": 0}
        finally:
            job.close()


def _greet_with_a_wrong_token(address: str) -> None:
    """Connects to a boundary server's Unix socket, greets with a wrong token, and reads until
    the server closes the connection (its refusal)."""
    import socket
    import struct

    from msrl.cluster.uds_transport import encode_hello

    assert address.startswith("unix:")
    hello = encode_hello("not-the-job-token", "actor/0")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(address[len("unix:"):])
        sock.sendall(struct.pack("<I", len(hello)) + hello)
        sock.settimeout(EVENT_TIMEOUT_S)
        while sock.recv(4096):
            pass


@pytest.mark.parametrize("policy, boundaries, producers", [
    ("single_learner_coarse", {"trajectories": "fifo", "weights": "latest"}, {"actor"}),
    ("single_learner_coarse", {}, set()),  # synchronous: everyone waits on everyone
    ("single_learner_coarse", {"trajectories": "fifo", "weights": "fresh"}, set()),  # lockstep: actors wait for weights
    ("async_learner", {}, {"actor"}),
    ("single_learner_fine", {}, set()),  # env replicas wait on the central replica's actions
])
def test_learner_priority_lowers_only_producer_only_replicas(spec_factory, policy, boundaries, producers):
    """``cluster.learner_priority``: the producer-only fragments of each policy, and which of
    their replicas each mode lowers -- ``auto`` only on a machine the job's replicas outnumber."""
    from msrl.cluster.placement import producer_only_fragments, producers_to_lower
    from msrl.frontend.pipeline import fragment_graph as partition_job
    from msrl.frontend.probe import probe as run_probe
    from msrl.frontend.tracer import trace
    from msrl.run.job import METHODS

    spec = spec_factory(policy)
    if boundaries:
        spec = dataclasses.replace(spec, policy=spec.policy.with_overrides(boundaries=boundaries))
    graphs = {m: trace(spec.algorithm.trainer, m) for m in METHODS}
    run_probe(graphs, spec)
    fg = partition_job(graphs, spec.policy)
    assert producer_only_fragments(fg) == producers
    keys = [(f.name, r) for f in spec.policy.fragments for r in range(f.replicas)]
    lowered = [k for k in keys if k[0] in producers]
    for cores, auto in ((len(keys) - 1, lowered), (len(keys), [])):  # outnumbered, or not
        peers = {k: {"node_id": "n1", "cores": cores} for k in keys}
        assert producers_to_lower(keys, peers, producers, "auto") == auto
        assert producers_to_lower(keys, peers, producers, "on") == lowered
        assert producers_to_lower(keys, peers, producers, "off") == []
    # two machines: only the outnumbered one's producers (two replicas on one core, the rest on 64)
    peers = {k: {"node_id": "n1" if i < 2 else "n2", "cores": 1 if i < 2 else 64} for i, k in enumerate(keys)}
    assert producers_to_lower(keys, peers, producers, "auto") == [k for k in keys[:2] if k in lowered]


class _Tee:
    """A stderr stand-in that keeps what is written and sets ``seen`` when ``marker`` is written."""

    def __init__(self, marker: str) -> None:
        import threading

        self.marker, self.text, self.seen = marker, [], threading.Event()

    def write(self, s: str) -> int:
        self.text.append(s)
        if self.marker in "".join(self.text):
            self.seen.set()
        return len(s)

    def flush(self) -> None:
        pass


@pytest.fixture
def ray_of_4_cpus():
    """A Ray of its own with 4 logical CPUs for one test (whatever Ray earlier tests left)."""
    if ray.is_initialized():
        ray.shutdown()
    init_ray(None, num_cpus=4)
    yield
    ray.shutdown()


def test_a_restart_waits_for_capacity_saying_so_and_starts_when_it_is_there(ray_of_4_cpus, spec_factory, monkeypatch):
    """A restarting job (``capacity_timeout_s`` set) on a cluster whose free CPUs cannot hold
    its bundles: one line says what it waits for (the bundles, the live nodes, what is free and
    the key that bounds the wait), and once the CPUs are freed the replicas are placed and run;
    with the CPUs never freed, :class:`PlacementError` names ``cluster.capacity_timeout_s``."""
    import sys
    import threading

    from ray.util.placement_group import placement_group, remove_placement_group

    from msrl.cluster.options import RayOptions
    from msrl.errors import PlacementError
    from msrl.run.driver import ray_job

    spec = spec_factory("single_learner_coarse")
    spec = dataclasses.replace(spec, policy=spec.policy.with_overrides(replicas={"actor": 1}))  # 2 bundles of 1 CPU
    tee = _Tee("msrl: waiting for capacity")
    monkeypatch.setattr(sys, "stderr", tee)
    # the live node is big enough (another group holds its CPUs): the note comes once Ray's view
    # of the live nodes has had CAPACITY_SETTLE_S to settle, here at once
    monkeypatch.setattr("msrl.cluster.ray_runtime.CAPACITY_SETTLE_S", 0.0)
    blocker = placement_group([{"CPU": 1}] * 3)  # 1 of the 4 CPUs left
    ray.get(blocker.ready(), timeout=EVENT_TIMEOUT_S)
    made: list = []
    t = threading.Thread(target=lambda: made.append(ray_job(spec, RayOptions(capacity_timeout_s=EVENT_TIMEOUT_S))), daemon=True)
    t.start()
    try:
        assert tee.seen.wait(EVENT_TIMEOUT_S), "".join(tee.text)
        assert not made  # still waiting
        note = next(line for line in "".join(tee.text).splitlines() if line.startswith("msrl: waiting for capacity"))
        assert "the job's 2 replicas need 2 bundles of 1 CPU (PACK), 2 CPU in all" in note, note
        assert "1 live node(s)" in note and "have 4 CPU, 1 CPU free" in note, note
        assert note.endswith(f"cluster.capacity_timeout_s={EVENT_TIMEOUT_S:g} s"), note
    finally:
        remove_placement_group(blocker)
    t.join(EVENT_TIMEOUT_S)
    assert made, "the job never started after the CPUs were freed"
    job = made[0]
    try:
        job.reset()
        assert job.run(1)[-1]["output"] is not None
    finally:
        job.close()
    assert "the cluster holds the job's 2 replicas again after" in "".join(tee.text)

    blocker = placement_group([{"CPU": 1}] * 3)
    ray.get(blocker.ready(), timeout=EVENT_TIMEOUT_S)
    try:
        with pytest.raises(PlacementError, match=r"not placed within 6 s \(cluster.capacity_timeout_s\)"):
            ray_job(spec, RayOptions(capacity_timeout_s=6))
    finally:
        remove_placement_group(blocker)
    # the refused job's pending group was removed with it: every CPU comes back free
    wait_for(lambda: ray.available_resources().get("CPU", 0) == 4, "the 4 CPUs free after the refused job")


def test_a_captured_fragment_in_a_ray_process_equals_the_local_eager_job_and_says_so(ray_local, capfd):
    """``capture: graph`` in a replica process (the host tape here; a CUDA graph on a GPU): the
    iterations equal the local runtime's eager ones bitwise, and the replica's notice -- printed
    in its own process, whose output Ray does not forward -- reaches the driver's stderr."""
    import pathlib

    from msrl.config import build_job_spec, load_config
    from msrl.run.driver import ray_job

    cfg = pathlib.Path(__file__).resolve().parents[1] / "configs" / "ppo_cartpole_gpu_only.yaml"
    over = ["env.num_envs=8", "algorithm.hparams.num_steps=16", "train.total_env_steps=4096"]
    local = Job(build_job_spec(load_config(cfg, over)))
    remote = ray_job(build_job_spec(load_config(cfg, [*over, "distribution_policy.capture.main=graph"])))
    try:
        local.reset(), remote.reset()
        assert [r["output"] for r in remote.run(6)] == [local.train_step() for _ in range(6)]
        assert remote.env_steps == local.env_steps
    finally:
        remote.close()
        local.close()
    err = capfd.readouterr().err
    assert err.count("msrl: fragment main replica 0: train_step captured as ") == 1, err


@pytest.mark.parametrize("boundaries", [None, {"trajectories": "fifo", "weights": "fresh"}], ids=["sync", "lockstep"])
def test_pong_rollouts_cross_processes_compact_and_train_the_local_bits(ray_local, boundaries):
    """Pong through ale-py's vector env (zero-padded stacks, episodes cut at 160 frames so they
    end inside the rollouts), coarse on Ray: each actor sends its rollout as the first stack and
    each step's newest frame (over Gloo, and over a Unix socket when queued), about a quarter of
    the whole rollout's bytes, and the learner trains the bits of the thread runtime, where the
    rollouts cross whole."""
    pytest.importorskip("ale_py.vector_env")
    from msrl.algorithms import ppo
    from msrl.policy import load_policy
    from msrl.run.driver import ray_job
    from msrl.run.job import JobSpec

    spec = JobSpec(ppo.ALGORITHM, ppo.ALGORITHM.hparams(num_steps=32, update_epochs=1, num_minibatches=2),
                   "ALE/Pong-v5", 2, load_policy("single_learner_coarse").with_overrides(
                       replicas={"actor": 1}, boundaries=boundaries),
                   seed=3, total_env_steps=10_000, env_engine="ale_vector", env_wrappers=("atari",),
                   env_kwargs={"max_num_frames_per_episode": 160}, env_num_workers=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each replica's process (oneDNN's convolutions sum by thread)
    try:
        local = Job(spec)  # (the thread runtime: one device, so its rollouts cross whole)
        local.reset()
        local_metrics = [local.train_step() for _ in range(3)]
        local_weights = _learner_weights_local(local)
        local.close()
    finally:
        torch.set_num_threads(threads)
    whole = 2 * 32 * 2 * 4 * 84 * 84  # obs and next_obs of one rollout, bytes
    remote = ray_job(spec)
    try:
        remote.reset()
        records = remote.run(3)
        assert [r["output"] for r in records] == local_metrics
        w_remote = remote.weights("learner")
        assert all(torch.equal(w_remote[k], local_weights[k]) for k in local_weights)
        actor = remote.comm_stats()[0]  # replica order: the actor first
        sent = actor["async"]["bytes_sent"] if boundaries else actor["bytes_sent"]
        assert 0 < sent < 3 * 0.3 * whole, (sent, whole)
    finally:
        remote.close()


@pytest.mark.parametrize("compile_mode", ["off", "inductor"])
def test_replica_processes_are_msrls_own_without_the_config_schema(ray_local, spec_factory, compile_mode):
    """A replica's process is msrl's own: its start-up shortcuts ran before tensordict and the
    optimisers were imported (:func:`msrl.runtime.startup.own_process`), except in a job that compiles a
    fragment; and it never imports the config schema (pydantic's models are the driver's)."""
    from msrl.run.driver import ray_job

    spec = spec_factory("single_learner_coarse")
    if compile_mode != "off":
        spec = dataclasses.replace(spec, policy=spec.policy.with_overrides(compile={"learner": compile_mode}))
    job = ray_job(spec)
    try:
        rows = job.replica_table()
    finally:
        job.close()
    assert [row["config_schema"] for row in rows] == [False] * 3
    for row in rows:
        assert ("tensordict" in row["startup"] and "Optimizer.zero_grad" in row["startup"]) is (compile_mode == "off")


@pytest.mark.parametrize("key, value, valid", [("strategy", "PAK", "PACK or SPREAD"), ("intra_node", "nccl", "shm or gloo"),
                                               ("boundary_transport", "unix", "auto or grpc"),
                                               ("learner_priority", "high", "auto, on, off"),
                                               ("sync_transport", "tcp", "auto, unix, gloo")])
def test_ray_options_are_checked_once_when_made_naming_the_key_and_its_values(key, value, valid):
    """:class:`~msrl.cluster.options.RayOptions` is the one validated value a Ray job receives:
    a bad value is a ``ValueError`` naming the ``cluster.*`` key and what is valid, before any
    job is compiled or Ray started."""
    from msrl.cluster.options import RayOptions

    with pytest.raises(ValueError, match=f"cluster.{key} must be (one of )?{valid}, got '{value}'"):
        RayOptions(**{key: value})
