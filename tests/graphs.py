"""Hand-built graphs, the shapes a traced ``train_step`` takes, for testing the front end's
passes alone (as fx's tests build graphs by hand): no algorithm is traced, no probe runs.

:class:`Builder` writes a region graph the way the tracer would (ids in program order, nested
regions numbered after their parents), and each ``*_step`` function returns the graphs of one
shape: method -> :class:`~msrl.graph.Graph`. Probe facts (a value's kind and axis, the collective
points a call reached) are given as ``meta``, as the probe would record them.
"""

from __future__ import annotations

import ast
from typing import Any, Callable

from msrl.graph import Const, Graph, Node, NodeKind


class Builder:
    """Appends nodes to one region graph, numbering them from a counter shared with its
    sub-regions (ids stay unique across the method, as the tracer's do)."""

    def __init__(self, name: str, counter: list[int] | None = None) -> None:
        self.graph = Graph(name)
        self.counter = counter if counter is not None else [0]

    def _add(self, node: Node) -> Node:
        node.id = self.counter[0]
        self.counter[0] += 1
        node.meta.setdefault("file", "graphs.py")
        node.meta.setdefault("line", node.id + 1)
        return self.graph.append(node)

    def state_in(self, attr: str, control: bool = False) -> str:
        """``self.<attr>`` read: returns its value name (a data attribute: sharded along the env
        axis, as the probe sees an observation)."""
        node = self._add(Node(NodeKind.STATE_IN, attr, outputs=[f"self.{attr}"], meta={"control": control}))
        if not control:
            self.values(node, **{f"self.{attr}": ("sharded", 0)})
        return f"self.{attr}"

    def compute(self, expr: str, out: str, control: bool = False) -> str:
        """``out = <expr>`` (a Python expression on value names)."""
        tree = ast.parse(expr, mode="eval").body
        names = list(dict.fromkeys(
            f"self.{n.attr}" if isinstance(n, ast.Attribute) else n.id for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
            or isinstance(n, ast.Name) and n.id != "self"))
        self._add(Node(NodeKind.COMPUTE, tree, inputs=names, outputs=[out], meta={"control": control}))
        return out

    def call(self, role: str, method: str, *args: str, outs: tuple[str, ...] = (), **meta: Any) -> Node:
        """``outs = self.<role>.<method>(*args)``; ``meta``: probe facts (``values``,
        ``collective_steps``)."""
        return self._add(Node(NodeKind.CALL, (role, method), inputs=list(args), outputs=list(outs), args=list(args),
                              meta=dict(meta)))

    def values(self, node: Node, **kinds: tuple[str, int | None]) -> None:
        """Records what a probe saw of ``node``'s outputs: name -> (kind, axis)."""
        node.meta.setdefault("values", {}).update({name: {"kind": kind, "axis": axis} for name, (kind, axis) in kinds.items()})

    def loop(self, var: str, trips: int, body: Callable[["Builder"], None]) -> Node:
        """``for var in range(trips): body``."""
        node = self._add(Node(NodeKind.LOOP, var, args=[Const(trips)]))
        inner = Builder(f"{self.graph.name}.loop", self.counter)
        body(inner)
        node.body = inner.graph
        written = inner.graph.written_values()
        node.inputs = [n for n in inner.graph.free_values() if n != var]
        node.outputs = written + ([var] if var not in written else [])
        node.meta["carried"] = [n for n in node.inputs if n in written]
        return node

    def branch(self, cond: str, body: Callable[["Builder"], None],
               orelse: Callable[["Builder"], None] | None = None) -> Node:
        """``if cond: body else: orelse`` (``cond`` a control value)."""
        node = self._add(Node(NodeKind.BRANCH, cond))
        sides = []
        for label, fill in (("body", body), ("orelse", orelse)):
            b = Builder(f"{self.graph.name}.{label}", self.counter)
            if fill is not None:
                fill(b)
            sides.append(b.graph)
        node.body, node.orelse = sides
        node.inputs = list(dict.fromkeys([cond] + [n for s in sides for n in s.free_values()]))
        node.outputs = list(dict.fromkeys(n for s in sides for n in s.written_values()))
        return node

    def state_out(self, attr: str, value: str, control: bool = False) -> None:
        """``self.<attr> = value``."""
        self._add(Node(NodeKind.STATE_OUT, attr, inputs=[value], meta={"control": control}))

    def output(self, value: str) -> None:
        """``return value``."""
        self._add(Node(NodeKind.OUTPUT, None, inputs=[value]))


