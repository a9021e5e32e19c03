"""Training runs: the loop around a :class:`~msrl.job.Job`, with its run directory.

A run directory ``<runs_dir>/<name>[-k]/`` holds:

* ``config.yaml`` -- the resolved config (overrides applied);
* ``metrics.csv`` -- one row per iteration: ``iteration``, ``env_steps``, ``time_s`` (training
  wall time, s), ``charts/SPS`` (env steps/s), ``charts/episodic_return`` (mean over episodes
  finished in the iteration), ``charts/episodic_length``, the learner's ``losses/...``, and
  ``eval/mean_return`` on evaluation iterations;
* ``tb/`` -- the same scalars as TensorBoard events;
* ``checkpoints/latest.pt`` -- written atomically (temp file + rename) every
  ``train.checkpoint_every`` iterations and at the end;
* ``eval.json`` -- the final deterministic evaluation; ``learning_curve.png``.

Nothing is written before the job has been traced, partitioned and built, so a config that
cannot run leaves no directory behind.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import json
import math
import os
import pathlib
import time
from typing import Any, Sequence

import torch
import yaml

from msrl.config import ConfigError, RunConfig, build_job_spec, validate
from msrl.evaluation import evaluate
from msrl.job import Job, JobSpec
from msrl.runtime.inference import inference_metrics
from msrl.runtime.local import FragmentError
from msrl.runtime.replica import ReplicaDied

__all__ = ["TrainResult", "TrainingStopped", "TrainingInterrupted", "train", "resume_config", "RESUMABLE",
           "load_run_config", "CHECKPOINT", "load_checkpoint", "CheckpointError", "evaluation_env"]

CHECKPOINT = "checkpoints/latest.pt"
#: The checkpoint before the latest one, kept so a damaged ``latest.pt`` has a fallback.
PREVIOUS_CHECKPOINT = "checkpoints/previous.pt"
_CHECKPOINT_KEYS = ("job", "actor_weights", "time_s", "done_eval", "threshold", "recent_returns", "env_steps")


class CheckpointError(ConfigError):
    """No readable checkpoint: damaged (truncated, overwritten, empty) or not one of msrl's.
    Reported as one line naming the file and what is wrong (exit status 2)."""
_TIME_COLUMNS = ("time_s", "charts/SPS")


class TrainingStopped(RuntimeError):
    """Training stopped on an error (e.g. a NaN); the last good checkpoint is kept.

    Attributes:
        iteration: the iteration that failed; ``env_steps``: env steps before it;
        checkpoint: path of the last good checkpoint (or ``None``).
    """

    def __init__(self, message: str, iteration: int, env_steps: int, checkpoint: pathlib.Path | None) -> None:
        super().__init__(message)
        self.iteration, self.env_steps, self.checkpoint = iteration, env_steps, checkpoint


class TrainingInterrupted(KeyboardInterrupt):
    """Training was interrupted (Ctrl-C, SIGINT); the run directory and its last checkpoint are
    kept, and ``msrl train --resume RUN_DIR`` continues from that checkpoint exactly.

    Attributes:
        run_dir: the run directory; ``env_steps``: env steps done when interrupted;
        checkpoint: the last checkpoint (``None`` if none was written yet);
        checkpoint_env_steps: the env steps it holds (where a resume starts).
    """

    def __init__(self, run_dir: pathlib.Path, env_steps: int, checkpoint: pathlib.Path | None,
                 checkpoint_env_steps: int | None) -> None:
        kept = (f"checkpoint kept: {checkpoint} (env step {checkpoint_env_steps}); resume with: "
                f"msrl train --resume {run_dir}") if checkpoint is not None else "no checkpoint was written yet"
        super().__init__(f"interrupted at env step {env_steps}; {kept}")
        self.run_dir, self.env_steps = run_dir, env_steps
        self.checkpoint, self.checkpoint_env_steps = checkpoint, checkpoint_env_steps


@dataclasses.dataclass
class TrainResult:
    """What a finished run reports.

    Attributes:
        run_dir: the run directory; ``iterations``, ``env_steps``: work done;
        time_s: training wall time (s, evaluations excluded); ``eval_returns``: the final
        evaluation's episode returns; ``time_to_threshold_s``/``steps_to_threshold``: when an
        evaluation first reached ``train.stop_at_return`` (``None`` if never).
    """

    run_dir: pathlib.Path
    iterations: int
    env_steps: int
    time_s: float
    eval_returns: list[float]
    time_to_threshold_s: float | None = None
    steps_to_threshold: int | None = None

    @property
    def eval_mean(self) -> float:
        """Mean of the final evaluation's returns (NaN when there was no evaluation)."""
        return sum(self.eval_returns) / len(self.eval_returns) if self.eval_returns else float("nan")

    def metrics(self) -> list[dict[str, float]]:
        """The run's ``metrics.csv``: one dict per iteration (column -> value; empty cells,
        e.g. iterations without an evaluation, are left out)."""
        with open(self.run_dir / "metrics.csv", newline="") as f:
            return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(f)]


