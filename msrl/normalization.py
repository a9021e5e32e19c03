"""Running mean and variance for observation and reward normalization, kept in a network's
buffers so they travel with its weights (to actors, into checkpoints, to ``msrl.load``).

The statistics are updated a batch at a time with the parallel-variance combination of Chan,
Golub and LeVeque (1979, "Updating formulae and a pairwise algorithm for computing sample
variances"), as gymnasium's ``RunningMeanStd`` (used by ``NormalizeObservation`` and
``NormalizeReward``, CleanRL's normalization) does. A ``reduce`` function (a learner's
statistics point, :meth:`msrl.api.Learner.reduce_statistics`: the mean over ``multi_learner``'s
replicas) turns a replica's batch moments into the moments of every replica's batch, so every
replica's statistics stay bitwise equal.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = ["RunningMeanStd", "RewardScaler"]


class RunningMeanStd(nn.Module):
    """Running mean and (population) variance of samples of shape ``shape``, float64 buffers.

    Args:
        shape: the shape of one sample (``()`` for scalars such as returns).
        epsilon: the initial count (gymnasium's 1e-4: the first batch all but replaces the
            initial mean 0 and variance 1).
    """

    def __init__(self, shape: tuple[int, ...] = (), epsilon: float = 1e-4) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(epsilon, dtype=torch.float64))

    @torch.no_grad()
    def update(self, x: torch.Tensor, reduce: Callable[[list[torch.Tensor]], object] | None = None,
               replicas: int = 1) -> None:
        """Adds a batch ``x`` ``(B, *shape)``.

        Args:
            x: the samples; any float dtype (moments are taken in float64).
            reduce: replaces its tensors in place by their mean over replicas (``None``: one
                replica); every replica's batch must hold ``B`` samples.
            replicas: how many replicas ``reduce`` averages over.
        """
        x = x.detach().to(torch.float64)
        moments = [x.mean(0), (x * x).mean(0)]
        if reduce is not None:
            reduce(moments)
        batch_mean, batch_sq = moments
        batch_var = (batch_sq - batch_mean * batch_mean).clamp(min=0.0)
        # made on the device (a fill, not a copy of host memory: a captured iteration replays it)
        batch_count = torch.full((), float(x.shape[0] * replicas), dtype=torch.float64, device=x.device)
        delta = batch_mean - self.mean
        total = self.count + batch_count
        m2 = self.var * self.count + batch_var * batch_count + delta * delta * self.count * batch_count / total
        self.mean.add_(delta * batch_count / total)
        self.var.copy_(m2 / total)
        self.count.copy_(total)

    def normalize(self, x: torch.Tensor, clip: float | None = None, center: bool = True) -> torch.Tensor:
        """``(x - mean) / sqrt(var + 1e-8)`` (without ``- mean`` when not ``center``), clipped to
        ``[-clip, clip]``; in ``x``'s dtype."""
        std = torch.sqrt(self.var + 1e-8).to(x.dtype)
        y = (x - self.mean.to(x.dtype)) / std if center else x / std
        return y if clip is None else y.clamp(-clip, clip)


class RewardScaler(nn.Module):
    """Rewards divided by the running std of the discounted return (gymnasium's
    ``NormalizeReward``, CleanRL's reward normalization): per env ``G <- gamma (1 - terminated) G + r``,
    carried across rollouts, its std from a :class:`RunningMeanStd` of every ``G``.

    Args:
        gamma: the discount of ``G`` (the learner's).
        clip: scaled rewards are clipped to ``[-clip, clip]``.
    """

    def __init__(self, gamma: float, clip: float) -> None:
        super().__init__()
        self.gamma, self.clip = gamma, clip
        self.return_rms = RunningMeanStd(())
        #: ``(N,)`` float64 per env across rollouts; ``None`` before the first rollout
        self.discounted_return: torch.Tensor | None = None

    @torch.no_grad()
    def forward(self, reward: torch.Tensor, terminated: torch.Tensor,
                reduce: Callable[[list[torch.Tensor]], object] | None = None, replicas: int = 1) -> torch.Tensor:
        """Rewards ``(T, N)`` (float) scaled and clipped, in their dtype, the statistics updated
        with this rollout's ``T N`` discounted returns first.

        Args:
            reward: ``(T, N)`` float.
            terminated: ``(T, N)`` bool: ``G`` restarts after a terminal step (not after a
                truncation, as gymnasium's wrapper).
            reduce, replicas: as :meth:`RunningMeanStd.update` (``multi_learner``'s mean).
        """
        T, N = reward.shape
        if self.discounted_return is None or self.discounted_return.shape[0] != N:
            self.discounted_return = torch.zeros(N, dtype=torch.float64, device=reward.device)
        g, returns = self.discounted_return, torch.empty(T, N, dtype=torch.float64, device=reward.device)
        for t in range(T):
            g = g * self.gamma * (~terminated[t]).to(torch.float64) + reward[t].to(torch.float64)
            returns[t] = g
        self.discounted_return.copy_(g)  # in place: a captured iteration replays the update
        self.return_rms.update(returns.flatten(), reduce, replicas)
        return self.return_rms.normalize(reward, self.clip, center=False)
