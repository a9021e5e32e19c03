"""Frame-stacked rollouts in their compact form (msrl.runtime.frame_stacks): the first stack and each
step's newest frame give the rollout back bit for bit, for both first-stack paddings, on real
Pong rollouts with episode ends; a rollout that is not frame-stacked has no compact form."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from msrl.runtime.frame_stacks import compact_frames, is_compact, rebuild_frames
from msrl.runtime.transports.codec import decode, encode


def _stacked_rollout(T=12, N=3, S=4, H=5, W=6, padding="zeros", seed=0):
    """A rollout as a frame-stacking env makes it: each env's frames a random stream, episodes
    ending at random steps, each new episode's first stack padded as ``padding`` says."""
    g = torch.Generator().manual_seed(seed)
    done = torch.rand(T, N, generator=g) < 0.2
    frames = torch.randint(0, 256, (T + 1, N, H, W), dtype=torch.uint8, generator=g)
    obs = torch.zeros(T, N, S, H, W, dtype=torch.uint8)
    nxt = torch.zeros_like(obs)
    stack = torch.zeros(N, S, H, W, dtype=torch.uint8)
    stack[:, -1] = frames[0]
    if padding == "reset":
        stack[:] = frames[0].unsqueeze(1)
    for t in range(T):
        obs[t] = stack
        nxt[t] = torch.cat([stack[:, 1:], frames[t + 1].unsqueeze(1)], 1)  # (the final one where done)
        stack = nxt[t].clone()
        for n in range(N):
            if done[t, n]:  # the next episode's first stack, from its first frame
                f = torch.randint(0, 256, (H, W), dtype=torch.uint8, generator=g)
                stack[n] = f if padding == "reset" else torch.cat([torch.zeros(S - 1, H, W, dtype=torch.uint8), f[None]])
    truncated = done & (torch.rand(T, N, generator=g) < 0.5)
    return TensorDict({"obs": obs, "action": torch.randint(0, 6, (T, N), generator=g), "terminated": done & ~truncated,
                       "truncated": truncated, "next_obs": nxt}, batch_size=[T, N])


@pytest.mark.parametrize("padding", ["zeros", "reset"])
def test_a_stacked_rollout_crosses_as_its_newest_frames_and_comes_back_bit_for_bit(padding):
    rollout = _stacked_rollout(padding=padding)
    assert bool((rollout["terminated"] | rollout["truncated"]).any())
    compact = compact_frames(rollout, padding)
    assert compact is not None and is_compact(compact)
    back = rebuild_frames(decode(encode(compact)))  # through the wire codec, as a boundary carries it
    assert list(back.keys()) == list(rollout.keys())
    assert all(torch.equal(back[k], rollout[k]) for k in rollout.keys())
    frame_bytes = 2 * rollout["obs"].numel()
    sent = sum(compact[k].numel() for k in ("first", "newest", "next_newest"))
    assert sent == (2 * 12 + 4 - 1) * 3 * 5 * 6 and sent < frame_bytes / 3


def test_stacks_of_another_padding_or_no_stacks_have_no_compact_form():
    assert compact_frames(_stacked_rollout(padding="reset"), "zeros") is None  # never sent wrong
    rollout = _stacked_rollout()
    rollout["obs"][5, 1, 0, 0, 0] ^= 1  # one pixel that is not its stack's
    assert compact_frames(rollout, "zeros") is None
    vec = TensorDict({"obs": torch.rand(8, 2, 4), "terminated": torch.zeros(8, 2, dtype=torch.bool),
                      "truncated": torch.zeros(8, 2, dtype=torch.bool)}, batch_size=[8, 2])
    assert compact_frames(vec, "zeros") is None and compact_frames(torch.zeros(3), "zeros") is None
    with pytest.raises(ValueError, match="frame padding must be one of zeros, reset"):
        compact_frames(rollout, "edge")


