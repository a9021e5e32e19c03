"""Advantage estimators on ``(T, N)`` trajectories."""

from __future__ import annotations

import torch

__all__ = ["gae"]


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    gamma: float,
    gae_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous
    Control Using Generalized Advantage Estimation", Eq. 11-16), truncation-aware.

    Row ``t`` of env ``n`` is a transition ``s_t -> s'_t``, where ``s'_t`` is the true next
    state (the final observation when the episode ended at ``t``). With
    ``done_t = terminated_t or truncated_t``::

        delta_t = r_t + gamma * V(s'_t) * (1 - terminated_t) - V(s_t)
        A_t     = delta_t + gamma * lambda * (1 - done_t) * A_{t+1},   A_T = 0

    so a truncated episode is bootstrapped from its final observation and an advantage never
    flows across an episode boundary.

    Args:
        rewards: ``(T, N)`` float.
        values: ``V(s_t)``, ``(T, N)`` float.
        next_values: ``V(s'_t)``, ``(T, N)`` float.
        terminated: ``(T, N)`` bool; ``truncated``: ``(T, N)`` bool.
        gamma: discount in ``[0, 1]``; ``gae_lambda``: GAE's lambda in ``[0, 1]``.

    Returns:
        ``(advantages, returns)``, both ``(T, N)`` with the dtype of ``values``;
        ``returns = advantages + values`` (the value targets). Both are constants of a loss:
        computed without autograd history, whatever the inputs' ``requires_grad``.

    Raises:
        ValueError: the inputs' shapes differ or are not 2-D.
    """
    shape = rewards.shape
    for name, t in (("values", values), ("next_values", next_values), ("terminated", terminated), ("truncated", truncated)):
        if t.shape != shape:
            raise ValueError(f"gae: {name} has shape {tuple(t.shape)}, rewards has {tuple(shape)}")
    if rewards.dim() != 2:
        raise ValueError(f"gae: expects (T, N) inputs, got shape {tuple(shape)}")
    deltas = rewards + gamma * next_values * (1.0 - terminated.to(values.dtype)) - values
    coef = (gamma * gae_lambda) * (1.0 - torch.logical_or(terminated, truncated).to(values.dtype))
    advantages = torch.empty_like(values)
    if shape[0] == 0:
        return advantages, advantages + values
    # the recursion on per-step views, written in place: two ops per step instead of six
    # (~2x faster for T = 16 on one CPU thread), the same roundings as delta_t + coef_t * A_{t+1}
    d, c, a = deltas.unbind(0), coef.unbind(0), advantages.unbind(0)
    last = a[-1]
    last.copy_(d[-1])
    for t in range(shape[0] - 2, -1, -1):
        torch.mul(c[t], last, out=a[t])
        a[t].add_(d[t])
        last = a[t]
    return advantages, advantages + values
