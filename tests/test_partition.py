"""The partitioner: fragments, comm ops and their placement, for both policies."""


import pytest

from msrl.algorithms.ppo import PPOTrainer
from msrl.errors import PartitionError
from msrl.frontend.partition import partition
from msrl.frontend.tracer import trace
from msrl.graph import COMM_KINDS, NodeKind
from msrl.policy import load_policy
from msrl.run.job import Job


def comm_nodes(graph):
    return [n for n in graph.walk() if n.kind in COMM_KINDS]


def calls(graph):
    return [n.target for n in graph.walk() if n.kind is NodeKind.CALL]


@pytest.fixture(scope="module")
def coarse_job():
    from conftest import ppo_spec

    job = Job(ppo_spec("single_learner_coarse", num_envs=4))
    yield job
    job.close()


def test_single_has_one_fragment_and_no_boundaries(spec_factory):
    job = Job(spec_factory("single"), probe=False)
    fg = job.fragment_graph
    assert [f.name for f in fg.fragments] == ["main"] and fg.boundaries == []
    main = fg.fragments[0].programs["train_step"]
    assert calls(main) == calls(fg.graphs["train_step"])
    assert comm_nodes(main) == []
    job.close()


def test_coarse_gathers_trajectories_and_broadcasts_weights(coarse_job):
    fg = coarse_job.fragment_graph
    assert [f.name for f in fg.fragments] == ["actor", "learner"]
    actor, learner = fg.fragment("actor").programs["train_step"], fg.fragment("learner").programs["train_step"]
    # components land where the policy puts them
    assert {r for r, _ in calls(actor)} == {"actor", "env", "buffer"}
    assert {r for r, _ in calls(learner)} == {"learner"}
    # the rollout loop lives in the actor fragment only
    assert [n.kind for n in actor].count(NodeKind.LOOP) == 1
    assert [n.kind for n in learner].count(NodeKind.LOOP) == 0
    (b_traj, b_w) = [b for b in fg.boundaries if b.method == "train_step"]
    assert (b_traj.comm_kind, b_traj.value, b_traj.src, b_traj.dst, b_traj.value_kind, b_traj.axis) == (
        NodeKind.GATHER, "trajectory", "actor", "learner", "sharded", 1)
    assert (b_w.comm_kind, b_w.src, b_w.dst, b_w.value_kind, b_w.axis) == (NodeKind.BROADCAST, "learner", "actor", "replicated", None)
    assert (b_traj.src_replicas, b_traj.dst_replicas) == (2, 1)
    # each side's comm node sits right after the producer / right before the consumer
    a_nodes = [n for n in actor]
    i = next(k for k, n in enumerate(a_nodes) if n.kind is NodeKind.CALL and n.target == ("buffer", "gather"))
    g_src = a_nodes[i + 1]
    assert g_src.kind is NodeKind.GATHER and g_src.target.side == "src" and g_src.inputs == ["trajectory"]
    bc_dst = a_nodes[i + 2]
    assert bc_dst.kind is NodeKind.BROADCAST and bc_dst.target.side == "dst"
    assert a_nodes[i + 3].target == ("actor", "set_weights") and a_nodes[i + 3].inputs == bc_dst.outputs
    l_nodes = [n for n in learner]
    assert l_nodes[0].kind is NodeKind.GATHER and l_nodes[0].target.side == "dst" and l_nodes[0].outputs == ["trajectory"]
    assert l_nodes[1].target == ("learner", "learn")
    assert l_nodes[3].kind is NodeKind.BROADCAST and l_nodes[3].target.side == "src"
    # the metrics are returned by the learner fragment only
    assert l_nodes[-1].kind is NodeKind.OUTPUT and l_nodes[-1].inputs == ["metrics"]
    assert not any(n.kind is NodeKind.OUTPUT and n.inputs for n in actor)
    # reset: the initial weights are broadcast too
    (b_reset,) = [b for b in fg.boundaries if b.method == "reset"]
    assert b_reset.comm_kind is NodeKind.BROADCAST and (b_reset.src, b_reset.dst) == ("learner", "actor")


