"""The tracer: PPO's graph, helper inlining, and TraceError for code outside the subset."""

import pytest

from msrl.algorithms.ppo import PPOTrainer
from msrl.api import Trainer
from msrl.frontend.tracer import TraceError, trace
from msrl.graph import Graph, GraphLintError, Node, NodeKind


def calls(graph):
    return [n.target for n in graph if n.kind is NodeKind.CALL]


def test_ppo_train_step_graph():
    g = trace(PPOTrainer, "train_step")
    kinds = [n.kind for n in g]
    assert kinds.count(NodeKind.LOOP) == 1
    loop = next(n for n in g if n.kind is NodeKind.LOOP)
    # the rollout loop holds act -> step -> insert; the update follows it
    assert calls(loop.body) == [("actor", "act"), ("env", "step"), ("buffer", "insert")]
    assert calls(g) == [("buffer", "gather"), ("learner", "learn"), ("learner", "get_weights"), ("actor", "set_weights")]
    # trip count from hyperparameters; self.obs is carried around the loop
    assert loop.meta["carried"] == ["self.obs"]
    assert loop.args == ["_t0"]
    state_in = {n.target for n in g if n.kind is NodeKind.STATE_IN}
    assert state_in == {"hparams", "obs"}
    assert [n.target for n in g if n.kind is NodeKind.STATE_OUT] == ["obs"]
    out = g.nodes[-1]
    assert out.kind is NodeKind.OUTPUT and out.inputs == ["metrics"]
    act = loop.body.nodes[0]
    assert act.outputs == ["action", "log_prob", "value"] and act.unpack
    assert act.inputs == ["self.obs"]
    step = loop.body.nodes[1]
    assert step.inputs == ["action"]
    # every node points back at the user's source
    assert all(n.where().startswith(PPOTrainer.train_step.__code__.co_filename) for n in loop.body)
    # data edges: gather -> learn -> (weights) -> set_weights
    edges = {(p.target, c.target, v) for p, c, v in g.edges() if p.kind is NodeKind.CALL and c.kind is NodeKind.CALL}
    assert (("buffer", "gather"), ("learner", "learn"), "trajectory") in edges
    assert (("learner", "get_weights"), ("actor", "set_weights"), "_learner_get_weights2") in edges
    g.lint(defined=set())


class HelperTrainer(Trainer):
    def rollout(self, n):
        total = 0
        for _ in range(n):
            obs, reward, term, trunc, info = self.env.step(self.actor.act(self.obs))
            self.obs = obs
            total = total + reward
        return total

    def train_step(self):
        total = self.rollout(self.hparams.num_steps)
        metrics = self.learner.learn(total)
        return metrics


def test_helpers_are_inlined_with_renamed_locals():
    g = trace(HelperTrainer, "train_step")
    loop = next(n for n in g if n.kind is NodeKind.LOOP)
    assert calls(loop.body) == [("actor", "act"), ("env", "step")]
    assert "_rollout0_total" in loop.meta["carried"] and "self.obs" in loop.meta["carried"]
    learn = next(n for n in g if n.kind is NodeKind.CALL and n.target == ("learner", "learn"))
    assert learn.inputs == ["total"]
    alias = next(n for n in g if n.kind is NodeKind.COMPUTE and n.outputs == ["total"])
    assert alias.inputs == ["_rollout0_total"]


class IfTrainer(Trainer):
    def train_step(self):
        x = self.env.step(self.actor.act(self.obs))
        if x:
            self.learner.learn(x)


class IfExpressionTrainer(Trainer):
    def train_step(self):
        x = self.env.step(self.actor.act(self.obs))
        if x.mean() > self.hparams.threshold:
            self.learner.learn(x)


class CallTripCountTrainer(Trainer):
    def train_step(self):
        for _ in range(self.buffer.size()):
            self.env.reset()


class WhileTrainer(Trainer):
    def train_step(self):
        while True:
            self.env.reset()


