"""The front end's passes, each alone on hand-built graphs (``tests/graphs.py``): the partition,
the collective placement and the serving pass are functions ``-> FragmentGraph`` that leave
their input as it was, and the pipeline composes them in one order."""

from __future__ import annotations

import ast

import pytest
from graphs import SHAPES, off_policy_step, on_policy_step

from msrl.errors import PartitionError
from msrl.frontend.collectives import place_collectives
from msrl.frontend.partition import partition
from msrl.frontend.pipeline import PASSES, fragment_graph
from msrl.frontend.serving import serve_inference
from msrl.graph import NodeKind
from msrl.policy import load_policy


def _kinds(graph) -> list[str]:
    """Every node's kind in program order, nested regions included."""
    return [n.kind.value for n in graph.walk()]


def _snapshot(fg) -> dict:
    """What a pass must not change of its input: every fragment's program, node by node."""
    return {(fr.name, m): [(n.id, n.kind, tuple(n.inputs), tuple(n.outputs)) for n in g.walk()]
            for fr in fg.fragments for m, g in fr.programs.items()}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_hand_built_graphs_lint_and_copy_into_independent_graphs(shape):
    for g in SHAPES[shape]().values():
        g.lint(defined=set())
        copy = g.copy()
        copy.lint(defined=set())
        assert [(n.id, n.kind, n.inputs) for n in copy.walk()] == [(n.id, n.kind, n.inputs) for n in g.walk()]
        assert all(a is not b for a, b in zip(copy.walk(), g.walk()))
        first = copy.nodes[0]
        first.outputs.append("changed")
        first.meta["changed"] = True
        assert "changed" not in g.nodes[0].outputs and "changed" not in g.nodes[0].meta


def test_partition_of_a_hand_built_on_policy_step_under_coarse():
    """The rollout goes to two actor replicas and the learner to one: the rollout is gathered
    along its env axis (1), the weights broadcast; no collective (that is a later pass)."""
    fg = partition(on_policy_step(), load_policy("single_learner_coarse").with_overrides(replicas={"actor": 2}))
    assert [(b.value, b.comm_kind, b.src, b.dst, b.axis) for b in fg.boundaries] == [
        ("batch", NodeKind.GATHER, "actor", "learner", 1), ("weights", NodeKind.BROADCAST, "learner", "actor", None)]
    assert fg.collectives == [] and fg.inference is None
    assert "loop" in _kinds(fg.fragment("actor").programs["train_step"])
    assert "loop" not in _kinds(fg.fragment("learner").programs["train_step"])  # no node of the learner's in it


def test_place_collectives_wraps_each_point_a_replicated_learner_reaches_and_leaves_its_input():
    fg = partition(on_policy_step({"gradients": 4}), load_policy("multi_learner").with_overrides(replicas={"main": 2}))
    before = _snapshot(fg)
    out = place_collectives(fg)
    assert _snapshot(fg) == before and fg.collectives == []
    assert [(c.name, c.value, c.fragment, c.replicas, c.in_loop, c.in_branch) for c in out.collectives] == [
        ("train_step/a0:gradients", "gradients", "main", 2, False, False)]
    [region] = [n for n in out.fragment("main").programs["train_step"] if n.kind is NodeKind.ALLREDUCE]
    [call] = list(region.body)
    assert call.target == ("learner", "learn") and region.inputs == call.inputs and region.outputs == call.outputs
    assert region.meta["gradient_step"] == 4 and region.id == fg.next_node_id()


def test_place_collectives_numbers_nested_points_outermost_first_and_marks_branches():
    """A learner call the probe never ran reaches every point (gradients outermost, then
    statistics); a call in a branch region is a collective ``in_branch``."""
    fg = partition(off_policy_step(), load_policy("multi_learner").with_overrides(replicas={"main": 2}))
    out = place_collectives(fg)
    assert [(c.name, c.in_branch, c.call.split(" ")[0]) for c in out.collectives] == [
        ("train_step/a0:gradients", True, "learner.learn")]
    fg = partition(on_policy_step(None), load_policy("multi_learner").with_overrides(replicas={"main": 2}))
    out = place_collectives(fg)
    assert [c.name for c in out.collectives] == ["train_step/a0:gradients", "train_step/a1:statistics"]
    [outer] = [n for n in out.fragment("main").programs["train_step"] if n.kind is NodeKind.ALLREDUCE]
    [inner] = list(outer.body)
    assert (outer.target.value, inner.kind, inner.target.value) == ("gradients", NodeKind.ALLREDUCE, "statistics")


def test_place_collectives_is_the_identity_without_a_replicated_learner():
    for policy in ("single", "single_learner_coarse", "async_learner"):
        fg = partition(on_policy_step({"gradients": 4}), load_policy(policy))
        assert place_collectives(fg) is fg


def test_a_direct_optimiser_step_in_a_replicated_learner_names_both_lines():
    graphs = on_policy_step({"gradients": 4})
    learn = next(n for n in graphs["train_step"] if n.kind is NodeKind.CALL and n.target == ("learner", "learn"))
    learn.meta["direct_step"] = "my_algo.py:42"
    fg = partition(graphs, load_policy("multi_learner").with_overrides(replicas={"main": 2}))
    with pytest.raises(PartitionError, match=r"steps an optimiser outside apply_gradients \(at my_algo.py:42\)"):
        place_collectives(fg)


