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

The probe also finds which calls reach the learner's **collective points** (under a
replicated learner it steps until every learner call has run, as for values in branches): every
``call`` node that ran gets ``meta["collective_steps"]`` (point -> ``{"tensors", "bytes"}`` of
the largest reduction the call passed through :meth:`msrl.api.Learner.apply_gradients` or
:meth:`~msrl.api.Learner.reduce_statistics`; empty: it reached none) and, where the call
stepped an optimiser outside ``apply_gradients``, ``meta["direct_step"]`` (that step's
``file:line``): where the partitioner puts a replicated learner's all-reduces. It watches
through the component API's scope and torch's optimiser hook, never by replacing a method.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Iterator

import torch

from msrl.api import COLLECTIVE_POINTS, collective_scope, declared_kinds, in_gradient_step
from msrl.errors import ConfigError, InputError, MsrlError, PartitionError
from msrl.frontend.partition import boundary_values, partition
from msrl.frontend.tracer import check_references
from msrl.graph import Graph, Node, NodeKind
from msrl.policy import load_policy
from msrl.runtime.programs.codegen import Lowering, generate
from msrl.runtime.values import describe_value

__all__ = ["probe", "PROBE_NUM_ENVS", "PROBE_MAX_ENV_STEPS", "describe_value", "DeclarationError", "ProbeDiverged",
           "message_nbytes", "check_message_sizes"]

#: The two env counts of the probe runs.
PROBE_NUM_ENVS = (2, 3)

#: How far a probe run steps, at most, to observe boundary values in branches not yet taken.
PROBE_MAX_ENV_STEPS = 20_000


class DeclarationError(PartitionError):
    """A component method's declared result kind (:func:`msrl.api.returns`) disagrees with
    what the probe observed."""


class ProbeDiverged(ConfigError):
    """The probe's first iterations met a NaN or an infinity (a component raised
    ``FloatingPointError``, or a ``*_loss`` metric was not finite): an input error, raised before
    any run directory is written. The message names the first non-finite value, the node and the
    user's ``file:line`` where it showed, and the hyperparameters that feed it (those set in the
    config, else every float one)."""


def _feeding_hparams(hparams: Any) -> str:
    """``name=value`` of the float hyperparameters set away from their defaults (all float
    ones when none is), for :class:`ProbeDiverged`'s message."""
    if not dataclasses.is_dataclass(hparams):
        return "(none)"
    floats = [f for f in dataclasses.fields(hparams) if isinstance(getattr(hparams, f.name), float)]
    changed = [f for f in floats if f.default is dataclasses.MISSING or getattr(hparams, f.name) != f.default]
    shown = changed or floats
    text = ", ".join(f"{f.name}={getattr(hparams, f.name):g}" for f in shown) or "(none)"
    return f"{text} ({'set in the config' if changed else 'the defaults'})"


def _node_of(e: BaseException, programs: dict[str, Any]) -> Any:
    """The graph node of ``programs`` that ``e`` was raised in (from its traceback, as
    :meth:`msrl.runtime.replica.Replica.run_method` finds it), or ``None``."""
    import traceback

    node = None
    files = {p.filename: p for p in programs.values()}
    for frame, lineno in traceback.walk_tb(e.__traceback__):
        program = files.get(frame.f_code.co_filename)
        if program is not None:
            node = program.node_at(lineno) or node
    return node


def _diverged(e: BaseException, programs: dict[str, Any], spec: Any, num_envs: int) -> ProbeDiverged:
    """The :class:`ProbeDiverged` of ``e`` raised by one of ``programs``."""
    node = _node_of(e, programs)
    where = f" (in {node.describe()} at {node.where()})" if node is not None else ""
    return ProbeDiverged(
        f"the probe's first iterations ({num_envs} envs, before any run directory) met a non-finite value: {e}{where}; "
        f"the hyperparameters that feed it: {_feeding_hparams(spec.hparams)} -- a learning rate or scale this large "
        "diverges; use finite values of the usual size"
    )


class ProbeFailed(InputError):
    """A component raised in the probe's first iterations (a bug in the algorithm, found before
    any run directory): one line with the exception, the ``file:line`` that raised it and the
    node of ``train_step`` (or ``reset``) it was called from, as a failure in training reads."""


