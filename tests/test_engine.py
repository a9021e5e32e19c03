"""The env engine (``env.engine: process``): worker processes over shared memory, checked
against gymnasium stepping the same envs in one process."""

from __future__ import annotations

import os
import re
import signal
import time

import numpy as np
import pytest
import torch
from procs import EVENT_TIMEOUT_S, popen, process_table, stop_tree, wait_for

from msrl.envs.engine import EnvWorkerError, ProcessEnv
from msrl.envs.gymnasium_env import GymnasiumEnv


def _actions(space, n: int, rng: np.random.Generator) -> torch.Tensor:
    if hasattr(space, "n"):
        return torch.as_tensor(rng.integers(0, space.n, size=n), dtype=torch.int64)
    return torch.as_tensor(rng.uniform(space.low, space.high, size=(n, *space.shape)), dtype=torch.float32)


def _assert_same(a, b):
    for x, y in zip(a[:4], b[:4]):
        assert torch.equal(x, y)
    assert torch.equal(a[4]["final_obs"], b[4]["final_obs"])


@pytest.mark.parametrize("env_id,n,workers,steps", [
    ("CartPole-v1", 5, 2, 300),     # many autoresets
    ("Pendulum-v1", 3, 3, 210),     # truncation at 200
    ("Hopper-v5", 4, 2, 120),       # MuJoCo, terminations
])
def test_process_engine_equals_sync_engine(env_id, n, workers, steps):
    rng = np.random.default_rng(0)
    sync, proc = GymnasiumEnv(env_id, n), ProcessEnv(env_id, n, num_workers=workers)
    try:
        assert torch.equal(sync.reset(seed=11), proc.reset(seed=11))
        done = 0
        for _ in range(steps):
            act = _actions(sync.spec.action_space, n, rng)
            a, b = sync.step(act), proc.step(act)
            _assert_same(a, b)
            assert not b[4]["lost"].any()
            done += int((a[2] | a[3]).sum())
        assert done > 0
        assert sync.pop_episode_stats() == proc.pop_episode_stats()
        assert proc.env_steps == sync.env_steps == n * steps
    finally:
        sync.close()
        proc.close()


def test_async_send_recv_returns_finished_envs_with_their_ids():
    n, rng = 6, np.random.default_rng(1)
    ref = [GymnasiumEnv("CartPole-v1", 1) for _ in range(n)]
    proc = ProcessEnv("CartPole-v1", n, num_workers=3, batch_size=2)
    try:
        for i, r in enumerate(ref):
            r.reset(seed=5 + i)
        proc.async_reset(seed=5)
        seen, expected = 0, {}
        for _ in range(200):
            obs, reward, term, trunc, info = proc.recv()
            ids = info["env_id"]
            assert ids.shape == (2,) and obs.shape == (2, 4)
            if seen >= n:  # after the first round, every row is a step of env ids[k]
                for k, i in enumerate(ids.tolist()):
                    assert torch.equal(obs[k], expected[i][0][0]) and reward[k] == expected[i][1][0]
                    assert torch.equal(info["final_obs"][k], expected[i][4]["final_obs"][0])
            seen += 2
            act = _actions(proc.spec.action_space, 2, rng)
            for k, i in enumerate(ids.tolist()):
                expected[i] = ref[i].step(act[k:k + 1])
            proc.send(act, ids)
        with pytest.raises(ValueError, match="in flight or not yet received"):
            proc.send(act, ids)
        with pytest.raises(RuntimeError, match="while envs are in flight"):
            proc.step(torch.zeros(n, dtype=torch.int64))
        proc.recv(batch_size=2)
        with pytest.raises(ValueError, match="recv: batch_size=5, but only 4 envs were sent"):
            proc.recv(batch_size=5)
    finally:
        proc.close()


