"""Training runs: the loop around a job (:class:`~msrl.run.job.Job` or a Ray job), in its run
directory (:mod:`msrl.run.rundir`), with checkpoints (:mod:`msrl.run.checkpoints`) and metrics
(:mod:`msrl.run.metrics`).

:func:`train` reads top to bottom: check the run directory, build the job spec, (on resume)
check the config and load the checkpoint, build the job on its runtime, then :class:`~msrl.run.loop.TrainingLoop`:
chunks of iterations in which the replicas run free, each chunk ending at the next checkpoint,
evaluation or the end; rows logged; a final evaluation, ``eval.json`` and the learning curve.
Under Ray, a replica whose process dies restarts the job from its last checkpoint.
"""

from __future__ import annotations

import os
import pathlib
import sys
from typing import Any

from msrl.config import ConfigError, RunConfig, build_job_spec
from msrl.errors import MsrlError, PlacementError
from msrl.run.checkpoints import CHECKPOINT, atomic_save, load_checkpoint, read_checkpoint, set_aside_damaged
from msrl.run.driver import make_job, oversubscription
from msrl.run.evaluation import check_evaluable, evaluation_env
from msrl.run.job import JobSpec
from msrl.run.loop import TrainingLoop
from msrl.run.outcome import ClusterLost, ReplicaLost, TrainingInterrupted, TrainingStopped, TrainResult, resume_command
from msrl.run.rundir import RunLock, check_resumable, check_runs_dir, load_run_config, write_config
from msrl.runtime.host import matmul_precision, torch_threads
from msrl.runtime.replica import ReplicaDied, ReplicaHung

__all__ = ["TrainResult", "TrainingStopped", "TrainingInterrupted", "train"]


def train(cfg: RunConfig, resume: str | pathlib.Path | None = None) -> TrainResult:
    """Trains ``cfg``'s job on its runtime, in a new run directory or resuming one.

    Under ``runtime: ray``, when a replica's process dies (killed, out of memory, node lost) or
    hangs (no heartbeat for ``cluster.replica_timeout_s``), whatever roles it held, every replica
    is stopped and the job restarts from its last checkpoint in fresh processes, up to
    ``cluster.max_restarts`` times: what the replicas did since that checkpoint (the running
    chunk and the dead replica's partial rollout included) is dropped, never mixed into a batch,
    and counted in the metrics (``faults/replica_restarts``, ``faults/replica_hangs``,
    ``faults/dropped_env_steps``). Episodes lost to a
    dead env worker of ``env.engine: process`` (restarted in place, training goes on) are
    counted in ``faults/lost_episodes``.

    The process runs the job with torch's intra-op threads at ``train.torch_threads`` and its
    float32 matmul precision at ``train.float32_matmul_precision``, and has the caller's own
    back afterwards, also when the run fails.

    Args:
        cfg: a validated config. With ``resume``, it must equal the run's saved config.
        resume: a run directory with a checkpoint; training continues exactly where the
            checkpoint left it (same metrics as an uninterrupted run).

    Returns:
        a :class:`TrainResult`.

    Raises:
        ConfigError: ``resume`` is not a run directory or its config differs from ``cfg``.
        TrainingStopped: a fragment raised (e.g. a NaN loss or observation), or replicas died
            more than ``cluster.max_restarts`` times; the last good checkpoint is kept and
            named in the message.
        ClusterLost: the Ray cluster itself stopped (its GCS or this machine's raylet gone):
            one line with the last checkpoint's env step and the ``--resume`` command.

    A replica that dies while the job starts (placing, connecting, loading a checkpoint) counts
    as any other death: the job starts again, from the last checkpoint where there is one.

    A config with a ``population`` section trains a population with PBT
    (:func:`msrl.run.population.train_population`, which resumes from its ``population.pt``).
    """
    if cfg.population is not None:
        from msrl.run.population import train_population

        return train_population(cfg, resume)
    restarts = 0
    pending: dict[str, int] = {}  # faults of attempts that ended before the run's first checkpoint
    reuse: pathlib.Path | None = None  # a fresh run's directory, made by an attempt that died at once
    while True:
        try:
            return _train_once(cfg, resume, restarted=restarts > 0, faults=pending, reuse=reuse)
        except PlacementError as e:
            if restarts == 0:
                raise  # a first start on a cluster too small: a config error
            run_dir = pathlib.Path(resume) if resume is not None else reuse
            ckpt = run_dir / CHECKPOINT if run_dir is not None else None
            steps = int(read_checkpoint(ckpt)["env_steps"]) if ckpt is not None and ckpt.is_file() else 0
            raise _stopped(f"the restart could not place the job's replicas: {e}", steps, run_dir) from e
        except (ReplicaLost, ReplicaDied) as e:
            lost = e if isinstance(e, ReplicaLost) else ReplicaLost(
                pathlib.Path(resume) if resume is not None else reuse, -1, e)  # died while the job started
            cause, run_dir = lost.cause, lost.run_dir
            # (a job that failed to start asked before it stopped the Ray it had started)
            why = getattr(cause, "cluster_stopped", None) or _cluster_stopped()
            if why is not None:  # nothing can restart on it
                raise ClusterLost(run_dir, why) from cause
            ckpt = run_dir / CHECKPOINT if run_dir is not None else None
            if restarts >= cfg.cluster.max_restarts:
                raise _stopped(f"{cause} ({restarts} restart(s) of cluster.max_restarts={cfg.cluster.max_restarts} used)",
                               lost.env_steps if lost.env_steps >= 0 else 0, run_dir) from cause
            restarts += 1
            during = " while the job started" if lost.env_steps < 0 else ""
            if ckpt is not None and ckpt.is_file():
                state = read_checkpoint(ckpt)
                dropped = max(0, lost.env_steps - int(state["env_steps"]))
                _count_faults(state.setdefault("faults", {}), cause, dropped)
                atomic_save(state, ckpt)
                print(f"msrl: {cause}{during}; restarting every replica from the checkpoint at env step "
                      f"{state['env_steps']} (restart {restarts} of {cfg.cluster.max_restarts}; "
                      f"{dropped} env steps dropped)", file=sys.stderr)
                resume = run_dir
            else:  # a fresh run that died before its first checkpoint: it starts again, in its directory
                _count_faults(pending, cause, max(0, lost.env_steps))
                reuse = run_dir
                print(f"msrl: {cause}{during}; starting every replica again (restart {restarts} of "
                      f"{cfg.cluster.max_restarts}; the run had no checkpoint yet)", file=sys.stderr)


