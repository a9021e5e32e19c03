"""TensorFlow's RMSProp, as the actor-critic papers' implementations stepped with it.

A3C (Mnih et al. 2016), OpenAI Baselines' A2C and IMPALA (Espeholt et al. 2018, Table G.1: decay
0.99, epsilon 0.01) trained with TensorFlow's ``RMSPropOptimizer``, which differs from
``torch.optim.RMSprop`` in two places: epsilon is added *inside* the square root, and the mean
square starts at 1, not 0. For a small gradient the two are far apart: with epsilon 1e-5 and
``|g| ~ 1e-4`` torch's steps a weight by about ``lr`` in the sign of its gradient, TensorFlow's by
``lr g / 3e-3``; with IMPALA's epsilon 0.01, torch's by ``100 lr g``, TensorFlow's by ``10 lr g``.
Stable Baselines3 ships the same rule as ``RMSpropTFLike`` (and recommends it for A2C on Atari);
this one steps all of a group's parameters with ``torch._foreach`` ops and reads a learning rate
held in a 0-d tensor on the device (:mod:`msrl.rl.schedules`), so a captured iteration (a CUDA
graph) replays it without a host read -- what ``RMSpropTFLike`` (a Python ``lr`` per parameter)
cannot do. ``tests/test_optim.py`` checks it against ``RMSpropTFLike`` bitwise.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

__all__ = ["RMSpropTF"]


class RMSpropTF(torch.optim.Optimizer):
    """RMSProp with TensorFlow's update (Tieleman and Hinton 2012, lecture 6e; TensorFlow's
    ``tf.compat.v1.train.RMSPropOptimizer`` without momentum)::

        v <- alpha * v + (1 - alpha) * g^2          (v starts at 1)
        p <- p - lr * g / sqrt(v + eps)

    Args:
        params: the parameters (float tensors; any device), or parameter groups.
        lr: the learning rate: a float, or a 0-d tensor on the parameters' device that a schedule
            updates in place (:func:`msrl.rl.schedules.learning_rate_tensor`); only then is the
            optimiser ``capturable`` (a float changed between steps is a host value).
        alpha: the mean square's decay.
        eps: added to the mean square under the root.

    Raises:
        ValueError: a negative ``lr``, ``eps``, or ``alpha`` outside ``[0, 1)``.
    """

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-2, alpha: float = 0.99,
                 eps: float = 1e-10) -> None:
        if float(lr) < 0.0:
            raise ValueError(f"RMSpropTF: lr must be >= 0, got {float(lr)}")
        if eps < 0.0:
            raise ValueError(f"RMSpropTF: eps must be >= 0, got {eps}")
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"RMSpropTF: alpha must be in [0, 1), got {alpha}")
        # no step count on the host: with its rate in a tensor an iteration's steps can be captured
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, capturable=isinstance(lr, torch.Tensor)))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every parameter that has a gradient (sparse gradients are refused:
        ``RuntimeError``); the mean squares are made (ones) at a parameter's first step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            if any(g.is_sparse for g in grads):
                raise RuntimeError("RMSpropTF does not support sparse gradients")
            squares = []
            for p in params:
                state = self.state[p]
                if "square_avg" not in state:
                    state["square_avg"] = torch.ones_like(p, memory_format=torch.preserve_format)
                squares.append(state["square_avg"])
            alpha, lr = group["alpha"], group["lr"]
            torch._foreach_mul_(squares, alpha)
            torch._foreach_addcmul_(squares, grads, grads, value=1 - alpha)
            denominators = torch._foreach_add(squares, group["eps"])
            torch._foreach_sqrt_(denominators)
            if isinstance(lr, torch.Tensor):  # read on the device: p -= (g / d) * lr
                steps = torch._foreach_div(grads, denominators)
                torch._foreach_mul_(steps, lr)
                torch._foreach_sub_(params, steps)
            else:
                torch._foreach_addcdiv_(params, grads, denominators, value=-lr)
        return loss
