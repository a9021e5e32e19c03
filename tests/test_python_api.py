"""The Python API: msrl.train / msrl.load / msrl.evaluate, as a notebook would use them."""

import pathlib

import gymnasium
import numpy as np
import pytest

import msrl
from msrl.config import ConfigError

MAIN = pathlib.Path(__file__).resolve().parents[1] / "configs" / "ppo_cartpole.yaml"


def test_train_load_act_evaluate(tmp_path):
    result = msrl.train(MAIN, seed=2, runs_dir=str(tmp_path), train__total_env_steps=4096, train__progress=False,
                        **{"eval.episodes": 3})
    assert result.run_dir == tmp_path / "ppo_cartpole" and result.env_steps == 4096
    rows = result.metrics()
    assert [r["iteration"] for r in rows] == list(range(1, 17)) and "losses/value_loss" in rows[-1]
    policy = msrl.load(result.run_dir)
    env = gymnasium.make("CartPole-v1")
    obs, _ = env.reset(seed=0)
    a = policy.act(obs)
    assert a.shape == () and env.action_space.contains(int(a))
    batch = np.stack([obs, obs, obs])
    assert policy.act(batch).tolist() == [int(a)] * 3  # deterministic: the same action for the same obs
    with pytest.raises(ValueError, match=r"expected \(4,\) \(one env\) or \(N, 4\)"):
        policy.act(np.zeros(5))
    returns = msrl.evaluate(policy, episodes=3)
    assert len(returns) == 3 and returns == result.eval_returns  # the run's final evaluation, reproduced
    assert msrl.evaluate(result.run_dir, episodes=3) == returns


def test_resume_for_longer_from_python(tmp_path):
    first = msrl.train(MAIN, runs_dir=str(tmp_path), train__total_env_steps=2048, train__progress=False)
    more = msrl.train(resume=first.run_dir, train__total_env_steps=3072)
    assert more.run_dir == first.run_dir and more.env_steps == 3072


def test_bad_input_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="algorithm.hparams.learning_rate: Input should be greater than 0"):
        msrl.train(MAIN, runs_dir=str(tmp_path), algorithm__hparams__learning_rate=-1)
    with pytest.raises(ConfigError, match="needs a config"):
        msrl.train()
    with pytest.raises(ConfigError, match="not a run directory"):
        msrl.load(tmp_path)
    assert not any(tmp_path.iterdir())  # nothing written


def spy_on_chunks(monkeypatch, probe):
    """Records ``probe()`` at the start of every chunk of iterations a run trains (in the process
    and thread running its fragments) into the returned list; a run fails at its next chunk once
    the second returned list holds anything."""
    from msrl.run.loop import TrainingLoop

    seen, fail = [], []
    chunk = TrainingLoop._chunk

    def spy(self, n):
        seen.append(probe())
        if fail:
            raise RuntimeError("a chunk failed")
        return chunk(self, n)

    monkeypatch.setattr(TrainingLoop, "_chunk", spy)
    return seen, fail


def test_the_run_sets_its_matmul_precision_and_gives_the_callers_back(tmp_path, monkeypatch):
    """``train.float32_matmul_precision`` holds in the process running the fragments for the
    whole run, and the caller's own setting comes back afterwards (also when the run fails)."""
    import torch

    seen, fail = spy_on_chunks(monkeypatch, torch.get_float32_matmul_precision)
    before = torch.get_float32_matmul_precision()
    assert before == "highest"  # torch's default: the config's default keeps it
    msrl.train(MAIN, runs_dir=str(tmp_path), train__total_env_steps=1024, train__progress=False,
               train__float32_matmul_precision="high", **{"eval.episodes": 1})
    assert seen and set(seen) == {"high"}
    assert torch.get_float32_matmul_precision() == before
    seen.clear()
    msrl.train(MAIN, runs_dir=str(tmp_path), train__total_env_steps=512, train__progress=False, **{"eval.episodes": 1})
    assert set(seen) == {"highest"}
    fail.append(True)
    with pytest.raises(RuntimeError, match="a chunk failed"):
        msrl.train(MAIN, runs_dir=str(tmp_path), train__total_env_steps=512, train__progress=False,
                   train__float32_matmul_precision="medium")
    assert seen[-1] == "medium" and torch.get_float32_matmul_precision() == before
    with pytest.raises(ConfigError, match="train.float32_matmul_precision: Input should be 'highest', 'high' or 'medium'"):
        msrl.train(MAIN, runs_dir=str(tmp_path), train__float32_matmul_precision="tf32")