def test_async_recv_serves_every_worker_with_a_finished_env():
    # the caller is slower than the envs (it sleeps between send and recv), so each worker has
    # a reply waiting at every recv: reading only the first worker's would return env 0 forever
    proc = ProcessEnv("CartPole-v1", 2, num_workers=2, batch_size=1)
    try:
        proc.async_reset(seed=0)
        returned = []
        for _ in range(20):
            _, _, _, _, info = proc.recv()
            returned += info["env_id"].tolist()
            proc.send(torch.zeros(1, dtype=torch.int64), info["env_id"])
            time.sleep(0.05)  # (on a busy machine a worker waits its turn for a few scheduler slices)
        # 10 each when every reply is in by the next recv (a worker slowed by the machine can
        # shift a few); reading only the first ready worker returned env 1 once, after the reset
        assert returned.count(0) >= 4 and returned.count(1) >= 4, returned
    finally:
        proc.close()


@pytest.mark.parametrize("env_id", ["CartPole-v1", "HalfCheetah-v5"])
def test_checkpoint_restores_every_env_exactly_under_another_worker_count(env_id):
    n, rng = 4, np.random.default_rng(2)
    a = ProcessEnv(env_id, n, num_workers=2)
    b = ProcessEnv(env_id, n, num_workers=3)
    try:
        a.reset(seed=3)
        for _ in range(25):
            a.step(_actions(a.spec.action_space, n, rng))
        a.pop_episode_stats()
        state = a.state_dict()
        b.reset(seed=99)
        b.load_state_dict(state)
        assert b.env_steps == a.env_steps
        for _ in range(60):
            act = _actions(a.spec.action_space, n, rng)
            _assert_same(a.step(act), b.step(act))
        assert a.pop_episode_stats() == b.pop_episode_stats()
        if env_id == "HalfCheetah-v5":  # the MjModel stored once, not per env; compressed MjData
            assert len(state["shared"]) == 1 and max(map(len, state["envs"])) < 100_000
    finally:
        a.close()
        b.close()


def test_sigkilled_worker_is_restarted_and_its_episodes_reported_lost():
    n = 4
    env = ProcessEnv("CartPole-v1", n, num_workers=2)
    try:
        env.reset(seed=0)
        for _ in range(5):
            last, *_ = env.step(torch.zeros(n, dtype=torch.int64))
        pids = env.worker_pids
        os.kill(pids[1], signal.SIGKILL)
        time.sleep(0.2)
        obs, reward, term, trunc, info = env.step(torch.zeros(n, dtype=torch.int64))
        assert info["lost"].tolist() == [False, False, True, True]
        assert trunc[2:].all() and not term[2:].any() and (reward[2:] == 0).all()
        assert torch.equal(info["final_obs"][2:], last[2:])  # the last observation the caller saw
        assert env.worker_pids[0] == pids[0] and env.worker_pids[1] != pids[1] and env.restarts == 1
        stats = env.pop_episode_stats()
        assert stats.lost == 2 and stats.returns == []
        assert env.env_steps == 5 * n + 2
        for _ in range(600):  # training goes on; the fresh episodes finish normally
            env.step(torch.randint(0, 2, (n,)))
        stats = env.pop_episode_stats()
        assert stats.lost == 0 and len(stats.returns) > 0
    finally:
        env.close()


def test_worker_crash_in_async_mode_loses_every_env_of_that_worker(tmp_path):
    n = 4
    env = ProcessEnv("engine_envs:Crashing-v0", n, num_workers=2, batch_size=1,
                     env_kwargs={"crash_at": 3, "marker": str(tmp_path / "crashed")})
    try:
        env.async_reset(seed=0)
        lost, returned = set(), []
        # a worker's death shows once the OS has closed its socket, which can take a few ms on a
        # loaded machine while the live worker's envs go on stepping: receive until both of the
        # dead worker's envs came back lost (bounded), then some more to see nothing else lost
        deadline, extra = time.monotonic() + 300.0, 40
        while extra > 0 and time.monotonic() < deadline:
            _, _, _, trunc, info = env.recv()
            returned += info["env_id"].tolist()
            if info["lost"].any():
                assert trunc.all()
                assert int(info["env_id"][0]) not in lost, "an env was reported lost twice"
                lost.add(int(info["env_id"][0]))
            if len(lost) == 2:
                extra -= 1
            env.send(torch.zeros(1, dtype=torch.int64), info["env_id"])
        # the dead worker's two envs, each lost once
        assert env.restarts == 1 and len(lost) == 2, (
            f"restarts {env.restarts}, lost {lost}, first returned {returned[:60]}, env steps {env.env_steps}, "
            f"marker {(tmp_path / 'crashed').exists()}, workers {env.worker_pids}")
        assert env.pop_episode_stats().lost == 2
    finally:
        env.close()


