"""The probe: one-off runs that annotate the FDG's values with shapes, dtypes and whether
each is **sharded** along the env batch dimension or **replicated** (DESIGN.md §2).

The whole job runs as one fragment (policy ``single``), instrumented after every node, on
two small throwaway copies with different env counts (``N = 2`` and ``N = 3``). A value whose
shape changes between the two runs is sharded along the first axis that changed; one whose
shape does not is replicated -- unless its component method declares otherwise
(:func:`msrl.api.returns`: a fixed-size replay sample is a ``batch``), which the probe
checks. Results land in ``node.meta["values"][name]`` of the traced
graphs: ``{"kind", "axis", "type", "shape", "dtype"}``, shapes with the env axis shown as
``"N"``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from tensordict import TensorDictBase

from msrl.api import declared_kinds
from msrl.codegen import Lowering, generate
from msrl.graph import Graph, Node, NodeKind
from msrl.partition import PartitionError, boundary_values, partition
from msrl.policy import load_policy
from msrl.tracer import check_references

__all__ = ["probe", "PROBE_NUM_ENVS", "PROBE_MAX_ENV_STEPS", "describe_value", "DeclarationError"]

#: The two env counts of the probe runs.
PROBE_NUM_ENVS = (2, 3)

#: How far a probe run steps, at most, to observe boundary values in branches not yet taken.
PROBE_MAX_ENV_STEPS = 20_000


class DeclarationError(PartitionError):
    """A component method's declared result kind (:func:`msrl.api.returns`) disagrees with
    what the probe observed."""


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


def _run(
    graphs: dict[str, Graph], spec: Any, num_envs: int, needed: set[tuple[str, int, str]]
) -> tuple[dict[tuple[str, int, str], dict[str, Any]], dict[tuple[str, int], Any], set[str]]:
    """Runs ``reset`` and then ``train_step`` until every ``needed`` value has been seen (at
    least one iteration, at most :data:`PROBE_MAX_ENV_STEPS` env steps). Returns what each
    node wrote, each call node's declaration (:func:`msrl.api.returns`) and the global
    generators the programs drew from."""
    import sys

    from msrl.fragments.torch_graph import LOWERING
    from msrl.runtime.replica import build_trainers
    from msrl.tracer import TRACED_METHODS as METHODS

    single = load_policy("single")
    pspec = dataclasses.replace(spec, policy=single, num_envs=num_envs)
    fg = partition(graphs, single)
    seen: dict[tuple[str, int, str], dict[str, Any]] = {}
    module_globals = dict(vars(sys.modules[spec.algorithm.trainer.__module__]))
    trainer = build_trainers(pspec)[("main", 0)]
    check_references(graphs, trainer)  # a misspelt component method or attribute: its line, not generated code's
    declared: dict[tuple[str, int], Any] = {}
    for method, g in graphs.items():
        for node in g.walk():
            if node.kind is NodeKind.CALL and node.role in trainer.components:
                d = declared_kinds(trainer.components[node.role], node.target[1])
                if d is not None:
                    declared[(method, node.id)] = (d, type(trainer.components[node.role]))
    main = fg.fragment("main")
    from msrl.runtime.generators import BATON, GlobalGenerators, drawn_kinds

    try:
        # the probe's draws from the global generators come from a stream of its own, and the
        # driver gets its own states back afterwards
        with BATON.hold(GlobalGenerators.seeded(spec.seed, "probe")):
            programs = {}
            for method in METHODS:
                def record(nid: int, name: str, value: Any, method: str = method) -> None:
                    if (method, nid, name) not in seen:
                        seen[(method, nid, name)] = describe_value(value)

                module_globals = dict(module_globals)
                module_globals["_msrl_probe"] = record
                programs[method] = generate(main.programs[method], "main", method, _instrumented(LOWERING), module_globals)
            before = GlobalGenerators()
            programs["reset"].fn(trainer, None)
            while True:
                programs["train_step"].fn(trainer, None)
                if needed <= set(seen) or "env" not in trainer.components:
                    break
                if trainer.env.env_steps >= PROBE_MAX_ENV_STEPS:
                    break
            drawn = drawn_kinds(before, GlobalGenerators())
    finally:
        if "env" in trainer.components:
            trainer.env.close()
        BATON.give_back()
    return seen, declared, drawn


def _check_declaration(
    node: Node, name: str, index: int, declared: Any, a: dict[str, Any] | None, b: dict[str, Any] | None
) -> dict[str, Any] | None:
    """Probe info of a declared output; raises DeclarationError when the observation disagrees."""
    (kinds, axis), cls = declared
    if len(kinds) > 1 and not node.unpack:
        raise DeclarationError(
            f"{cls.__name__}.{node.target[1]} declares {len(kinds)} kinds {kinds}, but the call at {node.where()} keeps "
            "its result whole; unpack it (a, b = ...) or declare one kind"
        )
    if len(kinds) > 1 and len(kinds) != len(node.outputs):
        raise DeclarationError(
            f"{cls.__name__}.{node.target[1]} declares {len(kinds)} kinds {kinds}, but the call at {node.where()} "
            f"unpacks {len(node.outputs)} values"
        )
    kind = kinds[index] if len(kinds) > 1 else kinds[0]
    if a is not None and b is not None:
        observed = _env_axis(a["shape"], b["shape"])
        what = (
            f"{cls.__name__}.{node.target[1]} (called at {node.where()}) declares {name!r} {kind!r}"
            + (f" along axis {axis}" if kind != "replicated" else "")
            + f", but the probe saw shape {a['shape']} with {PROBE_NUM_ENVS[0]} envs and {b['shape']} with "
            f"{PROBE_NUM_ENVS[1]}"
        )
        if kind == "sharded" and observed != axis:
            raise DeclarationError(
                what + (": it does not change with the env count (declare 'batch' or 'replicated')" if observed is None
                        else f": it changes along axis {observed}")
            )
        if kind == "replicated" and observed is not None:
            raise DeclarationError(what + f": it changes with the env count along axis {observed} (declare 'sharded')")
    info = dict(a) if a is not None else {"type": None, "shape": None, "dtype": None}
    info["kind"], info["axis"], info["declared"] = kind, (None if kind == "replicated" else axis), True
    if kind == "sharded" and a is not None:
        info["shape"] = _symbolic(info["shape"], axis)
    return info


def probe(graphs: dict[str, Graph], spec: Any) -> frozenset[str]:
    """Annotates ``graphs`` (traced, unpartitioned) in place with probe info; returns the
    global generators (``"torch"``, ``"numpy"``, ``"python"``) the programs drew from.

    Runs ``reset`` and at least one ``train_step`` with :data:`PROBE_NUM_ENVS` envs; when
    values that cross between fragments with different replica counts (under ``spec``'s
    policy) lie in a branch not taken yet (``if self.global_step > learning_starts:``), it goes
    on stepping until it has seen them, up to :data:`PROBE_MAX_ENV_STEPS` env steps. Values
    of component methods declared with :func:`msrl.api.returns` take the declared kind, after
    a check against what was observed.

    Args:
        graphs: method -> traced graph.
        spec: the :class:`msrl.job.JobSpec`; its algorithm, hparams and env are used with the
            probe's env counts and the ``single`` policy.

    Raises:
        DeclarationError: a declared kind disagrees with the shapes observed.
        Exception: whatever a component raises on the probe inputs (a bug in the algorithm
            shows here first, on tiny inputs).
    """
    needed: set[tuple[str, int, str]] = set()
    for method, node, name in boundary_values(graphs, spec.policy):
        needed.add((method, node.id, name))
    a, decl, drawn_a = _run(graphs, spec, PROBE_NUM_ENVS[0], needed)
    b, _, drawn_b = _run(graphs, spec, PROBE_NUM_ENVS[1], needed)
    drawn = frozenset(drawn_a | drawn_b)
    for method, g in graphs.items():
        for node in g.walk():
            d = decl.get((method, node.id))
            for i, name in enumerate(node.outputs):
                key = (method, node.id, name)
                if d is not None:
                    node.meta.setdefault("values", {})[name] = _check_declaration(node, name, i, d, a.get(key), b.get(key))
                    continue
                if key not in a:
                    continue
                axis = _env_axis(a[key]["shape"], b.get(key, a[key])["shape"])
                info = dict(a[key])
                info["kind"] = "sharded" if axis is not None else "replicated"
                info["axis"] = axis
                if axis is not None:
                    info["shape"] = _symbolic(info["shape"], axis)
                node.meta.setdefault("values", {})[name] = info
    return drawn
