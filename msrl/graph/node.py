"""The node of the fragmented dataflow graph (FDG) and its closed set of kinds.

Every node has a :class:`NodeKind`, a ``target`` whose meaning depends on the kind, the value
names it reads (``inputs``) and writes (``outputs``), and ``meta`` (provenance and probe
results). The kinds and their targets:

=============  =================================  =========================================
kind           target                             inputs -> outputs
=============  =================================  =========================================
state_in       trainer attribute name (``obs``)   () -> (``self.obs``,)
call           ``(role, method)``                 arg values -> results; ``args``/``kwargs``
                                                  hold each argument's value name or constant
compute        an ``ast.expr`` on value names     names it reads -> its result(s)
loop           loop variable name or ``None``     range args + values read by the body ->
                                                  values the body writes; ``body`` is a Graph
branch         the condition: a value name or     condition + values the two bodies read ->
               a :class:`Const`                   values either body writes; ``body`` (taken
                                                  when true) and ``orelse`` are Graphs
state_out      trainer attribute name             (``self.obs``,) -> ()
output         ``None``                           (value returned by the step,) -> ()
send/recv/     :class:`CommTarget` (boundary,     src side: (value,) -> ()
gather/...     op, fragments, axis)               dst side: () -> (value,)
allreduce      :class:`CommTarget` (boundary,     a region: the ``call`` in ``body`` (a
               ``gradients``, the fragment at     learner's gradient point) -> its results;
               both ends, side ``all``)           every gradient step the call takes is
                                                  averaged over the fragment's replicas
serve          the served role (``"actor"``)      a region: central inference's served part of
                                                  the server's ``train_step`` (``body``), run
                                                  once per client replica with the role's calls
                                                  batched -> the control values the rest reads
=============  =================================  =========================================

A ``branch`` is an ``if``/``else`` (or a conditional expression) whose condition is a
*control value* (``meta["control"]``): computed only from hyperparameters, constants, loop
indices, the job's sizes and other control values, so every fragment computes the same
condition and takes the same side. A value a body does not write passes through unchanged.

Comm kinds (``send``, ``recv``, ``gather``, ``reduce``, ``scatter``, ``broadcast``, ``allreduce``,
``put``, ``get``) are inserted only by the partitioner. ``call``, ``state_out``, ``output`` and every comm
node are impure: they are never removed or reordered.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
from typing import Any

__all__ = ["NodeKind", "Node", "CommTarget", "Const", "COMM_KINDS", "IMPURE_KINDS", "REGION_KINDS", "REGION_TABLE"]


class NodeKind(str, enum.Enum):
    """The closed set of node kinds (see the module docstring for each target's meaning)."""

    STATE_IN = "state_in"
    CALL = "call"
    COMPUTE = "compute"
    LOOP = "loop"
    BRANCH = "branch"
    STATE_OUT = "state_out"
    OUTPUT = "output"
    SEND = "send"
    RECV = "recv"
    GATHER = "gather"
    REDUCE = "reduce"
    SCATTER = "scatter"
    BROADCAST = "broadcast"
    ALLREDUCE = "allreduce"
    PUT = "put"
    GET = "get"
    SERVE = "serve"


#: Kinds the partitioner inserts at fragment boundaries.
COMM_KINDS = frozenset(
    {
        NodeKind.SEND,
        NodeKind.RECV,
        NodeKind.GATHER,
        NodeKind.REDUCE,
        NodeKind.SCATTER,
        NodeKind.BROADCAST,
        NodeKind.ALLREDUCE,
        NodeKind.PUT,
        NodeKind.GET,
    }
)

#: Kinds with side effects: kept and kept in program order by every pass.
IMPURE_KINDS = COMM_KINDS | {NodeKind.CALL, NodeKind.STATE_OUT, NodeKind.OUTPUT, NodeKind.LOOP, NodeKind.BRANCH,
                             NodeKind.SERVE}

#: Kinds that hold nested regions (an ``allreduce`` with a body holds the call that reaches its
#: collective point): the keys of :data:`msrl.graph.regions.REGIONS`, the table of what each is.
REGION_KINDS = frozenset({NodeKind.LOOP, NodeKind.BRANCH, NodeKind.ALLREDUCE, NodeKind.SERVE})


#: the region kinds' table, node kind -> :class:`msrl.graph.regions.RegionKind` (registered by
#: :mod:`msrl.graph.regions`, which ``msrl.graph`` imports: the kinds' rules live there)
REGION_TABLE: dict["NodeKind", Any] = {}


@dataclasses.dataclass(frozen=True)
class Const:
    """A literal argument of a call (e.g. ``deterministic=True``)."""

    value: Any

    def __repr__(self) -> str:
        return repr(self.value)


@dataclasses.dataclass(frozen=True)
class CommTarget:
    """What a comm node moves and between which fragments.

    Attributes:
        boundary: unique name of the boundary (``"b0:trajectory"``), shared by both sides.
        value: the value name crossing.
        src: producing fragment; ``dst``: consuming fragment.
        side: ``"src"`` in the producing fragment's program, ``"dst"`` in the consumer's;
            ``"all"`` for an ``allreduce`` (every replica of one fragment contributes and receives).
        axis: for ``gather``/``scatter``, the env-batch axis the value is sharded along.
    """

    boundary: str
    value: str
    src: str
    dst: str
    side: str
    axis: int | None = None


@dataclasses.dataclass(eq=False)
class Node:
    """One operation of the FDG.

    Attributes:
        kind: a :class:`NodeKind`.
        target: see the module docstring.
        inputs: value names read, in order.
        outputs: value names written, in order.
        args: for ``call``: positional arguments, each a value name (str) or :class:`Const`.
        kwargs: for ``call``: keyword arguments likewise.
        unpack: for ``call``/``compute``: the result is unpacked into ``outputs`` (``a, b = f()``).
        body: for ``loop``: the body's graph; for ``branch``: the region taken when the
            condition is true; for ``allreduce``: the region holding the gradient-step call;
            for ``serve``: the served part of the program.
        orelse: for ``branch``: the region taken when it is false (may be empty).
        meta: ``file``, ``line`` (user source), ``fragment``, ``values`` (output name -> probe
            info: shape, dtype, ``sharded``/``replicated``/``batch``, axis), ``carried`` for
            loops, ``control`` (the node computes control values only: copied into every
            fragment that needs them).
    """

    kind: NodeKind
    target: Any
    inputs: list[str] = dataclasses.field(default_factory=list)
    outputs: list[str] = dataclasses.field(default_factory=list)
    args: list[Any] = dataclasses.field(default_factory=list)
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    unpack: bool = False
    body: Any = None
    orelse: Any = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    id: int = -1

    @property
    def role(self) -> str | None:
        """The component role of a ``call`` node, else ``None``."""
        return self.target[0] if self.kind is NodeKind.CALL else None

    @property
    def is_impure(self) -> bool:
        """Whether the node has side effects (see :data:`IMPURE_KINDS`)."""
        return self.kind in IMPURE_KINDS

    def region_kind(self) -> Any:
        """This node's :class:`~msrl.graph.regions.RegionKind` in the region table, ``None`` for
        a node that is no region (an ``allreduce`` without a body among them)."""
        region = REGION_TABLE.get(self.kind)
        if region is None or (self.kind is NodeKind.ALLREDUCE and self.body is None):
            return None
        return region

    def regions(self) -> list[Any]:
        """The nested region graphs, in program order, as the region table
        (:data:`msrl.graph.regions.REGIONS`) names them: ``[body]`` of a loop, an all-reduce or a
        serve region, ``[body, orelse]`` of a branch; ``[]`` for any other node."""
        region = self.region_kind()
        return [getattr(self, attr) for attr, _ in region.subgraphs] if region is not None else []

    def where(self) -> str:
        """``file:line`` of the user source the node came from (``"<generated>"`` otherwise)."""
        if "file" in self.meta:
            return f"{self.meta['file']}:{self.meta['line']}"
        return "<generated>"

    def describe(self) -> str:
        """A one-line, human-readable form: ``%3 call actor.act(self.obs) -> action, log_prob``."""
        outs = ", ".join(self.outputs)
        if self.kind is NodeKind.CALL:
            args = [a if isinstance(a, str) else repr(a) for a in self.args]
            args += [f"{k}={v if isinstance(v, str) else repr(v)}" for k, v in self.kwargs.items()]
            text = f"call {self.target[0]}.{self.target[1]}({', '.join(args)})"
        elif self.kind is NodeKind.COMPUTE:
            text = f"compute {ast.unparse(self.target)}"
        elif getattr(self.region_kind(), "describe", None) is not None:
            text = self.region_kind().describe(self)
        elif self.kind in (NodeKind.STATE_IN, NodeKind.STATE_OUT):
            text = f"{self.kind.value} self.{self.target}"
            if self.kind is NodeKind.STATE_OUT:
                text += f" <- {self.inputs[0]}"
        elif self.kind is NodeKind.OUTPUT:
            text = f"output {self.inputs[0] if self.inputs else 'None'}"
        else:
            t: CommTarget = self.target
            axis = f", axis={t.axis}" if t.axis is not None else ""
            arrow = f"{t.src} -> {t.dst}" if t.side != "all" else f"over {t.src}'s replicas"
            text = f"{self.kind.value}[{t.side}] {t.value} ({arrow}{axis})"
        head = f"%{self.id} {text}"
        return f"{head} -> {outs}" if outs and self.kind not in (NodeKind.STATE_IN,) else head
