"""multi_learner (DD-PPO): gradients averaged at Learner.apply_gradients; identical weights on
every replica; one update equals one learner's update on the combined batch."""

import torch
from torch.testing import assert_close

from msrl.run.job import Job
from msrl.runtime.replica import build_trainer

FULL_BATCH = {"update_epochs": 1, "num_minibatches": 1, "norm_adv": False}


def _weights(job, r):
    return job.replica("main", r).trainer.components["learner"].get_weights()


def test_replicas_hold_identical_weights_after_every_update(spec_factory):
    job = Job(spec_factory("multi_learner", num_envs=4))
    job.reset()
    assert all(torch.equal(_weights(job, 0)[k], _weights(job, 1)[k]) for k in _weights(job, 0))
    before = {k: v.clone() for k, v in _weights(job, 0).items()}
    for _ in range(3):
        job.train_step()
        w0, w1 = _weights(job, 0), _weights(job, 1)
        assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert any(not torch.equal(before[k], _weights(job, 0)[k]) for k in before)
    # the replicas stepped different envs: their rollouts differ
    b0 = job.replica("main", 0).trainer.components["buffer"].storage
    b1 = job.replica("main", 1).trainer.components["buffer"].storage
    assert not torch.equal(b0["obs"], b1["obs"])
    job.close()


def test_one_update_equals_one_learner_on_the_combined_batch(spec_factory):
    spec = spec_factory("multi_learner", num_envs=4, **FULL_BATCH)
    job = Job(spec)
    job.reset()
    job.train_step()
    combined = torch.cat([job.replica("main", r).trainer.components["buffer"].storage.clone() for r in range(2)], dim=1)
    # one learner, built as replica 0's was (same seed, same initial weights), on both rollouts
    one = build_trainer(spec, spec.policy.fragment("main"), 0).components["learner"]
    one.learn(combined)
    w_one, w_multi = one.get_weights(), _weights(job, 0)
    for k in w_one:
        assert_close(w_multi[k], w_one[k], rtol=1e-5, atol=1e-6)
    job.close()
