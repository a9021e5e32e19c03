"""A job: one algorithm on one environment under one distribution policy, assembled through
the whole pipeline (DESIGN.md "The flow of one job")::

    trace(reset, train_step) -> probe -> partition(policy) -> build replicas -> generate
    programs (backend) -> runtime

:class:`Job` is what the CLI, the tests and the benchmarks run; the same calls will build the
Ray runtime's fragments.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from msrl.api import AlgorithmSpec, EpisodeStats, Trainer
from msrl.frontend.pipeline import front_end
from msrl.frontend.tracer import TRACED_METHODS
from msrl.graph import Graph
from msrl.graph.fragmented import FragmentGraph
from msrl.policy import DistributionPolicy
from msrl.runtime.interface import iteration_record
from msrl.runtime.local import LocalRuntime
from msrl.runtime.programs.backends import env_frame_padding
from msrl.runtime.programs.codegen import Program
from msrl.runtime.replica import Replica, as_floats, check_losses, compile_fragment, replica_states

__all__ = ["JobSpec", "Job", "METHODS", "compile_job", "CompiledJob"]

#: The traced trainer methods, in the order a job runs them.
METHODS = TRACED_METHODS


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """Everything that defines a job.

    Attributes:
        algorithm: the algorithm's spec; ``hparams``: an instance of its hyperparameter class.
        env_id: gymnasium id; ``num_envs``: envs summed over the env fragment's replicas;
        env_engine: how gymnasium envs step (``msrl.envs.ENGINES``); ``env_kwargs``: for
        ``gymnasium.make``; ``env_wrappers``: msrl's named wrappers; ``env_num_workers``: the
        process engine's workers per env replica (None: one per CPU).
        float32_matmul_precision: the internal precision of float32 matrix products in every
        process that runs the job's fragments (``highest``, ``high``, ``medium``:
        ``torch.set_float32_matmul_precision``; ``medium`` reaches a CPU's oneDNN too).
        flush_denormal: denormal floats read and written as 0 on the CPU by every thread while it
        runs a fragment or the job's evaluation (:func:`msrl.runtime.host.flushed_denormals`).
        policy: the distribution policy, overrides applied.
        seed: base seed; ``total_env_steps``: training budget in env steps (0 for an offline
        algorithm); ``total_gradient_steps``: an offline algorithm's budget (one per iteration).
        dataset: an offline algorithm's or an imitation one's :class:`~msrl.rl.datasets.DatasetSource` (``None`` otherwise).
    """

    algorithm: AlgorithmSpec
    hparams: Any
    env_id: str
    num_envs: int
    policy: DistributionPolicy
    seed: int = 1
    total_env_steps: int = 100_000
    env_engine: str = "sync"
    env_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    env_wrappers: tuple[str, ...] = ()
    env_num_workers: int | None = None
    float32_matmul_precision: str = "highest"
    flush_denormal: bool = True
    total_gradient_steps: int = 0
    dataset: Any = None

    @property
    def env_steps_per_iteration(self) -> int:
        """Env steps one ``train_step`` takes, over every replica."""
        return self.algorithm.env_steps_per_iteration(self.hparams, self.num_envs)

    @property
    def offline(self) -> bool:
        """Whether the algorithm learns from a dataset (:attr:`msrl.api.AlgorithmSpec.offline`)."""
        return self.algorithm.offline

    @property
    def steps_per_iteration(self) -> int:
        """What one ``train_step`` takes of the budget: env steps, or for an offline algorithm
        one gradient step."""
        return 1 if self.offline else self.env_steps_per_iteration

    @property
    def budget(self) -> int:
        """The training budget in :attr:`steps_per_iteration`'s unit (env or gradient steps)."""
        return self.total_gradient_steps if self.offline else self.total_env_steps

    @property
    def num_iterations(self) -> int:
        """``train_step`` calls within the budget (at least 1)."""
        return max(1, self.budget // self.steps_per_iteration)

    def envs_per_replica(self) -> int:
        """Envs of each replica of the fragment holding the env role.

        Raises:
            ValueError: ``num_envs`` does not divide evenly over those replicas.
        """
        frag = self.policy.fragment(self.policy.fragment_of_role("env"))
        r = frag.replicas
        if self.num_envs % r:
            fits = [d for d in range(1, r) if self.num_envs % d == 0 and d <= self.num_envs]
            raise ValueError(
                f"env.num_envs={self.num_envs} does not split evenly over {r} env replicas "
                f"(distribution_policy.replicas.{frag.name}={r}); set env.num_envs to a multiple of {r} "
                f"(e.g. env.num_envs={r * max(1, -(-self.num_envs // r))})"
                + (f" or distribution_policy.replicas.{frag.name}={max(fits)}" if fits else ""))
        return self.num_envs // r


class Job:
    """A job assembled through the pipeline and ready to run on the local runtime.

    Args:
        spec: the job.
        probe: annotate shapes and sharded/replicated values by a probe run (needed when
            fragments have different replica counts; see :mod:`msrl.frontend.probe`).

    Attributes:
        graphs: traced graph per method; ``fragment_graph``: the partition;
        programs: ``(fragment, method) -> Program``;
        replicas: ``(fragment, replica) -> Replica`` (:meth:`replica` reads one; its ``trainer``).

    Raises:
        TraceError, PartitionError, UnknownBackendError, ValueError: as the stages raise them.
    """

    #: a replica's failure stops the job (its replicas are threads of this process)
    restarts_replicas = False
    #: a failed :meth:`run` leaves ``iteration`` at the iterations that finished
    iterations_exact = True

    def __init__(self, spec: JobSpec, probe: bool = True) -> None:
        self.spec = spec
        compiled = compile_job(spec, probe)
        self.graphs: dict[str, Graph] = compiled.graphs
        self.fragment_graph: FragmentGraph = compiled.fragment_graph
        self.programs: dict[tuple[str, str], Program] = compiled.programs
        self._eval_actor: Any = None
        self.replicas: dict[tuple[str, int], Replica] = {}
        for frag in spec.policy.fragments:
            programs = {m: p for (f, m), p in self.programs.items() if f == frag.name}
            for r in range(frag.replicas):
                self.replicas[(frag.name, r)] = Replica(spec, self.fragment_graph, frag.name, r, programs)
        self.runtime = LocalRuntime(self.fragment_graph, self.replicas,
                                    frame_padding=env_frame_padding(spec))
        self.iteration = 0
        self._stats = EpisodeStats([], [])

    def replica(self, fragment: str, index: int = 0) -> Replica:
        """Replica ``index`` of ``fragment``, a thread of this process: its trainer, its
        programs (:meth:`~msrl.runtime.replica.Replica.program_status`), its components' weights
        and episodes -- for debugging and tests.

        Raises:
            KeyError: no such fragment or replica (the message names the job's replicas).
        """
        key = (fragment, index)
        if key not in self.replicas:
            raise KeyError(f"no replica {index} of fragment {fragment!r}; replicas: "
                           f"{', '.join(f'{f}/{r}' for f, r in self.replicas)}")
        return self.replicas[key]

    def measure_boundary_bytes(self) -> dict[str, int]:
        """Runs ``reset`` and one ``train_step`` and returns what each boundary and collective
        moved in it (name -> tensor bytes, every replica's sends; a loop's once per trip):
        what ``msrl graph`` reports."""
        self.reset()
        self.runtime.pop_boundary_bytes()
        self.run(1)
        return self.runtime.pop_boundary_bytes()

    # -- running ----------------------------------------------------------------------------
    def reset(self) -> None:
        """Runs every replica's ``reset`` program (initial state, initial weight sync)."""
        self.runtime.run("reset")

    def train_step(self) -> dict[str, float]:
        """Runs one ``train_step`` on every replica; returns the learner's metrics as floats.

        Metrics may come back as device tensors (so the iteration itself makes no host copy);
        they are read back here, once, after the iteration.

        Raises:
            FragmentError: a fragment raised.
            FloatingPointError: a metric named ``*_loss`` is NaN or infinite.
        """
        return self.run(1)[0]["output"]

    def run(self, n: int) -> list[dict[str, Any]]:
        """Runs ``n`` iterations, every replica on its own between boundaries; one record per
        iteration: ``output`` (the learner's metrics as floats), ``env_steps`` (the job's total
        after it), ``episodes`` (the :class:`EpisodeStats` finished in it, replica 0 first),
        ``time_s`` (the slowest replica's time for it), ``policy_lags`` (learner version
        minus acting version of what asynchronous boundaries delivered in it; empty without
        them) and ``inference`` (central inference's ``batch_sizes`` and ``latencies_s`` in it,
        or ``None``). The same records as :meth:`msrl.cluster.ray_runtime.RayJob.run`.

        Raises:
            FragmentError, FloatingPointError: as :meth:`train_step`.
        """
        results = self.runtime.run("train_step", n)
        records = []
        for i in range(n):
            out = as_floats(self.runtime.output("train_step", results, i))
            self.iteration += 1
            check_losses(out, self.iteration)
            record = iteration_record([results[key][i] for key in sorted(results)], out)
            self._stats.merge(record["episodes"])
            records.append(record)
        return records

    @property
    def env_steps(self) -> int:
        """Env steps taken so far, over every env replica."""
        return sum(r.env_steps for r in self.replicas.values())

    def pop_episode_stats(self) -> EpisodeStats:
        """Episodes finished on every env replica since the last call, replica 0 first within
        each iteration."""
        out, self._stats = self._stats, EpisodeStats([], [])
        return out

    def replicas_with(self, role: str) -> list[Trainer]:
        """The trainers (one per replica) of the fragment holding ``role``."""
        frag = self.spec.policy.fragment_of_role(role)
        return [r.trainer for (f, _), r in sorted(self.replicas.items()) if f == frag]

    def component(self, role: str, replica: int = 0) -> Any:
        """The ``role`` component of replica ``replica`` of its fragment."""
        return self.replicas_with(role)[replica].components[role]

    def eval_actor(self) -> Any:
        """An actor built on this process's CPU holding the job's current policy weights (replica
        0's actor's ``get_weights()``), as :meth:`msrl.cluster.ray_runtime.RayJob.eval_actor`
        gives: evaluating never touches a training replica."""
        if self._eval_actor is None:
            from msrl.runtime.replica import build_standalone_actor

            self._eval_actor, _ = build_standalone_actor(self.spec)
        self._eval_actor.set_weights({k: v.cpu() for k, v in self.component("actor").get_weights().items()})
        return self._eval_actor

    def replica_table(self) -> list[dict[str, Any]]:
        """``[]``: the replicas are threads of this process, nothing for an operator to find."""
        return []

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every replica's components, trainer state (the attributes the traced methods
        write) and global generators' states, and the iteration count."""
        replicas = {f"{frag}/{r}": rep.state_dict() for (frag, r), rep in self.replicas.items()}
        return {"iteration": self.iteration, "replicas": replicas}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output into a job built from the same spec.

        Raises:
            KeyError: the checkpoint's replicas differ from this job's.
        """
        for rep, saved in zip(self.replicas.values(), replica_states(state, self.replicas)):
            rep.load_state_dict(saved)
        self.iteration = int(state["iteration"])

    def close(self) -> None:
        """Closes envs and runtime threads; gives this process its own global generator
        states back (:meth:`msrl.runtime.generators.Baton.give_back`)."""
        self.runtime.close()
        for rep in self.replicas.values():
            rep.close()
        from msrl.runtime.generators import BATON

        BATON.give_back()


@dataclasses.dataclass
class CompiledJob:
    """A job through the front half of the pipeline, before any replica exists.

    Attributes:
        spec: the job it was compiled from.
        graphs: traced graph per method (probe info in their nodes' ``meta``).
        fragment_graph: the partition (its ``generator_kinds`` from the probe).
        programs: ``(fragment, method) -> Program``, each generated with its backend (and
            wrapped by its :meth:`~msrl.runtime.programs.backends.Backend.wrap_program`).
    """

    spec: JobSpec
    graphs: dict[str, Graph]
    fragment_graph: FragmentGraph
    programs: dict[tuple[str, str], Program]


def compile_job(spec: JobSpec, probe: bool = True, max_message: int | None = None) -> CompiledJob:
    """Trace -> probe -> partition -> passes (:func:`msrl.frontend.pipeline.front_end`) ->
    codegen: what every runtime runs, compiled once by the driver (DESIGN.md §1).

    Args:
        spec: the job.
        probe: annotate values by a probe run (needed when fragments have different replica
            counts, and for a replicated learner's gradient points; see :mod:`msrl.frontend.probe`).
        max_message: the largest message between processes (bytes): a boundary value larger
            than that is refused here, from the probe's sizes (``None``: no limit, one process).

    Raises:
        TraceError, PartitionError, ProbeDiverged, ConfigError, UnknownBackendError: as the
            stages raise them.
    """
    graphs, fg = front_end(spec, probe, max_message)
    return CompiledJob(spec, graphs, fg, compile_programs(fg, spec.algorithm))


def compile_programs(fg: FragmentGraph, algorithm: AlgorithmSpec) -> dict[tuple[str, str], Program]:
    """Generates every fragment's program with its backend.

    Raises:
        UnknownBackendError: a fragment names a backend that does not exist.
    """
    return {(fr.name, method): p for fr in fg.fragments for method, p in compile_fragment(fg, fr.name, algorithm).items()}