@pytest.mark.skipif(not hasattr(__import__("torch").backends.mkldnn.matmul, "fp32_precision"),
                    reason="torch before the per-backend precision API (2.9)")
def test_a_caller_on_torchs_per_backend_precision_api_trains_and_keeps_its_settings(tmp_path, monkeypatch):
    """A caller that set oneDNN's float32 matmul precision through torch's per-backend API (where
    ``torch.get_float32_matmul_precision`` then raises) trains, and finds its settings as it left
    them; ``medium`` reaches oneDNN, the CPU's backend, for the run (bfloat16 products there)."""
    import torch

    seen, _ = spy_on_chunks(monkeypatch, lambda: torch.backends.mkldnn.matmul.fp32_precision)
    cuda, onednn = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
    before = cuda.fp32_precision, onednn.fp32_precision
    try:
        onednn.fp32_precision, cuda.fp32_precision = "bf16", "ieee"
        with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
            torch.get_float32_matmul_precision()  # (what msrl.train read before: the run failed at its start)
        msrl.train(MAIN, runs_dir=str(tmp_path), train__total_env_steps=512, train__progress=False, **{"eval.episodes": 1})
        assert set(seen) == {"ieee"}  # the config's highest, for the run
        assert (cuda.fp32_precision, onednn.fp32_precision) == ("ieee", "bf16")
        seen.clear()
        msrl.train(MAIN, runs_dir=str(tmp_path), train__total_env_steps=512, train__progress=False,
                   train__float32_matmul_precision="medium", **{"eval.episodes": 1})
        assert set(seen) == {"bf16"}
        assert (cuda.fp32_precision, onednn.fp32_precision) == ("ieee", "bf16")
    finally:
        cuda.fp32_precision, onednn.fp32_precision = before


def test_train_and_evaluate_run_at_the_configs_threads_and_give_the_callers_back(tmp_path, monkeypatch):
    """The run's fragments and its evaluation run at ``train.torch_threads``; ``msrl.train``
    (also a failed run) and ``msrl.evaluate`` give the caller's own thread count back, where
    ``msrl.load`` keeps the run's for the policy it returns."""
    import torch

    seen, fail = spy_on_chunks(monkeypatch, torch.get_num_threads)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        result = msrl.train(MAIN, runs_dir=str(tmp_path), train__total_env_steps=512, train__progress=False,
                            **{"eval.episodes": 1})
        assert set(seen) == {1} and torch.get_num_threads() == 2
        fail.append(True)
        with pytest.raises(RuntimeError, match="a chunk failed"):
            msrl.train(MAIN, runs_dir=str(tmp_path), train__total_env_steps=512, train__progress=False)
        assert torch.get_num_threads() == 2
        msrl.evaluate(result.run_dir, episodes=1)
        assert torch.get_num_threads() == 2
        msrl.load(result.run_dir)
        assert torch.get_num_threads() == 1  # (the policy acts in this process as it trained)
    finally:
        torch.set_num_threads(before)


