"""One fragment replica, built from the job's spec and its (fragment, replica index): what every
runtime runs, in a thread of one process (:mod:`msrl.runtime.local`) or in its own process (the
Ray runtime in :mod:`msrl.cluster.ray_runtime`).

A :class:`Replica` owns its trainer (the fragment's components, its envs, its RNG state) and its
generated programs; a runtime only calls its methods, and gets plain values back (metrics as
floats, episode statistics, state dicts, weights), so the same calls work across a process
boundary.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
import traceback
from typing import Any, Callable, Mapping, Sequence

import torch

from msrl.api import BuildContext, EpisodeStats, Trainer
from msrl.api.roles import check_declared_state
from msrl.device import start_read
from msrl.envs import env_spec as make_env_spec
from msrl.errors import MsrlError
from msrl.graph.fragmented import FragmentGraph
from msrl.policy import FragmentSpec
from msrl.runtime.generators import BATON, KINDS, GlobalGenerators
from msrl.runtime.programs.backends import load_backend
from msrl.runtime.programs.capture import invalidate, pop_notices, replayed
from msrl.runtime.programs.codegen import Program, generate

__all__ = ["FragmentError", "ReplicaDied", "ReplicaHung", "Replica", "build_trainer", "build_trainers", "build_standalone_actor",
           "compile_fragment", "as_floats", "check_losses", "replica_states", "pipelined_records"]


class ReplicaDied(MsrlError, RuntimeError):
    """A replica's process died (killed, out of memory, node lost).

    Attributes:
        fragment, replica: which one (``None`` when not known); ``roles``: the roles it held.
        env_steps: the job's env steps when it died, the running chunk's included, as the
            replicas' heartbeats last reported them (``None``: not known; the driver's count at
            the chunk's start stands).
    """

    def __init__(self, message: str, fragment: str | None = None, replica: int | None = None,
                 roles: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fragment, self.replica, self.roles = fragment, replica, tuple(roles)
        self.env_steps: int | None = None


class ReplicaHung(ReplicaDied):
    """A replica made no progress for ``cluster.replica_timeout_s``: handled like a death (every
    replica restarts from the last checkpoint), counted as ``faults/replica_hangs``.

    Attributes:
        as :class:`~msrl.runtime.replica.ReplicaDied`; ``pid``: its process id.
    """

    def __init__(self, message: str, fragment: str, replica: int, roles: Sequence[str], pid: int | None) -> None:
        super().__init__(message, fragment, replica, tuple(roles))
        self.pid = pid


class FragmentError(MsrlError, RuntimeError):
    """An exception raised inside a fragment program.

    Attributes:
        fragment: the fragment whose program raised.
        replica: the replica's index within the fragment (0-based).
        method: the fragment method that raised (``train_step``, ``reset``).
        node: the FDG node that raised (``None`` if not mapped).
        cause: the original exception (also ``__cause__``).
    """

    def __init__(self, fragment: str, replica: int, method: str, node: Any, cause: BaseException) -> None:
        self.fragment, self.replica, self.method, self.node, self.cause = fragment, replica, method, node, cause
        where = f"{node.describe()} at {node.where()}" if node is not None else "(outside any node)"
        super().__init__(
            f"fragment {fragment} replica {replica}, {method}: {type(cause).__name__}: {cause}\n  in {where}"
        )

    def __reduce__(self):  # crosses Ray's process boundary with its message intact
        return (FragmentError, (self.fragment, self.replica, self.method, self.node, self.cause))


def as_floats(out: Any) -> Any:
    """A ``train_step`` output with its tensor and number metrics as Python floats (one host
    read per metric, after the iteration); anything but a dict is returned as it is."""
    if not isinstance(out, dict):
        return out
    return {k: float(v) if isinstance(v, (torch.Tensor, int, float)) else v
            for k, v in out.items()}


def check_losses(metrics: Any, iteration: int) -> None:
    """Raises ``FloatingPointError`` naming every metric called ``*_loss`` that is a NaN or
    infinite float in ``metrics`` (the output of iteration ``iteration``)."""
    if isinstance(metrics, dict):
        bad = {k: v for k, v in metrics.items() if k.endswith("_loss") and isinstance(v, float) and not math.isfinite(v)}
        if bad:
            raise FloatingPointError(f"non-finite loss in iteration {iteration}: {bad}")


def print_notices(records: Any) -> None:
    """Prints the ``notices`` of iteration records (:meth:`Replica.pop_notices`), each once, on
    the driver's stderr as ``msrl: <notice>``."""
    for rec in records:
        for line in rec.get("notices", ()):
            print(f"msrl: {line}", file=sys.stderr)