def test_generated_programs_hold_the_comm_ops(coarse_job):
    src = coarse_job.programs[("actor", "train_step")].source
    assert "_msrl_comm.gather('train_step/b0:trajectory', trajectory)" in src
    assert "= _msrl_comm.broadcast('train_step/b1:_learner_get_weights2')" in src
    assert "self.learner" not in src
    lsrc = coarse_job.programs[("learner", "train_step")].source
    assert "trajectory = _msrl_comm.gather('train_step/b0:trajectory')" in lsrc
    assert "self.env" not in lsrc and "for " not in lsrc


def test_probe_marks_sharded_and_replicated_values(coarse_job):
    g = coarse_job.graphs["train_step"]
    gather = next(n for n in g.walk() if n.kind is NodeKind.CALL and n.target == ("buffer", "gather"))
    info = gather.meta["values"]["trajectory"]
    assert info["kind"] == "sharded" and info["axis"] == 1 and info["shape"] == (16, "N")
    weights = next(n for n in g.walk() if n.kind is NodeKind.CALL and n.target == ("learner", "get_weights"))
    assert weights.meta["values"]["_learner_get_weights2"]["kind"] == "replicated"
    act = next(n for n in g.walk() if n.kind is NodeKind.CALL and n.target == ("actor", "act"))
    # nbytes: the tensor bytes with the probe's 2 and 3 envs (one int64 action per env)
    assert act.meta["values"]["action"] == {"type": "Tensor", "shape": ("N",), "dtype": "int64", "kind": "sharded", "axis": 0,
                                            "nbytes": {2: 16, 3: 24}}


def test_boundary_fitting_no_rule_names_the_edge(coarse_job):
    graphs = {m: trace(PPOTrainer, m) for m in ("reset", "train_step")}
    # copy probe info from the probed graphs, then pretend the trajectory is replicated
    for m in graphs:
        for a, b in zip(graphs[m].walk(), coarse_job.graphs[m].walk()):
            a.meta["values"] = {k: dict(v) for k, v in b.meta.get("values", {}).items()}
    gather = next(n for n in graphs["train_step"].walk() if n.kind is NodeKind.CALL and n.target == ("buffer", "gather"))
    gather.meta["values"]["trajectory"]["kind"] = "replicated"
    with pytest.raises(PartitionError, match=r"value 'trajectory' written by %\d+ at .*ppo.py:\d+ in fragment actor \(x2\) and read by %\d+ at .*ppo.py:\d+ in fragment learner \(x1\): a replicated value cannot be gathered"):
        partition(graphs, coarse_job.spec.policy)


def test_unprobed_boundary_between_replica_counts_is_an_error():
    graphs = {m: trace(PPOTrainer, m) for m in ("reset", "train_step")}
    with pytest.raises(PartitionError, match="no probe run observed it and its method declares no kind"):
        partition(graphs, load_policy("single_learner_coarse"))


def test_equal_replica_counts_use_send_recv():
    policy = load_policy("single_learner_coarse").with_overrides(replicas={"actor": 1})
    graphs = {m: trace(PPOTrainer, m) for m in ("reset", "train_step")}
    fg = partition(graphs, policy)
    ops = {(b.value, b.comm_kind) for b in fg.boundaries if b.method == "train_step"}
    assert ops == {("trajectory", NodeKind.SEND), ("_learner_get_weights2", NodeKind.SEND)}
    kinds = [n.kind for n in comm_nodes(fg.fragment("learner").programs["train_step"])]
    assert kinds == [NodeKind.RECV, NodeKind.SEND]


def test_policy_overrides_reject_unknown_fragments():
    with pytest.raises(KeyError, match="has no fragment 'learners'"):
        load_policy("single_learner_coarse").with_overrides(replicas={"learners": 2})