def _stopped(why: str, steps: int, run_dir: pathlib.Path | None) -> TrainingStopped:
    """The :class:`TrainingStopped` of a run that cannot go on after env step ``steps``: ``why``,
    the run's last good checkpoint (or none) and the command that continues it."""
    ckpt = run_dir / CHECKPOINT if run_dir is not None else None
    have = ckpt is not None and ckpt.is_file()
    return TrainingStopped(
        f"training stopped after env step {steps}: {why}"
        + f"\nlast good checkpoint: {ckpt if have else 'none'}"
        + (f"; continue with: {resume_command(run_dir)}" if have else ""),
        0, steps, ckpt if have else None,
    )


def _count_faults(faults: dict[str, int], cause: BaseException, dropped: int) -> None:
    """Adds one replica restart (and hang) and ``dropped`` env steps to ``faults``."""
    faults["replica_restarts"] = faults.get("replica_restarts", 0) + 1
    faults["dropped_env_steps"] = faults.get("dropped_env_steps", 0) + dropped
    if isinstance(cause, ReplicaHung):
        faults["replica_hangs"] = faults.get("replica_hangs", 0) + 1


def _maybe_cluster_loss(e: BaseException) -> bool:
    """Whether ``e`` may be the Ray cluster stopping under the run: a lost replica, or any error
    that is not msrl's own (msrl's errors and a user's Ctrl-C say what happened themselves)."""
    return isinstance(e, (ReplicaLost, ReplicaDied)) or (isinstance(e, Exception) and not isinstance(e, MsrlError))


def _cluster_stopped() -> str | None:
    """Why the Ray cluster of this driver stopped, or ``None`` (running, or no Ray imported)."""
    if "ray" not in sys.modules:
        return None
    from msrl.cluster.bootstrap import cluster_stopped

    return cluster_stopped()


