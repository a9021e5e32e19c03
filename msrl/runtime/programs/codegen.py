"""Code generation: a fragment's region graph -> a Python program held in memory (DESIGN.md §4).

The program keeps the loop and branch structure of the traced method restricted to the fragment's nodes
plus its comm ops; an ``allreduce`` region becomes a ``with comm.allreduce_region(...)``
block around its call, and central inference's ``serve`` region a nested ``_msrl_served``
function run by ``comm.serve``. Each node is lowered by its backend's rule table (:class:`Lowering`), so a
new op is a new table entry. Generated sources are registered with :mod:`linecache` under
``<msrl:fragment.method>`` so tracebacks show them, and every generated line maps back to the
node (and so to the user's ``file:line``) it came from.

The generated function is ``program(self, comm)``: ``self`` is the fragment replica's trainer
(holding only that fragment's components), ``comm`` its endpoint
(:class:`msrl.runtime.endpoint.Endpoint`: every call generated code makes on it is listed there).
"""

from __future__ import annotations

import ast
import dataclasses
import linecache
from typing import Any, Callable, Mapping

from msrl.graph import COMM_KINDS, Const, Graph, Node, NodeKind
from msrl.graph.regions import REGIONS, region_of

__all__ = ["endpoint_op", "REGION_LOWERING", "Program", "Lowering", "CodegenContext", "generate", "python_name", "COMM_VAR"]

#: Name of the endpoint argument inside generated programs (chosen not to clash with user names).
COMM_VAR = "_msrl_comm"


def python_name(value: str) -> str:
    """The Python identifier of an IR value name (``"self.obs"`` -> ``"self__obs"``)."""
    return value.replace(".", "__")


class CodegenContext:
    """Helpers a lowering rule uses to spell values, arguments and expressions."""

    comm = COMM_VAR

    def var(self, value: str) -> str:
        """The local variable holding IR value ``value``."""
        return python_name(value)

    def arg(self, a: Any) -> str:
        """A call argument: a value name or a :class:`~msrl.graph.Const`."""
        return repr(a.value) if isinstance(a, Const) else self.var(a)

    def expr(self, e: ast.expr) -> str:
        """A compute expression with IR value names replaced by their variables."""

        class _R(ast.NodeTransformer):
            def visit_Name(self, n: ast.Name) -> ast.AST:
                return ast.copy_location(ast.Name(python_name(n.id), n.ctx), n)

        import copy

        return ast.unparse(_R().visit(copy.deepcopy(e)))

    def targets(self, node: Node) -> str:
        """The assignment target for a node's outputs (``a, b`` when unpacking)."""
        names = [self.var(o) for o in node.outputs]
        if node.unpack:
            return ", ".join(names) + ("," if len(names) == 1 else "")
        return names[0]


#: A lowering rule: ``(node, ctx) -> lines of Python`` (unindented).
Rule = Callable[[Node, CodegenContext], list[str]]


@dataclasses.dataclass(frozen=True)
class Lowering:
    """A backend's rule table: one rule per node kind it supports (loops are structural)."""

    backend: str
    rules: Mapping[NodeKind, Rule]


@dataclasses.dataclass
class Program:
    """A generated fragment program.

    Attributes:
        fragment, method: what it was generated for.
        source: the Python source text (what ``msrl graph`` prints).
        fn: the compiled ``program(self, comm)``.
        line_nodes: generated line number (1-based) -> the node it lowers.
        filename: the pseudo file name used in tracebacks.
        graph: the fragment program graph it was generated from.
    """

    fragment: str
    method: str
    source: str
    fn: Callable[..., Any]
    line_nodes: dict[int, Node]
    filename: str
    graph: Graph | None = None

    def node_at(self, lineno: int) -> Node | None:
        """The node whose lowering holds generated line ``lineno``."""
        return self.line_nodes.get(lineno)

    def first_communication(self) -> tuple[Node, str] | None:
        """The program's first node (in program order, regions included) that exchanges values
        with other replicas, with the endpoint op it lowers to (:func:`endpoint_op`), or ``None``:
        known from the graph's node kinds, not from the generated text."""
        for node in self.graph.walk() if self.graph is not None else ():
            op = endpoint_op(node)
            if op is not None:
                return node, op
        return None


def endpoint_op(node: Node) -> str | None:
    """The :class:`~msrl.runtime.endpoint.Endpoint` op a node lowers to (``gather``, ``put``,
    ``allreduce_region``, ``serve``, ...), or ``None`` for a node that communicates with no one."""
    region = region_of(node)
    if region is not None:
        return region.endpoint_op
    return node.kind.value if node.kind in COMM_KINDS else None


def _lower_loop(node: Node, ctx: CodegenContext, pad: str, depth: int, emit: Callable[[Graph, int], None],
                lines: list[str], line_nodes: dict[int, Node]) -> None:
    rng = ", ".join(ctx.arg(a) for a in node.args)
    var = ctx.var(node.target) if node.target else "_"
    lines.append(f"{pad}for {var} in range({rng}):  # %{node.id} {node.where()}")
    line_nodes[len(lines)] = node
    emit(node.body, depth + 1)


