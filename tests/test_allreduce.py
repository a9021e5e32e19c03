"""The gradient all-reduce is in the graph: the partitioner places it at the learner's gradient
point (found by the probe), ``msrl graph`` shows it with its bytes, no runtime installs hooks, and
a learner that steps its optimiser outside ``apply_gradients`` under a replicated learner is a
``file:line`` error rather than diverging copies."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import pytest
import torch

from msrl.graph import NodeKind
from msrl.job import Job, JobSpec
from msrl.partition import PartitionError
from msrl.policy import load_policy

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
        assert (b.name, b.fragment, b.replicas, b.op) == (node.target.boundary, "main", 2, NodeKind.ALLREDUCE)
        assert not job.fragment_graph.boundaries  # a collective among one fragment's replicas, no boundary
        source = job.programs[("main", "train_step")].source
        assert f"with _msrl_comm.allreduce_gradients({b.name!r}, self.learner):" in source
        # nothing installed on the component: the region sets the hook only while its call runs
        job.reset()
        job.run(2)
        assert all(t.components["learner"].gradient_hook is None for t in job.trainers.values())
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
    from msrl.printer import _human, format_boundary_bytes, format_job

    job = Job(_spec(global_rng_algo.ALGORITHM, "multi_learner", {"main": 2}))
    try:
        text = format_job(job)
        assert "\n## collectives\n- train_step/a0:gradients: all-reduce (mean) of the learner's gradients over main's 2 replicas" in text
        assert "allreduce[all] gradients (over main's replicas)" in text
        grad_bytes = 4 * sum(p.numel() for p in job.component("learner").parameters)
        measured = format_boundary_bytes(job)
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