def _train_once(cfg: RunConfig, resume: str | pathlib.Path | None, restarted: bool = False,
                faults: dict[str, int] | None = None, reuse: pathlib.Path | None = None) -> TrainResult:
    if resume is None and reuse is None:
        check_runs_dir(cfg)  # before tracing and probing: a run that cannot save never starts
    spec: JobSpec = build_job_spec(cfg)
    state = None
    locks: list[RunLock] = []
    try:
        # this process's fragments (a Ray replica sets its own); the caller's own precision and
        # threads come back after the run (msrl.train in a user's process)
        with torch_threads(cfg.train.torch_threads), matmul_precision(spec.float32_matmul_precision):
            if resume is not None:
                state = _open_resumed(cfg, spec, pathlib.Path(resume), locks)
            if evaluation_env(cfg)[0] is not None:  # what evaluation will call, checked before training
                actor = spec.algorithm.components.get("actor")
                if isinstance(actor, type):
                    check_evaluable(actor)
            if not restarted:
                crowded = oversubscription(cfg, spec, os.cpu_count() or 1, os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0)
                if crowded is not None:
                    print(crowded, file=sys.stderr)
            job = make_job(spec, cfg, restarted)
            per, total = spec.steps_per_iteration, spec.budget
            if total % per and not restarted:  # (said once the job is built: an input error comes alone)
                print(f"msrl: train.total_env_steps={total} is {total // per} whole iterations of {per} env steps: "
                      f"{total // per * per} env steps (a run trains whole iterations within its budget)", file=sys.stderr)
            lagging = [bc.name for bc in spec.policy.boundaries if bc.channel == "latest"]
            if lagging and spec.algorithm.policy_lag is None and not restarted:
                print(f"msrl: under {spec.policy.name} the actors act with weights up to a few learner updates old "
                      f"({', '.join(lagging)}: latest; async/policy_lag_mean in metrics.csv); algorithm "
                      f"{cfg.algorithm.name} does not declare whether its update corrects for that "
                      "(AlgorithmSpec.policy_lag)", file=sys.stderr)
            loop = None
            try:
                loop = TrainingLoop(cfg, spec, job, resume, state, locks, faults=faults, reuse=reuse)
                return loop.run()
            except BaseException as e:
                # a replica lost with the cluster under it, or a call into Ray's core worker failing
                # as its raylet goes (``OSError: Connection reset by peer`` from ray.wait, before Ray
                # ends this process itself): looked at before close() stops the Ray it started
                why = _cluster_stopped() if _maybe_cluster_loss(e) else None
                job.close()  # no replica process outlives a failed or interrupted run
                if why is not None:
                    where = (e.run_dir if isinstance(e, ReplicaLost) else loop.run_dir if loop is not None
                             else pathlib.Path(resume) if resume else reuse)
                    raise ClusterLost(where, why) from e
                raise
    finally:
        for lock in locks:
            lock.release()


def _value_at(config: dict[str, Any], key: str) -> Any:
    """The value of dotted ``key`` in a nested config dict (``None`` where the new config has no
    such key: a per-fragment value that became one number)."""
    value: Any = config
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _open_resumed(cfg: RunConfig, spec: JobSpec, run_dir: pathlib.Path, locks: list[RunLock]) -> dict[str, Any]:
    """Locks a run directory to resume, loads its last good checkpoint and records the config
    changes (budget-like keys only); returns the checkpoint's state.

    Raises:
        ConfigError: not a run directory, another config, no checkpoint, a shorter budget.
    """
    changed = check_resumable(load_run_config(run_dir), cfg, run_dir)
    locks.append(RunLock(run_dir))  # before anything in the run directory is read or written
    try:
        state, used = load_checkpoint(run_dir)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    if spec.offline:
        done, key, unit = int(state["job"]["iteration"]), "train.total_gradient_steps", "gradient step"
    else:
        done, key, unit = int(state["env_steps"]), "train.total_env_steps", "env step"
    if spec.num_iterations * spec.steps_per_iteration < done:
        raise ConfigError(f"{key}={spec.budget}: the run's checkpoint is already at {unit} {done}; a resumed run can "
                          "only train for longer")
    set_aside_damaged(run_dir, used)
    if changed:
        # a key that changed shape (a number to a per-fragment mapping) is shown once, whole
        shown = [k for k in changed if not any(k.startswith(other + ".") for other in changed)]
        print(f"msrl: resuming {run_dir} with " + ", ".join(f"{k}={_value_at(cfg.model_dump(), k)!r}" for k in shown)
              + (" (budget-dependent schedules such as anneal_lr follow the new budget from here)"
                 if "train.total_env_steps" in changed or "train.total_gradient_steps" in changed else ""), file=sys.stderr)
        write_config(run_dir, cfg)
    return state