def _lower_branch(node: Node, ctx: CodegenContext, pad: str, depth: int, emit: Callable[[Graph, int], None],
                  lines: list[str], line_nodes: dict[int, Node]) -> None:
    lines.append(f"{pad}if {ctx.arg(node.target)}:  # %{node.id} {node.where()}")
    line_nodes[len(lines)] = node
    emit(node.body, depth + 1)
    if len(node.orelse):
        lines.append(f"{pad}else:")
        line_nodes[len(lines)] = node
        emit(node.orelse, depth + 1)


def _lower_allreduce(node: Node, ctx: CodegenContext, pad: str, depth: int, emit: Callable[[Graph, int], None],
                     lines: list[str], line_nodes: dict[int, Node]) -> None:
    # what the call inside passes through its collective point (the target's value: gradients,
    # statistics) is averaged over the fragment's replicas
    lines.append(f"{pad}with {ctx.comm}.allreduce_region({node.target.boundary!r}, {node.target.value!r}, "
                 f"self.{node.meta['role']}):  # %{node.id} {node.where()}")
    line_nodes[len(lines)] = node
    emit(node.body, depth + 1)


def _lower_serve(node: Node, ctx: CodegenContext, pad: str, depth: int, emit: Callable[[Graph, int], None],
                 lines: list[str], line_nodes: dict[int, Node]) -> None:
    # central inference (msrl.frontend.serving): the region becomes a nested function that returns
    # the values the rest reads, run by comm.serve once per client replica (msrl.runtime.inference)
    outs = "".join(f"{ctx.var(v)}, " for v in node.outputs)
    lines.append(f"{pad}def _msrl_served(self, {COMM_VAR}):  # %{node.id} {node.where()}")
    line_nodes[len(lines)] = node
    lines.append(f'{pad}    """The part run once per client replica (central inference)."""')
    emit(node.body, depth + 1)
    lines.append(f"{pad}    return ({outs})")
    lines.append(f"{pad}{outs or '_ = '}{'= ' if outs else ''}{COMM_VAR}.serve(self, _msrl_served)")
    line_nodes[len(lines)] = node


#: How each region kind of :data:`msrl.graph.regions.REGIONS` is written as Python (every
#: backend alike: a region's structure is the program's, its sub-graphs lowered by the
#: backend's rules): ``(node, ctx, pad, depth, emit, lines, line_nodes)``.
REGION_LOWERING: dict[NodeKind, Callable[..., None]] = {
    NodeKind.LOOP: _lower_loop,
    NodeKind.BRANCH: _lower_branch,
    NodeKind.ALLREDUCE: _lower_allreduce,
    NodeKind.SERVE: _lower_serve,
}
if set(REGION_LOWERING) != set(REGIONS):  # a region kind without its lowering rule
    raise ImportError(f"msrl.runtime.programs.codegen lowers regions {sorted(k.value for k in REGION_LOWERING)}, the region table holds "
                      f"{sorted(k.value for k in REGIONS)}")


def generate(
    graph: Graph,
    fragment: str,
    method: str,
    lowering: Lowering,
    globals_: Mapping[str, Any],
) -> Program:
    """Generates and compiles the program of one fragment's region graph.

    Args:
        graph: the fragment's program region for ``method`` (from :mod:`msrl.frontend.partition`).
        fragment, method: names used in the function's pseudo file name.
        lowering: the backend's rule table.
        globals_: globals the user's expressions refer to (the trainer module's namespace).

    Returns:
        the compiled :class:`Program`.

    Raises:
        NotImplementedError: a node kind the backend has no rule for, naming backend and node.
    """
    ctx = CodegenContext()
    lines: list[str] = [f"def program(self, {COMM_VAR}):", f'    """{fragment}.{method}, generated by msrl ({lowering.backend})."""']
    line_nodes: dict[int, Node] = {}

    def emit(region: Graph, depth: int) -> None:
        pad = "    " * depth
        start = len(lines)
        for node in region:
            if region_of(node) is not None:  # loop, branch, allreduce, serve: each kind's own rule
                REGION_LOWERING[node.kind](node, ctx, pad, depth, emit, lines, line_nodes)
                continue
            rule = lowering.rules.get(node.kind)
            if rule is None:
                raise NotImplementedError(
                    f"backend {lowering.backend!r} cannot lower {node.kind.value} node %{node.id} at {node.where()}"
                )
            out = rule(node, ctx)
            for i, text in enumerate(out):
                comment = f"  # %{node.id} {node.where()}" if i == len(out) - 1 else ""
                lines.append(f"{pad}{text}{comment}")
                line_nodes[len(lines)] = node
        if len(lines) == start:
            lines.append(f"{pad}pass")

    emit(graph, 1)
    if not any(n.kind is NodeKind.OUTPUT for n in graph):
        lines.append("    return None")
    source = "\n".join(lines) + "\n"
    filename = f"<msrl:{fragment}.{method}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict[str, Any] = dict(globals_)
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own generated code
    return Program(fragment, method, source, namespace["program"], line_nodes, filename, graph)
