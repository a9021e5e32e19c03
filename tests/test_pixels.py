"""Pixels across boundaries: uint8 frames cross every boundary kind unchanged (bitwise) and
reach the learner's network as bytes (never widened on the way); what a pixel rollout costs at a
boundary is its bytes, measured."""

from __future__ import annotations

import hashlib

import engine_envs  # noqa: F401 - registers Frames-v0: (4, 36, 36) uint8 frames
import pytest
import torch
from tensordict import TensorDict

from msrl.algorithms import impala, ppo
from msrl.policy import load_policy
from msrl.run.job import Job, JobSpec
from msrl.runtime.transports.codec import decode, encode

ENV = "engine_envs:Frames-v0"
FRAME = 4 * 36 * 36  # bytes of one observation
HP = {"ppo": (ppo.ALGORITHM, dict(num_steps=4, update_epochs=1, num_minibatches=2)),
      "impala": (impala.ALGORITHM, dict(num_steps=4, num_minibatches=1))}


def _learn(algo, policy, iterations=2, num_envs=4, **overrides):
    """Trains ``iterations`` on the thread runtime, recording what the learner's ``learn``
    receives: each trajectory's observation dtype and a digest of its bytes; returns those, the
    metrics, the learner's weights and the bytes each boundary moved in the last iteration."""
    algorithm, hp = HP[algo]
    spec = JobSpec(algorithm, algorithm.hparams(**hp), ENV, num_envs, load_policy(policy).with_overrides(**overrides),
                   seed=3, total_env_steps=10_000)
    job = Job(spec)
    seen = []
    try:
        learner = job.component("learner")
        learn = learner.learn

        def recording(trajectory, *args, **kwargs):
            obs = trajectory["obs"]
            seen.append((obs.dtype, tuple(obs.shape), hashlib.sha256(obs.contiguous().numpy().tobytes()).hexdigest()))
            return learn(trajectory, *args, **kwargs)

        learner.learn = recording
        job.reset()
        job.runtime.pop_boundary_bytes()
        records = job.run(iterations)
        measured = job.runtime.pop_boundary_bytes()
        weights = {k: v.clone() for k, v in learner.get_weights().items()}
        boundaries = {b.name: b for b in job.fragment_graph.boundaries if b.method == "train_step"}
    finally:
        job.close()
    return seen, [r["output"] for r in records], weights, measured, boundaries


def _same(a, b):
    assert [s for s in a[0]] == [s for s in b[0]]  # the learner trained on the same bytes
    assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][k], b[2][k]) for k in a[2])


def test_frames_cross_a_synchronous_gather_as_bytes_bit_for_bit():
    """coarse x1 (the trajectory gathered over a synchronous boundary) against single: the same
    bytes reach the learner, uint8, and the gather moves them as bytes (obs and next_obs: 2
    bytes per pixel of the rollout, not 8)."""
    single = _learn("ppo", "single")
    coarse = _learn("ppo", "single_learner_coarse", replicas={"actor": 1})
    assert all(dtype == torch.uint8 for dtype, _, _ in single[0] + coarse[0])
    _same(single, coarse)
    trajectory = next(n for n in coarse[4] if n.endswith(":trajectory"))
    pixels = 2 * 4 * 4 * FRAME  # obs and next_obs: T=4 x N=4 frames each
    columns = 4 * 4 * (8 + 4 + 4 + 4 + 1 + 1)  # action int64; log_prob, value, reward float32; 2 bools
    assert coarse[3][trajectory] == 2 * (pixels + columns), coarse[3]  # 2 iterations, exactly


def test_frames_cross_streams_in_lockstep_as_bytes_bit_for_bit():
    """coarse x2 over fifo/fresh streams (asynchronous boundaries, in lockstep) against synchronous
    coarse x2: the same bytes, uint8 at the learner."""
    sync = _learn("ppo", "single_learner_coarse", replicas={"actor": 2})
    streams = _learn("ppo", "single_learner_coarse", replicas={"actor": 2},
                     boundaries={"trajectories": "fifo", "weights": "fresh"})
    assert all(dtype == torch.uint8 for dtype, _, _ in streams[0])
    _same(sync, streams)


