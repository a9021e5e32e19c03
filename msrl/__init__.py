"""msrl: distributed reinforcement learning on a fragmented dataflow graph.

From Python::

    import msrl

    result = msrl.train("configs/ppo_cartpole.yaml", seed=3)
    policy = msrl.load(result.run_dir)
    msrl.evaluate(policy, episodes=20)

(:mod:`msrl.python_api`; ``import msrl`` itself imports nothing heavy, so the ``msrl`` command's
help and config errors come before torch is loaded.)
"""

from __future__ import annotations

from typing import Any

__all__ = ["train", "load", "evaluate", "TrainedPolicy"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from msrl import python_api

        return getattr(python_api, name)
    raise AttributeError(f"module 'msrl' has no attribute {name!r}")