def test_schedule_check_rejects_boundaries_met_in_different_orders(coarse_job):
    import copy

    fg = copy.deepcopy(coarse_job.fragment_graph)
    fg.check_schedule()  # the partitioner's own result passes
    learner = fg.fragment("learner").programs["train_step"]
    nodes = learner.nodes
    gather_dst, bcast_src = nodes[0], nodes[3]
    learner._nodes[0], learner._nodes[3] = bcast_src, gather_dst  # broadcast weights before receiving trajectories
    with pytest.raises(PartitionError, match="fragments actor and learner meet their boundaries in different orders"):
        fg.check_schedule()


def test_compute_mixing_fragments_goes_to_its_user():
    from msrl.api import Trainer

    class MixTrainer(Trainer):
        def train_step(self):
            a = self.env.reset()
            w = self.learner.get_weights()
            both = (a, w)
            self.actor.set_weights(both)

    graphs = {"train_step": trace(MixTrainer, "train_step")}
    policy = load_policy("single_learner_coarse").with_overrides(replicas={"actor": 1})
    fg = partition(graphs, policy)
    actor = fg.fragment("actor").programs["train_step"]
    assert any(n.kind is NodeKind.COMPUTE and n.outputs == ["both"] for n in actor)
    assert [b.value for b in fg.boundaries] == ["w"]


def test_every_fragment_node_records_its_fragment(coarse_job):
    for fr in coarse_job.fragment_graph.fragments:
        for method, g in fr.programs.items():
            assert {n.meta["fragment"] for n in g.walk()} == {fr.name}, method


def test_boundary_kinds_from_the_policy_and_yaml_become_put_get_with_their_pattern():
    """A train_step boundary of an asynchronous class is put/get on both sides and keeps the
    collective it stands for (its pattern); reset's stay synchronous; msrl graph prints kinds."""
    policy = load_policy("single_learner_coarse").with_overrides(
        replicas={"actor": 1}, boundaries={"trajectories": "fifo", "weights": "latest"}, queue_capacity=3)
    graphs = {m: trace(PPOTrainer, m) for m in ("reset", "train_step")}
    fg = partition(graphs, policy)
    got = {(b.method, b.value): (b.comm_kind, b.pattern, b.channel, b.boundary_class, b.capacity) for b in fg.boundaries}
    assert got == {
        ("reset", "_learner_get_weights0"): (NodeKind.SEND, NodeKind.SEND, "sync", None, 3),
        ("train_step", "trajectory"): (NodeKind.PUT, NodeKind.SEND, "fifo", "trajectories", 3),
        ("train_step", "_learner_get_weights2"): (NodeKind.PUT, NodeKind.SEND, "latest", "weights", 3),
    }
    kinds = [n.kind for n in comm_nodes(fg.fragment("learner").programs["train_step"])]
    assert kinds == [NodeKind.GET, NodeKind.PUT]
    with pytest.raises(KeyError, match=r"no boundary class 'weight'; classes: trajectories \(actor -> learner\), "
                                       r"weights \(learner -> actor\)"):
        load_policy("single_learner_coarse").with_overrides(boundaries={"weight": "latest"})
    with pytest.raises(ValueError, match="unknown kind 'newest'; kinds: sync, fifo, latest"):
        load_policy("single_learner_coarse").with_overrides(boundaries={"weights": "newest"})


def test_msrl_graph_prints_each_boundarys_kind(capsys):
    from msrl.run.cli import main

    assert main(["graph", "configs/impala_cartpole.yaml", "--out", "/dev/null"]) == 0
    text = capsys.readouterr().out
    assert "fifo queue of 1 per producer, gather trajectory actor (x2) -> learner (x1), sharded, axis 1 [trajectories]" in text
    assert "latest-value slot, broadcast _learner_get_weights2 learner (x1) -> actor (x2), replicated [weights]" in text
    assert "sync broadcast _learner_get_weights0 learner (x1) -> actor (x2), replicated" in text
