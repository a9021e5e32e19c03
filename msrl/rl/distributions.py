"""Categorical sampling and log-probabilities without host syncs (a GPU iteration stays on the
device), bitwise equal to ``torch.distributions.Categorical``'s and ``torch.multinomial``'s; and
epsilon-greedy action selection (DQN, C51)."""

from __future__ import annotations

import torch

__all__ = ["categorical_log_prob_entropy", "multi_categorical_log_prob_entropy", "sample_categorical",
           "sample_multi_categorical", "epsilon_greedy"]


def categorical_log_prob_entropy(logits: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``action`` and entropy of a Categorical over ``logits``.

    What ``torch.distributions.Categorical(logits=...)``'s ``log_prob``/``entropy`` compute (the
    entropy with log-probabilities clamped to the dtype's smallest finite value, so a zero
    probability adds 0, not NaN), without its argument validation and bookkeeping (less than
    half the time forward and backward: ``bench/results/startup.md``, "Figures behind the code").
    Log-probabilities come from ``log_softmax``, as :meth:`msrl.rl.actors.ActorCriticActor.act`
    computes them, so a rollout's and an update's agree bitwise.

    Args:
        logits: ``(B, n)`` float; action: ``(B,)`` int64 indices in ``[0, n)``.

    Returns:
        ``(log_prob, entropy)``, each ``(B,)``.
    """
    logp = torch.log_softmax(logits, dim=-1)
    log_prob = logp.gather(-1, action.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)
    return log_prob, entropy


def multi_categorical_log_prob_entropy(logits: torch.Tensor, nvec: tuple[int, ...],
                                      action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability and entropy of a MultiDiscrete ``action`` under independent Categoricals
    (one per component, CleanRL's ``ppo_multidiscrete.py``): each component's by
    :func:`categorical_log_prob_entropy`, summed.

    Args:
        logits: ``(B, sum(nvec))`` float, component ``j``'s ``nvec[j]`` logits in order;
            action: ``(B, k)`` int64, column ``j`` in ``[0, nvec[j])``.

    Returns:
        ``(log_prob, entropy)``, each ``(B,)``.
    """
    log_prob = entropy = None
    for j, lg in enumerate(logits.split(list(nvec), dim=-1)):
        lp, ent = categorical_log_prob_entropy(lg, action[:, j])
        log_prob = lp if log_prob is None else log_prob + lp
        entropy = ent if entropy is None else entropy + ent
    return log_prob, entropy


def sample_multi_categorical(logits: torch.Tensor, nvec: tuple[int, ...], generator: torch.Generator | None = None,
                             deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A MultiDiscrete action from independent Categoricals and its log-probability: each
    component drawn by :func:`sample_categorical` (the mode when ``deterministic``), in order.

    Args:
        logits: ``(B, sum(nvec))`` float; generator: the RNG to draw from.

    Returns:
        ``(action, log_prob)``: ``(B, k)`` int64 and ``(B,)`` float (the components' summed).
    """
    actions, log_prob = [], None
    for lg in logits.split(list(nvec), dim=-1):
        lp = torch.log_softmax(lg, dim=-1)
        a = lg.argmax(-1) if deterministic else sample_categorical(lp.exp(), generator)
        actions.append(a)
        one = lp.gather(-1, a.unsqueeze(-1)).squeeze(-1)
        log_prob = one if log_prob is None else log_prob + one
    return torch.stack(actions, dim=-1), log_prob


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of a Categorical over ``probs``: what ``torch.multinomial(probs, 1,
    generator=generator).squeeze(-1)`` returns, bitwise, with the same generator use.

    That is ATen's own single-sample path (``multinomial`` in ``aten/src/ATen/native/
    Distributions.cpp``: the exponential race ``argmax(p / q)``, ``q ~ Exp(1)``, equivalent to
    the Gumbel-max trick), without its argument checks -- two host syncs per call on a GPU and a
    tenth of an inference call on a CPU (``bench/results/startup.md``, "Figures behind the code").
    ``probs`` come from a softmax here, so
    the checks (no NaN, no negative entries, rows summing to more than 0) hold by construction;
    a NaN loss is caught where the weights are updated (:meth:`msrl.api.Learner.apply_gradients`).

    Args:
        probs: ``(B, n)`` float, non-negative rows with positive sums (need not be normalised).
        generator: the RNG to draw from (default: torch's global one).

    Returns:
        ``(B,)`` int64 indices in ``[0, n)``.
    """
    q = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / q).argmax(-1)


def epsilon_greedy(greedy: torch.Tensor, n_actions: int, epsilon: float | torch.Tensor,
                   generator: torch.Generator) -> torch.Tensor:
    """Epsilon-greedy exploration (Mnih et al. 2015): each env's greedy action, replaced by a
    uniformly random one with probability ``epsilon``.

    Args:
        greedy: ``(N,)`` int64, the greedy actions.
        n_actions: the Discrete action space's size.
        epsilon: in ``[0, 1]``; a float for every env, or ``(N,)`` float32, one per env (Ape-X).
        generator: the draws' RNG: ``N`` uniform draws, then ``N`` random actions, in that order.

    Returns:
        ``(N,)`` int64 actions, on ``greedy``'s device, without a host sync.
    """
    n = greedy.shape[0]
    explore = torch.rand(n, generator=generator, device=greedy.device) < epsilon
    random = torch.randint(n_actions, (n,), generator=generator, device=greedy.device)
    return torch.where(explore, random, greedy)