def test_fragments_run_with_denormals_flushed_and_the_callers_thread_keeps_its_mode(tmp_path, monkeypatch):
    """``train.flush_denormal`` (default on) holds on every thread while it runs a fragment's
    iterations -- the calling thread of a one-replica job, the replica threads of a job of many on
    the thread runtime -- or the run's evaluation, and is off where the config turns it off; the
    caller's thread has its own mode after the run, also after a run that failed."""
    from msrl.run import evaluation
    from msrl.runtime.host import denormals_flushed, flushed_denormals
    from msrl.runtime.replica import Replica

    seen, fail = [], []
    run_method = Replica.run_method

    def spy(self, method, comm):
        seen.append(denormals_flushed())
        if fail:
            raise RuntimeError("an iteration failed")
        return run_method(self, method, comm)

    monkeypatch.setattr(Replica, "run_method", spy)
    episodes = evaluation.evaluate

    def evaluating(*args, **kwargs):
        seen.append(denormals_flushed())
        return episodes(*args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate", evaluating)  # the job's evaluations too
    assert not denormals_flushed()  # torch's default: IEEE denormals
    for policy in ("single", "single_learner_coarse"):
        seen.clear()
        msrl.train(MAIN, runs_dir=str(tmp_path / policy), train__total_env_steps=1024, train__progress=False,
                   distribution_policy__name=policy, runtime="local", **{"eval.episodes": 1})
        assert seen and all(seen), policy
        assert not denormals_flushed()
    seen.clear()
    msrl.train(MAIN, runs_dir=str(tmp_path / "off"), train__total_env_steps=512, train__progress=False,
               train__flush_denormal=False, **{"eval.episodes": 1})
    assert seen and not any(seen)
    fail.append(True)
    with pytest.raises(RuntimeError, match="an iteration failed"):
        msrl.train(MAIN, runs_dir=str(tmp_path / "failed"), train__total_env_steps=512, train__progress=False)
    assert seen[-1] and not denormals_flushed()
    with flushed_denormals(True):  # a caller that flushes keeps flushing, whatever the run's key
        fail.clear()
        msrl.train(MAIN, runs_dir=str(tmp_path / "caller"), train__total_env_steps=512, train__progress=False,
                   train__flush_denormal=False, **{"eval.episodes": 1})
        assert not seen[-1] and denormals_flushed()
    assert not denormals_flushed()


def test_flushed_denormals_flushes_and_gives_the_mode_back():
    """Inside the block a float32 of 1e-39 is 0 in arithmetic; after it (also after an error)
    it is a denormal again."""
    import torch

    from msrl.runtime.host import denormals_flushed, flushed_denormals

    tiny = torch.tensor([1e-39])
    assert tiny.item() > 0 and not denormals_flushed()
    with flushed_denormals(True):
        assert denormals_flushed() and (tiny * 1.0).item() == 0.0
    assert (tiny * 1.0).item() > 0
    with pytest.raises(ValueError), flushed_denormals(True):
        raise ValueError
    assert not denormals_flushed()


def test_a_replica_process_takes_the_jobs_matmul_precision():
    """A Ray replica (:class:`ReplicaActor`, built here in-process as Ray builds it in its own)
    sets the job's precision in its process."""
    import cloudpickle
    import torch

    from msrl.cluster.replica_actor import ReplicaActor
    from msrl.config import build_job_spec, load_config
    from msrl.run.job import compile_job

    spec = build_job_spec(load_config(MAIN, ["train.float32_matmul_precision=medium",
                                             "distribution_policy.name=single_learner_coarse"]))
    compiled = compile_job(spec)
    actor = None
    try:
        actor = ReplicaActor(None, cloudpickle.dumps(spec), cloudpickle.dumps(compiled.fragment_graph), "learner", 0, 1)
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision("highest")
        if actor is not None:
            actor.close()


def test_an_error_from_ray_as_its_cluster_stops_is_the_cluster_lost_with_the_run_directory(tmp_path, monkeypatch):
    """A call into Ray's core worker can fail as this machine's raylet dies (``OSError: Connection
    reset by peer`` from ``ray.wait``) before Ray ends the driver itself: while the cluster is
    gone, that is :class:`~msrl.run.outcome.ClusterLost` naming the run's directory (one line,
    ``msrl train`` exits 3), not a traceback; while the cluster runs, the error is the error."""
    from msrl.run import training
    from msrl.run.loop import TrainingLoop
    from msrl.run.outcome import EXIT_LOST, ClusterLost

    def run(self):
        raise OSError("Connection reset by peer")

    monkeypatch.setattr(TrainingLoop, "run", run)
    monkeypatch.setattr(training, "_cluster_stopped", lambda: "its raylet (pid 1) exited with status -9")
    with pytest.raises(ClusterLost) as lost:
        msrl.train(MAIN, runs_dir=str(tmp_path / "a"), train__progress=False)
    run_dir = tmp_path / "a" / "ppo_cartpole"
    assert str(lost.value) == (f"the Ray cluster of this run stopped (its raylet (pid 1) exited with status -9); "
                               f"the run ({run_dir}) has no checkpoint yet: start it again")
    assert lost.value.run_dir == run_dir and lost.value.exit_status == EXIT_LOST
    assert isinstance(lost.value.__cause__, OSError)
    monkeypatch.setattr(training, "_cluster_stopped", lambda: None)
    with pytest.raises(OSError, match="Connection reset by peer"):
        msrl.train(MAIN, runs_dir=str(tmp_path / "b"), train__progress=False)
