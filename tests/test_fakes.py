"""The fakes (``tests/fakes.py``) run through the whole pipeline -- trace, probe, partition,
passes, code generation, the local runtime -- under policies they were not written for, with
exact results: a lockstep split computes what one process computes, bit for bit."""

from __future__ import annotations

import pytest
import torch
from fakes import ENV_ID

from msrl.config import build_job_spec, validate
from msrl.run.job import Job


def _job(policy: str, **replicas: int) -> Job:
    raw = {"name": "fakes", "algorithm": {"name": "fakes"}, "env": {"id": ENV_ID, "num_envs": 4},
           "distribution_policy": {"name": policy, "replicas": replicas}, "runtime": "local",
           "train": {"total_env_steps": 1024, "eval_every": 0}}
    return Job(build_job_spec(validate(raw)))


def _run(job: Job, n: int = 3) -> tuple[list[dict[str, float]], list[dict[str, torch.Tensor]]]:
    job.reset()
    rows = [job.train_step() for _ in range(n)]
    weights = [job.replica(f, r).trainer.components["learner"].get_weights() for f, r in sorted(job.replicas)
               if "learner" in job.replica(f, r).trainer.components]
    job.close()
    return rows, weights


def test_the_fake_algorithm_learns_its_weight_in_one_process():
    rows, [weights] = _run(_job("single"), 5)
    assert all(set(r) == {"losses/fake_loss", "charts/w"} for r in rows)
    assert weights["w"].item() > 0 and rows[-1]["charts/w"] == weights["w"].item()


@pytest.mark.parametrize("policy, replicas", [("single_learner_coarse", {"actor": 2}),
                                              ("single_learner_fine", {"env": 2})])
def test_a_lockstep_split_of_the_fakes_equals_one_process_bitwise(policy, replicas):
    single_rows, [single] = _run(_job("single"))
    rows, [weights] = _run(_job(policy, **replicas))
    assert rows == single_rows
    assert torch.equal(weights["w"], single["w"])


def test_the_fakes_replicated_learners_stay_identical():
    """``multi_learner`` x2: each replica steps its own envs and the gradient all-reduce keeps
    the two learners' weights identical."""
    _, (w0, w1) = _run(_job("multi_learner", main=2))
    assert torch.equal(w0["w"], w1["w"]) and w0["w"].item() != 0
