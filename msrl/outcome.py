"""How a run ends: its :class:`TrainResult`, or the error that stopped it."""

from __future__ import annotations

import csv
import dataclasses
import pathlib

from msrl.runtime.replica import ReplicaDied

__all__ = ["TrainResult", "TrainingStopped", "TrainingInterrupted", "ReplicaLost"]


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


class ReplicaLost(Exception):
    """A replica process died during an attempt (:func:`msrl.run.train` restarts the job from its last
    checkpoint); the attempt's run directory and env steps."""

    def __init__(self, run_dir: pathlib.Path, env_steps: int, cause: ReplicaDied) -> None:
        super().__init__(str(cause))
        self.run_dir, self.env_steps, self.cause = run_dir, env_steps, cause