def _failed(e: Exception, programs: dict[str, Any], num_envs: int) -> ProbeFailed:
    """The :class:`ProbeFailed` of ``e`` raised by one of ``programs``."""
    import traceback

    node = _node_of(e, programs)
    generated = {p.filename for p in programs.values()}
    frames = [(f.f_code.co_filename, n, f.f_code.co_name) for f, n in traceback.walk_tb(e.__traceback__)]
    own = [f for f in frames if f[0] not in generated and "/torch/" not in f[0] and "/site-packages/" not in f[0]]
    raised = f"; raised at {own[-1][0]}:{own[-1][1]} in {own[-1][2]}" if own else ""
    where = f", in {node.describe()} at {node.where()}" if node is not None else ""
    text = " ".join(str(e).split()) or "(no message)"
    return ProbeFailed(f"the probe's first iterations ({num_envs} envs, before any run directory) stopped: "
                       f"{type(e).__name__}: {text}{raised}{where}")


def message_nbytes(info: dict[str, Any], envs: int) -> int | None:
    """The tensor bytes of a probed value when ``envs`` envs produce it: linear in the env count
    through the two probe runs' sizes (constant for a replicated value or a fixed-size batch);
    ``None`` without probe sizes."""
    sizes = info.get("nbytes")
    if not sizes:
        return None
    (n0, b0), (n1, b1) = sorted(sizes.items())
    per_env = (b1 - b0) / (n1 - n0)
    return max(0, round(b0 + per_env * (envs - n0)))