def pipelined_records(n: int, iteration: Callable[[], tuple[Callable[[], tuple[Any, EpisodeStats]], dict[str, Any]]],
                      keep_output: bool = True, clock: Callable[[], float] = time.perf_counter) -> list[dict[str, Any]]:
    """Runs ``n`` iterations, finishing each one's read after the next one is launched: after a
    replay on a GPU the host unpacks iteration i while the device runs i+1
    (:meth:`Replica.start_read_iteration`). Both runtimes' replica loops.

    Args:
        iteration: runs one iteration and returns ``(finish, record)``: the call that finishes
            its read (``-> (output, episodes)``) and its record so far (what belongs to it and
            must be taken now: env steps, notices, lags).
        keep_output: whether the records keep the output (else ``None``).
        clock: seconds (monotonic), read around each launch and read.

    Returns:
        the ``n`` records, in order, each completed with ``output``, ``episodes`` and ``time_s``:
        the seconds from its launch to the next one's (the last: to the end of its read), so
        each record holds one iteration's launch and the read of the one before it, and the
        records sum to the call's time. (Timing a record to the end of its own read would give
        the first record two launches and the last none: ``charts/SPS`` spiked at every chunk's
        end.)
    """
    records: list[dict[str, Any]] = []
    waiting = None

    def finish(read: Callable[[], tuple[Any, EpisodeStats]], rec: dict[str, Any], launched: float,
               end: float | None) -> None:
        out, rec["episodes"] = read()
        rec["output"] = out if keep_output else None
        rec["time_s"] = (clock() if end is None else end) - launched
        records.append(rec)

    for _ in range(n):
        started = clock()
        read, rec = iteration()
        if waiting is not None:
            finish(*waiting, started)
        waiting = (read, rec, started)
    if waiting is not None:
        finish(*waiting, None)
    return records


def replica_states(state: Mapping[str, Any], keys: Any) -> list[Any]:
    """The per-replica states of a job checkpoint (``state["replicas"]``, keyed
    ``"fragment/replica"``), in the order of ``keys`` (``(fragment, replica)`` pairs).

    Raises:
        KeyError: the checkpoint's replicas differ from ``keys``.
    """
    saved = state["replicas"]
    mine = [f"{f}/{r}" for f, r in keys]
    if set(saved) != set(mine):
        raise KeyError(f"checkpoint holds replicas {sorted(saved)}, this job has {sorted(mine)}")
    return [saved[k] for k in mine]


