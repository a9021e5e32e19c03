"""Graph semantics that off-policy algorithms need: control values, branch regions, state
across methods and fragments, declared value kinds, algorithms from anywhere, and the errors
for what cannot be honoured. Each of the bugs listed in the "Write once, for real" issue has a
test here that failed before it was fixed."""

import pathlib
import textwrap

import pytest
import torch

from msrl.algorithms import dqn
from msrl.api import Learner, Trainer, returns
from msrl.config import ConfigError, load_config
from msrl.errors import PartitionError
from msrl.frontend.partition import partition
from msrl.frontend.tracer import TraceError, trace, trace_methods
from msrl.graph import COMM_KINDS, NodeKind
from msrl.policy import load_policy
from msrl.registry import UnknownAlgorithmError, load_algorithm
from msrl.run.cli import main
from msrl.run.job import Job, JobSpec

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tiny_dqn(**hp):
    return dqn.DQNConfig(**{"learning_starts": 16, "train_frequency": 4, "gradient_steps": 2, "batch_size": 8,
                            "buffer_size": 256, "target_network_frequency": 8, "hidden_sizes": (8,), **hp})


def dqn_spec(trainer=dqn.DQNTrainer, policy="single", replicas=None, placement=None, num_envs=2, **hp):
    algo = dqn.ALGORITHM if trainer is dqn.DQNTrainer else dqn.dataclasses.replace(dqn.ALGORITHM, trainer=trainer)
    pol = load_policy(policy).with_overrides(replicas=replicas, placement=placement)
    return JobSpec(algo, tiny_dqn(**hp), "CartPole-v1", num_envs, pol, seed=5, total_env_steps=2_000)


def branches(graph):
    return [n for n in graph.walk() if n.kind is NodeKind.BRANCH]


# -- bug 1: a call inside a conditional expression was hoisted out of it ----------------------
class IfExpTrainer(dqn.DQNTrainer):
    def train_step(self):
        action = self.actor.act(self.obs, 0.5)
        next_obs, reward, terminated, truncated, info = self.env.step(action)
        self.buffer.insert(obs=self.obs, action=action, reward=reward, next_obs=info["final_obs"], terminated=terminated)
        self.obs = next_obs
        self.global_step += self.num_envs
        metrics = self.learner.learn(self.buffer.sample()) if self.global_step > 1000 else {}
        return metrics


def test_call_in_conditional_expression_runs_only_when_taken():
    g = trace(IfExpTrainer)
    (br,) = branches(g)
    assert [n.target for n in br.body.walk() if n.kind is NodeKind.CALL] == [("buffer", "sample"), ("learner", "learn")]
    assert not any(n.kind is NodeKind.CALL and n.target[0] == "learner" for n in g)  # not at top level
    job = Job(dqn_spec(IfExpTrainer))
    job.reset()
    for _ in range(5):
        assert job.train_step() == {}
    assert job.component("learner").optimizer.state == {}  # never stepped: global_step <= 1000
    job.close()


# -- bug 2: a loop holding a learner call read actor-only state in the learner fragment -------
class LearnInLoopTrainer(dqn.DQNTrainer):
    def train_step(self):
        hp = self.hparams
        metrics = {}
        for _ in range(hp.train_frequency):
            action = self.actor.act(self.obs, 0.3)
            next_obs, reward, terminated, truncated, info = self.env.step(action)
            self.buffer.insert(obs=self.obs, action=action, reward=reward, next_obs=info["final_obs"], terminated=terminated)
            self.obs = next_obs
            self.global_step += self.num_envs
            if self.global_step >= hp.learning_starts:
                metrics = self.learner.learn(self.buffer.sample())
        self.actor.set_weights(self.learner.get_weights())
        return metrics


def _weights(job):
    return {k: v.clone() for k, v in job.component("learner").get_weights().items()}


def _run(spec, iterations):
    job = Job(spec)
    job.reset()
    out = [job.train_step() for _ in range(iterations)]
    w = _weights(job)
    steps = job.env_steps
    job.close()
    return out, w, steps


