"""The probe: one-off runs that annotate the FDG's values with shapes, dtypes and whether
each is **sharded** along the env batch dimension or **replicated** (DESIGN.md §2).

The whole job runs as one fragment (policy ``single``), instrumented after every node, on
two small throwaway copies with different env counts (``N = 2`` and ``N = 3``). A value whose
shape changes between the two runs is sharded along the first axis that changed; one whose
shape does not is replicated. Results land in ``node.meta["values"][name]`` of the traced
graphs: ``{"kind", "axis", "type", "shape", "dtype"}``, shapes with the env axis shown as
``"N"``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from tensordict import TensorDictBase

from msrl.codegen import Lowering, generate
from msrl.graph import Graph, NodeKind
from msrl.partition import partition
from msrl.policy import load_policy

__all__ = ["probe", "PROBE_NUM_ENVS", "describe_value"]

#: The two env counts of the probe runs.
PROBE_NUM_ENVS = (2, 3)


def describe_value(v: Any) -> dict[str, Any]:
    """``type``, ``shape`` (a tuple, or a dict of shapes for containers) and ``dtype`` of ``v``."""
    if isinstance(v, torch.Tensor):
        return {"type": "Tensor", "shape": tuple(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
    if isinstance(v, TensorDictBase):
        return {"type": "TensorDict", "shape": tuple(v.batch_size), "dtype": None}
    if isinstance(v, dict):
        shapes = {k: describe_value(x)["shape"] for k, x in v.items()}
        return {"type": "dict", "shape": shapes, "dtype": None}
    if isinstance(v, (tuple, list)):
        return {"type": type(v).__name__, "shape": tuple(describe_value(x)["shape"] for x in v), "dtype": None}
    return {"type": type(v).__name__, "shape": None, "dtype": None}


def _leaves(shape: Any) -> list[tuple]:
    if isinstance(shape, dict):
        return [leaf for k in sorted(shape) for leaf in _leaves(shape[k])]
    if isinstance(shape, tuple) and all(isinstance(s, int) for s in shape):
        return [shape]
    if isinstance(shape, tuple):
        return [leaf for s in shape for leaf in _leaves(s)]
    return []


def _env_axis(a: Any, b: Any) -> int | None:
    for la, lb in zip(_leaves(a), _leaves(b)):
        if len(la) == len(lb):
            for i, (x, y) in enumerate(zip(la, lb)):
                if x != y:
                    return i
    return None


def _symbolic(shape: Any, axis: int) -> Any:
    if isinstance(shape, dict):
        return {k: _symbolic(v, axis) for k, v in shape.items()}
    if isinstance(shape, tuple) and all(isinstance(s, int) for s in shape):
        return tuple("N" if i == axis else s for i, s in enumerate(shape))
    if isinstance(shape, tuple):
        return tuple(_symbolic(s, axis) for s in shape)
    return shape


def _instrumented(lowering: Lowering) -> Lowering:
    def wrap(rule):
        def lowered(node, ctx):
            lines = rule(node, ctx)
            if node.kind is NodeKind.OUTPUT:
                return lines
            return lines + [f"_msrl_probe({node.id}, {o!r}, {ctx.var(o)})" for o in node.outputs]

        return lowered

    return Lowering(lowering.backend + "+probe", {k: wrap(r) for k, r in lowering.rules.items()})


def _run(graphs: dict[str, Graph], spec: Any, num_envs: int) -> dict[tuple[str, int, str], dict[str, Any]]:
    import sys

    from msrl.fragments.torch_graph import LOWERING
    from msrl.job import METHODS, build_trainers

    single = load_policy("single")
    pspec = dataclasses.replace(spec, policy=single, num_envs=num_envs)
    fg = partition(graphs, single)
    seen: dict[tuple[str, int, str], dict[str, Any]] = {}
    module_globals = dict(vars(sys.modules[spec.algorithm.trainer.__module__]))
    trainer = build_trainers(pspec)[("main", 0)]
    main = fg.fragment("main")
    try:
        with torch.random.fork_rng(devices=[]):
            for method in METHODS:
                def record(nid: int, name: str, value: Any, method: str = method) -> None:
                    seen[(method, nid, name)] = describe_value(value)

                module_globals["_msrl_probe"] = record
                prog = generate(main.programs[method], "main", method, _instrumented(LOWERING), module_globals)
                prog.fn(trainer, None)
    finally:
        if "env" in trainer.components:
            trainer.env.close()
    return seen


def probe(graphs: dict[str, Graph], spec: Any) -> None:
    """Annotates ``graphs`` (traced, unpartitioned) in place with probe info.

    Args:
        graphs: method -> traced graph.
        spec: the :class:`msrl.job.JobSpec`; its algorithm, hparams and env are used with the
            probe's env counts and the ``single`` policy.

    Raises:
        Exception: whatever a component raises on the probe inputs (a bug in the algorithm
            shows here first, on tiny inputs).
    """
    a = _run(graphs, spec, PROBE_NUM_ENVS[0])
    b = _run(graphs, spec, PROBE_NUM_ENVS[1])
    for method, g in graphs.items():
        for node in g.walk():
            for name in node.outputs:
                key = (method, node.id, name)
                if key not in a:
                    continue
                axis = _env_axis(a[key]["shape"], b.get(key, a[key])["shape"])
                info = dict(a[key])
                info["kind"] = "sharded" if axis is not None else "replicated"
                info["axis"] = axis
                if axis is not None:
                    info["shape"] = _symbolic(info["shape"], axis)
                node.meta.setdefault("values", {})[name] = info
