"""Offline RL through the whole pipeline: BC, discrete CQL, IQL and CQL
(algorithms/{bc,discrete_cql,iql,cql}.py) learn
from Minari datasets that msrl collect wrote, with no env in their loops. The same file under every policy: single, coarse
(the dataset reader beside each actor replica, beside the learner, or a fragment of its own),
async_learner (the reader a prefetching fragment), single_learner_fine and multi_learner (the
dataset sharded over data-parallel learners) -- bitwise where a policy must compute what
single computes; the budget in gradient steps; a run resumed goes on exactly; bad input is one
line before any work."""

import json
import math
import pathlib

import pytest
import torch

import msrl
from msrl.config import ConfigError, build_job_spec, load_config
from msrl.graph import NodeKind
from msrl.run.cli import main
from msrl.run.collect import collect
from msrl.run.job import Job

pytest.importorskip("minari")

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
BC = CONFIGS / "bc_cartpole.yaml"
#: each offline algorithm's config, the tiny dataset of :func:`root` it trains on and its own
#: overrides (discrete CQL copies its target network every 2 steps: the copy is in every run)
OFFLINE = {"bc": (BC, "msrl/cartpole/tiny-v0", []),
           "discrete_cql": (CONFIGS / "discrete_cql_cartpole.yaml", "msrl/cartpole/tiny-v0",
                            ["algorithm.hparams.target_update_interval=2"]),
           "iql": (CONFIGS / "iql_pendulum.yaml", "msrl/pendulum/tiny-v0", []),
           "cql": (CONFIGS / "cql_pendulum.yaml", "msrl/pendulum/tiny-v0", []),
           "awac": (CONFIGS / "awac_pendulum.yaml", "msrl/pendulum/tiny-v0",
                    ["algorithm.hparams.offline_steps=3", "algorithm.hparams.buffer_size=64", "env.num_envs=2"])}
