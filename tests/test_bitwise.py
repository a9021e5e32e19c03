"""The generated fragment programs reproduce eager execution bitwise."""

import torch

from msrl.run.job import Job
from msrl.runtime.replica import build_trainers


def _weights_equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.values(), b.values())) and a.keys() == b.keys()


def test_single_program_reproduces_eager_train_step_bitwise(spec_factory):
    spec = spec_factory("single", num_envs=4, seed=7)
    eager = build_trainers(spec)[("main", 0)]
    eager.reset()
    eager_metrics = [{k: float(v) for k, v in eager.train_step().items()} for _ in range(4)]

    job = Job(spec)
    job.reset()
    job_metrics = [job.train_step() for _ in range(4)]
    program = job.replica("main", 0).trainer

    assert job_metrics == eager_metrics  # every loss, KL, clip fraction: exact floats
    assert _weights_equal(program.learner.get_weights(), eager.learner.get_weights())
    assert _weights_equal(program.actor.get_weights(), eager.actor.get_weights())
    assert torch.equal(program.obs, eager.obs)
    assert program.env.env_steps == eager.env.env_steps == 4 * 16 * 4
    job.close()


def test_different_seeds_differ(spec_factory):
    a = Job(spec_factory("single", seed=1))
    b = Job(spec_factory("single", seed=2))
    a.reset(), b.reset()
    assert a.train_step() != b.train_step()
    a.close(), b.close()


def test_coarse_replicas_step_the_same_envs_as_one_process(spec_factory):
    """Replica r of 2 holds envs r*n..r*n+n-1 with the same seeds as in one process, so the
    first observations of both policies are identical and gathered in env order."""
    single = Job(spec_factory("single", num_envs=4, seed=5))
    coarse = Job(spec_factory("single_learner_coarse", num_envs=4, seed=5))
    single.reset(), coarse.reset()
    obs_single = single.replica("main", 0).trainer.obs
    obs_coarse = torch.cat([coarse.replica("actor", r).trainer.obs for r in range(2)])
    assert torch.equal(obs_single, obs_coarse)
    # the initial weights broadcast from the learner reach both actor replicas
    w = {k: v.clone() for k, v in coarse.component("learner").get_weights().items()}
    for r in range(2):
        assert _weights_equal(coarse.component("actor", r).get_weights(), w)
    m = coarse.train_step()
    assert set(m) >= {"losses/value_loss", "losses/policy_loss", "losses/entropy", "charts/learning_rate"}
    # after the step both replicas hold the learner's new weights
    w2 = coarse.component("learner").get_weights()
    assert not _weights_equal(w, w2)
    for r in range(2):
        assert _weights_equal(coarse.component("actor", r).get_weights(), w2)
    single.close(), coarse.close()