def build_trainer(spec: Any, frag: FragmentSpec, replica: int, inference: Any = None) -> Trainer:
    """The trainer of replica ``replica`` of fragment ``frag``, holding that fragment's components.

    Replica ``r`` of the env fragment steps envs ``r*n .. r*n+n-1`` of the job (``n`` envs per
    replica) and is seeded with ``seed + r*n``; the components of a fragment without envs see
    the job's envs split over its replicas (``single_learner_fine``'s central buffer: all of
    them), so its env ``i`` gets seed ``seed + r*n + i``
    exactly as env ``r*n + i`` would in one process. Learners are built with the job's base seed
    on every replica (identical initial weights under ``multi_learner``).

    Each component is built holding the global generators seeded for
    ``(seed, "build", role, index)`` (:mod:`msrl.runtime.generators`; ``index`` is ``replica``,
    0 for the learner, the client's index for a shard), the trainer object for
    ``(seed, "build", fragment, replica)``: layers built with ``nn.Linear``'s defaults get the same
    weights under every policy that gives the role the same envs.

    Under central inference (``inference``: the job's :class:`~msrl.graph.fragmented.InferencePlan`),
    the server replica holds each sharded role (its buffer) as one shard per env replica
    (:class:`~msrl.runtime.inference.ShardedComponent`), shard ``i`` built exactly as a
    fragment replica ``i`` beside env replica ``i`` would be.

    Raises:
        ValueError: envs do not split evenly over the env replicas.
    """
    n = spec.envs_per_replica()
    seed = spec.seed + replica * n
    device = torch.device(frag.device)
    # the env rows this replica's components see: its own envs, or (a fragment without envs:
    # a central buffer, a learner) the job's, split over its replicas
    seen = n if "env" in frag.roles else spec.num_envs // frag.replicas
    ctx = BuildContext(
        hparams=spec.hparams,
        env_spec=make_env_spec(spec.env_id, seen, spec.env_kwargs, spec.env_wrappers, spec.env_engine),
        replica=replica,
        num_replicas=frag.replicas,
        total_num_envs=spec.num_envs,
        total_env_steps=spec.budget,
        seed=seed,
        device=device,
        dataset=spec.dataset,
    )

    def seeded(*key: int | str) -> Any:
        return BATON.hold(GlobalGenerators.seeded(spec.seed, "build", *key, device=device))

    components: dict[str, Any] = {}
    for role in frag.roles:
        if role == "env":
            with seeded(role, replica):
                components[role] = load_backend(frag.backend).build_env(
                    spec.env_id, n, device, spec.env_engine, spec.env_kwargs, spec.env_wrappers, spec.env_num_workers)
                if spec.algorithm.env_wrapper is not None:  # the algorithm's env-side code (a search)
                    components[role] = spec.algorithm.env_wrapper(components[role], ctx)
        elif role == "learner":
            # every learner replica from the job's base seed: identical initial weights, which
            # gradient all-reduce keeps identical (one learner: the same seed as before)
            with seeded(role, 0):
                components[role] = spec.algorithm.components[role](dataclasses.replace(ctx, seed=spec.seed))
        elif inference is not None and frag.name == inference.server and role in inference.shard_roles:
            from msrl.runtime.inference import ShardedComponent

            shards = []
            for i in range(inference.clients_count):
                es = make_env_spec(spec.env_id, n, spec.env_kwargs, spec.env_wrappers, spec.env_engine)
                with seeded(role, i):
                    shards.append(spec.algorithm.components[role](dataclasses.replace(
                        ctx, env_spec=es, replica=i, num_replicas=inference.clients_count, seed=spec.seed + i * n)))
            components[role] = ShardedComponent(shards, {m: axes for (r, m), axes in inference.combine.items() if r == role})
        else:
            with seeded(role, replica):
                components[role] = spec.algorithm.components[role](ctx)
    for role, component in components.items():
        if role != "env":  # (msrl builds envs: their state is msrl's)
            check_declared_state(role, component)
    with seeded(frag.name, replica):
        return spec.algorithm.trainer(components, spec.hparams, seed, num_envs=spec.num_envs,
                                      total_env_steps=spec.budget)


def build_trainers(spec: Any) -> dict[tuple[str, int], Trainer]:
    """Builds one trainer per fragment replica (see :func:`msrl.runtime.replica.build_trainer`).

    Raises:
        ValueError: envs do not split evenly over replicas.
    """
    return {(frag.name, r): build_trainer(spec, frag, r) for frag in spec.policy.fragments for r in range(frag.replicas)}


