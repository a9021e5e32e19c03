"""The endpoint is the one interface generated programs talk through: every call a program makes
on its ``comm`` is a method of :class:`msrl.runtime.endpoint.Endpoint`, those ops are written
once there, and each transport's endpoint supplies only how one value travels."""

from __future__ import annotations

import ast
import dataclasses

import pytest
from test_matrix import spec

from msrl.graph import NodeKind
from msrl.policy import load_policy
from msrl.run.job import Job
from msrl.runtime.channels import LocalEndpoint
from msrl.runtime.endpoint import BOUNDARY_OPS, Endpoint
from msrl.runtime.programs.codegen import COMM_VAR
from msrl.runtime.transports.dist import DistEndpoint

#: the ops generated code may call
OPS = {"send", "recv", "gather", "reduce", "scatter", "broadcast", "put", "get", "allreduce_region", "serve"}


def _comm_calls(source: str) -> set[str]:
    """The methods a generated program calls on its endpoint argument."""
    return {n.func.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) and n.func.value.id == COMM_VAR}


def test_every_comm_node_a_backend_lowers_is_an_endpoint_op():
    """Every node kind any backend lowers, other than the program's own statements, becomes a
    ``comm.<kind>`` call: each must be an op of the endpoint, and every boundary op is lowered."""
    from msrl.runtime.programs.backends import load_backend

    own = {NodeKind.STATE_IN, NodeKind.CALL, NodeKind.COMPUTE, NodeKind.STATE_OUT, NodeKind.OUTPUT}
    for name in ("torch_graph", "cuda_kernel", "cpu_process_group"):
        comm_kinds = set(load_backend(name).lowering.rules) - own
        assert set(BOUNDARY_OPS) <= comm_kinds, name
        assert {k.value for k in comm_kinds} <= OPS, name
    assert all(callable(getattr(Endpoint, op)) for op in OPS)


def test_the_ops_are_written_once_and_transports_supply_only_how_values_travel():
    for cls in (LocalEndpoint, DistEndpoint):
        assert issubclass(cls, Endpoint)
        assert {op for op in OPS | {"allreduce"} if op in vars(cls)} == set(), cls
        assert {"_post", "_take", "_reduce_flat", "_fragment_size"} <= set(vars(cls)), cls


@pytest.mark.parametrize("algo, policy, replicas, expected", [
    ("ppo", "single_learner_coarse", {"actor": 2}, {"gather", "broadcast"}),
    ("impala", "async_learner", {"actor": 2}, {"put", "get"}),
    ("ppo", "single_learner_fine", {"env": 2}, {"serve", "put", "get"}),
    ("ppo", "multi_learner", {"main": 2}, {"allreduce_region"}),
])
def test_generated_programs_call_nothing_but_the_endpoint(algo, policy, replicas, expected):
    s = spec(algo, policy, replicas, None)
    if policy == "single_learner_fine":  # central inference, as tests/test_inference.py serves it
        s = dataclasses.replace(s, policy=load_policy(policy).with_overrides(replicas=replicas, inference={}))
    job = Job(s)
    try:
        calls = set().union(*(_comm_calls(p.source) for p in job.programs.values()))
    finally:
        job.close()
    assert expected <= calls <= OPS, calls