def test_learner_call_inside_rollout_loop_runs_under_coarse_as_under_single():
    spec = dqn_spec(LearnInLoopTrainer, "single_learner_coarse", replicas={"actor": 1})
    job = Job(spec)
    learner = job.fragment_graph.fragment("learner").programs["train_step"]
    # the learner keeps its own copy of the control counter, and never reads self.obs
    reads = {n.target for n in learner.walk() if n.kind is NodeKind.STATE_IN}
    assert "global_step" in reads and "obs" not in reads
    assert any(n.kind is NodeKind.STATE_OUT and n.target == "global_step" for n in learner.walk())
    job.close()
    a = _run(dqn_spec(LearnInLoopTrainer), 6)
    b = _run(spec, 6)
    assert a[0] and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    assert [{k: float(v) for k, v in m.items()} for m in a[0]] == [{k: float(v) for k, v in m.items()} for m in b[0]]


def test_data_state_read_in_another_fragment_crosses_a_boundary():
    class ReadObsInLearner(dqn.DQNTrainer):
        def train_step(self):
            action = self.actor.act(self.obs, 0.1)
            next_obs, reward, terminated, truncated, info = self.env.step(action)
            self.buffer.insert(obs=self.obs, action=action, reward=reward, next_obs=info["final_obs"], terminated=terminated)
            self.obs = next_obs
            batch = self.buffer.sample()
            metrics = self.learner.learn(batch)
            return metrics

    graphs = trace_methods(ReadObsInLearner)
    fg = partition(graphs, load_policy("single_learner_coarse").with_overrides(replicas={"actor": 1}))
    assert [(b.value, b.src, b.dst) for b in fg.boundaries if b.method == "train_step"] == [("batch", "actor", "learner")]
    learner = fg.fragment("learner").programs["train_step"]
    assert not any(n.kind is NodeKind.STATE_IN and n.target == "obs" for n in learner.walk())


def test_an_attribute_written_by_two_fragments_is_rejected_naming_both():
    class TwoWriters(dqn.DQNTrainer):
        def train_step(self):
            if self.seed > 3:
                self.thing = self.actor.act(self.obs, 0.1)
            else:
                self.thing = self.learner.get_weights()
            return {}

    graphs = trace_methods(TwoWriters)
    with pytest.raises(PartitionError, match=r"self.thing is written by several fragments: .*test_graph_semantics.py:\d+ "
                                             r"\(fragment learner\)"):
        partition(graphs, load_policy("single_learner_coarse").with_overrides(replicas={"actor": 1}))


