"""msrl: distributed reinforcement learning on a fragmented dataflow graph.

From Python::

    import msrl

    result = msrl.train("configs/ppo_cartpole.yaml", seed=3)
    policy = msrl.load(result.run_dir)
    msrl.evaluate(policy, episodes=20)

(:mod:`msrl.run.python_api`; ``import msrl`` itself imports nothing heavy, so the ``msrl`` command's
help and config errors come before torch is loaded.) The errors a run raises are here too:
``msrl.ConfigError`` (bad input), ``msrl.TraceError`` and ``msrl.PartitionError`` (code the
tracer or the policy cannot honour), ``msrl.TrainingStopped`` (a NaN, dead replicas) and
``msrl.TrainingInterrupted`` (Ctrl-C; the last checkpoint is kept).

Importing msrl changes nothing outside msrl: torch, ``torch.optim`` and tensordict stay as they
are. The start-up shortcuts of :mod:`msrl.runtime.startup` run only in the processes msrl owns (the
``msrl`` command, Ray replica processes), or in yours with ``msrl.train(..., own_process=True)``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["train", "load", "evaluate", "TrainedPolicy", "TrainResult", "MsrlError", "InputError", "ConfigError",
           "TraceError", "PartitionError", "TrainingStopped", "TrainingInterrupted"]

#: where each name lives (imported on first use)
_HOMES = {"train": "msrl.run.python_api", "load": "msrl.run.python_api", "evaluate": "msrl.run.python_api",
          "TrainedPolicy": "msrl.run.python_api", "TrainResult": "msrl.run.outcome", "MsrlError": "msrl.errors",
          "InputError": "msrl.errors", "ConfigError": "msrl.errors",
          "TraceError": "msrl.frontend.tracer", "PartitionError": "msrl.errors", "TrainingStopped": "msrl.run.outcome",
          "TrainingInterrupted": "msrl.run.outcome"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is not None:
        import importlib

        return getattr(importlib.import_module(home), name)
    raise AttributeError(f"module 'msrl' has no attribute {name!r}")