def _reset() -> Graph:
    b = Builder("reset")
    b.call("env", "reset", outs=("obs",))
    b.state_out("obs", "obs")
    return b.graph


def on_policy_step(learn_points: dict[str, int] | None = None) -> dict[str, Graph]:
    """PPO's shape: a rollout loop (act, step, insert) over a data attribute, then one
    ``learner.learn`` on the gathered rollout and the weights back to the actor.
    ``learn_points``: the collective points the probe saw ``learn`` reach
    (``{"gradients": 4}``); ``None``: not probed."""
    b = Builder("train_step")
    b.state_in("obs")

    def rollout(r: Builder) -> None:
        act = r.call("actor", "act", "self.obs", outs=("action",))
        r.values(act, action=("sharded", 0))
        step = r.call("env", "step", "action", outs=("next_obs", "reward"))
        r.values(step, next_obs=("sharded", 0), reward=("sharded", 0))
        r.call("buffer", "insert", "self.obs", "action", "reward")
        nxt = r.compute("next_obs", "self.obs")
        r.values(r.graph.nodes[-1], **{nxt: ("sharded", 0)})

    b.loop("t", 4, rollout)
    b.state_out("obs", "self.obs")
    gather = b.call("buffer", "gather", outs=("batch",))
    b.values(gather, batch=("sharded", 1))  # (T, N, ...): the env axis is 1
    learn = b.call("learner", "learn", "batch", outs=("metrics",),
                   **({"collective_steps": learn_points} if learn_points is not None else {}))
    b.values(learn, metrics=("replicated", None))
    weights = b.call("learner", "get_weights", outs=("weights",), collective_steps={})
    b.values(weights, weights=("replicated", None))
    b.call("actor", "set_weights", "weights")
    b.output("metrics")
    return {"reset": _reset(), "train_step": b.graph}


def off_policy_step() -> dict[str, Graph]:
    """DQN's shape: an epsilon from a control step counter, a rollout loop, then a branch on
    the counter around a target update, a sampled update and the weights back."""
    b = Builder("train_step")
    b.state_in("global_step", control=True)
    b.state_in("obs")
    b.compute("1.0 - self.global_step / 1000", "epsilon", control=True)

    def rollout(r: Builder) -> None:
        act = r.call("actor", "act", "self.obs", "epsilon", outs=("action",))
        r.values(act, action=("sharded", 0))
        step = r.call("env", "step", "action", outs=("next_obs", "reward"))
        r.values(step, next_obs=("sharded", 0), reward=("sharded", 0))
        r.call("buffer", "insert", "self.obs", "action", "reward")
        nxt = r.compute("next_obs", "self.obs")
        r.values(r.graph.nodes[-1], **{nxt: ("sharded", 0)})
        r.compute("self.global_step + 4", "self.global_step", control=True)

    b.loop("t", 2, rollout)
    b.state_out("obs", "self.obs")
    b.state_out("global_step", "self.global_step", control=True)
    b.compute("self.global_step >= 8", "learning", control=True)

    def update(u: Builder) -> None:
        u.call("learner", "update_target", collective_steps={})
        sample = u.call("buffer", "sample", outs=("batch",))
        u.values(sample, batch=("batch", 0))
        u.call("learner", "learn", "batch", outs=("metrics",), collective_steps={"gradients": 1})
        weights = u.call("learner", "get_weights", outs=("weights",), collective_steps={})
        u.values(weights, weights=("replicated", None))
        u.call("actor", "set_weights", "weights")

    b.branch("learning", update)
    b.output("epsilon")
    return {"reset": _reset(), "train_step": b.graph}


#: every hand-built shape, by name
SHAPES: dict[str, Callable[[], dict[str, Graph]]] = {
    "on_policy": on_policy_step,
    "on_policy_probed": lambda: on_policy_step({"gradients": 4}),
    "off_policy": off_policy_step,
}