def load_run_config(run_dir: str | pathlib.Path) -> RunConfig:
    """The resolved config saved in a run directory.

    Raises:
        ConfigError: no run directory, or no ``config.yaml`` in it.
    """
    p = pathlib.Path(run_dir) / "config.yaml"
    if not p.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    return validate(yaml.safe_load(p.read_text()))


#: Config keys a resumed run may change: its budget and how it is watched, never what it
#: computes. A longer ``train.total_env_steps`` continues the run; schedules that depend on the
#: budget (``anneal_lr``) follow the new budget from the resume point, as SB3's
#: ``learn(..., reset_num_timesteps=False)`` does.
RESUMABLE = ("train.total_env_steps", "train.eval_every", "train.checkpoint_every", "train.stop_at_return",
             "train.progress", "cluster.address", "cluster.max_restarts", "cluster.intra_node",
             "env.num_workers")


def _check_resumable(saved: RunConfig, cfg: RunConfig, run_dir: str | pathlib.Path) -> list[str]:
    """The keys where ``cfg`` differs from the run's saved config.

    Raises:
        ConfigError: a key outside :data:`RESUMABLE` differs (named, with its two values).
    """
    a, b = _flatten(saved.model_dump()), _flatten(cfg.model_dump())
    diff = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    fixed = [k for k in diff if k not in RESUMABLE]
    if fixed:
        # the root of a difference first: another algorithm differs in every hyperparameter too
        roots = ("algorithm.name", "env.id", "distribution_policy.name")
        k = next((r for r in roots if r in fixed), fixed[0])
        raise ConfigError(
            f"--resume {run_dir}: {k}={b.get(k)!r} differs from the run's {a.get(k)!r} (config.yaml); a resumed run "
            f"may change only {', '.join(RESUMABLE)}"
        )
    return diff


def resume_config(run_dir: str | pathlib.Path, overrides: Sequence[str] = (),
                  config: str | pathlib.Path | None = None) -> RunConfig:
    """The config to resume ``run_dir`` with: its saved ``config.yaml`` (or ``config``) with
    ``overrides`` applied, e.g. ``train.total_env_steps=600000`` to train for longer.

    Raises:
        ConfigError: not a run directory, an invalid override, or a change to a key outside
            :data:`RESUMABLE`.
    """
    from msrl.config import apply_overrides, load_config

    saved = load_run_config(run_dir)
    if config is None:
        cfg = validate(apply_overrides(saved.model_dump(), overrides))
    else:
        cfg = load_config(config, overrides)
    _check_resumable(saved, cfg, run_dir)
    return cfg