def build_standalone_actor(spec: Any, device: torch.device | str = "cpu") -> Any:
    """The job's actor built outside any replica, for one env on ``device`` (evaluation on the
    driver, a run loaded with :func:`msrl.load`); it holds initial weights until ``set_weights``.

    Returns:
        ``(actor, env_spec)``: the actor and the :class:`~msrl.api.EnvSpec` it was built for.
    """
    es = make_env_spec(spec.env_id, 1, spec.env_kwargs, spec.env_wrappers, spec.env_engine)
    ctx = BuildContext(spec.hparams, es, 0, 1, spec.num_envs, spec.budget, spec.seed, torch.device(device), spec.dataset)
    if BATON.held() is not None:  # inside an evaluation: its stream
        return spec.algorithm.components["actor"](ctx), es
    with BATON.hold(GlobalGenerators.seeded(spec.seed, "build", "actor", 0, device=device)):
        return spec.algorithm.components["actor"](ctx), es


def compile_fragment(fg: FragmentGraph, fragment: str, algorithm: Any) -> dict[str, Program]:
    """Generates ``fragment``'s program for every traced method with its backend.

    Raises:
        UnknownBackendError: the fragment names a backend that does not exist.
    """
    fr = fg.fragment(fragment)
    module_globals = vars(sys.modules[algorithm.trainer.__module__])
    backend = load_backend(fr.spec.backend)
    out = {}
    for method, g in fr.programs.items():
        out[method] = backend.wrap_program(generate(g, fr.name, method, backend.lowering, module_globals), fr.spec)
    return out