# -- bug 3: replicas.learner=2 under single_learner_coarse ran two diverging learners ---------
@pytest.mark.parametrize("overrides,message", [
    (["distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.learner=2"],
     "distribution_policy.replicas.learner=2: policy single_learner_coarse runs at most 1 replica(s) of fragment learner"),
    (["distribution_policy.replicas.main=2"], "distribution_policy.replicas.main=2: policy single runs at most 1 replica(s)"),
    (["distribution_policy.name=single_learner_coarse", "distribution_policy.placement.learner=actor"],
     "leaves fragment learner of policy single_learner_coarse without roles"),
    (["distribution_policy.name=single_learner_coarse", "distribution_policy.placement.critic=learner"],
     "distribution_policy.placement.critic: unknown role 'critic'"),
    (["distribution_policy.name=single_learner_coarse", "distribution_policy.placement.buffer=main"],
     "policy single_learner_coarse has no fragment 'main'; fragments: actor, learner"),
])
def test_replica_and_placement_overrides_a_policy_cannot_honour_are_config_errors(overrides, message, tmp_path, capsys):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(ROOT / "configs" / "dqn_cartpole.yaml", overrides)
    assert main(["train", str(ROOT / "configs" / "dqn_cartpole.yaml"), f"runs_dir={tmp_path}", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("msrl: error: ") and err.count("\n") == 1 and not list(tmp_path.iterdir())


# -- bug 4: a step-counted `if` was rejected as data-dependent --------------------------------
class StepCountedTrainer(Trainer):
    def reset(self):
        self.global_step = 0
        self.obs = self.env.reset(seed=self.seed)

    def train_step(self):
        self.global_step += self.num_envs
        epsilon = max(0.05, 1.0 - self.global_step / (0.5 * self.total_env_steps))
        action = self.actor.act(self.obs, epsilon)
        if self.global_step % self.hparams.target_network_frequency == 0:
            self.learner.update_target()
        elif self.global_step > 10:
            self.learner.learn(action)
        self.obs = self.env.step(action)[0]
        return {"epsilon": epsilon}


def test_step_counted_branches_are_control_flow():
    graphs = trace_methods(StepCountedTrainer)
    g = graphs["train_step"]
    (outer,) = [b for b in g if b.kind is NodeKind.BRANCH]
    assert [n.target for n in outer.body if n.kind is NodeKind.CALL] == [("learner", "update_target")]
    (inner,) = [b for b in outer.orelse if b.kind is NodeKind.BRANCH]
    assert [n.target for n in inner.body if n.kind is NodeKind.CALL] == [("learner", "learn")]
    control = {n.target for m in graphs.values() for n in m.walk() if n.kind is NodeKind.STATE_OUT and n.meta["control"]}
    data = {n.target for m in graphs.values() for n in m.walk() if n.kind is NodeKind.STATE_OUT and not n.meta["control"]}
    assert control == {"global_step"} and data == {"obs"}
    # coarse: the branches hold learner calls only, so only the learner runs them; the action
    # they read crosses at its producer, outside the branch
    fg = partition(graphs, load_policy("single_learner_coarse").with_overrides(replicas={"actor": 1}))
    assert not branches(fg.fragment("actor").programs["train_step"])
    assert len(branches(fg.fragment("learner").programs["train_step"])) == 2
    (b,) = [b for b in fg.boundaries if b.method == "train_step"]
    assert (b.value, b.src, b.dst, b.in_branch) == ("action", "actor", "learner", False)
    # the learner computes its own copy of the step counter it branches on
    learner = fg.fragment("learner").programs["train_step"]
    assert any(n.kind is NodeKind.STATE_OUT and n.target == "global_step" for n in learner)


class DataConditionTrainer(Trainer):
    def train_step(self):
        metrics = self.learner.learn(self.buffer.sample())
        loss = metrics["losses/td_loss"]
        if loss > 1.0:
            self.learner.update_target()


class ShortCircuitTrainer(Trainer):
    def train_step(self):
        ok = self.seed > 3 and self.learner.learn(self.buffer.sample())
        return ok


class OneSidedTrainer(Trainer):
    def train_step(self):
        if self.seed > 3:
            metrics = self.learner.learn(self.buffer.sample())
        return metrics


class ImpureConditionTrainer(Trainer):
    def train_step(self):
        if torch.rand(()) < 0.5:
            self.learner.update_target()


@pytest.mark.parametrize("cls,message,advice", [
    (DataConditionTrainer, "which is data (it comes from the result of learner.learn() at", "torch.where"),
    (ShortCircuitTrainer, "called in an operand of `and` that runs only sometimes", "write an `if` statement"),
    (OneSidedTrainer, "'metrics' is assigned in only one side of the `if` at", "assign metrics before the `if`"),
    (ImpureConditionTrainer, "which msrl cannot tell is deterministic", "step counters"),
])
def test_conditions_the_tracer_cannot_honour_name_file_line(cls, message, advice):
    with pytest.raises(TraceError) as info:
        trace(cls)
    assert info.value.file == __file__ and message in str(info.value) and advice in str(info.value)
    first = cls.train_step.__code__.co_firstlineno
    assert first <= info.value.line <= first + 5


# -- bug 5: a fixed-size replay sample could not be gathered; the buffer could not move ------
def test_declared_batch_is_gathered_from_every_actor_replica():
    job = Job(dqn_spec(policy="single_learner_coarse", replicas={"actor": 2}, num_envs=4))
    (sample,) = [b for b in job.fragment_graph.boundaries  # the uniform replay's (the prioritized branch: not taken)
                 if b.method == "train_step" and b.src == "actor" and b.value.startswith("_buffer_sample")]
    # the iteration's gradient_steps=2 minibatches, (2, batch_size), concatenated along axis 1
    assert (sample.comm_kind, sample.value_kind, sample.axis, sample.in_loop, sample.in_branch) == (NodeKind.GATHER, "batch", 1, False, True)
    seen = []
    learner = job.component("learner")
    real = learner.learn
    learner.learn = lambda batch: (seen.append(tuple(batch.batch_size)), real(batch))[1]
    job.reset()
    for _ in range(4):
        job.train_step()
    assert seen and set(seen) == {(2, 2 * 8)}  # two replicas' minibatches of batch_size 8, concatenated
    job.close()


def test_replay_at_the_learner_gathers_transitions_every_step():
    job = Job(dqn_spec(policy="single_learner_coarse", replicas={"actor": 2}, placement={"buffer": "learner"}, num_envs=4))
    fg = job.fragment_graph
    assert fg.fragment("learner").spec.roles == ("buffer", "learner")
    gathered = {b.value for b in fg.boundaries if b.method == "train_step" and b.comm_kind is NodeKind.GATHER}
    temps = {v for v in gathered if v.startswith("_t")}  # info["final_obs"]
    # (truncated: an n-step replay cuts its sums at episode ends)
    assert gathered - temps == {"self.obs", "action", "reward", "terminated", "truncated"} and len(temps) == 1
    # every step's transitions cross inside the rollout loop; the first observation at the start
    outside = [b.value for b in fg.boundaries if b.comm_kind is NodeKind.GATHER and not b.in_loop and b.method == "train_step"]
    assert outside == ["self.obs"]
    job.reset()
    for _ in range(3):
        job.train_step()
    assert job.component("buffer").size == 3 * 4 * 4  # every env of both replicas, every step
    job.close()


def test_a_declaration_the_probe_contradicts_is_an_error():
    class Bad(dqn.ReplayBuffer):
        @returns("sharded")
        def sample_many(self, num_batches):
            return super().sample_many(num_batches)

    algo = dqn.dataclasses.replace(dqn.ALGORITHM, components={**dqn.ALGORITHM.components, "buffer": Bad})
    spec = JobSpec(algo, tiny_dqn(), "CartPole-v1", 4, load_policy("single_learner_coarse"), seed=1, total_env_steps=2000)
    with pytest.raises(PartitionError, match=r"Bad.sample_many \(called at .*dqn.py:\d+\) declares '_buffer_sample_many\d+' "
                                             r"'sharded' along axis 0, but the probe saw shape \(2, 8\) with 2 envs"):
        Job(spec)


# -- bug 6: algorithms outside msrl.algorithms; PartitionError as a traceback ------------------
ALGO_FILE = '''
from msrl.algorithms.dqn import ALGORITHM as _DQN, DQNTrainer
import dataclasses

class MyTrainer(DQNTrainer):
    """A user's DQN variant outside the msrl package."""

ALGORITHM = dataclasses.replace(_DQN, name="my_dqn", trainer=MyTrainer)
'''


def test_algorithms_load_from_a_file_or_a_dotted_module(tmp_path, monkeypatch):
    path = tmp_path / "my_dqn.py"
    path.write_text(textwrap.dedent(ALGO_FILE))
    assert load_algorithm(str(path)).name == "my_dqn"
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_algorithm("msrl.algorithms.a2c").name == "a2c"
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "empty.py").write_text("X = 1\n")
    (pkg / "algo.py").write_text(textwrap.dedent(ALGO_FILE))
    assert load_algorithm("userpkg.algo").trainer.__name__ == "MyTrainer"
    with pytest.raises(UnknownAlgorithmError, match="algorithm file 'nope.py' does not exist"):
        load_algorithm("nope.py")
    with pytest.raises(UnknownAlgorithmError, match="no module 'userpkg.missing' on sys.path"):
        load_algorithm("userpkg.missing")
    with pytest.raises(UnknownAlgorithmError, match="defines no ALGORITHM"):
        load_algorithm("userpkg.empty")
    # a whole run from the file, through the CLI
    monkeypatch.chdir(tmp_path)
    args = ["train", str(ROOT / "configs" / "dqn_cartpole.yaml"), f"algorithm.name={path}", "runs_dir=runs",
            "train.total_env_steps=256", "train.progress=false", "train.eval_every=0", "eval.episodes=2",
            "algorithm.hparams.train_frequency=64", "algorithm.hparams.learning_starts=128",
            "algorithm.hparams.gradient_steps=2", "algorithm.hparams.hidden_sizes=[8]"]
    assert main(args) == 0


def test_partition_error_is_one_line_with_status_2(tmp_path, capsys):
    bad = tmp_path / "two_writers.py"
    bad.write_text(textwrap.dedent('''
        import dataclasses
        from msrl.algorithms.dqn import ALGORITHM as _DQN, DQNTrainer

        class TwoWriters(DQNTrainer):
            def train_step(self):
                if self.seed > 3:
                    self.thing = self.actor.act(self.obs, 0.1)
                else:
                    self.thing = self.learner.get_weights()
                return {}

        ALGORITHM = dataclasses.replace(_DQN, trainer=TwoWriters)
    '''))
    rc = main(["train", str(ROOT / "configs" / "dqn_cartpole.yaml"), f"algorithm.name={bad}", f"runs_dir={tmp_path / 'runs'}",
               "distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("msrl: error: trainer attribute self.thing is written by several fragments")
    assert err.count("\n") == 1 and not (tmp_path / "runs").exists()


# -- bug 7: apply_gradients assumed one optimiser ---------------------------------------------
def test_apply_gradients_steps_one_optimiser_and_hooks_its_gradients():
    class TwoOpt(Learner):
        def __init__(self):
            self.a, self.b = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
            self.opt_a = torch.optim.SGD(self.a.parameters(), lr=0.1)
            self.opt_b = torch.optim.SGD(self.b.parameters(), lr=0.1)

    from msrl.api import collective_scope

    learner, hooked = TwoOpt(), []
    x = torch.ones(4, 3)
    b_before = [p.clone() for p in learner.b.parameters()]
    with collective_scope(learner, "gradients", lambda grads: hooked.append([g.shape for g in grads])):
        learner.apply_gradients((learner.a(x) + learner.b(x)).sum(), optimizer=learner.opt_a)
        assert all(torch.equal(p, q) for p, q in zip(learner.b.parameters(), b_before))  # b not stepped
        learner.apply_gradients(learner.b(x).sum(), optimizer=learner.opt_b)
    assert not all(torch.equal(p, q) for p, q in zip(learner.b.parameters(), b_before))
    assert hooked == [[torch.Size([1, 3]), torch.Size([1])]] * 2  # one call per optimiser, its own parameters


def test_msrl_graph_prints_branch_regions(capsys):
    assert main(["graph", str(ROOT / "configs" / "dqn_cartpole.yaml"), "distribution_policy.name=single_learner_coarse",
                 "distribution_policy.replicas.actor=1", "--out", "/dev/null"]) == 0
    text = capsys.readouterr().out
    traced = text.split("## fragments")[0]
    assert "branch if _t" in traced  # the traced graph shows the branch region
    programs = text.split("### generated program")[1:]
    assert all("    if _t" in p for p in programs[1::2])  # actor and learner train_step programs branch
    assert "_msrl_comm.send(" in text


def test_comm_nodes_sit_inside_branches_in_both_fragments():
    job = Job(dqn_spec(policy="single_learner_coarse", replicas={"actor": 1}))
    for frag in ("actor", "learner"):
        g = job.fragment_graph.fragment(frag).programs["train_step"]
        # the learning branch (DQN's other branch, on the exploration kind, holds no comm)
        branches = [n for n in g if n.kind is NodeKind.BRANCH]
        assert [any(n.kind in COMM_KINDS for n in br.body.walk()) for br in branches].count(True) == 1, frag
    job.close()


def test_replay_buffer_overwrites_the_oldest_rows_in_ring_order():
    """Inserts of 3 rows into 7 slots, wrapping every few steps: the storage holds each row
    where ring order puts it (contiguous inserts take slices, wrapping ones an index)."""
    import types

    from msrl.algorithms.dqn import ReplayBuffer

    ctx = types.SimpleNamespace(hparams=types.SimpleNamespace(buffer_size=7, batch_size=4), device=torch.device("cpu"), seed=0)
    buf, ref, pos = ReplayBuffer(ctx), torch.zeros(7), 0
    for i in range(10):
        r = torch.arange(3, dtype=torch.float32) + 10 * i
        buf.insert(obs=torch.full((3, 2), float(i)), action=torch.zeros(3, dtype=torch.int64), reward=r,
                   next_obs=torch.zeros(3, 2), terminated=torch.zeros(3, dtype=torch.bool))
        ref[(pos + torch.arange(3)) % 7] = r
        pos = (pos + 3) % 7
        assert torch.equal(buf.storage["reward"], ref)
        assert buf.pos == pos and buf.size == min(3 * (i + 1), 7)
    assert torch.equal(buf.storage["obs"][:, 0], torch.tensor([9.0, 9, 7, 8, 8, 8, 9]))


# -- the probe stops waiting for a side of a branch its fixed condition never takes ------------
def test_the_probe_knows_which_branches_have_a_condition_fixed_for_the_run():
    """``if hp.prioritized_replay:`` (hyperparameters only) is fixed for the whole run;
    ``if self.global_step >= hp.learning_starts:`` (a counter written back) is not."""
    from msrl.frontend.probe import _fixed_branches

    graphs = trace_methods(dqn.DQNTrainer)
    lines = {int(b.where().rsplit(":", 1)[1]) for _, b in _fixed_branches(graphs)}
    source = (ROOT / "algorithms" / "dqn.py").read_text().splitlines()
    texts = {source[n - 1].strip() for n in lines}
    assert texts == {"if hp.gradient_steps > 0 and hp.prioritized_replay:", "elif hp.gradient_steps > 0:",
                     'if hp.exploration == "schedule":  # (apex: each env keeps its own, DQNActor.env_epsilons)'}


@pytest.mark.parametrize("prioritized", [False, True])
def test_the_probe_stops_once_the_other_side_of_a_fixed_branch_has_run(monkeypatch, prioritized):
    """Coarse DQN's boundary values sit in both sides of ``if hp.prioritized_replay``; the probe
    used to step PROBE_MAX_ENV_STEPS (20,000) env steps, twice, waiting for the side that never
    runs (3.7 minutes before the shipped Ape-X config started). It stops as soon as learning has
    started, and the job is the same."""
    from msrl.frontend.probe import PROBE_MAX_ENV_STEPS
    from msrl.runtime import replica

    iterations = []
    check = replica.check_losses
    monkeypatch.setattr(replica, "check_losses", lambda losses, it: (iterations.append(it), check(losses, it))[1])
    spec = dqn_spec(policy="single_learner_coarse", replicas={"actor": 2}, prioritized_replay=prioritized)
    job = Job(spec)
    try:
        job.reset()
        assert job.train_step() is not None
    finally:
        job.close()
    # 2 probe runs (2 and 3 envs), each until the first learning iteration: learning_starts 16
    # env steps at 4 steps per iteration
    per_run = [k for k in iterations if k == 1]
    assert len(per_run) == 2 and max(iterations) * 4 * 2 < PROBE_MAX_ENV_STEPS // 100, max(iterations)