def _first_sentence(text: str, limit: int = 300) -> str:
    """The loader's message on one line, cut at a sentence (or word) end, never mid-word."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    head = text[:limit]
    end = head.rfind(". ")
    return head[:end + 1] if end > 0 else head[:head.rfind(" ")] + " ..."


def _read_checkpoint(path: pathlib.Path) -> dict[str, Any]:
    """A checkpoint file's state, checked to be msrl's.

    Raises:
        CheckpointError: unreadable (the loader's error, in one line) or missing keys.
    """
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path}: damaged checkpoint (empty file)")
    try:
        state = torch.load(path, weights_only=False)
    except Exception as e:  # noqa: BLE001 - zip, pickle and EOF errors all mean a damaged file
        raise CheckpointError(f"{path}: damaged checkpoint ({type(e).__name__}: {_first_sentence(str(e))})") from None
    missing = [k for k in _CHECKPOINT_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{path}: not an msrl checkpoint (no {', '.join(missing)})")
    return state


def load_checkpoint(run_dir: str | pathlib.Path) -> tuple[dict[str, Any], pathlib.Path]:
    """The run's last good checkpoint: ``latest.pt``, or, when that one is damaged,
    ``previous.pt`` (saying so on stderr).

    Returns:
        ``(state, path)``.

    Raises:
        FileNotFoundError: the run has no checkpoint yet.
        CheckpointError: no readable checkpoint; the message names each file and its problem.
    """
    import sys

    latest, previous = pathlib.Path(run_dir) / CHECKPOINT, pathlib.Path(run_dir) / PREVIOUS_CHECKPOINT
    if not latest.is_file() and not previous.is_file():
        raise FileNotFoundError(f"{run_dir} has no checkpoint ({CHECKPOINT})")
    try:
        return _read_checkpoint(latest), latest
    except (CheckpointError, FileNotFoundError) as e:
        if not previous.is_file():
            raise CheckpointError(f"{e}; no earlier checkpoint ({PREVIOUS_CHECKPOINT}) to fall back to") from None
        try:
            state = _read_checkpoint(previous)
        except CheckpointError as e2:
            raise CheckpointError(f"{e}; the earlier one too: {e2}") from None
        print(f"msrl: {e}; falling back to {previous} (env step {state['env_steps']})", file=sys.stderr)
        return state, previous


class RunLock:
    """An exclusive lock on a run directory (``RUN_DIR/.lock``) for as long as one process
    trains in it: ``flock`` on the file, which the OS releases when the process ends however it
    ends, so a lock left by a crash or ``kill -9`` is stale and simply taken over. The file
    holds the holder's pid and host, for the refusal message.

    Args:
        run_dir: the run directory (must exist).

    Raises:
        ConfigError: another process holds the lock (named by pid and host).
    """

    def __init__(self, run_dir: str | pathlib.Path) -> None:
        import fcntl
        import socket

        self.path = pathlib.Path(run_dir) / ".lock"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(f"run directory {run_dir} is in use by {holder} (lock {self.path}); wait for it to end "
                              "or stop it, or train in another run directory") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"process {os.getpid()} on {socket.gethostname()}".encode())
        os.fsync(fd)
        self.fd: int | None = fd

    def release(self) -> None:
        """Releases the lock (idempotent)."""
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the flock
            self.fd = None


def check_runs_dir(cfg: RunConfig) -> pathlib.Path:
    """Checks, before any work is done and without writing anything, that a run directory can be
    made in ``cfg.runs_dir``: no part of it is a file, and its deepest existing directory takes
    a new directory (made and removed at once).

    Raises:
        ConfigError: ``runs_dir`` is a file, lies under one, or no directory can be made there
            (naming why).
    """
    base = pathlib.Path(cfg.runs_dir).expanduser()
    for p in (base, *base.parents):
        if p.exists() and not p.is_dir():
            raise ConfigError(f"runs_dir={cfg.runs_dir}: {p} is a file, not a directory; choose another runs_dir")
    deepest = next(p for p in (base, *base.parents) if p.exists() or p == pathlib.Path(p.anchor or "."))
    probe = deepest / f".msrl-write-check-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        where = f" ({deepest} accepts no new directories)" if deepest != base else ""
        raise ConfigError(f"runs_dir={cfg.runs_dir}: cannot make a run directory there: {e.strerror}{where}; "
                          "choose a directory you can write to") from None
    return base


def _new_run_dir(cfg: RunConfig) -> pathlib.Path:
    base = check_runs_dir(cfg)
    base.mkdir(parents=True, exist_ok=True)
    for k in range(10_000):
        p = base / (cfg.name if k == 0 else f"{cfg.name}-{k}")
        try:
            p.mkdir()
            return p
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run directory name for {cfg.name} in {base}")


def _atomic_write_text(path: pathlib.Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _atomic_save(obj: Any, path: pathlib.Path, keep_previous: bool = False) -> None:
    """Writes ``obj`` to ``path`` so that a crash leaves the old file or the new one, whole;
    with ``keep_previous``, the file it replaces becomes ``previous.pt`` beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    if keep_previous and path.is_file():
        os.replace(path, path.with_name("previous.pt"))
    os.replace(tmp, path)


class _Metrics:
    """CSV + TensorBoard writer; on resume, rows past the checkpoint are dropped.

    TensorBoard events are written in batches, every :attr:`TB_EVERY_S` seconds of
    :meth:`flush` calls and at :meth:`close`, each batch drained before training goes on.
    Handed over one row per iteration, TensorBoard's writer thread (event serialisation and a
    pure-Python CRC per record) competed with the training thread for the GIL: measured on the
    dev machine, A2C on native CartPole ran 5-15% slower than with TensorBoard off
    (``bench/RESULTS.md``)."""

    TB_EVERY_S = 5.0

    def __init__(self, run_dir: pathlib.Path, resume_iteration: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.path = run_dir / "metrics.csv"
        self.rows: list[dict[str, Any]] = []
        if resume_iteration is not None and self.path.is_file():
            with open(self.path, newline="") as f:
                self.rows = [r for r in csv.DictReader(f) if int(r["iteration"]) <= resume_iteration]
        self.columns: list[str] = list(self.rows[0].keys()) if self.rows else []
        self._csv: Any = None
        self._writer: Any = None
        self._rewrite()
        purge = resume_iteration + 1 if resume_iteration is not None else None
        self.tb = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=purge)
        self._tb_next = len(self.rows)  # rows before it are in TensorBoard already
        self._tb_written_at = time.perf_counter()

    def _rewrite(self) -> None:
        if not self.columns:
            return
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.columns)
            w.writeheader()
            w.writerows(self.rows)

    def log(self, row: dict[str, Any]) -> None:
        """Appends ``row`` to metrics.csv (buffered until :meth:`flush`) and its finite numbers
        to TensorBoard as one event at step ``row["env_steps"]`` (written by a later
        :meth:`flush` or :meth:`close`)."""
        new = [k for k in row if k not in self.columns]
        self.rows.append(row)
        if new:
            self._close_csv()
            self.columns += new
            self._rewrite()
        else:
            if self._csv is None:
                self._csv = open(self.path, "a", newline="")
                self._writer = csv.DictWriter(self._csv, fieldnames=self.columns)
            self._writer.writerow(row)

    def _write_tb(self) -> None:
        """Writes the rows logged since the last batch to TensorBoard, one Summary per row holding
        every finite scalar (what ``add_scalar`` writes one value at a time), and waits until
        they are out."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        writer = self.tb._get_file_writer()
        for row in self.rows[self._tb_next:]:
            values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in row.items()
                      if k not in ("iteration", "env_steps") and isinstance(v, (int, float)) and math.isfinite(v)]
            writer.add_summary(Summary(value=values), int(row["env_steps"]))
        self._tb_next = len(self.rows)
        self.tb.flush()
        self._tb_written_at = time.perf_counter()

    def flush(self) -> None:
        """Writes the buffered rows to metrics.csv, and to TensorBoard when the last batch is
        :attr:`TB_EVERY_S` seconds old."""
        if self._csv is not None:
            self._csv.flush()
        if len(self.rows) > self._tb_next and time.perf_counter() - self._tb_written_at >= self.TB_EVERY_S:
            self._write_tb()

    def _close_csv(self) -> None:
        if self._csv is not None:
            self._csv.close()
            self._csv = None

    def close(self) -> None:
        self._close_csv()
        if len(self.rows) > self._tb_next:
            self._write_tb()
        self.tb.close()


def make_job(spec: JobSpec, cfg: RunConfig) -> Any:
    """The job of ``cfg`` on its runtime: :class:`~msrl.job.Job` (``runtime: local``) or
    :class:`~msrl.cluster.ray_runtime.RayJob` (``runtime: ray``; ``cluster.*`` places it);
    ``runtime: auto`` runs policies with more than one replica on Ray."""
    from msrl.config import resolve_runtime

    if resolve_runtime(cfg.runtime, spec.policy) == "local":
        return Job(spec)
    from msrl.cluster.ray_runtime import RayJob
    from msrl.job import available_algorithms

    name = cfg.algorithm.name
    ref = None if name in available_algorithms() else (
        str(pathlib.Path(name).expanduser().resolve()) if name.endswith(".py") or "/" in name else name
    )
    return RayJob(spec, algorithm_ref=ref, address=cfg.cluster.address,
                  cpus_per_replica=cfg.cluster.cpus_per_replica, gpus_per_replica=cfg.cluster.gpus_per_replica,
                  strategy=cfg.cluster.strategy, intra_node=cfg.cluster.intra_node, tls=tls_config(cfg),
                  max_message=int(cfg.cluster.max_message_mb * (1 << 20)))


def tls_config(cfg: RunConfig) -> Any:
    """The :class:`~msrl.cluster.grpc_transport.TlsConfig` of ``cluster.tls_*`` (``None``
    without ``cluster.tls_cert``).

    Raises:
        ConfigError: only one of certificate and key, or a file that cannot be read or is not PEM.
    """
    c = cfg.cluster
    if c.tls_cert is None and c.tls_key is None:
        return None
    if c.tls_cert is None or c.tls_key is None:
        raise ConfigError("cluster.tls_cert and cluster.tls_key go together: TLS needs the certificate and its key")
    pem = {}
    for key, path in (("tls_cert", c.tls_cert), ("tls_key", c.tls_key)):
        try:
            data = pathlib.Path(path).expanduser().read_bytes()
        except OSError as e:
            raise ConfigError(f"cluster.{key}={path}: {e.strerror}") from None
        if b"-----BEGIN " not in data:
            raise ConfigError(f"cluster.{key}={path}: not a PEM file")
        pem[key] = data
    from msrl.cluster.grpc_transport import TlsConfig

    return TlsConfig(pem["tls_cert"], pem["tls_key"], c.tls_server_name)


def _evaluate(job: Job, cfg: RunConfig) -> list[float]:
    actor = job.eval_actor()
    env_id, kwargs, wrappers = evaluation_env(cfg)
    if env_id is None:
        return []  # no gymnasium env to evaluate on (e.g. Tag): the training curves tell
    return evaluate(actor, env_id, cfg.eval.episodes, cfg.eval.seed, kwargs, device=actor_device(actor),
                    wrappers=wrappers)


def evaluation_env(cfg: RunConfig) -> tuple[str | None, dict[str, Any], list[str]]:
    """The gymnasium env id, ``gymnasium.make`` kwargs and msrl wrappers evaluations run on:
    ``eval.env_id`` (with the training env's wrappers) if set, else the training env, or a
    native env's gymnasium counterpart (``None`` when a native env has none)."""
    from msrl.envs import eval_env_id, is_native

    if cfg.eval.env_id:
        return cfg.eval.env_id, {}, list(cfg.env.wrappers)
    if is_native(cfg.env.id):
        return eval_env_id(cfg.env.id), {}, []
    if eval_env_id(cfg.env.id) is None:
        return None, {}, []
    if cfg.env.engine == "envpool":  # EnvPool's kwargs are not gymnasium's; its ids may not be gymnasium ids
        from msrl.envs.single import UnknownEnvError, check_env_id

        try:
            check_env_id(cfg.env.id)
        except UnknownEnvError:
            return None, {}, []
        return cfg.env.id, {}, []
    return cfg.env.id, dict(cfg.env.kwargs), list(cfg.env.wrappers)


def actor_device(actor: Any) -> torch.device:
    """The device of an actor's first parameter (CPU when it has none)."""
    for v in actor.get_weights().values():
        return v.device
    return torch.device("cpu")


class _ReplicaLost(Exception):
    """Internal: a replica process died; the attempt's run directory and env steps."""

    def __init__(self, run_dir: pathlib.Path, env_steps: int, cause: ReplicaDied) -> None:
        super().__init__(str(cause))
        self.run_dir, self.env_steps, self.cause = run_dir, env_steps, cause


def train(cfg: RunConfig, resume: str | pathlib.Path | None = None) -> TrainResult:
    """Trains ``cfg``'s job on its runtime, in a new run directory or resuming one.

    Under ``runtime: ray``, when a replica's process dies (killed, out of memory, node lost),
    every replica is stopped and the job restarts from its last checkpoint in fresh processes,
    up to ``cluster.max_restarts`` times: what the replicas did since that checkpoint (the dead
    replica's partial rollout included) is dropped, never mixed into a batch, and counted in
    the metrics (``faults/replica_restarts``, ``faults/dropped_env_steps``). Episodes lost to a
    dead env worker of ``env.engine: process`` (restarted in place, training goes on) are
    counted in ``faults/lost_episodes``.

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
    """
    import sys

    restarts = 0
    while True:
        try:
            return _train_once(cfg, resume)
        except _ReplicaLost as lost:
            ckpt = lost.run_dir / CHECKPOINT
            learner = "learner" in lost.cause.roles  # a learner's death stops the job (--resume continues it)
            if learner or restarts >= cfg.cluster.max_restarts or not ckpt.is_file():
                raise TrainingStopped(
                    f"training stopped after env step {lost.env_steps}: {lost.cause}"
                    + (" (it held the learner)" if learner else
                       f" ({restarts} restart(s) of cluster.max_restarts={cfg.cluster.max_restarts} used)")
                    + f"\nlast good checkpoint: {ckpt if ckpt.is_file() else 'none'}"
                    + (f"; continue with: msrl train --resume {lost.run_dir}" if ckpt.is_file() else ""),
                    0, lost.env_steps, ckpt if ckpt.is_file() else None,
                ) from lost.cause
            restarts += 1
            state = _read_checkpoint(ckpt)
            faults = state.setdefault("faults", {"replica_restarts": 0, "dropped_env_steps": 0})
            faults["replica_restarts"] += 1
            faults["dropped_env_steps"] += lost.env_steps - int(state["env_steps"])
            _atomic_save(state, ckpt)
            print(f"msrl: {lost.cause}; restarting every replica from the checkpoint at env step "
                  f"{state['env_steps']} (restart {restarts} of {cfg.cluster.max_restarts}; "
                  f"{lost.env_steps - int(state['env_steps'])} env steps dropped)", file=sys.stderr)
            resume = lost.run_dir


def _train_once(cfg: RunConfig, resume: str | pathlib.Path | None) -> TrainResult:
    if resume is None:
        check_runs_dir(cfg)  # before tracing and probing: a run that cannot save never starts
    spec: JobSpec = build_job_spec(cfg)
    per, total = spec.env_steps_per_iteration, cfg.train.total_env_steps
    if total % per:
        import sys

        print(f"msrl: train.total_env_steps={total} is {total // per} whole iterations of {per} env steps: "
              f"{total // per * per} env steps (a run trains whole iterations within its budget)", file=sys.stderr)
    resume_state = None
    locks: list[RunLock] = []
    try:
        if resume is not None:
            saved = load_run_config(resume)
            changed = _check_resumable(saved, cfg, resume)
            locks.append(RunLock(resume))  # before anything in the run directory is read or written
            try:
                resume_state, used = load_checkpoint(resume)
            except FileNotFoundError as e:
                raise ConfigError(str(e)) from None
            done = int(resume_state["env_steps"])
            if spec.num_iterations * spec.env_steps_per_iteration < done:
                raise ConfigError(f"train.total_env_steps={cfg.train.total_env_steps}: the run's checkpoint is already at "
                                  f"env step {done}; a resumed run can only train for longer")
            damaged = pathlib.Path(resume) / CHECKPOINT
            if used != damaged and damaged.is_file():
                # set aside (not deleted), so the next checkpoint does not rotate it into previous.pt
                os.replace(damaged, damaged.with_suffix(".pt.damaged"))
            if changed:
                import sys

                print(f"msrl: resuming {resume} with "
                      + ", ".join(f"{k}={_flatten(cfg.model_dump())[k]!r}" for k in changed)
                      + (" (budget-dependent schedules such as anneal_lr follow the new budget from here)"
                         if "train.total_env_steps" in changed else ""), file=sys.stderr)
                _atomic_write_text(pathlib.Path(resume) / "config.yaml", yaml.safe_dump(cfg.model_dump(), sort_keys=False))
        torch.set_num_threads(cfg.train.torch_threads)
        job = make_job(spec, cfg)
        try:
            return _run_job(cfg, spec, job, resume, resume_state, locks)
        except BaseException:
            job.close()  # no replica process outlives a failed or interrupted run
            raise
    finally:
        for lock in locks:
            lock.release()


def _run_job(cfg: RunConfig, spec: JobSpec, job: Any, resume: Any, resume_state: Any, locks: list[RunLock]) -> TrainResult:
    faults = {"replica_restarts": 0, "dropped_env_steps": 0, "lost_episodes": 0}
    if resume is None:
        run_dir = _new_run_dir(cfg)
        locks.append(RunLock(run_dir))  # (a new name: nobody else can hold it yet, but a --resume soon can)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
        job.reset()
        time_s, done_eval, threshold = 0.0, 0, (None, None)
        recent: collections.deque[float] = collections.deque(maxlen=20)
    else:
        run_dir = pathlib.Path(resume)
        job.load_state_dict(resume_state["job"])
        time_s, done_eval = resume_state["time_s"], resume_state["done_eval"]
        threshold = tuple(resume_state["threshold"])
        recent = collections.deque(resume_state["recent_returns"], maxlen=20)
        faults = {**faults, **resume_state.get("faults", {})}
    import sys

    if resume is None:
        clash = pathlib.Path(cfg.runs_dir) / cfg.name
        print(f"msrl: run directory {run_dir}" + (f" ({clash} exists)" if run_dir != clash else ""), file=sys.stderr)
    else:
        print(f"msrl: resuming {run_dir} at env step {job.env_steps}", file=sys.stderr)
    metrics = _Metrics(run_dir, job.iteration if resume is not None else None)
    ckpt_path = run_dir / CHECKPOINT

    last_ckpt_steps: list[int | None] = [int(resume_state["env_steps"]) if resume_state is not None else None]

    def checkpoint() -> None:
        _atomic_save(
            {
                "job": job.state_dict(),
                "actor_weights": job.eval_actor().get_weights(),
                "time_s": time_s,
                "done_eval": done_eval,
                "threshold": list(threshold),
                "recent_returns": list(recent),
                "env_steps": job.env_steps,
                "faults": faults,
            },
            ckpt_path,
            keep_previous=True,
        )
        last_ckpt_steps[0] = job.env_steps  # once the file is in place

    if hasattr(job, "replica_table"):  # where each replica runs (pids, nodes), for operators
        (run_dir / "replicas.json").write_text(json.dumps(job.replica_table(), indent=1))
    on_ray = not isinstance(job, Job)
    if resume is None and on_ray:
        checkpoint()  # a restart point before the first chunk

    bar = None
    if cfg.train.progress:
        from tqdm import tqdm

        # one speed: training env steps per second of training time (evaluations excluded), the
        # figure the final summary reports; tqdm's own rate (which counts evaluations) only
        # feeds the time-remaining estimate
        bar = tqdm(total=spec.num_iterations * spec.env_steps_per_iteration, initial=job.env_steps, unit="step",
                   dynamic_ncols=True, desc="training",
                   bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")
    E = spec.env_steps_per_iteration
    chunk_s = 0.5  # replicas run free for about this long between the driver's looks
    iter_s = None
    try:
        while job.iteration < spec.num_iterations:
            # the next event: a checkpoint, an evaluation, the end; replicas run free until it
            it = job.iteration
            n = min(spec.num_iterations - it, cfg.train.checkpoint_every - it % cfg.train.checkpoint_every)
            if cfg.train.eval_every:
                n = min(n, max(1, -(-((done_eval + 1) * cfg.train.eval_every - job.env_steps) // E)))
            n = max(1, min(n, 1 if iter_s is None else int(chunk_s / max(iter_s, 1e-6)) or 1))
            t0 = time.perf_counter()
            steps_before = job.env_steps
            try:
                records = job.run(n)
            except ReplicaDied as e:
                raise _ReplicaLost(run_dir, job.env_steps, e) from e
            except (FragmentError, FloatingPointError) as e:
                good = ckpt_path if ckpt_path.is_file() else None
                if isinstance(job, Job) or n == 1:  # the in-process job counts the iterations it finished
                    steps_before += (job.iteration - it) * E
                    where = f"at iteration {job.iteration + 1} (after env step {steps_before})"
                    failed = job.iteration + 1
                else:
                    where, failed = f"in iterations {it + 1}-{it + n} (after env step {steps_before})", it + 1
                raise TrainingStopped(
                    f"training stopped {where}: {e}\nlast good checkpoint: {good or 'none'}", failed, steps_before, good
                ) from e
            chunk_dt = time.perf_counter() - t0
            iter_s = chunk_dt / n
            eval_dt = 0.0
            if bar is not None:
                bar.update(E * n)  # before an evaluation, so "evaluating" shows the steps it evaluates at
            for i, rec in enumerate(records):
                stats = rec["episodes"]
                recent.extend(stats.returns)
                faults["lost_episodes"] += stats.lost
                row: dict[str, Any] = {
                    "iteration": it + i + 1,
                    "env_steps": rec["env_steps"],
                    "time_s": round(time_s + chunk_dt * (i + 1) / n, 4),
                    "charts/SPS": round(E / max(rec["time_s"], 1e-9), 1),
                    "charts/episodic_return": sum(stats.returns) / len(stats.returns) if stats.returns else float("nan"),
                    "charts/episodic_length": sum(stats.lengths) / len(stats.lengths) if stats.lengths else float("nan"),
                    **{f"charts/{k}": sum(v) / len(v) for k, v in stats.extra.items() if v},
                    **(rec["output"] or {}),
                    **({f"faults/{k}": v for k, v in faults.items()} if on_ray else {}),
                    **({"faults/lost_episodes": faults["lost_episodes"]}
                       if cfg.env.engine == "process" and not on_ray else {}),
                    **({"charts/comm_share": round(rec["comm_share"], 4), "charts/wait_share": round(rec["wait_share"], 4)}
                       if "comm_share" in rec else {}),
                    **({"async/policy_lag_mean": sum(lags) / len(lags), "async/policy_lag_max": max(lags)}
                       if (lags := rec.get("policy_lags")) else {}),
                    **inference_metrics(rec.get("inference")),
                }
                if i == n - 1 and cfg.train.eval_every and job.env_steps // cfg.train.eval_every > done_eval:
                    done_eval = job.env_steps // cfg.train.eval_every
                    eval_t0 = time.perf_counter()
                    if bar is not None:
                        bar.set_description_str("evaluating", refresh=True)
                    mean = sum(r := _evaluate(job, cfg)) / len(r)
                    if bar is not None:
                        bar.set_description_str("training", refresh=False)
                    eval_dt = time.perf_counter() - eval_t0
                    row["eval/mean_return"] = mean
                    if cfg.train.stop_at_return is not None and mean >= cfg.train.stop_at_return and threshold[0] is None:
                        threshold = (time_s + (eval_t0 - t0), job.env_steps)
                metrics.log(row)
            metrics.flush()
            stop = threshold[0] is not None
            # training time: the whole chunk (steps, logging), evaluation excluded
            time_s += time.perf_counter() - t0 - eval_dt
            if bar is not None:
                mean_ret = sum(recent) / len(recent) if recent else float("nan")
                # no refresh here: the next update() draws it (tqdm redraws at most every 0.1 s)
                bar.set_postfix({"steps/s": f"{job.env_steps / max(time_s, 1e-9):.0f}", "return": f"{mean_ret:.1f}"},
                                refresh=False)
            if job.iteration % cfg.train.checkpoint_every == 0 or stop or job.iteration == spec.num_iterations:
                ckpt_t0 = time.perf_counter()
                checkpoint()
                time_s += time.perf_counter() - ckpt_t0
            if stop:
                break
    except ReplicaDied as e:  # at a checkpoint's or an evaluation's call into the replicas
        raise _ReplicaLost(run_dir, job.env_steps, e) from e
    except KeyboardInterrupt:
        kept = ckpt_path if ckpt_path.is_file() else None
        raise TrainingInterrupted(run_dir, job.env_steps, kept, last_ckpt_steps[0] if kept else None) from None
    finally:
        if bar is not None:
            bar.close()
        metrics.close()
    try:
        returns = _evaluate(job, cfg)
    except ReplicaDied as e:
        raise _ReplicaLost(run_dir, job.env_steps, e) from e
    result = TrainResult(run_dir, job.iteration, job.env_steps, time_s, returns, threshold[0], threshold[1])
    (run_dir / "eval.json").write_text(
        json.dumps(
            {
                "episodes": len(returns),
                "mean_return": result.eval_mean if returns else None,
                "returns": returns,
                "env_steps": job.env_steps,
                "iterations": job.iteration,
                "time_s": time_s,
                "time_to_threshold_s": threshold[0],
                "steps_to_threshold": threshold[1],
            },
            indent=2,
        )
    )
    job.close()
    from msrl.plot import plot_run

    plot_run(run_dir)
    return result


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