def check_message_sizes(graphs: dict[str, Graph], fg: Any, num_envs: int, max_message: int) -> None:
    """Checks, from the probe's sizes, that one message of every boundary fits in
    ``max_message`` bytes (``cluster.max_message_mb``) with the job's ``num_envs`` envs: a value
    too large for the channels between processes is a config error before any replica starts or
    any run directory is made, not a failure in the first iteration.

    Raises:
        ConfigError: a boundary whose tensors alone exceed the limit, named with its size and the
            smallest ``cluster.max_message_mb`` that holds it.
    """
    infos: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for method, g in graphs.items():
        for node in g.walk():
            for name, info in node.meta.get("values", {}).items():
                infos.setdefault((method, name), []).append(info)
    for b in fg.boundaries:
        parts = b.dst_replicas if b.pattern is NodeKind.SCATTER else b.src_replicas
        envs = max(1, num_envs // max(1, parts))
        sizes = [n for info in infos.get((b.method, b.value), []) if (n := message_nbytes(info, envs)) is not None]
        if sizes and max(sizes) > max_message:
            need = max(sizes) / (1 << 20)
            size = f"{need:.1f} MiB" if need >= 1 else f"{max(sizes) / 1024:.1f} KiB"
            raise ConfigError(
                f"cluster.max_message_mb={max_message / (1 << 20):.4g}: boundary {b.name} ({b.src} -> {b.dst}) carries "
                f"{size} of tensors in one message with {num_envs} envs, more than a message between processes "
                f"may hold; set cluster.max_message_mb to at least {math.ceil(need * 1000) / 1000:g}, or send less"
            )


def _sizes(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[int, int] | None:
    """Env count -> tensor bytes of a value in the two probe runs (``None`` if unseen)."""
    if a is None or b is None:
        return None
    return {PROBE_NUM_ENVS[0]: a["nbytes"], PROBE_NUM_ENVS[1]: b["nbytes"]}


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
            if node.kind is NodeKind.CALL:  # the call running now: where a gradient step is taken
                lines = [f"_msrl_at({node.id})"] + lines
            if node.kind is NodeKind.OUTPUT:
                return lines
            return lines + [f"_msrl_probe({node.id}, {o!r}, {ctx.var(o)})" for o in node.outputs]

        return lowered

    return Lowering(lowering.backend + "+probe", {k: wrap(r) for k, r in lowering.rules.items()})


class _CollectivePoints:
    """Watches which ``call`` nodes reach the probe trainer's learner's collective points
    (:data:`msrl.api.COLLECTIVE_POINTS`: gradient steps through
    :meth:`~msrl.api.Learner.apply_gradients`, running statistics through
    :meth:`~msrl.api.Learner.reduce_statistics`) and which step one of its optimisers outside
    ``apply_gradients`` (named by the line that stepped it): what the partitioner needs to place
    a replicated learner's all-reduces, or to refuse them. Nothing on the learner is replaced:
    the points are watched through the component API's own scope
    (:func:`msrl.api.collective_scope`) and the optimisers through torch's global step hook
    (``torch.optim.optimizer.register_optimizer_step_pre_hook``), both only while
    :meth:`watching`.

    Attributes:
        steps: ``(method, call node id) -> {point: {"tensors": k, "bytes": b}}``, the largest
            reduction the call passed through each point it reached.
        direct: ``(method, call node id) ->`` ``file:line`` of the first optimiser step taken
            outside ``apply_gradients`` during the call.
    """

    def __init__(self, learner: Any) -> None:
        self.learner = learner
        self.at: tuple[str, int] | None = None
        #: every ``(method, call node id)`` that ran
        self.called: set[tuple[str, int]] = set()
        self.steps: dict[tuple[str, int], dict[str, dict[str, int]]] = {}
        self.direct: dict[tuple[str, int], str] = {}
        self._optimizers = {id(v) for v in vars(learner).values() if isinstance(v, torch.optim.Optimizer)}

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """The scope in which the probe's programs run."""
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        with contextlib.ExitStack() as stack:
            for point in COLLECTIVE_POINTS:
                stack.enter_context(collective_scope(self.learner, point, functools.partial(self._reached, point)))
            stack.callback(register_optimizer_step_pre_hook(self._stepping).remove)
            yield

    def _reached(self, point: str, tensors: list[torch.Tensor]) -> None:
        if self.at is None:
            return
        have = self.steps.setdefault(self.at, {}).setdefault(point, {"tensors": 0, "bytes": 0})
        have["tensors"] = max(have["tensors"], len(tensors))
        have["bytes"] = max(have["bytes"], sum(t.numel() * t.element_size() for t in tensors))

    def _stepping(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.at is None or in_gradient_step() or id(optimizer) not in self._optimizers:
            return
        self.direct.setdefault(self.at, _caller_outside_torch())


def _caller_outside_torch() -> str:
    """``file:line`` of the innermost frame of the running stack that is neither torch's nor
    msrl's own (the line of the learner's code that called ``optimizer.step()``), for an error
    message."""
    import os
    import sys

    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(os.path.abspath(__file__))
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(torch_dir)
                                 or os.path.dirname(frame.f_code.co_filename) == here):
        frame = frame.f_back
    return "<unknown>" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _fixed_branches(graphs: dict[str, Graph]) -> list[tuple[str, Node]]:
    """The branches of ``graphs`` whose condition is the same on every iteration: a constant,
    or computed (by ``compute`` nodes) only from constants and trainer attributes that no
    method writes back (``self.hparams``, the job's sizes). Once the probe has seen one side of
    such a branch run, the other side never will (``if hp.prioritized_replay: ... else: ...``).

    Returns:
        ``(method, branch node)`` pairs.
    """
    written = {n.target for g in graphs.values() for n in g.walk() if n.kind is NodeKind.STATE_OUT}
    out = []
    for method, g in graphs.items():
        producers: dict[str, list[Node]] = {}
        for node in g.walk():
            if node.kind in (NodeKind.LOOP, NodeKind.BRANCH):
                continue  # a region's outputs are its body's writes, walked as their own nodes
            for name in node.outputs:
                producers.setdefault(name, []).append(node)
        memo: dict[str, bool] = {}
        for node in g.walk():
            if node.kind is NodeKind.BRANCH and (not isinstance(node.target, str)
                                                  or _fixed_value(node.target, producers, written, memo)):
                out.append((method, node))
    return out


def _fixed_value(name: str, producers: dict[str, list[Node]], written: set[str], memo: dict[str, bool]) -> bool:
    """Whether value ``name`` is the same on every iteration: every node writing it reads a
    trainer attribute no method writes back, or computes from such values only."""
    if name in memo:
        return memo[name]
    memo[name] = False  # a cycle (a value computed from itself) is not fixed
    ok = bool(producers.get(name))
    for n in producers.get(name, ()):
        if n.kind is NodeKind.STATE_IN:
            ok = ok and n.target not in written
        elif n.kind is NodeKind.COMPUTE:
            ok = ok and all(_fixed_value(i, producers, written, memo) for i in n.inputs)
        else:
            ok = False
    memo[name] = ok
    return ok


def _unreachable(fixed: list[tuple[str, Node]], seen: dict[tuple[str, int, str], Any],
                 called: set[tuple[str, int]]) -> tuple[set[tuple[str, int, str]], set[tuple[str, int]]]:
    """The values (``(method, node id, name)``) and calls (``(method, node id)``) inside a side
    of a fixed-condition branch (:func:`_fixed_branches`) whose other side has run: the probe
    need not wait for them."""
    values: set[tuple[str, int, str]] = set()
    calls: set[tuple[str, int]] = set()

    def ran(method: str, region: Graph) -> bool:
        return any((method, n.id) in called or any((method, n.id, o) in seen for o in n.outputs) for n in region.walk())

    for method, branch in fixed:
        sides = [branch.body, branch.orelse]
        for side, other in ((sides[0], sides[1]), (sides[1], sides[0])):
            if side is None or other is None or not ran(method, other) or ran(method, side):
                continue
            for n in side.walk():
                calls.add((method, n.id))
                values.update((method, n.id, o) for o in n.outputs)
    return values, calls


def _run(
    graphs: dict[str, Graph], spec: Any, num_envs: int, needed: set[tuple[str, int, str]],
    needed_calls: set[tuple[str, int]] = frozenset(),  # type: ignore[assignment]
) -> tuple[dict[tuple[str, int, str], dict[str, Any]], dict[tuple[str, int], Any], set[str], _CollectivePoints | None]:
    """Runs ``reset`` and then ``train_step`` until every ``needed`` value has been seen and
    every ``needed_calls`` call has run (at least one iteration, at most :data:`PROBE_MAX_ENV_STEPS` env steps). Returns what each
    node wrote, each call node's declaration (:func:`msrl.api.returns`), the global
    generators the programs drew from and the learner's gradient points (``None`` without a
    learner)."""
    import sys

    from msrl.fragments.torch_graph import LOWERING
    from msrl.frontend.tracer import TRACED_METHODS as METHODS
    from msrl.runtime.replica import as_floats, build_trainers, check_losses

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
    learner = trainer.components.get("learner")
    points = _CollectivePoints(learner) if learner is not None else None
    from msrl.runtime.generators import BATON, GlobalGenerators, drawn_kinds

    try:
        # the probe's draws from the global generators come from a stream of its own, and the
        # driver gets its own states back afterwards
        with BATON.hold(GlobalGenerators.seeded(spec.seed, "probe")), \
                points.watching() if points is not None else contextlib.nullcontext():
            programs = {}
            for method in METHODS:
                def record(nid: int, name: str, value: Any, method: str = method) -> None:
                    if (method, nid, name) not in seen:
                        seen[(method, nid, name)] = describe_value(value)

                def at(nid: int, method: str = method) -> None:
                    if points is not None:
                        points.at = (method, nid)
                        points.called.add((method, nid))

                module_globals = dict(module_globals)
                module_globals["_msrl_probe"] = record
                module_globals["_msrl_at"] = at
                programs[method] = generate(main.programs[method], "main", method, _instrumented(LOWERING), module_globals)
            before = GlobalGenerators()
            try:
                programs["reset"].fn(trainer, None)
            except FloatingPointError as e:
                raise _diverged(e, programs, spec, num_envs) from e
            except MsrlError:
                raise
            except Exception as e:  # a bug in the algorithm: one line, as in training
                raise _failed(e, programs, num_envs) from e
            iteration = 0
            fixed = _fixed_branches(graphs)
            while True:
                iteration += 1
                try:
                    check_losses(as_floats(programs["train_step"].fn(trainer, None)), iteration)
                except FloatingPointError as e:
                    raise _diverged(e, programs, spec, num_envs) from e
                except MsrlError:
                    raise
                except Exception as e:  # a bug in the algorithm: one line, as in training
                    raise _failed(e, programs, num_envs) from e
                called = points.called if points is not None else set()
                never_values, never_calls = _unreachable(fixed, seen, called)
                if ((needed - never_values <= set(seen) and (points is None or needed_calls - never_calls <= points.called))
                        or "env" not in trainer.components):
                    break
                if trainer.env.env_steps >= PROBE_MAX_ENV_STEPS:
                    break
            drawn = drawn_kinds(before, GlobalGenerators())
    finally:
        if "env" in trainer.components:
            trainer.env.close()
        BATON.give_back()
    return seen, declared, drawn, points


def _check_declaration(
    node: Node, name: str, index: int, declared: Any, a: dict[str, Any] | None, b: dict[str, Any] | None
) -> dict[str, Any] | None:
    """Probe info of a declared output; raises DeclarationError when the observation disagrees."""
    (kinds, axis, reduce), cls = declared
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
            + (f" along axis {axis}" if kind in ("sharded", "batch") else "")
            + f", but the probe saw shape {a['shape']} with {PROBE_NUM_ENVS[0]} envs and {b['shape']} with "
            f"{PROBE_NUM_ENVS[1]}"
        )
        if kind == "sharded" and observed != axis:
            raise DeclarationError(
                what + (": it does not change with the env count (declare 'batch' or 'replicated')" if observed is None
                        else f": it changes along axis {observed}")
            )
        if kind in ("replicated", "partial") and observed is not None:
            raise DeclarationError(what + f": it changes with the env count along axis {observed} (declare 'sharded')")
        if kind == "batch":
            rows = {leaf[axis] if len(leaf) > axis else None for leaf in _leaves(a["shape"])}
            if len(rows) > 1:
                raise DeclarationError(
                    what + f": its tensors do not share one number of rows along axis {axis} "
                    f"({', '.join(sorted(str(r) for r in rows))}), so concatenating replicas' batches would not "
                    "stack rows; a value each replica holds a part of a sum of (gradients) is "
                    "@msrl.api.returns('partial'), one the same everywhere 'replicated'"
                )
    info = dict(a) if a is not None else {"type": None, "shape": None, "dtype": None}
    info["nbytes"] = _sizes(a, b)
    info["kind"], info["axis"], info["declared"] = kind, (axis if kind in ("sharded", "batch") else None), True
    if kind == "partial":
        info["reduce"] = reduce
    if kind == "sharded" and a is not None:
        info["shape"] = _symbolic(info["shape"], axis)
    return info


def probe(graphs: dict[str, Graph], spec: Any) -> frozenset[str]:
    """Annotates ``graphs`` (traced, unpartitioned) in place with probe info; returns the
    global generators (``"torch"``, ``"numpy"``, ``"python"``) the programs drew from.

    Runs ``reset`` and at least one ``train_step`` with :data:`PROBE_NUM_ENVS` envs; when
    values that cross between fragments with different replica counts (under ``spec``'s
    policy) lie in a branch not taken yet (``if self.global_step > learning_starts:``), it goes
    on stepping until it has seen them, up to :data:`PROBE_MAX_ENV_STEPS` env steps -- except
    those in a side of a branch whose condition is fixed for the run (hyperparameters only:
    ``if hp.prioritized_replay:``) once its other side has run (:func:`_fixed_branches`). Values
    of component methods declared with :func:`msrl.api.returns` take the declared kind, after
    a check against what was observed.

    Args:
        graphs: method -> traced graph.
        spec: the :class:`msrl.run.job.JobSpec`; its algorithm, hparams and env are used with the
            probe's env counts and the ``single`` policy.

    Raises:
        DeclarationError: a declared kind disagrees with the shapes observed.
        ProbeDiverged: a NaN or infinity showed in the probe's iterations (e.g. a learning rate
            of 1e30), named with the node and the hyperparameters that feed it.
        Exception: whatever a component raises on the probe inputs (a bug in the algorithm
            shows here first, on tiny inputs).
    """
    needed: set[tuple[str, int, str]] = set()
    for method, node, name in boundary_values(graphs, spec.policy):
        needed.add((method, node.id, name))
    # a replicated learner: every learner call must have run once, to know which take gradient
    # steps (the partitioner all-reduces those; a call never seen is all-reduced to be safe)
    replicated = any(f.replicas > 1 and "learner" in f.roles for f in spec.policy.fragments)
    needed_calls = {(m, n.id) for m, g in graphs.items() for n in g.walk()
                    if replicated and n.kind is NodeKind.CALL and n.role == "learner"}
    a, decl, drawn_a, points = _run(graphs, spec, PROBE_NUM_ENVS[0], needed, needed_calls)
    b, _, drawn_b, _ = _run(graphs, spec, PROBE_NUM_ENVS[1], needed)
    drawn = frozenset(drawn_a | drawn_b)
    for method, g in graphs.items():
        for node in g.walk():
            if node.kind is NodeKind.CALL and points is not None:
                node.meta.pop("collective_steps", None)  # absent: never ran in the probe
                node.meta.pop("direct_step", None)
                if (method, node.id) in points.called:
                    node.meta["collective_steps"] = points.steps.get((method, node.id), {})
                if (method, node.id) in points.direct:
                    node.meta["direct_step"] = points.direct[(method, node.id)]
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
                info["nbytes"] = _sizes(a[key], b.get(key, a[key]))
                info["kind"] = "sharded" if axis is not None else "replicated"
                info["axis"] = axis
                if axis is not None:
                    info["shape"] = _symbolic(info["shape"], axis)
                node.meta.setdefault("values", {})[name] = info
    return drawn
