"""Checkpoints of a run: atomic save with one rotation, load with fallback, and the training
progress they carry.

``checkpoints/latest.pt`` is written through a temporary file, fsync and a rename, so a crash
leaves the old file or the new one, whole; the file it replaces becomes ``previous.pt``. A
damaged ``latest.pt`` (truncated, overwritten, empty, not msrl's) falls back to ``previous.pt``
and says so; with no readable one, the error names each file and its problem in one line.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pathlib
import shutil
import sys
from typing import Any

import torch

from msrl.config import ConfigError
from msrl.runtime.signals import signals_deferred

__all__ = ["CHECKPOINT", "PREVIOUS_CHECKPOINT", "WEIGHTS_DIR", "CheckpointError", "Progress", "save_checkpoint", "read_checkpoint",
           "load_checkpoint", "atomic_save", "set_aside_damaged", "first_sentence"]

CHECKPOINT = "checkpoints/latest.pt"
#: The checkpoint before the latest one, kept so a damaged ``latest.pt`` has a fallback.
PREVIOUS_CHECKPOINT = "checkpoints/previous.pt"
_KEYS = ("job", "actor_weights", "time_s", "done_eval", "threshold", "recent_returns", "env_steps")


class CheckpointError(ConfigError):
    """No readable checkpoint: damaged (truncated, overwritten, empty) or not one of msrl's.
    Reported as one line naming the file and what is wrong (exit status 2)."""


#: the fault counters of a run (``faults/...`` in metrics.csv), each from 0
FAULTS = {"replica_restarts": 0, "replica_hangs": 0, "replaced_replicas": 0, "absent_replicas": 0, "dropped_env_steps": 0,
          "lost_episodes": 0}


@dataclasses.dataclass
class Progress:
    """What the training loop carries from checkpoint to checkpoint.

    Attributes:
        time_s: training wall time so far (s, evaluations excluded).
        done_eval: evaluations done (the next is due at ``(done_eval + 1) * train.eval_every``).
        threshold: ``(time_s, env_steps)`` when an evaluation first reached
            ``train.stop_at_return``, or ``(None, None)``.
        recent: the last 20 episode returns (the progress bar's figure).
        faults: ``replica_restarts``, ``replica_hangs``, ``replaced_replicas`` (lost replicas replaced
            alone), ``absent_replicas`` (lost replicas the job ran on without while no node had room
            for them), ``dropped_env_steps``, ``lost_episodes`` so far.
    """

    time_s: float = 0.0
    done_eval: int = 0
    threshold: tuple[float | None, int | None] = (None, None)
    recent: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=20))
    faults: dict[str, int] = dataclasses.field(default_factory=lambda: dict(FAULTS))

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Progress":
        """The progress a checkpoint holds."""
        return cls(state["time_s"], state["done_eval"], tuple(state["threshold"]),  # type: ignore[arg-type]
                   collections.deque(state["recent_returns"], maxlen=20),
                   {**FAULTS, **state.get("faults", {})})


def atomic_save(obj: Any, path: pathlib.Path, keep_previous: bool = False) -> None:
    """Writes ``obj`` to ``path`` so that a crash leaves the old file or the new one, whole;
    with ``keep_previous``, the file it replaces becomes ``previous.pt`` beside it. ``path``
    exists at every moment once written (a Ctrl-C or a crash mid-save, or a reader looking,
    never finds it missing): the old file is linked to ``previous.pt`` before the new one
    replaces it, never moved away first. ``SIGINT``/``SIGTERM``/``SIGHUP`` during the write wait
    for its end (:func:`~msrl.runtime.signals.signals_deferred`); a write that fails (a full disk) leaves no temporary
    file and the old ``path`` as it was.

    Raises:
        OSError: the write failed (``path`` unchanged).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with signals_deferred():
        try:
            torch.save(obj, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            if keep_previous and path.is_file():
                previous = path.with_name("previous.pt")
                staged = previous.with_suffix(previous.suffix + ".tmp")
                staged.unlink(missing_ok=True)
                try:
                    os.link(path, staged)  # the old file under a second name: path stays in place
                except OSError:  # a file system without hard links: a copy
                    shutil.copyfile(path, staged)
                os.replace(staged, previous)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


#: where ``train.keep_weights`` keeps each checkpoint's policy weights, ``<env steps>.pt``
WEIGHTS_DIR = "checkpoints/weights"


def save_checkpoint(run_dir: pathlib.Path, job: Any, progress: Progress, keep_weights_at: int | None = None) -> None:
    """Saves the job's state, the actor's weights (for ``msrl.load``) and ``progress`` as the
    run's latest checkpoint, the one before it kept as ``previous.pt``. With ``keep_weights_at``
    (the run's steps in its budget's unit: env steps, an offline algorithm's gradient steps),
    the actor's weights and the env steps are first also written, atomically, to
    ``WEIGHTS_DIR/<keep_weights_at>.pt`` (``{"actor_weights", "env_steps"}``; ``train.keep_weights``).

    Raises:
        OSError: a write failed (the files as they were).
    """
    weights = job.eval_actor().get_weights()
    if keep_weights_at is not None:
        (run_dir / WEIGHTS_DIR).mkdir(parents=True, exist_ok=True)
        atomic_save({"actor_weights": weights, "env_steps": job.env_steps}, run_dir / WEIGHTS_DIR / f"{keep_weights_at}.pt")
    atomic_save({
        "job": job.state_dict(),
        "actor_weights": weights,
        "time_s": progress.time_s,
        "done_eval": progress.done_eval,
        "threshold": list(progress.threshold),
        "recent_returns": list(progress.recent),
        "env_steps": job.env_steps,
        "faults": progress.faults,
    }, run_dir / CHECKPOINT, keep_previous=True)


def first_sentence(text: str, limit: int = 300) -> str:
    """A loader's message on one line, cut at a sentence (or word) end, never mid-word."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    head = text[:limit]
    end = head.rfind(". ")
    return head[:end + 1] if end > 0 else head[:head.rfind(" ")] + " ..."


def read_checkpoint(path: pathlib.Path) -> dict[str, Any]:
    """A checkpoint file's state, checked to be msrl's.

    Raises:
        CheckpointError: unreadable (the loader's error, in one line) or missing keys.
    """
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path}: damaged checkpoint (empty file)")
    try:
        state = torch.load(path, weights_only=False)
    except Exception as e:  # noqa: BLE001 - zip, pickle and EOF errors all mean a damaged file
        raise CheckpointError(f"{path}: damaged checkpoint ({type(e).__name__}: {first_sentence(str(e))})") from None
    missing = [k for k in _KEYS if not isinstance(state, dict) or k not in state]
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
    latest, previous = pathlib.Path(run_dir) / CHECKPOINT, pathlib.Path(run_dir) / PREVIOUS_CHECKPOINT
    if not latest.is_file() and not previous.is_file():
        raise FileNotFoundError(f"{run_dir} has no checkpoint ({CHECKPOINT})")
    try:
        return read_checkpoint(latest), latest
    except (CheckpointError, FileNotFoundError) as e:
        if not previous.is_file():
            raise CheckpointError(f"{e}; no earlier checkpoint ({PREVIOUS_CHECKPOINT}) to fall back to") from None
        try:
            state = read_checkpoint(previous)
        except CheckpointError as e2:
            raise CheckpointError(f"{e}; the earlier one too: {e2}") from None
        print(f"msrl: {e}; falling back to {previous} (env step {state['env_steps']})", file=sys.stderr)
        return state, previous


def set_aside_damaged(run_dir: str | pathlib.Path, used: pathlib.Path) -> None:
    """After a fallback to ``previous.pt``: renames the damaged ``latest.pt`` to
    ``latest.pt.damaged`` (kept, not deleted), so the next save does not rotate it into
    ``previous.pt``."""
    damaged = pathlib.Path(run_dir) / CHECKPOINT
    if used != damaged and damaged.is_file():
        os.replace(damaged, damaged.with_suffix(".pt.damaged"))