class TryTrainer(Trainer):
    def train_step(self):
        try:
            self.env.reset()
        except ValueError:
            pass


class WithTrainer(Trainer):
    def train_step(self):
        with open("x"):
            self.env.reset()


class ComprehensionTrainer(Trainer):
    def train_step(self):
        xs = [self.actor.act(o) for o in range(3)]
        return xs


class LambdaTrainer(Trainer):
    def train_step(self):
        f = lambda o: self.actor.act(o)  # noqa: E731
        return f


class DataLoopTrainer(Trainer):
    def train_step(self):
        n = self.buffer.size()
        for _ in range(n):
            self.env.reset()


class IterLoopTrainer(Trainer):
    def train_step(self):
        for x in self.buffer.gather():
            self.learner.learn(x)


class EarlyReturnTrainer(Trainer):
    def train_step(self):
        for _ in range(3):
            return self.env.reset()


class BreakTrainer(Trainer):
    def train_step(self):
        for _ in range(3):
            break


class SubscriptTrainer(Trainer):
    def train_step(self):
        d = {}
        d["a"] = self.env.reset()


class PrintTrainer(Trainer):
    def train_step(self):
        print(self.env.reset())


@pytest.mark.parametrize(
    "cls,message,advice",
    [
        (IfTrainer, "the condition depends on 'x', which is data (it comes from the result of env.step()", "torch.where"),
        # an expression is named as written, with the data name it reads, never a temporary (issue 73, item 12)
        (IfExpressionTrainer, "the condition `x.mean() > self.hparams.threshold` depends on 'x', which is data (it comes "
                              "from the result of env.step()", "torch.where"),
        (CallTripCountTrainer, "the loop's trip count `self.buffer.size()` is data (it comes from the result of "
                               "buffer.size()", "self.hparams"),
        (WhileTrainer, "`while` loops are not traced", "range(n)"),
        (TryTrainer, "`try` is not traced", "inside a component method"),
        (WithTrainer, "`with` is not traced", "inside a component method"),
        (ComprehensionTrainer, "called inside a comprehension", "collect results in a Buffer"),
        (LambdaTrainer, "called inside a lambda", "collect results in a Buffer"),
        (DataLoopTrainer, "trip count depends on 'n', which is data (it comes from the result of buffer.size()", "self.hparams"),
        (IterLoopTrainer, "only `for <name> in range(...)` loops are traced", "range(n)"),
        (EarlyReturnTrainer, "`return` is only traced as the last statement", "return once"),
        (BreakTrainer, "`break` is not traced", "fixed trip count"),
        (SubscriptTrainer, "only assignments to local names", "Buffer method"),
        (PrintTrainer, "has no traced effect", "call a component method"),
    ],
)
def test_trace_errors_name_file_line_and_advice(cls, message, advice):
    with pytest.raises(TraceError) as info:
        trace(cls, "train_step")
    e = info.value
    assert e.file == __file__
    src_lines = open(__file__).read().splitlines()
    assert 0 < e.line <= len(src_lines)
    assert str(e).startswith(f"{__file__}:{e.line}: ")
    assert message in str(e) and advice in str(e)
    # the line named is inside the offending method
    first = cls.train_step.__code__.co_firstlineno
    assert first <= e.line <= first + 6


def test_trace_rejects_non_trainers():
    with pytest.raises(TypeError, match="Trainer subclass"):
        trace(object)


def test_lint_catches_reads_before_writes():
    g = Graph("broken")
    g.append(Node(NodeKind.CALL, ("actor", "act"), inputs=["obs"], outputs=["a"], args=["obs"]))
    with pytest.raises(GraphLintError, match="reads \\['obs'\\] before they are written"):
        g.lint(defined=set())
    g2 = Graph("bad-call")
    g2.append(Node(NodeKind.CALL, "actor.act", outputs=["a"]))
    with pytest.raises(GraphLintError, match="call target must be"):
        g2.lint(defined=set())
