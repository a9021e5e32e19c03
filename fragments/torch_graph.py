"""``torch_graph``: a fragment run in one process on one torch device.

Component methods run as ordinary torch code on the fragment's device; comm ops call the
fragment replica's channel endpoint. Eager execution is the reference. The backend's program
hook (:meth:`msrl.runtime.programs.backends.Backend.wrap_program`) compiles the components' declared pure tensor
methods with ``torch.compile`` under ``distribution_policy.compile.<fragment>: inductor``
(:mod:`msrl.runtime.programs.compiled`; off by default: on the 2-core CPU machines tiny MLPs run slower
compiled, bench/RESULTS.md) and captures the iteration as a CUDA graph on a GPU
(:mod:`msrl.runtime.programs.capture`).
"""

from __future__ import annotations

from msrl.graph import Node, NodeKind
from msrl.runtime.endpoint import BOUNDARY_OPS
from msrl.runtime.programs.backends import Backend
from msrl.runtime.programs.codegen import CodegenContext, Lowering

__all__ = ["BACKEND", "LOWERING"]


def _state_in(node: Node, ctx: CodegenContext) -> list[str]:
    return [f"{ctx.var(node.outputs[0])} = self.{node.target}"]


def _call(node: Node, ctx: CodegenContext) -> list[str]:
    role, method = node.target
    args = [ctx.arg(a) for a in node.args] + [f"{k}={ctx.arg(v)}" for k, v in node.kwargs.items()]
    call = f"self.{role}.{method}({', '.join(args)})"
    return [f"{ctx.targets(node)} = {call}" if node.outputs else call]


def _compute(node: Node, ctx: CodegenContext) -> list[str]:
    return [f"{ctx.targets(node)} = {ctx.expr(node.target)}"]


def _state_out(node: Node, ctx: CodegenContext) -> list[str]:
    return [f"self.{node.target} = {ctx.var(node.inputs[0])}"]


def _output(node: Node, ctx: CodegenContext) -> list[str]:
    return [f"return {ctx.var(node.inputs[0])}" if node.inputs else "return None"]


def _comm(node: Node, ctx: CodegenContext) -> list[str]:
    t = node.target
    if t.side == "src":
        return [f"{ctx.comm}.{node.kind.value}({t.boundary!r}, {ctx.var(t.value)})"]
    return [f"{ctx.var(t.value)} = {ctx.comm}.{node.kind.value}({t.boundary!r})"]


LOWERING = Lowering(
    backend="torch_graph",
    rules={
        NodeKind.STATE_IN: _state_in,
        NodeKind.CALL: _call,
        NodeKind.COMPUTE: _compute,
        NodeKind.STATE_OUT: _state_out,
        NodeKind.OUTPUT: _output,
        # (an ``allreduce`` region is structural, as loops are: :func:`msrl.runtime.programs.codegen.generate`)
        **{k: _comm for k in BOUNDARY_OPS},  # comm.<op>(boundary[, value]): msrl.runtime.endpoint
    },
)

BACKEND = Backend(name="torch_graph", lowering=LOWERING, devices=("cpu", "cuda"))
