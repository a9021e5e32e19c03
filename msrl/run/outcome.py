"""How a run ends: its :class:`TrainResult`, or the error that stopped it."""

from __future__ import annotations

import csv
import dataclasses
import pathlib
import shlex

from msrl.errors import MsrlError
from msrl.runtime.replica import ReplicaDied

__all__ = ["TrainResult", "TrainingStopped", "TrainingInterrupted", "ReplicaLost", "ClusterLost", "EXIT_LOST",
           "lost_message"]

#: the exit status of ``msrl train`` when the run's Ray cluster, or the training process itself,
#: stopped under it (the run directory and its last checkpoint are kept; ``--resume`` continues)
EXIT_LOST = 3


class TrainingStopped(MsrlError, RuntimeError):
    """Training stopped on an error (e.g. a NaN); the last good checkpoint is kept (``msrl
    train`` prints it as one line and exits with status 1).

    Attributes:
        iteration: the iteration that failed; ``env_steps``: env steps before it;
        checkpoint: path of the last good checkpoint (or ``None``).
    """

    exit_status = 1

    def __init__(self, message: str, iteration: int, env_steps: int, checkpoint: pathlib.Path | None) -> None:
        super().__init__(message)
        self.iteration, self.env_steps, self.checkpoint = iteration, env_steps, checkpoint


class ClusterLost(TrainingStopped):
    """The Ray cluster the run's replicas ran on stopped (its head, GCS or this machine's raylet
    gone): nothing can restart on it. The run directory and its last checkpoint are kept; the
    message is one line ending in the ``--resume`` command (``msrl train`` exits with
    :data:`EXIT_LOST`)."""

    exit_status = EXIT_LOST

    def __init__(self, run_dir: pathlib.Path, why: str) -> None:
        message, steps, ckpt = lost_message(run_dir, f"the Ray cluster of this run stopped ({why})")
        super().__init__(message, 0, steps if steps is not None else 0, ckpt)
        self.run_dir = run_dir


def resume_command(run_dir: str | pathlib.Path) -> str:
    """The command that resumes the run in ``run_dir``, shell-quoted so that it can be pasted
    (a runs directory with a space or a quote in its name)."""
    return f"msrl train --resume {shlex.quote(str(run_dir))}"


def lost_message(run_dir: pathlib.Path | None, what: str) -> tuple[str, int | None, pathlib.Path | None]:
    """``what`` happened to the run in ``run_dir``: the one line that says so, where its last
    checkpoint is and how to resume; with the checkpoint's env steps and path (``None`` when
    there is none yet)."""
    from msrl.run.checkpoints import CheckpointError, load_checkpoint

    if run_dir is None:
        return f"{what}; no run directory was made yet", None, None
    try:
        state, used = load_checkpoint(run_dir)
    except (FileNotFoundError, CheckpointError):
        return f"{what}; the run ({run_dir}) has no checkpoint yet: start it again", None, None
    steps = int(state["env_steps"])
    return (f"{what}; the last checkpoint is at env step {steps}; resume with {resume_command(run_dir)}",
            steps, used)


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
                f"{resume_command(run_dir)}") if checkpoint is not None else "no checkpoint was written yet"
        super().__init__(f"interrupted at env step {env_steps}; {kept}")
        self.run_dir, self.env_steps = run_dir, env_steps
        self.checkpoint, self.checkpoint_env_steps = checkpoint, checkpoint_env_steps


@dataclasses.dataclass
class TrainResult:
    """What a finished run reports.

    Attributes:
        run_dir: the run directory.
        iterations: training iterations done (``train_step`` calls).
        env_steps: env steps done (over all envs).
        time_s: training wall time (s, evaluations excluded).
        eval_returns: the final evaluation's episode returns (undiscounted, one per episode).
        time_to_threshold_s: training time (s) when an evaluation first reached
            ``train.stop_at_return`` (``None`` if never).
        steps_to_threshold: env steps when an evaluation first reached ``train.stop_at_return``
            (``None`` if never).
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


class ReplicaLost(MsrlError):
    """A replica process died during an attempt (:func:`msrl.run.training.train` restarts the job from its last
    checkpoint); the attempt's run directory (``None``: not made yet) and the env steps the job
    had reached (``-1``: it died while the job started, before any chunk)."""

    def __init__(self, run_dir: pathlib.Path | None, env_steps: int, cause: ReplicaDied) -> None:
        super().__init__(str(cause))
        self.run_dir, self.env_steps, self.cause = run_dir, env_steps, cause
