"""Distributional RL's shared math: the fixed support of a categorical return distribution and
the projection of a Bellman-updated distribution back onto it (Bellemare, Dabney and Munos 2017,
"A Distributional Perspective on Reinforcement Learning", arXiv:1707.06887, Algorithm 1); and
DreamerV3's symlog transform and two-hot regression onto fixed bins (Hafner et al. 2023,
"Mastering Diverse Domains through World Models", arXiv:2301.04104v1, Eq. 9-10).

Shared math only (:mod:`msrl.rl`): C51's and DreamerV3's networks, actors, learners and trainers
live in ``algorithms/c51.py`` and ``algorithms/dreamerv3.py``.
"""

from __future__ import annotations

import torch

__all__ = ["categorical_support", "categorical_projection", "symlog", "symexp", "two_hot", "two_hot_log_likelihood",
           "two_hot_mean"]


def categorical_support(v_min: float, v_max: float, n_atoms: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The atoms ``z_i = v_min + i (v_max - v_min) / (n_atoms - 1)``, ``(n_atoms,)`` float32.

    Raises:
        ValueError: ``n_atoms < 2`` or ``v_min >= v_max``.
    """
    if n_atoms < 2:
        raise ValueError(f"a categorical support needs at least 2 atoms, got n_atoms={n_atoms}")
    if not v_min < v_max:
        raise ValueError(f"a categorical support needs v_min < v_max, got v_min={v_min}, v_max={v_max}")
    return torch.linspace(v_min, v_max, n_atoms, dtype=torch.float32, device=device)


def categorical_projection(next_pmfs: torch.Tensor, rewards: torch.Tensor, not_done: torch.Tensor,
                           discount: torch.Tensor | float, support: torch.Tensor) -> torch.Tensor:
    """The distribution of ``r + discount * (1 - done) * Z(s', a*)`` projected onto ``support``
    (Bellemare et al. 2017, Algorithm 1): each atom's shifted value ``Tz_j``, clamped into
    ``[v_min, v_max]``, splits its probability between its two neighbouring atoms in proportion
    to its distance from each.

    Args:
        next_pmfs: ``(B, n_atoms)`` float32, the probabilities of ``Z(s', a*)`` (rows sum to 1).
        rewards: ``(B,)`` float32 (an n-step transition's discounted reward sum).
        not_done: ``(B,)`` float32, 0 where the episode terminated at ``s'`` (no bootstrap), else 1.
        discount: ``gamma`` (or each transition's ``gamma^m``, ``(B,)``).
        support: ``(n_atoms,)`` float32, evenly spaced (:func:`categorical_support`).

    Returns:
        ``(B, n_atoms)`` float32, rows summing to 1 (no gradient flows through it).
    """
    with torch.no_grad():
        v_min, v_max = support[0], support[-1]
        n_atoms = support.shape[0]
        delta_z = (v_max - v_min) / (n_atoms - 1)
        discount = torch.as_tensor(discount, dtype=torch.float32, device=support.device)
        tz = (rewards.unsqueeze(-1) + (discount * not_done).reshape(-1, 1) * support.unsqueeze(0)).clamp(v_min, v_max)
        b = (tz - v_min) / delta_z  # in [0, n_atoms - 1]
        lower, upper = b.floor().long(), b.ceil().long()
        # an atom landing exactly on a support point (lower == upper) gives it its whole mass
        w_lower = (upper.float() + (lower == upper).float() - b) * next_pmfs
        w_upper = (b - lower.float()) * next_pmfs
        out = torch.zeros_like(next_pmfs)
        out.scatter_add_(1, lower, w_lower)
        out.scatter_add_(1, upper, w_upper)
        return out


def symlog(x: torch.Tensor) -> torch.Tensor:
    """``sign(x) ln(1 + |x|)`` (Eq. 9), elementwise."""
    return torch.sign(x) * torch.log1p(x.abs())


def symexp(x: torch.Tensor) -> torch.Tensor:
    """``sign(x) (exp(|x|) - 1)``, the inverse of :func:`symlog` (Eq. 9), elementwise."""
    return torch.sign(x) * torch.expm1(x.abs())


def _two_hot_bins(y: torch.Tensor, bins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The lower bin's index ``k`` (int64) and the upper bin's weight ``w`` of ``y``'s two-hot
    encoding over ``bins`` (Eq. 10), each shaped as ``y``; ``y`` outside the bins clips to the end bins."""
    y = y.clamp(bins[0], bins[-1])
    k = (torch.searchsorted(bins, y.contiguous(), right=True) - 1).clamp(0, bins.numel() - 2)
    lo, hi = bins[k], bins[k + 1]
    return k, ((y - lo) / (hi - lo)).clamp(0.0, 1.0)


def two_hot(y: torch.Tensor, bins: torch.Tensor) -> torch.Tensor:
    """The two-hot encoding of ``y`` ``(...)`` over the sorted ``bins`` ``(K,)`` (Eq. 10): weight
    on the two bins around each value, in proportion to its nearness, ``(..., K)``; values outside
    the bins clip to the end bins."""
    k, w_hi = _two_hot_bins(y, bins)
    out = torch.zeros(*y.shape, bins.numel(), dtype=y.dtype, device=y.device)
    out.scatter_(-1, k[..., None], (1 - w_hi)[..., None])
    out.scatter_add_(-1, (k + 1)[..., None], w_hi[..., None])
    return out


def two_hot_log_likelihood(log_probs: torch.Tensor, y: torch.Tensor, bins: torch.Tensor) -> torch.Tensor:
    """``sum_k two_hot(y, bins)_k log_probs_k``, the negated two-hot cross-entropy of DreamerV3's
    reward and critic heads (Eq. 10), from the two bins around ``y`` alone: ``log_probs`` ``(..., K)``
    (a head's log-softmax), ``y`` ``(...)`` -> ``(...)``; equal to the dense form, without writing
    and multiplying the ``(..., K)`` encoding (a DreamerV3 ``mini`` update 1.02x, 333 -> 325 ms)."""
    k, w_hi = _two_hot_bins(y, bins)
    pair = log_probs.gather(-1, torch.stack([k, k + 1], -1))
    return (1 - w_hi) * pair[..., 0] + w_hi * pair[..., 1]


def two_hot_mean(logits: torch.Tensor, bins: torch.Tensor) -> torch.Tensor:
    """The value a two-hot head predicts: ``symexp(sum softmax(logits) * bins)``, ``(..., K) -> (...)``."""
    return symexp((torch.softmax(logits, -1) * bins).sum(-1))