def test_env_error_is_raised_with_the_workers_traceback():
    env = ProcessEnv("engine_envs:Faulty-v0", 2, num_workers=2, env_kwargs={"fail_at": 3})
    try:
        env.reset(seed=0)
        env.step(torch.zeros(2, dtype=torch.int64))
        env.step(torch.zeros(2, dtype=torch.int64))
        # both workers' envs fail at step 3; whichever reply arrives first is raised
        with pytest.raises(EnvWorkerError, match=r"(?s)env worker ([01]) \(envs \1\.\.\1.*simulated simulator error at step 3"):
            env.step(torch.zeros(2, dtype=torch.int64))
    finally:
        env.close()


def test_bad_arguments():
    with pytest.raises(ValueError, match="env.num_workers must be in 1..num_envs=2, got 3"):
        ProcessEnv("CartPole-v1", 2, num_workers=3)
    with pytest.raises(ValueError, match="batch_size must be in 1..num_envs=2"):
        ProcessEnv("CartPole-v1", 2, batch_size=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_kwarg'"):
        ProcessEnv("engine_envs:Faulty-v0", 1, env_kwargs={"no_such_kwarg": 1})
    with pytest.raises(EnvWorkerError, match="(?s)env worker 0 .* failed to build its envs.*simulator licence not found"):
        ProcessEnv("engine_envs:WorkerOnlyFailure-v0", 1)


def test_close_leaves_no_worker_process():
    env = ProcessEnv("CartPole-v1", 3, num_workers=3)
    pids = env.worker_pids
    env.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("wrapper,shape", [("atari", (4, 84, 84)), ("atari64", (1, 64, 64))])
def test_atari_wrappers_through_the_engine_and_their_exact_snapshots(wrapper, shape):
    """``atari`` (PPO's, 4 stacked 84x84 frames) and ``atari64`` (DreamerV3's, one 64x64 frame):
    frames through the process engine equal the in-process env's, and an exact checkpoint of the
    envs resumes them bit for bit in both engines (ALE games snapshot through cloneState;
    gymnasium's ``ReshapeObservation``, once ``atari64``'s last wrapper, held a lambda no checkpoint
    could pickle)."""
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    n, rng = 2, np.random.default_rng(4)
    sync = GymnasiumEnv("ALE/Pong-v5", n, wrappers=[wrapper])
    proc = ProcessEnv("ALE/Pong-v5", n, num_workers=2, wrappers=[wrapper])
    try:
        o = proc.reset(seed=1)
        assert o.shape == (n, *shape) and o.dtype == torch.uint8
        assert torch.equal(sync.reset(seed=1), o)
        for _ in range(30):
            act = _actions(proc.spec.action_space, n, rng)
            _assert_same(sync.step(act), proc.step(act))
        for env in (proc, sync):
            state = env.state_dict()
            after = [env.step(act) for _ in range(5)]
            env.load_state_dict(state)
            for x in after:
                _assert_same(x, env.step(act))
    finally:
        sync.close()
        proc.close()


def test_script_without_main_guard_is_not_rerun_by_the_workers(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text("import torch\nfrom msrl.envs.engine import ProcessEnv\nprint('ran', flush=True)\n"
                      "env = ProcessEnv('CartPole-v1', 2, num_workers=2)\nenv.reset(seed=0)\n"
                      "print(tuple(env.step(torch.zeros(2, dtype=torch.int64))[0].shape))\nenv.close()\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ran", "(2,", "4)"]


def _worker_children(pid: int) -> list[int]:
    """Pids of the env engine workers whose parent is ``pid``."""
    return [p for p, (ppid, cmd) in process_table().items() if ppid == pid and b"msrl.envs._worker" in cmd]


def test_training_survives_a_sigkilled_env_worker_and_reports_the_lost_episodes(tmp_path):
    """Acceptance: SIGKILL one env worker mid-run; training continues; the lost episodes are
    reported on stderr and in faults/lost_episodes."""
    import csv
    import subprocess
    import sys

    proc = popen(
        [sys.executable, "-m", "msrl.run.cli", "train", "configs/ppo_cartpole.yaml", f"runs_dir={tmp_path}", "name=k",
         "env.engine=process", "env.num_workers=2", "train.total_env_steps=40000", "train.eval_every=0",
         "train.progress=false"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # training has started (the probe's envs, built and closed before, are gone)
        wait_for((tmp_path / "k" / "metrics.csv").exists, "the run's first metrics row", alive=proc)
        workers = _worker_children(proc.pid)
        assert len(workers) == 2, f"the run's env workers: {workers} below the driver, once training started"
        os.kill(workers[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=EVENT_TIMEOUT_S)
    finally:
        stop_tree(proc)
    assert proc.returncode == 0, err
    assert "died (signal 9); restarted it, and the 8 episode(s) its envs were in are lost" in err
    with open(tmp_path / "k" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    # every iteration ran; the dead worker's 8 envs' step was not counted as 8 env steps
    assert int(rows[-1]["iteration"]) * 256 - int(rows[-1]["env_steps"]) == 8
    assert int(rows[0]["faults/lost_episodes"]) == 0 and int(rows[-1]["faults/lost_episodes"]) == 8


def test_envpool_engine_keeps_the_same_step_contract():
    envpool = pytest.importorskip("envpool")
    from msrl.envs import make_env

    n = 3
    env = make_env("CartPole-v1", n, engine="envpool", num_workers=1)
    ref = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=n, seed=5, num_threads=1)
    try:
        obs = env.reset(seed=5)
        ref_obs, _ = ref.reset()
        assert torch.equal(obs, torch.as_tensor(ref_obs, dtype=torch.float32))
        done_seen = 0
        for _ in range(200):
            o, r, te, tr, info = env.step(torch.ones(n, dtype=torch.int64))  # always push right: short episodes
            done = te | tr
            assert torch.equal(info["final_obs"][~done], o[~done])
            if done.any():
                done_seen += int(done.sum())
                assert not torch.equal(info["final_obs"][done], o[done])  # a new episode's first observation
                assert (o[done].abs() <= 0.05).all()  # CartPole starts within +-0.05
        stats = env.pop_episode_stats()
        assert done_seen == len(stats.returns) > 0 and all(x == y for x, y in zip(stats.returns, stats.lengths))
        state = env.state_dict()
        assert state["exact"] is False
    finally:
        env.close()
        ref.close()


def test_ppo_builds_the_nature_cnn_for_atari_frames_and_stores_them_as_bytes():
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    from msrl.algorithms import ppo
    from msrl.policy import load_policy
    from msrl.run.job import Job, JobSpec

    hp = ppo.PPOConfig(num_steps=4, num_minibatches=2, update_epochs=1)
    spec = JobSpec(ppo.ALGORITHM, hp, "ALE/Pong-v5", 2, load_policy("single"), seed=1, total_env_steps=1000,
                   env_engine="process", env_wrappers=("atari",), env_num_workers=2)
    job = Job(spec)
    try:
        job.reset()
        metrics = job.train_step()
        assert all(torch.isfinite(torch.as_tensor(v)).all() for k, v in metrics.items() if k.startswith("losses/")
                   and "kl" not in k and "variance" not in k)
        net = job.component("learner").net
        assert net.image and isinstance(net.trunk[0], torch.nn.Conv2d)
        assert job.component("buffer").storage["obs"].dtype == torch.uint8
    finally:
        job.close()
    with pytest.raises(ValueError, match="normalize_obs is for vector observations"):
        import gymnasium
        ppo.ActorCritic(gymnasium.spaces.Box(0, 255, (4, 84, 84), np.uint8), gymnasium.spaces.Discrete(6), (64,), 10.0)


def test_gymnasium_mujoco_envs_share_one_model_and_step_as_before():
    import gymnasium

    from msrl.envs.single_env import make_single_env, share_mujoco_models

    own = [make_single_env("HalfCheetah-v5") for _ in range(3)]
    shared = [make_single_env("HalfCheetah-v5") for _ in range(3)]
    other = make_single_env("HalfCheetah-v5")
    other.unwrapped.model.opt.timestep = 0.02  # same class, another model: kept apart
    assert share_mujoco_models([*shared, other]) == 2
    assert shared[1].unwrapped.model is shared[0].unwrapped.model is shared[2].unwrapped.model
    assert other.unwrapped.model is not shared[0].unwrapped.model
    rng = np.random.default_rng(0)
    for i, (a, b) in enumerate(zip(own, shared)):
        a.reset(seed=i)
        b.reset(seed=i)
    for _ in range(50):
        for a, b in zip(own, shared):
            act = rng.uniform(-1, 1, 6).astype(np.float32)
            ra, rb = a.step(act), b.step(act)
            assert np.array_equal(ra[0], rb[0]) and ra[1:4] == rb[1:4]

    class UserCheetah(gymnasium.envs.mujoco.half_cheetah_v5.HalfCheetahEnv):  # may randomise its model
        pass

    users = [UserCheetah(), UserCheetah()]
    assert share_mujoco_models(users) == 0
    assert users[0].model is not users[1].model
    assert share_mujoco_models([make_single_env("CartPole-v1"), make_single_env("CartPole-v1")]) == 0


def test_ale_vector_engine_keeps_the_same_step_contract_and_the_atari_wrappers_spaces():
    """env.engine=ale_vector (ale-py's C++ vector env): the atari wrapper's spaces ((4, 84, 84)
    uint8 frames, the minimal action set), uint8 observations never widened, same-step autoreset
    (a finished env's row is its next episode's first, final_obs its last; the others' final_obs
    is their obs), episodes counted, seeded resets repeatable, no exact checkpoint."""
    pytest.importorskip("ale_py.vector_env")
    from msrl.envs import env_spec, make_env

    n = 3
    spec = env_spec("ALE/Pong-v5", n, wrappers=["atari"], engine="ale_vector")
    assert spec.observation_space.shape == (4, 84, 84) and spec.observation_space.dtype == np.uint8
    assert spec.action_space.n == 6
    kwargs = {"max_num_frames_per_episode": 400, "repeat_action_probability": 0.0}  # 100-step episodes
    env = make_env("ALE/Pong-v5", n, engine="ale_vector", wrappers=["atari"], num_workers=1, env_kwargs=kwargs)
    try:
        first = env.reset(seed=5)
        assert first.shape == (n, 4, 84, 84) and first.dtype == torch.uint8
        done_seen, rng = 0, torch.Generator().manual_seed(0)
        for _ in range(250):
            o, r, te, tr, info = env.step(torch.randint(6, (n,), generator=rng))
            assert o.dtype == torch.uint8 and r.dtype == torch.float32 and te.dtype == torch.bool
            done = te | tr
            assert torch.equal(info["final_obs"][~done], o[~done])
            if done.any():
                done_seen += int(done.sum())
                assert not torch.equal(info["final_obs"][done], o[done])  # a new episode's first frames
        stats = env.pop_episode_stats()
        assert done_seen == len(stats.returns) >= n and env.env_steps == 250 * n
        assert env.state_dict()["exact"] is False
        assert torch.equal(env.reset(seed=5), first)  # a seeded reset repeats
    finally:
        env.close()


@pytest.mark.parametrize("over, says", [
    (["env.wrappers=[]"], "env.wrappers: [atari]"),
    (["env.kwargs={frameskip: 2}"], "not options of env.engine=ale_vector"),
    (["env.id=ALE/Pongg-v5"], "Did you mean 'pong'"),
    (["env.id=CartPole-v1"], "ALE/<Game>-v5"),
])
def test_ale_vector_engine_refuses_what_it_cannot_step_in_one_line(tmp_path, over, says):
    pytest.importorskip("ale_py.vector_env")
    from msrl.config import ConfigError, build_job_spec, load_config

    with pytest.raises(ConfigError, match=re.escape(says)):
        build_job_spec(load_config("configs/ppo_pong.yaml", [f"runs_dir={tmp_path}", "env.engine=ale_vector", *over]))


def test_ppo_trains_on_the_ale_vector_engine_with_bytes_end_to_end():
    """PPO's Atari config on env.engine=ale_vector: one iteration, the rollout stored as bytes."""
    pytest.importorskip("ale_py.vector_env")
    from msrl.algorithms import ppo
    from msrl.policy import load_policy
    from msrl.run.job import Job, JobSpec

    hp = ppo.PPOConfig(num_steps=4, num_minibatches=2, update_epochs=1)
    spec = JobSpec(ppo.ALGORITHM, hp, "ALE/Pong-v5", 2, load_policy("single"), seed=1, total_env_steps=1000,
                   env_engine="ale_vector", env_wrappers=("atari",), env_num_workers=1)
    job = Job(spec)
    try:
        job.reset()
        metrics = job.train_step()
        assert torch.isfinite(torch.as_tensor(metrics["losses/value_loss"]))
        assert job.component("buffer").storage["obs"].dtype == torch.uint8
    finally:
        job.close()


def test_the_impala_resnet_trunk_trains_pixels_and_is_refused_on_vectors(tmp_path):
    """``algorithm.hparams.cnn: impala`` (Espeholt et al. 2018, Figure 3): three stacks of 16, 32, 32
    channels, each halving 84 -> 42 -> 21 -> 11, two residual blocks each, 256 features; PPO trains
    an iteration with it on the ale_vector engine; on vector observations it is one config error."""
    pytest.importorskip("ale_py.vector_env")
    from torch import nn

    from msrl.algorithms import ppo
    from msrl.config import ConfigError, build_job_spec, load_config
    from msrl.policy import load_policy
    from msrl.run.job import Job, JobSpec

    hp = ppo.PPOConfig(num_steps=4, num_minibatches=2, update_epochs=1, cnn="impala")
    spec = JobSpec(ppo.ALGORITHM, hp, "ALE/Pong-v5", 2, load_policy("single"), seed=1, total_env_steps=1000,
                   env_engine="ale_vector", env_wrappers=("atari",), env_num_workers=1)
    job = Job(spec)
    try:
        job.reset()
        metrics = job.train_step()
        assert torch.isfinite(torch.as_tensor(metrics["losses/value_loss"]))
        net = job.component("learner").net
        linear = [m for m in net.trunk.modules() if isinstance(m, nn.Linear)]
        assert len(linear) == 1 and linear[0].in_features == 32 * 11 * 11 and linear[0].out_features == 256
        assert [m.out_channels for m in net.trunk.modules() if isinstance(m, nn.Conv2d)][::5] == [16, 32, 32]
        assert net.actor.in_features == net.critic.in_features == 256
    finally:
        job.close()
    with pytest.raises(ConfigError, match=r"algorithm.hparams.cnn=impala: the impala trunk is for uint8 frame observations"):
        build_job_spec(load_config("configs/ppo_cartpole.yaml", [f"runs_dir={tmp_path}", "algorithm.hparams.cnn=impala"]))
