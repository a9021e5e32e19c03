"""Run directories: where a run keeps what it writes, who may write there, and what a resumed run
may change.

A run directory ``<runs_dir>/<name>[-k]/`` (the first free name: ``-1``, ``-2``, ... when the
name is taken; announced at the start) holds:

* ``config.yaml`` -- the resolved config (overrides applied);
* ``metrics.csv`` and ``tb/`` -- one row (TensorBoard: one event) per iteration
  (:mod:`msrl.run.metrics`);
* ``checkpoints/latest.pt`` and ``previous.pt`` -- written atomically (:mod:`msrl.run.checkpoints`);
* ``replicas.json`` -- where each replica runs (Ray runs);
* ``eval.json`` -- the final deterministic evaluation; ``learning_curve.png``;
* ``.lock`` -- held by the one process training in it (:class:`RunLock`).

Nothing is written before the job has been traced, partitioned and built, so a config that
cannot run leaves no directory behind; whether one *could* be made is checked first of all
(:func:`check_runs_dir`).
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Sequence

import yaml

from msrl.config import ConfigError, RunConfig, validate

__all__ = ["RunLock", "check_runs_dir", "new_run_dir", "atomic_write_text", "write_config", "load_run_config",
           "RESUMABLE", "check_resumable", "resume_config", "flatten"]

#: Config keys a resumed run may change: its budget and how it is watched or placed, never what
#: it computes. A longer ``train.total_env_steps`` continues the run; schedules that depend on
#: the budget (``anneal_lr``) follow the new budget from the resume point, as SB3's
#: ``learn(..., reset_num_timesteps=False)`` does.
RESUMABLE = ("train.total_env_steps", "train.total_gradient_steps", "train.eval_every", "train.checkpoint_every",
             "train.keep_weights", "train.stop_at_return",
             "train.progress", "cluster.address", "cluster.connect_timeout_s", "cluster.max_restarts", "cluster.capacity_timeout_s",
             "cluster.watchdog", "cluster.cpus_per_replica", "cluster.gpus_per_replica",
             "cluster.replica_timeout_s", "cluster.intra_node",
             "cluster.boundary_transport", "cluster.sync_transport", "cluster.learner_priority", "cluster.on_replica_loss",
             "env.num_workers")


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


def new_run_dir(cfg: RunConfig) -> pathlib.Path:
    """Makes the run's directory: ``<runs_dir>/<name>``, or the first free ``<name>-k``.

    Raises:
        ConfigError: as :func:`check_runs_dir`; RuntimeError: 10,000 names taken.
    """
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


def atomic_write_text(path: pathlib.Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file and a rename (whole or not at all)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_config(run_dir: pathlib.Path, cfg: RunConfig) -> None:
    """Saves the resolved config as the run's ``config.yaml``."""
    atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(cfg.model_dump(), sort_keys=False))


def load_run_config(run_dir: str | pathlib.Path) -> RunConfig:
    """The resolved config saved in a run directory.

    Raises:
        ConfigError: no run directory, or no ``config.yaml`` in it.
    """
    p = pathlib.Path(run_dir) / "config.yaml"
    if not p.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    return validate(yaml.safe_load(p.read_text()))


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict as ``{"train.total_env_steps": ..., ...}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def check_resumable(saved: RunConfig, cfg: RunConfig, run_dir: str | pathlib.Path) -> list[str]:
    """The keys where ``cfg`` differs from the run's saved config.

    Raises:
        ConfigError: a key outside :data:`RESUMABLE` differs (named, with its two values; the
            root of a difference first: another algorithm differs in every hyperparameter too).
    """
    a, b = flatten(saved.model_dump()), flatten(cfg.model_dump())
    diff = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    _refuse_fixed(a, b, diff, run_dir)
    return diff


def _refuse_fixed(a: dict[str, Any], b: dict[str, Any], diff: Sequence[str], run_dir: str | pathlib.Path) -> None:
    """Raises ConfigError naming the first key of ``diff`` outside :data:`RESUMABLE` (the root of
    a difference first: another algorithm differs in every hyperparameter too)."""
    fixed = [k for k in diff if not any(k == r or k.startswith(r + ".") for r in RESUMABLE)]  # a per-fragment value's keys too
    if fixed:
        roots = ("algorithm.name", "env.id", "distribution_policy.name")
        k = next((r for r in roots if r in fixed), fixed[0])
        raise ConfigError(
            f"--resume {run_dir}: {k}={b.get(k)!r} differs from the run's {a.get(k)!r} (config.yaml); a resumed run "
            f"may change only {', '.join(RESUMABLE)}"
        )


def resume_config(run_dir: str | pathlib.Path, overrides: Sequence[str] = (),
                  config: str | pathlib.Path | None = None) -> RunConfig:
    """The config to resume ``run_dir`` with: its saved ``config.yaml`` (or ``config``) with
    ``overrides`` applied, e.g. ``train.total_env_steps=600000`` to train for longer.

    Raises:
        ConfigError: not a run directory, an invalid override, or a change to a key outside
            :data:`RESUMABLE`.
    """
    from msrl.config import load_config, parse_overrides, set_values

    saved = load_run_config(run_dir)
    if config is None:
        values = parse_overrides(overrides)
        # a key a resumed run cannot change is named before the new config is checked: with
        # algorithm.name=dqn the run's PPO hyperparameters would be the first error otherwise
        a = flatten(saved.model_dump())
        given = {".".join(path): value for path, value in values}
        _refuse_fixed(a, given, [k for k, v in given.items() if k not in a or a[k] != v], run_dir)
        cfg = validate(set_values(saved.model_dump(), values))
    else:  # the run keeps its name and runs_dir (its directory is given); any other difference is refused
        cfg = load_config(config, overrides).model_copy(update={"name": saved.name, "runs_dir": saved.runs_dir})
        try:
            check_resumable(saved, cfg, run_dir)
        except ConfigError as e:
            raise ConfigError(f"{e}. CONFIG {config} is not the run's config: give CONFIG (a new run) or "
                              f"--resume {run_dir} (the run's own config.yaml), not both") from None
        return cfg
    check_resumable(saved, cfg, run_dir)
    return cfg