@pytest.mark.parametrize("engine,padding", [("ale_vector", "zeros"), ("process", "reset")])
def test_a_real_pong_rollout_has_its_compact_form(tmp_path, engine, padding):
    """PPO's rollout of Pong (episodes cut at 160 frames so that they end inside it), from
    ale-py's vector env (zero padding) and from gymnasium's wrappers in the process engine
    (the first frame repeated): compact and back, bit for bit."""
    pytest.importorskip("ale_py.vector_env")
    from msrl.config import build_job_spec, load_config
    from msrl.run.job import Job

    spec = build_job_spec(load_config("configs/ppo_pong.yaml", [
        f"runs_dir={tmp_path}", f"env.engine={engine}", "env.num_envs=2", "env.num_workers=1",
        "algorithm.hparams.num_steps=64", "algorithm.hparams.update_epochs=1", "train.torch_threads=1",
        "env.kwargs={max_num_frames_per_episode: 160}"]))
    job = Job(spec)
    try:
        job.reset()
        job.train_step()
        rollout = job.component("buffer").storage.clone()
    finally:
        job.close()
    assert bool(rollout["truncated"].any())  # episodes ended inside the rollout
    compact = compact_frames(rollout, padding)
    assert compact is not None
    back = rebuild_frames(compact)
    assert all(torch.equal(back[k], rollout[k]) for k in rollout.keys())
    other = "reset" if padding == "zeros" else "zeros"
    assert compact_frames(rollout, other) is None


def _pong_job(policy, padding, iterations=2, algorithm="ppo", **overrides):
    """PPO (or IMPALA) on Pong through ale-py's vector env, episodes cut at 160 frames, on the
    thread runtime with the endpoints' compaction as ``padding`` says (what a job does where its
    fragments sit on two devices, here on the CPU): the learner's weights after ``iterations``
    and the bytes each boundary moved in the last one (``rollout``, ``weights``)."""
    pytest.importorskip("ale_py.vector_env")
    from msrl.algorithms import impala, ppo
    from msrl.policy import load_policy
    from msrl.run.job import Job, JobSpec

    algo, hp = {"ppo": (ppo.ALGORITHM, dict(num_steps=32, update_epochs=1, num_minibatches=2)),
                "impala": (impala.ALGORITHM, dict(num_steps=16, num_minibatches=1))}[algorithm]
    spec = JobSpec(algo, algo.hparams(**hp), "ALE/Pong-v5", 2, load_policy(policy).with_overrides(**overrides), seed=3,
                   total_env_steps=10_000, env_engine="ale_vector", env_wrappers=("atari",),
                   env_kwargs={"max_num_frames_per_episode": 160}, env_num_workers=1)
    job = Job(spec)
    try:
        assert job.runtime.frame_padding is None  # one device: values cross whole unless told
        job.runtime.frame_padding = padding
        for ep in job.runtime.asynchronous.values():
            ep.frame_padding = padding
        job.reset()
        job.run(iterations - 1)
        job.runtime.pop_boundary_bytes()
        job.run(1)
        moved = {("rollout" if "traject" in k else "weights" if "weights" in k else k): v
                 for k, v in job.runtime.pop_boundary_bytes().items()}
        return {k: v.clone() for k, v in job.component("learner").get_weights().items()}, moved
    finally:
        job.close()


def test_a_pong_rollout_crosses_a_gather_as_a_quarter_of_its_bytes_and_trains_the_same_bits():
    """single_learner_coarse: the trajectories' gather carries the compact form (episodes end
    inside the rollouts) and the learner trains on exactly the rollout it would have had."""
    whole, whole_bytes = _pong_job("single_learner_coarse", None, replicas={"actor": 1})
    compact, compact_bytes = _pong_job("single_learner_coarse", "zeros", replicas={"actor": 1})
    assert all(torch.equal(whole[k], compact[k]) for k in whole)
    assert compact_bytes["rollout"] < 0.3 * whole_bytes["rollout"]
    assert compact_bytes["weights"] == whole_bytes["weights"]  # not a rollout: whole


def test_a_queued_pong_rollout_crosses_compact_under_async_learner():
    """async_learner (a fifo of unrolls; one actor, so the order is fixed): compact unrolls,
    the learner's weights those of whole ones, bit for bit."""
    whole, whole_bytes = _pong_job("async_learner", None, algorithm="impala", replicas={"actor": 1})
    compact, compact_bytes = _pong_job("async_learner", "zeros", algorithm="impala", replicas={"actor": 1})
    assert all(torch.equal(whole[k], compact[k]) for k in whole)
    assert compact_bytes["rollout"] < 0.35 * whole_bytes["rollout"]


def test_a_wrong_padding_costs_one_check_and_never_a_wrong_value():
    """Told the wrong padding, the endpoint sends the first rollout whole after its check fails,
    and every later one whole without checking: the same bits as with compaction off."""
    whole, whole_bytes = _pong_job("single_learner_coarse", None, replicas={"actor": 1})
    wrong, wrong_bytes = _pong_job("single_learner_coarse", "reset", replicas={"actor": 1})
    assert all(torch.equal(whole[k], wrong[k]) for k in whole)
    assert wrong_bytes == whole_bytes
