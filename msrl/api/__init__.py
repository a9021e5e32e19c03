"""The component API: the roles an RL algorithm is made of (DESIGN.md §1).

An algorithm is a set of components, each with a role, and a :class:`Trainer` whose
``train_step()`` is the body of the training loop. The tracer reads ``train_step`` (and
``reset``) and never executes them; the components' methods are the units the distribution
policy places on fragments. The loop of a trainer in one process reads::

    trainer.reset()                  # self.obs = self.env.reset(seed=...)
    while env_steps < total:
        metrics = trainer.train_step()   # rollout -> learn -> sync weights

Roles:

* :class:`Environment` -- batched env on tensors with a leading env dimension ``(N, ...)``;
  :class:`EnvWrapper` -- an algorithm's own env-side code around it (AlphaZero's search).
* :class:`Actor` -- policy inference; holds networks; ``get_weights``/``set_weights``.
* :class:`Learner` -- ``learn(batch) -> metrics``; owns networks and optimiser. Its gradient
  step goes through :meth:`Learner.apply_gradients` and its running statistics through
  :meth:`Learner.reduce_statistics`: the declared **collective points** where a replicated
  learner (``multi_learner``) averages over its replicas, each an ``allreduce`` node of the
  graph (:data:`COLLECTIVE_POINTS`, :func:`collective_scope`).
* :class:`Buffer` -- rollout or replay storage.

The contracts are split by idea: :mod:`~msrl.api.roles` (the roles, collective points),
:mod:`~msrl.api.specs` (what msrl hands components and an algorithm hands msrl),
:mod:`~msrl.api.value_kinds` (``@returns``) and :mod:`~msrl.api.hparams` (hyperparameter
bounds). Import them from here: ``from msrl.api import Learner, returns``.
"""

from __future__ import annotations

from msrl.api.hparams import Fraction, LayerSizes, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, UnitInterval
from msrl.api.roles import (
                              COLLECTIVE_POINTS,
                              ROLES,
                              Actor,
                              Buffer,
                              Component,
                              ComponentFactory,
                              Environment,
                              EnvWrapper,
                              Learner,
                              ModuleWeights,
                              Trainer,
                              UndeclaredStateError,
                              collective_scope,
                              in_gradient_step,
)
from msrl.api.specs import AlgorithmSpec, BuildContext, EnvSpec, EpisodeStats, ReplayContract
from msrl.api.value_kinds import PARTIAL_REDUCTIONS, VALUE_KINDS, declared_kinds, returns

__all__ = [
    "PositiveInt",
    "NonNegativeInt",
    "PositiveFloat",
    "NonNegativeFloat",
    "UnitInterval",
    "Fraction",
    "LayerSizes",
    "ROLES",
    "ComponentFactory",
    "UndeclaredStateError",
    "ReplayContract",
    "Component",
    "Environment",
    "EnvWrapper",
    "Actor",
    "Learner",
    "Buffer",
    "Trainer",
    "EnvSpec",
    "BuildContext",
    "AlgorithmSpec",
    "EpisodeStats",
    "ModuleWeights",
    "returns",
    "declared_kinds",
    "VALUE_KINDS",
    "PARTIAL_REDUCTIONS",
    "COLLECTIVE_POINTS",
    "collective_scope",
    "in_gradient_step",
]