class Replica:
    """One fragment replica: its trainer, its programs and its global generator states
    (seeded for ``(seed, fragment, replica)``, held while its programs run; see
    :mod:`msrl.runtime.generators`).

    Args:
        spec: the job (:class:`msrl.run.job.JobSpec`).
        fragment_graph: the partitioned job.
        fragment, replica: which replica this is.
        programs: the fragment's programs when already generated (else generated here).
        trainer: the trainer when already built (else built here).
    """

    def __init__(
        self,
        spec: Any,
        fragment_graph: FragmentGraph,
        fragment: str,
        replica: int,
        programs: Mapping[str, Program] | None = None,
        trainer: Trainer | None = None,
    ) -> None:
        self.fragment, self.replica = fragment, replica
        self.spec = fragment_graph.fragment(fragment).spec
        #: the job's ``train.flush_denormal``, which :class:`~msrl.runtime.host.ReplicaHost` runs it with
        self.flush_denormal: bool = spec.flush_denormal
        self.programs = dict(programs) if programs is not None else compile_fragment(fragment_graph, fragment, spec.algorithm)
        plan = fragment_graph.inference
        self.trainer = trainer if trainer is not None else build_trainer(spec, self.spec, replica, plan)
        #: the global generators' states this replica's programs run with
        kinds = fragment_graph.generator_kinds
        kinds = KINDS if kinds is None else kinds
        self.generators = GlobalGenerators.seeded(spec.seed, fragment, replica, device=self.spec.device, kinds=kinds)
        # programs that drew from no global generator in the probe run without the baton (no
        # hand-overs between this process's replicas), watched for a draw (Baton.watch)
        self.generators.kinds_drawn = bool(kinds)
        #: the :class:`~msrl.runtime.inference.InferenceServer` of central inference's server replica
        self.inference: Any = None
        if plan is not None and fragment == plan.server:
            from msrl.runtime.inference import InferenceServer

            self.inference = InferenceServer(plan, [GlobalGenerators.seeded(spec.seed, fragment, replica, "client", i,
                                                                            device=self.spec.device, kinds=kinds)
                                                    for i in range(plan.clients_count)])
        self.state_attrs = sorted(
            {n.target for fr in fragment_graph.fragments for g in fr.programs.values() for n in g.walk() if n.kind.value == "state_out"}
        )

    def program_status(self, method: str = "train_step") -> str:
        """How ``method``'s program runs: ``graph`` (captured once and replayed, or still
        warming up), ``eager: <reason>`` (a capture refused, with why), or ``eager`` (never
        captured: the fragment's ``capture`` is ``eager``).

        Raises:
            KeyError: ``method`` is not a traced method.
        """
        return getattr(self.programs[method].fn, "status", "eager")

    def capture_summary(self, method: str = "train_step") -> str | None:
        """How ``method``'s program ran under ``distribution_policy.capture`` so far, in one
        line: ``captured as a CUDA graph, replayed``, ``captured as a host tape of <n> ops,
        replayed``, or :meth:`program_status` (warming up, or why it runs eagerly); ``None``
        when the program is not under capture.

        Raises:
            KeyError: ``method`` is not a traced method.
        """
        from msrl.runtime.programs.capture import CapturedProgram

        fn = self.programs[method].fn
        if not isinstance(fn, CapturedProgram):
            return None
        cap = fn.capture_of(self.trainer)
        if fn.reason is None and cap is not None and cap.graph is not None:
            what = "a CUDA graph" if fn.device.type == "cuda" else f"a host tape of {len(cap.graph.steps)} ops"
            return f"captured as {what}, replayed"
        return fn.status

    def compile_status(self, method: str = "train_step") -> list[str]:
        """One line per compile target of ``method``'s program under
        ``distribution_policy.compile`` (:mod:`msrl.runtime.programs.compiled`):
        ``<role>.<path>: inductor`` or ``...: eager: <reason>``; empty when it compiles nothing
        or has not run.

        Raises:
            KeyError: ``method`` is not a traced method.
        """
        from msrl.runtime.programs.compiled import compiled_program_of

        program = compiled_program_of(self.programs[method].fn)
        return [] if program is None else program.status(self.trainer)

    @property
    def has_env(self) -> bool:
        """Whether this replica steps envs."""
        return "env" in self.trainer.components

    def run_method(self, method: str, comm: Any) -> Any:
        """Runs ``method``'s program once with endpoint ``comm`` (:class:`~msrl.runtime.endpoint.Endpoint`); returns its output.

        Raises:
            FragmentError: the program raised; names the node and the user's ``file:line``.
        """
        program = self.programs[method]
        try:
            replays = getattr(program.fn, "replays_next", None)
            if replays is not None and replays(self.trainer):  # no Python runs: nothing to watch (~50 us)
                return program.fn(self.trainer, comm)
            if self.generators.kinds_drawn or BATON.forced:
                with BATON.hold(self.generators):
                    return program.fn(self.trainer, comm)
            with BATON.watch():
                return program.fn(self.trainer, comm)
        except Exception as e:  # re-raised with the node that failed (Ctrl-C passes through as itself)
            node = None
            for frame, lineno in traceback.walk_tb(sys.exc_info()[2]):
                if frame.f_code.co_filename == program.filename:
                    node = program.node_at(lineno)
            raise FragmentError(self.fragment, self.replica, method, node, e) from e

    @property
    def env_steps(self) -> int:
        """Env steps this replica's envs took (0 without envs)."""
        return self.trainer.env.env_steps if self.has_env else 0

    def pop_episode_stats(self) -> EpisodeStats:
        """Episodes this replica's envs finished since the last call."""
        return self.trainer.env.pop_episode_stats() if self.has_env else EpisodeStats([], [])

    def read_iteration(self, out: Any, output: bool) -> tuple[Any, EpisodeStats]:
        """An iteration's results on the host, read together: with ``output``, the tensor
        metrics of the program's output (a dict) as Python floats (:func:`as_floats`), and the
        episodes its envs finished since the last call (:meth:`pop_episode_stats`). On a GPU
        the metrics and a native env's episode statistics come back in one device-to-host copy
        (:func:`~msrl.device.read_host`): the iteration's one host sync. After a
        replayed iteration (:func:`msrl.runtime.programs.capture.replayed`) the packing of that copy is
        replayed too (on a GPU: one graph launch, then the copy).
        :meth:`start_read_iteration`, then its result.

        Returns:
            ``(out, episodes)``: ``out`` with its metrics as floats (as it was without
            ``output`` or when it is not a dict), and the :class:`EpisodeStats`.
        """
        return self.start_read_iteration(out, output)()

    def start_read_iteration(self, out: Any, output: bool) -> Callable[[], tuple[Any, EpisodeStats]]:
        """Starts :meth:`read_iteration`'s read and returns the call that finishes it: after a
        replay on a GPU the copy runs behind the iteration on the device
        (:func:`~msrl.device.start_read`), so the caller may launch the next iteration
        first and unpack this one while the GPU runs it. What belongs to this iteration (its
        finished episodes) is taken now."""
        env = self.trainer.env if self.has_env else None
        pending = env.pop_finished() if env is not None and hasattr(env, "pop_finished") else None
        keys = [k for k, v in out.items() if isinstance(v, torch.Tensor) and v.numel() == 1] \
            if output and isinstance(out, dict) else []
        tensors = [out[k] for k in keys] + (pending[0] if pending is not None else [])
        read = start_read(tensors, scalars=len(keys), static=replayed(self.trainer)) if tensors else None
        episodes = None
        if pending is None:
            episodes = env.pop_episode_stats() if env is not None else EpisodeStats([], [])

        def finish() -> tuple[Any, EpisodeStats]:
            host = read.result() if read is not None else []
            result = as_floats({**out, **dict(zip(keys, host))}) if output and isinstance(out, dict) else out
            return result, (pending[1](host[len(keys):]) if pending is not None else episodes)

        return finish

    def pop_notices(self) -> list[str]:
        """One-line notices of this replica's programs since the last call (a captured program:
        captured, or why it runs eagerly; :func:`msrl.runtime.programs.capture.pop_notices`), each naming
        the replica: the runtime hands them to the driver, which prints them
        (:func:`print_notices`)."""
        return [f"fragment {self.fragment} replica {self.replica}: {line}" for line in pop_notices(self.trainer)]

    def component(self, role: str) -> Any:
        """The component of ``role`` (in-process use only)."""
        return self.trainer.components[role]

    def weights(self, role: str) -> dict[str, torch.Tensor]:
        """``get_weights()`` of the ``role`` component."""
        return self.trainer.components[role].get_weights()

    def state_dict(self) -> dict[str, Any]:
        """The components' state dicts, the trainer state (the attributes the traced methods
        write) and the global generators' states (this replica's, and its inference clients')
        this replica holds."""
        out = {
            "components": {role: c.state_dict() for role, c in self.trainer.components.items()},
            "state": {a: getattr(self.trainer, a) for a in self.state_attrs if a in vars(self.trainer)},
            "generators": BATON.state_dict(self.generators),
        }
        if self.inference is not None:
            out["client_generators"] = [BATON.state_dict(g) for g in self.inference.generators]
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output (a checkpoint written before the generators were
        saved leaves them as seeded). A captured program of this replica is captured again
        (:func:`msrl.runtime.programs.capture.invalidate`: loading may replace the tensors it replays on)."""
        invalidate(self.trainer)
        for role, c in self.trainer.components.items():
            c.load_state_dict(state["components"][role])
        for a, v in state["state"].items():
            setattr(self.trainer, a, v)
        if "generators" in state:
            BATON.load_state_dict(self.generators, state["generators"])
        if self.inference is not None and "client_generators" in state:
            for g, saved in zip(self.inference.generators, state["client_generators"]):
                BATON.load_state_dict(g, saved)

    def close(self) -> None:
        """Closes this replica's envs."""
        if self.has_env:
            self.trainer.env.close()
