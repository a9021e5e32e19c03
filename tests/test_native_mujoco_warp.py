"""Native MuJoCo tasks on MJWarp physics (``env.kwargs.physics: warp``): the GPU path's code run
on the CPU, against gymnasium step by step, through a checkpoint, and under ``gpu_only`` with its
iteration captured (the CPU tape replays the Warp launches as foreign calls).

All in one file: the first use compiles MJWarp's kernels (minutes on a cold cache), once per
test process.
"""

from __future__ import annotations

import copy
import pathlib

import pytest
import torch

pytest.importorskip("mjbatch")
pytest.importorskip("mujoco_warp")

from msrl.config import build_job_spec, load_config  # noqa: E402
from msrl.envs.native import MUJOCO_PHYSICS, HalfCheetah, WarpHalfCheetah, WarpHopper, make_native  # noqa: E402
from msrl.envs.native.check import MUJOCO_WARP_REWARD_TOL, MUJOCO_WARP_TOL, check_mujoco  # noqa: E402
from msrl.run.job import Job  # noqa: E402
from msrl.runtime.programs import capture  # noqa: E402
from msrl.runtime.programs.capture import WARMUP, CapturedProgram  # noqa: E402

CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "ppo_halfcheetah_gpu.yaml"
SMALL = ["env.num_envs=2", "algorithm.hparams.num_steps=4", "algorithm.hparams.num_minibatches=2",
         "algorithm.hparams.update_epochs=1"]


@pytest.mark.parametrize("env_id,steps,start_step,min_episodes,min_truncations", [
    ("msrl/HalfCheetah-v5", 30, 990, 4, 4),   # each episode 10 steps from the 1,000-step limit
    ("msrl/Hopper-v5", 80, 0, 6, 0),          # unhealthy terminations, resets mid-batch
])
def test_each_step_equals_gymnasiums_to_float32_tolerance(env_id, steps, start_step, min_episodes, min_truncations):
    report = check_mujoco(env_id, num_envs=2, steps=steps, seed=3, physics="warp", start_step=start_step)
    assert report.ok, report
    assert report.mode == "step" and report.impl == "warp"
    assert report.flag_mismatches == 0
    assert report.max_obs_diff <= MUJOCO_WARP_TOL and report.max_reward_diff <= MUJOCO_WARP_REWARD_TOL
    assert report.max_obs_diff > 0.0  # float32 physics: not bitwise MuJoCo's C (the check would be vacuous)
    assert report.episodes >= min_episodes and report.truncations >= min_truncations


def test_start_states_are_the_mjbatch_tasks_draws_in_float32():
    warp, c = WarpHalfCheetah(3), HalfCheetah(3, impl="torch", num_threads=1)
    assert torch.equal(warp.reset(seed=11), c.reset(seed=11))
    assert warp.qpos.dtype == torch.float32 and warp.qpos.shape == (3, c.model.nq)


def test_a_checkpoint_resumes_the_simulations_bitwise():
    env = WarpHopper(2)
    env.reset(seed=5)
    g = torch.Generator().manual_seed(0)
    actions = [torch.rand(2, 3, generator=g) * 2 - 1 for _ in range(60)]
    for a in actions[:20]:
        env.step(a)
    saved = copy.deepcopy(env.state_dict())
    rest = [env.step(a) for a in actions[20:]]
    other = WarpHopper(2)
    other.reset(seed=99)
    other.load_state_dict(saved)
    again = [other.step(a) for a in actions[20:]]
    for x, y in zip(rest, again):
        for u, v in zip(x[:4], y[:4]):
            assert torch.equal(u, v)
        assert torch.equal(x[4]["final_obs"], y[4]["final_obs"])
    assert torch.equal(env.episode, other.episode) and torch.equal(env.steps, other.steps)
    assert torch.equal(env._episode_return, other._episode_return)
    assert int((env.episode - saved["tensors"]["episode"]).sum()) >= 1  # an episode restarted after the checkpoint


def test_the_physics_choice_is_checked():
    assert set(MUJOCO_PHYSICS["msrl/HalfCheetah-v5"]) == {"mjbatch", "warp"}
    with pytest.raises(ValueError, match="unknown env.kwargs.physics 'mjx'.*valid: mjbatch, warp"):
        make_native("msrl/HalfCheetah-v5", 2, physics="mjx")
    with pytest.raises(ValueError, match="msrl/CartPole-v1 has one implementation"):
        make_native("msrl/CartPole-v1", 2, physics="warp")
    with pytest.raises(ValueError, match=r"unknown native env implementation 'cuda'; valid: torch, kernel"):
        WarpHalfCheetah(2, impl="cuda")
    with pytest.raises(ValueError, match=r"action has shape \(2, 5\), expected"):
        WarpHalfCheetah(2).step(torch.zeros(2, 5))


def test_under_gpu_only_the_captured_iteration_equals_the_eager_one_bitwise():
    """PPO on the Warp task under ``gpu_only``: the iteration captured (on the CPU, the tape,
    which replays the physics as one foreign call per step) and the eager program take the same
    steps, metrics, episodes and weights."""
    graph = Job(build_job_spec(load_config(CONFIG, [*SMALL, "distribution_policy.capture.main=graph"])))
    eager = Job(build_job_spec(load_config(CONFIG, [*SMALL, "distribution_policy.capture.main=eager"])))
    try:
        graph.reset(), eager.reset()
        for _ in range(WARMUP + 4):
            assert graph.train_step() == eager.train_step()
        rg, re_ = graph.replica("main", 0), eager.replica("main", 0)
        for role in ("actor", "learner"):
            for (k, x), (_, y) in zip(rg.weights(role).items(), re_.weights(role).items()):
                assert torch.equal(x, y), f"{role}.{k}"
        assert torch.equal(rg.trainer.obs, re_.trainer.obs) and rg.env_steps == re_.env_steps
        fn = rg.programs["train_step"].fn
        assert isinstance(fn, CapturedProgram) and fn.status == "graph", getattr(fn, "status", fn)
        (cap,) = capture.captures(rg.trainer)
        assert cap.replays == 2
        foreign = [s for s in cap.graph.steps if s[0] == "foreign"]
        assert len(foreign) == 4  # one physics call per env step of the iteration
    finally:
        graph.close(), eager.close()
