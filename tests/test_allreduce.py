"""The all-reduces are in the graph: the partitioner places one at each of the learner's
collective points a call reaches (its gradient steps; its running statistics, in an all-reduce of
their own), found by the probe; ``msrl graph`` shows each with its bytes; nothing is set on a
component at run time; and a learner that steps its optimiser outside ``apply_gradients`` under
a replicated learner is a ``file:line`` error rather than diverging copies."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import pytest
import torch

from msrl.errors import PartitionError
from msrl.graph import NodeKind
from msrl.policy import load_policy
from msrl.run.job import Job, JobSpec

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
import global_rng_algo  # noqa: E402


class DirectStepLearner(global_rng_algo.GlobalLearner):
    """Steps its optimiser itself, as hand-written training code often does."""

    def learn(self, batch: Any) -> dict[str, Any]:
        flat = batch.flatten(0, 1)
        log_probs, value = self.net(flat["obs"])
        loss = ((flat["reward"] - value) ** 2).mean() - log_probs.mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()  # DIRECT-STEP
        return {"losses/value_loss": loss.detach()}


DIRECT = dataclasses.replace(global_rng_algo.ALGORITHM, name="direct_step",
                             components={**global_rng_algo.ALGORITHM.components, "learner": DirectStepLearner})


def _spec(algorithm, policy, replicas=None):
    pol = load_policy(policy).with_overrides(replicas=replicas)
    return JobSpec(algorithm, algorithm.hparams(num_steps=6, hidden_sizes=(8,)), "CartPole-v1", 4, pol, seed=7,
                   total_env_steps=5_000)


def _allreduce_nodes(job):
    return [(fr.name, n) for fr in job.fragment_graph.fragments for n in fr.programs["train_step"].walk()
            if n.kind is NodeKind.ALLREDUCE]


def test_the_partitioner_places_the_gradient_allreduce_at_the_learners_gradient_point():
    job = Job(_spec(global_rng_algo.ALGORITHM, "multi_learner", {"main": 2}))
    try:
        [(frag, node)] = _allreduce_nodes(job)
        call = next(iter(node.body))
        assert frag == "main" and call.target == ("learner", "learn")
        assert node.meta["gradient_step"] == {"tensors": 6, "bytes": 4 * sum(p.numel() for p in job.component("learner").parameters)}
        [b] = job.fragment_graph.collectives
        assert (b.name, b.fragment, b.replicas, b.comm_kind) == (node.target.boundary, "main", 2, NodeKind.ALLREDUCE)
        assert not job.fragment_graph.boundaries  # a collective among one fragment's replicas, no boundary
        source = job.programs[("main", "train_step")].source
        assert f"with _msrl_comm.allreduce_region({b.name!r}, 'gradients', self.learner):" in source
        # nothing set on the component: the region is a scope of the running code, not an attribute
        learners = [t.components["learner"] for t in (r.trainer for r in job.replicas.values())]
        before = [dict(vars(learner)) for learner in learners]
        job.reset()
        job.run(2)
        assert [sorted(vars(learner)) for learner in learners] == [sorted(b) for b in before]
        assert all(vars(learner)[k] is v for learner, b in zip(learners, before) for k, v in b.items()
                   if not isinstance(v, (int, float)))
        w = [t.components["learner"].get_weights() for t in job.replicas_with("learner")]
        assert all(torch.equal(w[0][k], w[1][k]) for k in w[0])  # the replicas averaged: the same weights
    finally:
        job.close()


@pytest.mark.parametrize("policy, replicas", [("single", None), ("single_learner_coarse", {"actor": 2}),
                                               ("multi_learner", {"main": 1})])
def test_a_single_learner_has_no_allreduce(policy, replicas):
    job = Job(_spec(global_rng_algo.ALGORITHM, policy, replicas))
    try:
        assert _allreduce_nodes(job) == [] and job.fragment_graph.collectives == []
    finally:
        job.close()


def test_msrl_graph_shows_the_allreduce_with_its_bytes():
    from msrl.run.printer import _human, format_boundary_bytes, format_job

    job = Job(_spec(global_rng_algo.ALGORITHM, "multi_learner", {"main": 2}))
    try:
        text = format_job(job)
        assert "\n## collectives\n- train_step/a0:gradients: all-reduce (mean) of the learner's gradients over main's 2 replicas" in text
        assert "allreduce[all] gradients (over main's replicas)" in text
        grad_bytes = 4 * sum(p.numel() for p in job.component("learner").parameters)
        measured = format_boundary_bytes(job, job.measure_boundary_bytes())
        # one gradient step per iteration, contributed by each of the 2 replicas
        assert f"- train_step/a0:gradients: {_human(2 * grad_bytes)} (all-reduce over main's replicas" in measured, measured
    finally:
        job.close()


def test_a_learner_stepping_its_optimiser_directly_under_a_replicated_learner_is_a_file_line_error():
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if text.endswith("# DIRECT-STEP"))
    with pytest.raises(PartitionError, match=rf"steps an optimiser outside apply_gradients \(at {__file__}:{line}\)"):
        Job(_spec(DIRECT, "multi_learner", {"main": 2}))
    job = Job(_spec(DIRECT, "single"))  # one learner: its own steps are its business
    try:
        job.reset()
        job.run(1)
    finally:
        job.close()


def _ppo_spec(policy, replicas=None, **hp):
    from msrl.algorithms.ppo import ALGORITHM, PPOConfig

    pol = load_policy(policy).with_overrides(replicas=replicas)
    hparams = PPOConfig(**{"num_steps": 8, "update_epochs": 1, "num_minibatches": 2, "hidden_sizes": (8,), **hp})
    return JobSpec(ALGORITHM, hparams, "CartPole-v1", 4, pol, seed=3, total_env_steps=5_000)


def test_running_statistics_get_an_allreduce_of_their_own_beside_the_gradients():
    """PPO with observation and reward normalisation under multi_learner: the learner's call
    sits in two nested all-reduce regions, gradients and statistics, each a collective with its
    own name, lowering and bytes; the replicas' statistics stay bitwise equal."""
    from msrl.run.printer import _human, format_boundary_bytes, format_job

    job = Job(_ppo_spec("multi_learner", {"main": 2}, normalize_obs=True, normalize_reward=True))
    try:
        (_, outer), (_, inner) = _allreduce_nodes(job)  # (walk: the outer region, then its body's)
        assert list(outer.body) == [inner]
        assert (outer.target.value, inner.target.value) == ("gradients", "statistics")
        assert [n.target for n in inner.body] == [("learner", "learn")]
        grads, stats = job.fragment_graph.collectives
        assert (grads.name, grads.value, stats.name, stats.value) == ("train_step/a0:gradients", "gradients",
                                                                     "train_step/a1:statistics", "statistics")
        # the observations' moments (2 x 4 float64) are the largest reduction: 64 bytes
        assert stats.gradient_step == {"tensors": 2, "bytes": 64}
        source = job.programs[("main", "train_step")].source
        assert ("with _msrl_comm.allreduce_region('train_step/a0:gradients', 'gradients', self.learner):" in source
                and "with _msrl_comm.allreduce_region('train_step/a1:statistics', 'statistics', self.learner):" in source)
        text = format_job(job)
        assert ("- train_step/a1:statistics: all-reduce (mean) of the learner's running statistics over main's 2 "
                "replicas at every reduce_statistics of learner.learn") in text, text
        measured = format_boundary_bytes(job, job.measure_boundary_bytes())
        # per iteration and replica: the observations' moments (64 B) and the returns' (16 B)
        assert f"- train_step/a1:statistics: {_human(2 * (64 + 16))} (all-reduce over main's replicas" in measured, measured
        job.run(2)
        a, b = (t.components["learner"] for t in job.replicas_with("learner"))
        for k in ("mean", "var", "count"):
            assert torch.equal(getattr(a.net.obs_rms, k), getattr(b.net.obs_rms, k))
            assert torch.equal(getattr(a.reward_scaler.return_rms, k), getattr(b.reward_scaler.return_rms, k))
    finally:
        job.close()


def test_a_learner_without_running_statistics_gets_no_statistics_allreduce():
    job = Job(_ppo_spec("multi_learner", {"main": 2}))
    try:
        assert [c.value for c in job.fragment_graph.collectives] == ["gradients"]
    finally:
        job.close()


def test_the_statistics_point_is_a_no_op_for_one_learner_and_the_mean_in_a_scope():
    from msrl.api import Learner, collective_scope

    learner = Learner()
    x = [torch.tensor([1.0, 3.0], dtype=torch.float64)]
    learner.reduce_statistics(x)
    assert x[0].tolist() == [1.0, 3.0]
    with collective_scope(learner, "statistics", lambda ts: [t.mul_(0.5) for t in ts]):
        learner.reduce_statistics(x)
        Learner().reduce_statistics(x)  # another learner's point is not in the scope
    assert x[0].tolist() == [0.5, 1.5]
    learner.reduce_statistics(x)  # the scope ended
    assert x[0].tolist() == [0.5, 1.5]
    with pytest.raises(ValueError, match="unknown collective point 'weights'; points are"):
        with collective_scope(learner, "weights", lambda ts: None):
            pass
