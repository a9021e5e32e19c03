"""The serving pass: central inference with dynamic batching, the graph side: which part of the server fragment's
``train_step`` runs once per client replica, and what that asks of the algorithm (SEED RL,
Espeholt et al. 2020, "SEED RL: Scalable and Efficient Deep-RL with Accelerated Central
Inference", section 3).

Under ``single_learner_fine`` with ``distribution_policy.inference`` set, the central replica
(the *server*) does not meet every env replica (*client*) in one lockstep collective per step.
Its ``train_step`` program is cut in two:

* the **served region**: the leading top-level nodes of the program up to and with the last one
  that talks to the clients (in practice: the rollout loop). The runtime runs it once per
  client, side by side (:mod:`msrl.runtime.inference`), each run on that client's rows only:
  its boundaries become that client's own ``fifo`` queues, its calls on the served role
  (``actor.act``) go to a batcher that runs the requests waiting together, and its calls on
  the other roles (the ``buffer``) go to that client's own shard of the component.
* the **rest** (learning, weight updates), run once on the whole trainer after every client's
  run ended, where a call on a sharded component combines the shards' results as a gather of
  replicas would (sharded values concatenated along their env axis).

What cannot be honoured exactly is a :class:`~msrl.errors.PartitionError` naming the
``file:line``: a learner call, or state that is not a control value, inside the served region
(it would run once per client), a served call whose results are not sharded along axis 0, a
call after the region whose result the shards cannot combine into what one component returns
(a replay sample), a non-control value that the region computes and the rest reads.

:func:`serve_inference` is the pass (``FragmentGraph -> FragmentGraph``): the plan
(:func:`plan_inference`) and the served region (:func:`wrap_served_region`) on a copy.
"""

from __future__ import annotations

import dataclasses

from msrl.graph import COMM_KINDS, Graph, Node, NodeKind
from msrl.graph.defuse import DefUse
from msrl.graph.fragmented import FragmentGraph, InferencePlan

__all__ = ["serve_inference", "plan_inference", "wrap_served_region"]


def _walk(nodes: list[Node]) -> list[Node]:
    out: list[Node] = []
    for n in nodes:
        out.append(n)
        for region in n.regions():
            out += _walk(list(region))
    return out


def plan_inference(fg: FragmentGraph) -> InferencePlan:
    """The :class:`InferencePlan` of a partitioned job whose policy serves inference.

    Args:
        fg: a :class:`~msrl.graph.fragmented.FragmentGraph` whose ``policy.serving`` is set.

    Raises:
        PartitionError: the algorithm's ``train_step`` cannot run per client (see the module
            docstring), naming the node's ``file:line`` and the setting to change.
    """
    from msrl.errors import PartitionError
    from msrl.graph.fragmented import value_info

    inf = fg.policy.serving
    server, clients = fg.fragment(inf.server), fg.fragment(inf.clients)
    off = "; run it lockstep by dropping distribution_policy.inference"
    if server.spec.replicas != 1:
        raise PartitionError(f"central inference serves from one {inf.server} replica, not {server.spec.replicas}")
    program: Graph = server.programs["train_step"]
    top = list(program)

    def talks_to_clients(n: Node) -> bool:
        return n.kind in COMM_KINDS and inf.clients in (n.target.src, n.target.dst)

    last = max((i for i, n in enumerate(top) if any(talks_to_clients(m) for m in _walk([n]))), default=-1)
    if last < 0:
        raise PartitionError(f"central inference: the {inf.server} fragment's train_step never talks to the "
                             f"{inf.clients} replicas; there is nothing to serve{off}")
    region, rest = top[:last + 1], top[last + 1:]
    shard_roles = tuple(r for r in server.spec.roles if r not in (inf.role, "learner"))
    state_writes: list[str] = []
    sharded_state: list[str] = []
    for n in _walk(region):
        where = f"{n.describe()} at {n.where()}"
        if n.kind is NodeKind.CALL:
            if n.role == "learner":
                raise PartitionError(f"central inference runs the part of train_step that talks to the {inf.clients} "
                                     f"replicas once per {inf.clients} replica, and {where} is inside it; the learner "
                                     f"must run after the rollout loop{off}")
            if n.role == inf.role:
                if not n.outputs:
                    raise PartitionError(f"central inference batches {inf.role} calls that answer each env row, and "
                                         f"{where} returns nothing (it would run once per {inf.clients} replica){off}")
                for out in n.outputs:
                    info = value_info(n, out)
                    if info is None or info.get("kind") != "sharded" or (info.get("axis") or 0) != 0:
                        kind = "unknown" if info is None else f"{info.get('kind')} along axis {info.get('axis')}"
                        raise PartitionError(f"central inference batches {inf.role} calls over env rows, but {out!r} of "
                                             f"{where} is {kind}, not one row per env along axis 0{off}")
        elif n.kind is NodeKind.STATE_IN and not n.meta.get("control") and _rows(n, n.outputs[0] if n.outputs else ""):
            sharded_state.append(n.target)  # each client's run reads its own rows (an LSTM's state)
        elif n.kind in (NodeKind.STATE_IN, NodeKind.STATE_OUT) and not n.meta.get("control"):
            raise PartitionError(f"central inference runs the rollout once per {inf.clients} replica, and {where} "
                                 f"reads or writes trainer state self.{n.target} that is not a control value; keep "
                                 f"such state in the {inf.clients} fragment{off}")
        elif n.kind is NodeKind.STATE_OUT:
            state_writes.append(n.target)
        elif n.kind is NodeKind.OUTPUT:
            raise PartitionError(f"central inference: train_step returns ({where}) inside its rollout loop{off}")
        elif n.kind in COMM_KINDS and not talks_to_clients(n):
            raise PartitionError(f"central inference runs the rollout once per {inf.clients} replica, and {where} "
                                 f"crosses to fragment {n.target.src if n.target.dst == inf.server else n.target.dst} "
                                 f"inside it{off}")
    # the values the region leaves live: what a node after it reads from a write inside it
    flow = DefUse(program)
    order = {n.id: i for i, n in enumerate(_walk(region))}
    live_outs, sharded_outs = [], []
    for n in _walk(rest):
        for name in DefUse.reads(n):
            defs = sorted((d for d in flow.uses.get((n.id, name), ()) if d in order), key=order.__getitem__)
            if not defs or name in live_outs:
                continue
            w = flow.nodes[defs[-1]]
            if not w.meta.get("control") and _rows(w, name):
                sharded_outs.append(name)  # the clients' rows, concatenated in client order
            elif not w.meta.get("control"):
                raise PartitionError(f"central inference: {name!r}, written by %{w.id} at {w.where()} in the rollout "
                                     f"(run once per {inf.clients} replica), is read after it by %{n.id} at {n.where()} "
                                     f"and is not a control value; the runs' values cannot be combined{off}")
            live_outs.append(name)
    combine: dict[tuple[str, str], tuple[int, ...]] = {}
    for method, g in server.programs.items():
        nodes = rest if method == "train_step" else list(g)
        for n in _walk(nodes):
            if n.kind is not NodeKind.CALL or n.role not in shard_roles:
                continue
            axes = []
            for out in n.outputs:
                info = value_info(n, out)
                if info is None or info.get("kind") != "sharded":
                    kind = "of unknown kind" if info is None else f"a {info.get('kind')} value"
                    raise PartitionError(
                        f"central inference keeps one {n.role} shard per {inf.clients} replica, and {out!r} of "
                        f"{n.describe()} at {n.where()} is {kind}: the shards cannot combine it into what one "
                        f"{n.role} returns (only values sharded along the env axis concatenate){off}")
                axes.append(int(info.get("axis") or 0))
            key = (n.role, n.target[1])
            if combine.setdefault(key, tuple(axes)) != tuple(axes):
                raise PartitionError(f"central inference: {n.role}.{n.target[1]} at {n.where()} returns values along "
                                     f"different env axes at different calls{off}")
    count = clients.spec.replicas
    return InferencePlan(
        server=inf.server, clients=inf.clients, clients_count=count, role=inf.role,
        max_batch=inf.batch_size(count), timeout_ms=inf.timeout_ms, region=len(region),
        shard_roles=shard_roles, combine=combine, live_outs=tuple(live_outs), state_writes=tuple(state_writes),
        sharded_state=tuple(sharded_state), sharded_outs=tuple(sharded_outs),
    )