@pytest.mark.parametrize("inference", [None, {"max_batch": 2}], ids=["collective", "served"])
def test_frames_cross_central_inference_every_step_as_bytes_bit_for_bit(inference):
    """single_learner_fine x2: each step's frames gathered from the env replicas to the central
    actor (the lockstep collective, or served in full batches), uint8 all the way, the same bytes
    as single; each step's observation boundary moves the frames as bytes."""
    single = _learn("ppo", "single")
    fine = _learn("ppo", "single_learner_fine", replicas={"env": 2}, inference=inference)
    assert all(dtype == torch.uint8 for dtype, _, _ in fine[0])
    _same(single, fine)
    first_obs = min((n for n, b in fine[4].items() if b.value == "self.obs"), key=lambda n: int(n.split("/b")[1].split(":")[0]))
    assert fine[3][first_obs] == 2 * 4 * FRAME  # 2 iterations x 4 envs' frames, once at each rollout's start


def test_frames_reach_the_learner_as_bytes_under_async_learner():
    """IMPALA under async_learner x2 (rollouts queued from free-running actors): every trajectory
    the learner trains on holds uint8 frames."""
    seen, outputs, *_ = _learn("impala", "async_learner", iterations=3, replicas={"actor": 2})
    assert len(seen) == 3 and all(dtype == torch.uint8 and shape[2:] == (4, 36, 36) for dtype, shape, _ in seen)
    assert all(o is not None for o in outputs)


def test_frames_survive_the_wire_codec_bit_for_bit():
    """The codec every process and network transport sends through keeps a uint8 rollout's dtype
    and bytes, and takes a byte per pixel."""
    frames = torch.randint(0, 256, (4, 2, 4, 36, 36), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    td = TensorDict({"obs": frames, "reward": torch.ones(4, 2)}, batch_size=[4, 2])
    wire = encode(td)
    back = decode(wire)
    assert back["obs"].dtype == torch.uint8 and torch.equal(back["obs"], frames)
    assert frames.numel() <= wire.numel() < frames.numel() + 1024


def test_the_cnn_sees_the_frames_scaled_exactly_laid_out_channels_last_on_the_cpu():
    """``scale_frames`` hands the trunk ``frames / 255`` bit for bit (float32), laid out
    channels-last on the CPU (oneDNN's faster convolutions), and the Nature CNN's output on it
    equals the default layout's up to the summation order."""
    from msrl.rl.networks import nature_cnn, scale_frames

    frames = torch.randint(0, 256, (8, 4, 84, 84), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    x = scale_frames(frames)
    assert x.dtype == torch.float32 and x.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(x, frames.float() / 255.0)
    torch.manual_seed(0)
    trunk = nature_cnn(4, (84, 84))
    torch.testing.assert_close(trunk(x), trunk((frames.float() / 255.0).contiguous()), rtol=1e-5, atol=1e-5)
    assert frames.dtype == torch.uint8 and int(frames.max()) > 1  # the frames themselves untouched (no in-place scaling)


def test_the_impala_pong_config_trains_under_async_learner_on_pixels(tmp_path):
    """configs/impala_pong.yaml as shipped (ale-py's vector env, the Nature CNN, async_learner with
    2 actor replicas), scaled down: its learner trains on uint8 frames queued by both actors."""
    pytest.importorskip("ale_py.vector_env")
    from msrl.config import build_job_spec, load_config

    spec = build_job_spec(load_config("configs/impala_pong.yaml", [
        f"runs_dir={tmp_path}", "env.num_envs=4", "algorithm.hparams.num_steps=4", "env.num_workers=1"]))
    assert spec.policy.name == "async_learner" and spec.policy.fragment("actor").replicas == 2
    job = Job(spec)
    try:
        job.reset()
        records = job.run(3)
    finally:
        job.close()
    assert all(torch.isfinite(torch.as_tensor(float(r["output"]["losses/value_loss"]))) for r in records)
