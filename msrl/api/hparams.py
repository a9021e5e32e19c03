"""Hyperparameter types: bounds an algorithm's hparams dataclass declares on its fields, which
the config checks (``algorithm.hparams.<field>: ...``, exit status 2) before anything runs."""

from __future__ import annotations

from typing import Annotated

from annotated_types import Ge, Gt, Le, MinLen

__all__ = ["PositiveInt", "NonNegativeInt", "PositiveFloat", "NonNegativeFloat", "UnitInterval", "Fraction", "LayerSizes"]

#: an integer >= 1 (steps, epochs, batch and buffer sizes, frequencies)
PositiveInt = Annotated[int, Ge(1)]
#: an integer >= 0 (e.g. warm-up steps)
NonNegativeInt = Annotated[int, Ge(0)]
#: a float > 0 (learning rates, gradient-norm limits, epsilons)
PositiveFloat = Annotated[float, Gt(0)]
#: a float >= 0 (loss coefficients)
NonNegativeFloat = Annotated[float, Ge(0)]
#: a float in [0, 1] (discounts, GAE lambda, exploration rates)
UnitInterval = Annotated[float, Ge(0), Le(1)]
#: a float in (0, 1] (Polyak tau, schedule fractions)
Fraction = Annotated[float, Gt(0), Le(1)]
#: hidden layer widths, each >= 1, at least one layer
LayerSizes = Annotated[tuple[PositiveInt, ...], MinLen(1)]