#: env steps of :func:`_run`'s 6 iterations: AWAC's last 3 step its 2 envs (its online phase)
ENV_STEPS = {"awac": 6}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A Minari root holding msrl/cartpole/tiny-v0 (4 noisy episodes of a briefly trained PG
    policy) and msrl/pendulum/tiny-v0 (3 noisy episodes of a briefly trained DDPG policy)."""
    base = tmp_path_factory.mktemp("offline")
    run = msrl.train(CONFIGS / "pg_cartpole.yaml", runs_dir=str(base / "runs"), train__total_env_steps=8000,
                     env__num_envs=2, train__progress=False, train__eval_every=0, eval__episodes=1)
    collect([run.run_dir], "msrl/cartpole/tiny-v0", 4, noise=0.3, seed=0, root=base / "root")
    run = msrl.train(CONFIGS / "ddpg_pendulum.yaml", runs_dir=str(base / "runs"), train__total_env_steps=300,
                     algorithm__hparams__learning_starts=100, train__progress=False, train__eval_every=0,
                     eval__episodes=1)
    collect([run.run_dir], "msrl/pendulum/tiny-v0", 3, noise=0.5, seed=0, root=base / "root")
    return base / "root"


def _cfg(root, *overrides, algo="bc"):
    config, dataset, own = OFFLINE[algo]
    return load_config(config, [f"dataset.id={dataset}", f"dataset.root={root}", "algorithm.hparams.batch_size=16",
                                "algorithm.hparams.hidden_sizes=[16]", "train.total_gradient_steps=20",
                                "train.progress=false", "train.eval_every=0", "eval.episodes=2", *own, *overrides])


def _run(cfg, iterations=6):
    job = Job(build_job_spec(cfg))
    try:
        job.reset()
        metrics = [{k: float(v) for k, v in job.train_step().items()} for _ in range(iterations)]
        weights = {k: v.clone() for k, v in job.component("learner").get_weights().items()}
        comm = {(b.method, b.comm_kind, b.src, b.dst) for b in job.fragment_graph.boundaries}
        return metrics, weights, comm, job.env_steps
    finally:
        job.close()


POLICIES = {
    "coarse x1": ["distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=1"],
    "coarse x1, reader at the learner": ["distribution_policy.name=single_learner_coarse",
                                         "distribution_policy.replicas.actor=1", "distribution_policy.placement.buffer=learner"],
    "coarse x1, reader a fragment": ["distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=1",
                                     "distribution_policy.placement.buffer=replay"],
    "fine": ["distribution_policy.name=single_learner_fine"],
    "multi_learner x1": ["distribution_policy.name=multi_learner", "distribution_policy.replicas.main=1"],
}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("algo", list(OFFLINE))
def test_each_offline_algorithm_computes_under_each_policy_what_it_computes_under_single_bitwise(root, algo, policy):
    a = _run(_cfg(root, algo=algo))
    b = _run(_cfg(root, *POLICIES[policy], algo=algo))
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    assert a[0] == b[0] and all(math.isfinite(v) for m in a[0] for k, v in m.items() if k.startswith("losses/"))
    assert a[3] == b[3] == ENV_STEPS.get(algo, 0)  # the dataset is the experience (and AWAC's online steps)
    if policy.startswith("coarse"):
        src = "replay" if "fragment" in policy else ("learner" if "learner" in policy else "actor")
        if src != "learner":  # the sampled batch crosses to the learner
            assert ("train_step", NodeKind.SEND, src, "learner") in b[2]


@pytest.mark.parametrize("algo", list(OFFLINE))
def test_multi_learner_shards_the_dataset_and_keeps_the_replicas_identical(root, algo):
    job = Job(build_job_spec(_cfg(root, "distribution_policy.name=multi_learner", "distribution_policy.replicas.main=2",
                                  algo=algo)))
    try:
        job.reset()
        for _ in range(5):
            job.train_step()
        buffers = [job.replica("main", r).trainer.components["buffer"] for r in range(2)]
        held = [getattr(b, "dataset_size", b.size) for b in buffers]  # (AWAC's buffer holds online rows too)
        assert held[0] + held[1] == buffers[0].total  # every transition in one shard
        first = [(b.rows if hasattr(b, "rows") else b.storage)["obs"][:8] for b in buffers]
        assert not torch.equal(first[0], first[1])
        w0, w1 = (job.replica("main", r).trainer.components["learner"].get_weights() for r in range(2))
        assert all(torch.equal(w0[k], w1[k]) for k in w0)  # gradients all-reduced
        # one all-reduce per optimiser step: BC's one, IQL's three (value, critics, policy)
        assert {c.comm_kind for c in job.fragment_graph.collectives} == {NodeKind.ALLREDUCE}
    finally:
        job.close()


@pytest.mark.parametrize("policy", [["distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2"],
                                    ["distribution_policy.name=async_learner"]], ids=["coarse x2", "async_learner"])
@pytest.mark.parametrize("algo", list(OFFLINE))
def test_readers_beside_two_actor_replicas_feed_the_learner_their_samples_together(root, algo, policy):
    job = Job(build_job_spec(_cfg(root, *policy, algo=algo)))
    try:
        job.reset()
        records = job.run(4)
        losses = [float(v) for r in records if r["output"] for k, v in r["output"].items() if k.startswith("losses/")]
        assert losses and all(math.isfinite(x) for x in losses)
        ops = {(b.comm_kind, b.src, b.dst) for b in job.fragment_graph.boundaries if b.method == "train_step"}
        kinds = {NodeKind.GATHER, NodeKind.PUT}
        assert any(k in kinds and src == "actor" and dst == "learner" for k, src, dst in ops)
    finally:
        job.close()


@pytest.mark.parametrize("algo", ["bc", "awac"])
def test_a_run_counts_gradient_steps_and_resumes_exactly(root, tmp_path, capsys, algo):
    """AWAC's resumed run crosses into its online phase (at 20 of 30): its envs, buffer and
    counters come back from the checkpoint as they were."""
    own = ["algorithm.hparams.offline_steps=20"] if algo == "awac" else []
    online = 10 * 2 if algo == "awac" else 0  # 10 online iterations of 2 envs
    straight = msrl.train(_cfg(root, f"runs_dir={tmp_path / 'a'}", "train.total_gradient_steps=30", *own, algo=algo))
    first = msrl.train(_cfg(root, f"runs_dir={tmp_path / 'b'}", "train.total_gradient_steps=15",
                            "train.checkpoint_every=5", *own, algo=algo))
    resumed = msrl.train(resume=first.run_dir, train__total_gradient_steps=30)
    assert straight.iterations == resumed.iterations == 30 and straight.env_steps == resumed.env_steps == online
    ours = json.loads((resumed.run_dir / "eval.json").read_text())
    assert ours["gradient_steps"] == 30 and ours["env_steps"] == online
    a, b = (torch.load(r.run_dir / "checkpoints" / "latest.pt", weights_only=False)["actor_weights"]
            for r in (straight, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)
    header = (resumed.run_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "gradient_steps" in header and "charts/gradient_steps_per_s" in header and "charts/SPS" not in header


def test_the_command_line_says_gradient_steps(root, tmp_path, capsys):
    assert main(["train", str(BC), "dataset.id=msrl/cartpole/tiny-v0", f"dataset.root={root}", f"runs_dir={tmp_path}",
                 "train.total_gradient_steps=10", "train.progress=false", "eval.episodes=1",
                 "algorithm.hparams.hidden_sizes=[16]"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert ": 10 iterations, 10 gradient steps, " in line and "env steps" not in line


@pytest.mark.parametrize("overrides, message", [
    (["dataset=null"], "dataset: missing; bc is an offline algorithm, which learns from a dataset"),
    (["train.total_gradient_steps=null", "train.total_env_steps=1000"],
     "train.total_env_steps=1000: bc is an offline algorithm, whose budget is train.total_gradient_steps "
     "(one per iteration), not env steps"),
    (["train.total_env_steps=1000"], "train: both given"),
    (["dataset.path=/x"], "dataset: give the dataset by id or by path, one of them"),
    (["population.size=2", "population.interval=5", "population.explore.learning_rate={min: 0.0001, max: 0.01}"],
     "population: PBT trains algorithms that step their env; bc is an offline one"),
])
def test_an_offline_config_missing_what_it_needs_is_one_line(root, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_job_spec(_cfg(root, *overrides))


def test_an_online_algorithm_with_a_dataset_is_refused(root):
    with pytest.raises(ConfigError, match="dataset: ppo learns from its env, not from a dataset"):
        build_job_spec(load_config(CONFIGS / "ppo_cartpole.yaml", ["dataset.id=msrl/cartpole/tiny-v0"]))
    with pytest.raises(ConfigError, match="train.total_gradient_steps=5: ppo steps its env"):
        build_job_spec(load_config(CONFIGS / "ppo_cartpole.yaml", ["train.total_env_steps=null",
                                                                    "train.total_gradient_steps=5"]))


@pytest.mark.parametrize("overrides, message", [
    (["env.id=Acrobot-v1"], "its observation space is Box.*the env's is Box"),
    (["dataset.id=msrl/none-v0"], "dataset msrl/none-v0 not found under"),
])
def test_a_missing_or_mismatched_dataset_is_one_line_before_any_run_directory(root, tmp_path, capsys, overrides, message):
    import re

    args = ["train", str(BC), "dataset.id=msrl/cartpole/tiny-v0", f"dataset.root={root}", f"runs_dir={tmp_path / 'runs'}",
            "train.progress=false", *overrides]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("algo", ["bc", "awac"])
def test_multi_learner_x2_on_ray_learns_what_it_learns_in_one_process_bitwise(root, tmp_path, algo):
    """The data-parallel learners as Ray processes (each reading its shard of the dataset, the
    gradients all-reduced between processes; AWAC's also stepping their envs from iteration 4 on)
    end with the weights two threads of one process end with, bit for bit."""
    common = ["distribution_policy.name=multi_learner", "distribution_policy.replicas.main=2",
              "train.total_gradient_steps=12", "train.checkpoint_every=12"]
    local = msrl.train(_cfg(root, *common, "runtime=local", f"runs_dir={tmp_path / 'local'}", algo=algo))
    ray = msrl.train(_cfg(root, *common, "runtime=ray", f"runs_dir={tmp_path / 'ray'}", algo=algo))
    assert local.iterations == ray.iterations == 12
    assert local.env_steps == ray.env_steps == (18 if algo == "awac" else 0)  # AWAC: 9 online iterations of 2 envs
    a, b = (torch.load(r.run_dir / "checkpoints" / "latest.pt", weights_only=False)["actor_weights"] for r in (local, ray))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cqls_target_action_is_the_policys_mean_or_a_sample_as_configured(root):
    """``deterministic_backup`` (d3rlpy's target action, the shipped config's) against a sampled
    one (CORL's): both run, each reproducibly, and they learn different critics."""
    mean = _run(_cfg(root, "algorithm.hparams.deterministic_backup=true", algo="cql"))
    again = _run(_cfg(root, "algorithm.hparams.deterministic_backup=true", algo="cql"))
    sampled = _run(_cfg(root, "algorithm.hparams.deterministic_backup=false", algo="cql"))
    assert mean[0] == again[0]
    assert [m["losses/qf_loss"] for m in mean[0][1:]] != [m["losses/qf_loss"] for m in sampled[0][1:]]


def test_cqls_k_sampled_actions_per_state_are_one_pass_of_the_policy_drawing_the_repeated_states_noise():
    """``SquashedGaussianPolicy(obs, g, n_samples=K)`` (CQL's penalty: one network pass over the
    B states, as d3rlpy's ``sample_n_with_log_prob``) draws the very noise the ``B * K`` repeated
    states drew, so its actions and log-probabilities are those of the repeated pass; a wrong
    ``n_samples`` is an error."""
    import gymnasium as gym
    import numpy as np

    from msrl.rl.continuous import SquashedGaussianPolicy

    torch.manual_seed(0)
    policy = SquashedGaussianPolicy(gym.spaces.Box(-np.inf, np.inf, (5,)), gym.spaces.Box(-2, 2, (3,)), (32, 32))
    obs = torch.randn(16, 5)
    g_rep, g_k = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    a_rep, logp_rep = policy(obs.repeat_interleave(4, dim=0), g_rep)
    a_k, logp_k = policy(obs, g_k, n_samples=4)
    assert a_k.shape == (16, 4, 3) and logp_k.shape == (16, 4)
    assert torch.allclose(a_k, a_rep.view(16, 4, 3), atol=1e-6) and torch.allclose(logp_k, logp_rep.view(16, 4), atol=1e-5)
    assert torch.equal(g_rep.get_state(), g_k.get_state())  # the same numbers drawn
    assert a_k.abs().max() <= 2.0 and not torch.equal(a_k[:, 0], a_k[:, 1])
    for bad in (dict(n_samples=0), dict(n_samples=4, deterministic=True)):
        with pytest.raises(ValueError, match="n_samples"):
            policy(obs, g_k, **bad)


#: the native twin of each offline algorithm's env (gpu_only steps native envs only)
NATIVE_ENV = {"msrl/cartpole/tiny-v0": "msrl/CartPole-v1", "msrl/pendulum/tiny-v0": "msrl/Pendulum-v1"}


@pytest.mark.parametrize("algo", list(OFFLINE))
def test_each_offline_algorithm_runs_under_gpu_only_as_under_single_on_the_native_env(root, algo):
    """gpu_only (one cuda_kernel fragment, its host build here) with the env's native twin,
    whose spaces are the dataset's: the same file computes what single computes on that env."""
    env = f"env.id={NATIVE_ENV[OFFLINE[algo][1]]}"
    a = _run(_cfg(root, env, algo=algo))
    b = _run(_cfg(root, env, "distribution_policy.name=gpu_only", algo=algo))
    assert a[2] == b[2] == set()  # one fragment: nothing crosses
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    assert a[0] == b[0] and a[3] == b[3] == ENV_STEPS.get(algo, 0)


def test_the_offline_benchmarks_state_dir_continues_a_run_exactly(root, tmp_path, monkeypatch):
    """``bench/bench_offline.py --state-dir``: a run stopped after its first evaluation and run
    again continues from its checkpoint to the curve and final evaluation of an unbroken run
    (CQL on HalfCheetah at 50,000 gradient steps outlasts a sitting); a finished one is read back."""
    bench = pathlib.Path(__file__).resolve().parents[1] / "bench"
    monkeypatch.syspath_prepend(str(bench))
    monkeypatch.chdir(tmp_path)
    import bench_offline

    dataset = str(root / "msrl/pendulum/tiny-v0")
    whole = bench_offline.run_msrl("iql", dataset, 1, 4, 2, str(tmp_path / "w"))
    state = tmp_path / "state"
    first = bench_offline.run_msrl("iql", dataset, 1, 2, 2, str(tmp_path / "w"), str(state))
    assert [c[0] for c in first["curve"]] == [2]
    (state / "iql_s1" / "eval.json").unlink()  # as if it had stopped there
    continued = bench_offline.run_msrl("iql", dataset, 1, 4, 2, str(tmp_path / "w"), str(state))
    assert [(c[0], c[2]) for c in continued["curve"]] == [(c[0], c[2]) for c in whole["curve"]] and len(whole["curve"]) == 2
    assert continued["final_eval"] == whole["final_eval"]
    assert bench_offline.run_msrl("iql", dataset, 1, 4, 2, str(tmp_path / "w"), str(state)) == continued


def test_a_stopped_offline_benchmark_leaves_no_peer_running(root, tmp_path):
    """``bench/bench_offline.py --parallel`` stopped by SIGTERM while msrl's seed trains: its
    d3rlpy process (here a stand-in that sleeps) is stopped with it, not left training beside the
    next run. Waits on events (the peer's pid file, the peer's end), not on a clock."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pidfile = tmp_path / "peer.pid"
    fake = tmp_path / "fake_python"
    fake.write_text(f"#!/bin/sh\necho $$ > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}\nexec sleep 600\n")
    fake.chmod(0o755)
    bench = pathlib.Path(__file__).resolve().parents[1] / "bench" / "bench_offline.py"
    proc = subprocess.Popen([sys.executable, str(bench), "iql", "--seeds", "1", "--steps", "1000000", "--dataset",
                             str(root / "msrl/pendulum/tiny-v0"), "--d3rlpy-python", str(fake), "--parallel"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not pidfile.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the peer never started"
            time.sleep(0.05)
        peer = int(pidfile.read_text())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 60
    while True:  # the peer was a child of the benchmark: gone, or a zombie nobody reaps
        try:
            with open(f"/proc/{peer}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        if time.monotonic() > deadline:
            os.kill(peer, signal.SIGKILL)  # not left behind by the failing test either
            pytest.fail(f"the peer {peer} was still running ({state}) a minute after the benchmark stopped")
        time.sleep(0.05)


def test_the_offline_benchmarks_json_files_join_their_seeds_and_refuse_a_mismatch(tmp_path, monkeypatch):
    """``bench/bench_offline.py --json`` rewrites its file whole after each seed, and ``--from-json A B``
    joins the seeds of runs made apart (ten seeds over several sittings) -- but not of two tasks, two
    budgets or the same seed twice."""
    bench = pathlib.Path(__file__).resolve().parents[1] / "bench"
    monkeypatch.syspath_prepend(str(bench))
    import bench_offline

    def run(final):
        return {"final_eval": final, "grad_steps_per_s": 10.0, "curve": [[2, 1.0, final]]}

    a, b = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    bench_offline.write_json(a, "awac", [1], 4, {"msrl": [run(-1.0)], "d3rlpy AWAC": [run(-2.0)]})
    bench_offline.write_json(a, "awac", [1, 2], 4, {"msrl": [run(-1.0), run(-3.0)],
                                                    "d3rlpy AWAC": [run(-2.0), run(-4.0)]})
    assert not (tmp_path / "a.json.tmp").exists()
    bench_offline.write_json(b, "awac", [3], 4, {"msrl": [run(-5.0)], "d3rlpy AWAC": [run(-6.0)]})
    merged = bench_offline.merge_json([a, b])
    assert merged["seeds"] == [1, 2, 3] and merged["steps"] == 4
    assert [r["final_eval"] for r in merged["results"]["msrl"]] == [-1.0, -3.0, -5.0]
    assert [r["final_eval"] for r in merged["results"]["d3rlpy AWAC"]] == [-2.0, -4.0, -6.0]
    assert "| msrl | -3.0 [" in bench_offline.table("awac", merged["results"])
    # RLlib's stop rule beside the final evaluation: a seed at the gate at 2 steps, below it at the end
    fell = {"final_eval": -700.0, "grad_steps_per_s": 10.0, "curve": [[2, 1.0, -150.0], [4, 2.0, -700.0]]}
    never = {"final_eval": -600.0, "grad_steps_per_s": 10.0, "curve": [[2, 1.0, -400.0], [4, 2.0, -600.0]]}
    assert bench_offline.first_reach(fell["curve"], -200.0) == 2 and bench_offline.first_reach(never["curve"], -200.0) is None
    rows = bench_offline.table("iql", {"msrl": [fell, fell, never]}).splitlines()
    assert rows[2].startswith("| msrl | -700.0 [") and "| 0/3 | 2/3 (2) | 10 |" in rows[2]
    assert "| 0/2 | 1/2 | 10 |" in bench_offline.table("iql", {"msrl": [fell, never]})
    with pytest.raises(ValueError, match="repeats seeds \\[1, 2\\]"):
        bench_offline.merge_json([a, a])
    c = str(tmp_path / "c.json")
    bench_offline.write_json(c, "awac", [4], 6, {"msrl": [run(-1.0)], "d3rlpy AWAC": [run(-2.0)]})
    with pytest.raises(ValueError, match="steps 6"):
        bench_offline.merge_json([a, c])
    bench_offline.write_json(c, "awac", [4], 4, {"msrl": [run(-1.0)]})
    with pytest.raises(ValueError, match="systems"):
        bench_offline.merge_json([a, c])


def test_the_offline_benchmarks_iql_peer_gets_the_expectile_and_temperature_of_msrls_config(monkeypatch):
    """d3rlpy's IQL trains with the expectile and inverse temperature of the msrl config it is measured
    beside (Pendulum's are RLlib's, HalfCheetah's the paper's), not with d3rlpy's defaults."""
    bench = pathlib.Path(__file__).resolve().parents[1] / "bench"
    monkeypatch.syspath_prepend(str(bench))
    import bench_offline

    for algo, (expectile, beta) in {"iql": (0.8, 0.1), "iql_halfcheetah": (0.7, 3.0)}.items():
        hp = load_config(bench.parent / "configs" / bench_offline.TASKS[algo]["config"]).algorithm.hparams
        assert (hp["expectile"], hp["beta"]) == (expectile, beta)
        assert bench_offline.peer_settings(algo) == ["--expectile", str(expectile), "--weight-temp", str(beta)]
    assert bench_offline.peer_settings("cql") == [] and bench_offline.peer_settings("awac") == []