def _rows(node: Node, name: str) -> bool:
    """Whether value ``name`` of ``node`` is sharded along the env axis, axis 0 (one row per env)."""
    from msrl.graph.fragmented import value_info

    info = value_info(node, name)
    return info is not None and info.get("kind") == "sharded" and (info.get("axis") or 0) == 0


def serve_inference(fg: FragmentGraph) -> FragmentGraph:
    """The pass: under a policy that serves inference (``policy.serving``), a copy of ``fg``
    with its :class:`~msrl.graph.fragmented.InferencePlan` and the served region wrapped in the
    server's ``train_step``; ``fg`` itself otherwise (unchanged either way).

    Raises:
        PartitionError: what central inference cannot honour exactly (``file:line``).
    """
    if fg.policy.serving is None:
        return fg
    plan = plan_inference(fg)
    out = fg.copy()
    wrap_served_region(out, plan)
    return dataclasses.replace(out, inference=plan)


def wrap_served_region(fg: FragmentGraph, plan: InferencePlan) -> None:
    """Puts the served region of ``plan`` into the IR of ``fg`` (in place: the pass's own copy): the first ``plan.region`` top-level nodes
    of the server fragment's ``train_step`` program become the body of one ``serve`` region node
    (its outputs: ``plan.live_outs``), which codegen lowers to the function ``comm.serve`` runs
    once per client replica. The program is linted again.

    Raises:
        GraphLintError: the wrapped program breaks an IR invariant (a bug of the plan).
    """
    from msrl.graph import Graph, Node, NodeKind

    server = fg.fragment(plan.server)
    program: Graph = server.programs["train_step"]
    top = list(program)
    body = Graph(f"{program.name}.serve")
    for n in top[:plan.region]:
        body.append(n)
    first = top[0]
    node = Node(NodeKind.SERVE, plan.role, inputs=body.free_values(), outputs=list(plan.live_outs), body=body,
                meta={"file": first.meta.get("file", "<generated>"), "line": first.meta.get("line", 0),
                      "fragment": plan.server, "clients": plan.clients, "clients_count": plan.clients_count})
    node.id = 1 + max(n.id for fr in fg.fragments for g in fr.programs.values() for n in g.walk())
    wrapped = Graph(program.name)
    for n in [node, *top[plan.region:]]:
        wrapped.append(n)
    wrapped.lint(defined=set())
    server.programs["train_step"] = wrapped