def test_serve_inference_plans_the_rollout_per_client_and_leaves_its_input():
    policy = load_policy("single_learner_fine").with_overrides(inference={"max_batch": 2})
    fg = partition(on_policy_step(), policy)
    assert serve_inference(partition(on_policy_step(), load_policy("single_learner_fine"))).inference is None
    before = _snapshot(fg)
    out = serve_inference(fg)
    assert _snapshot(fg) == before and fg.inference is None
    plan = out.inference
    assert (plan.server, plan.clients, plan.clients_count, plan.role, plan.max_batch) == ("learner", "env", 2, "actor", 2)
    assert plan.combine == {("buffer", "gather"): (1,)}  # the shards' rollouts concatenate along the env axis
    first = out.fragment("learner").programs["train_step"].nodes[0]
    assert first.kind is NodeKind.SERVE and "loop" in _kinds(first.body)


def test_serve_inference_refuses_a_replay_sample_it_cannot_combine():
    policy = load_policy("single_learner_fine").with_overrides(inference={"max_batch": 2})
    with pytest.raises(PartitionError, match=r"buffer\.sample\(\) -> batch at graphs\.py:\d+ is a batch value"):
        serve_inference(partition(off_policy_step(), policy))


def test_the_pipeline_runs_the_partition_then_each_pass_in_order():
    assert PASSES == (place_collectives, serve_inference)
    policy = load_policy("multi_learner").with_overrides(replicas={"main": 2})
    fg = fragment_graph(on_policy_step({"gradients": 4}), policy)
    by_hand = serve_inference(place_collectives(partition(on_policy_step({"gradients": 4}), policy)))
    assert _snapshot(fg) == _snapshot(by_hand) and fg.collectives == by_hand.collectives


def test_def_use_sees_a_loops_carried_value_and_both_arms_of_a_branch():
    """``msrl.graph.defuse.DefUse``, the one def-use analysis: a read inside a loop body is
    reached by the definition before the loop and by the body's own (the next trip's); a read
    after a branch by the writes of both arms and, where one arm writes nothing, the earlier
    write; a write that every path redefines does not reach."""
    from graphs import Builder

    from msrl.graph.defuse import DefUse

    b = Builder("train_step")
    b.compute("0", "x")
    b.loop("t", 3, lambda r: r.compute("x + 1", "x"))
    b.compute("1", "y")
    b.compute("2", "y")  # kills the write just before it
    b.branch("flag", lambda r: r.compute("x * 2", "x"))
    b.compute("x + y", "z")
    nodes = {n.id: n for n in b.graph.walk()}
    by_expr = {ast.unparse(n.target): n.id for n in nodes.values() if n.kind is NodeKind.COMPUTE}
    flow = DefUse(b.graph)
    loop_body_write = by_expr["x + 1"]
    assert flow.uses[(loop_body_write, "x")] == {by_expr["0"], loop_body_write}
    assert flow.uses[(by_expr["x + y"], "y")] == {by_expr["2"]}
    assert flow.uses[(by_expr["x + y"], "x")] == {by_expr["0"], loop_body_write, by_expr["x * 2"]}
    assert DefUse.reads(nodes[by_expr["x + y"]]) == ["x", "y"]
    branch = next(n for n in nodes.values() if n.kind is NodeKind.BRANCH)
    assert DefUse.reads(branch) == ["flag"] and flow.uses[(branch.id, "flag")] == frozenset()


def test_serve_inference_leaves_live_only_what_reaches_a_read_after_the_rollout():
    """The serving pass's live-outs come from the same def-use: a value the rollout writes but
    the rest of train_step rewrites before reading it is not sent back from the clients."""
    from graphs import Builder, _reset

    def step(rewrite: bool):
        b = Builder("train_step")
        b.state_in("obs")

        def rollout(r: Builder) -> None:
            act = r.call("actor", "act", "self.obs", outs=("action",))
            r.values(act, action=("sharded", 0))
            stepped = r.call("env", "step", "action", outs=("next_obs", "reward"))
            r.values(stepped, next_obs=("sharded", 0), reward=("sharded", 0))
            r.call("buffer", "insert", "self.obs", "action", "reward")
            r.compute("0", "n", control=True)

        b.loop("t", 2, rollout)
        if rewrite:
            b.compute("1", "n", control=True)
        gather = b.call("buffer", "gather", outs=("batch",))
        b.values(gather, batch=("sharded", 1))
        learn = b.call("learner", "learn", "batch", "n", outs=("metrics",))
        b.values(learn, metrics=("replicated", None))
        weights = b.call("learner", "get_weights", outs=("weights",))
        b.values(weights, weights=("replicated", None))
        b.call("actor", "set_weights", "weights")
        b.output("metrics")
        return {"reset": _reset(), "train_step": b.graph}

    policy = load_policy("single_learner_fine").with_overrides(inference={"max_batch": 2})
    assert "n" in serve_inference(partition(step(rewrite=False), policy)).inference.live_outs
    assert "n" not in serve_inference(partition(step(rewrite=True), policy)).inference.live_outs
