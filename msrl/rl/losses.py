"""Policy-gradient losses and the minibatch plumbing of epoch-based updates, written once for
the algorithms that use them (PPO, MA-PPO and MAPPO update with :func:`ppo_epochs` over
:func:`ppo_loss`; A2C steps on :func:`actor_critic_loss` and A3C's actors push its gradients),
as rlax shares losses between Acme's agents. Each returns 0-d
tensors on its inputs' device: nothing is read back to the host.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from msrl.advantages import gae

__all__ = ["clipped_surrogate_loss", "clipped_value_loss", "normalize_advantages", "actor_critic_loss",
           "rollout_next_values", "ppo_loss", "ppo_epochs", "explained_variance", "shuffled_minibatches"]


def normalize_advantages(advantages: torch.Tensor) -> torch.Tensor:
    """``(A - mean(A)) / (std(A) + 1e-8)`` over all of ``advantages`` (CleanRL's and SB3's
    per-minibatch normalisation); a single advantage is returned as it is (its std is NaN)."""
    if advantages.numel() <= 1:
        return advantages
    return (advantages - advantages.mean()) / (advantages.std() + 1e-8)


def rollout_next_values(net: Any, batch: Any) -> torch.Tensor:
    """``V(s'_t)`` for a rollout whose ``value`` column was computed with ``net``'s current
    weights (an A3C actor's: its copy does not change between acting and taking the gradients).

    ``s'_t`` is ``s_{t+1}`` wherever step ``t`` did not end its episode, so ``V(s'_t)`` is the
    rollout's own ``value[t + 1]`` there; the critic runs only on the last row's next
    observations ``(N, *obs_shape)`` and on the final observations of episodes truncated before
    the last row (bootstrapped from, :func:`~msrl.advantages.gae`). A terminated row keeps
    ``value[t + 1]`` (the reset observation's), which GAE multiplies by 0. The same values as
    ``net.value(next_obs)`` over all ``T * N`` rows to float rounding (the critic's batch differs),
    at a ``1 / T`` of its cost: what SB3's A2C bootstraps with.

    Args:
        net: an actor-critic with ``value(obs) -> (B,)``.
        batch: a TensorDict of batch size ``(T, N)`` with ``value`` ``(T, N)`` float32,
            ``next_obs`` ``(T, N, *obs_shape)`` and ``truncated`` ``(T, N)`` bool.

    Returns:
        ``(T, N)`` float32, without autograd history.

    Note:
        The truncated rows are found on the host (one read of a ``(T - 1, N)`` bool): on a CUDA
        device, where that read is a sync, the critic runs on all ``T * N`` next observations.
    """
    T, N = batch.batch_size
    with torch.no_grad():
        if batch["value"].device.type != "cpu":
            return net.value(batch["next_obs"].flatten(0, 1)).view(T, N)
        next_values = torch.cat([batch["value"][1:], net.value(batch["next_obs"][-1]).view(1, N)])
        truncated = batch["truncated"][:-1]
        if bool(truncated.any()):
            rows = truncated.nonzero(as_tuple=True)
            next_values[rows] = net.value(batch["next_obs"][:-1][rows])
    return next_values


def actor_critic_loss(net: Any, batch: Any, *, gamma: float, gae_lambda: float, norm_adv: bool, vf_coef: float,
                      ent_coef: float, next_values: torch.Tensor | None = None,
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The advantage actor-critic loss of one rollout (Mnih et al. 2016, "Asynchronous Methods for
    Deep Reinforcement Learning", Algorithm S3, with GAE's advantages, Schulman et al. 2016)::

        loss = -mean(A_t * log pi(a_t|s_t)) + vf_coef * mean((R_t - V(s_t))^2) - ent_coef * mean(H)

    the loss A2C's learner steps on and A3C's actors take the gradients of.

    Args:
        net: an actor-critic with ``value(obs) -> (B,)`` and ``evaluate(obs, action) ->
            (log_prob, entropy, value)``, each ``(B,)``.
        batch: a TensorDict of batch size ``(T, N)`` with ``obs``, ``action``, ``reward``,
            ``value``, ``next_obs``, ``terminated``, ``truncated`` (:class:`~msrl.rl.buffers.RolloutBuffer`).
        gamma, gae_lambda: GAE's; norm_adv: :func:`normalize_advantages` over the rollout;
        vf_coef, ent_coef: the value loss's and the entropy bonus's weights.
        next_values: ``V(s'_t)`` ``(T, N)`` when the caller has them (:func:`rollout_next_values`);
            ``None``: the critic runs on ``next_obs``.

    Returns:
        ``(loss, terms)``: the 0-d loss (differentiable in ``net``'s parameters) and
        ``losses/policy_loss``, ``losses/value_loss``, ``losses/entropy`` (detached).
    """
    T, N = batch.batch_size
    if next_values is None:
        with torch.no_grad():
            next_values = net.value(batch["next_obs"].flatten(0, 1)).view(T, N)
    advantages, returns = gae(batch["reward"], batch["value"], next_values, batch["terminated"], batch["truncated"], gamma,
                              gae_lambda)
    b_adv = normalize_advantages(advantages.flatten()) if norm_adv else advantages.flatten()
    log_prob, entropy, value = net.evaluate(batch["obs"].flatten(0, 1), batch["action"].flatten(0, 1))
    pg_loss = -(b_adv * log_prob).mean()
    v_loss = ((returns.flatten() - value) ** 2).mean()
    entropy_loss = entropy.mean()
    loss = pg_loss + vf_coef * v_loss - ent_coef * entropy_loss
    return loss, {"losses/policy_loss": pg_loss.detach(), "losses/value_loss": v_loss.detach(),
                  "losses/entropy": entropy_loss.detach()}


def clipped_surrogate_loss(advantages: torch.Tensor, ratio: torch.Tensor, clip: torch.Tensor | float) -> torch.Tensor:
    """PPO's clipped surrogate objective as a loss (Schulman et al. 2017, Eq. 7, negated):
    ``mean(max(-A r, -A clamp(r, 1 - clip, 1 + clip)))`` for advantages and probability ratios
    ``r = pi(a|s) / pi_old(a|s)`` of the same shape."""
    return torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip, 1 + clip)).mean()


def clipped_value_loss(value: torch.Tensor, old_value: torch.Tensor, returns: torch.Tensor,
                       clip: torch.Tensor | float | None) -> torch.Tensor:
    """``0.5 mean((V - R)^2)``, or with ``clip`` the pessimistic clipped form of OpenAI baselines'
    PPO2 (CleanRL's ``clip_vloss``): ``0.5 mean(max((V - R)^2, (V_old + clamp(V - V_old, -clip,
    clip) - R)^2))``. All ``(B,)``."""
    if clip is None:
        return 0.5 * ((value - returns) ** 2).mean()
    unclipped = (value - returns) ** 2
    clipped = old_value + torch.clamp(value - old_value, -clip, clip)
    return 0.5 * torch.max(unclipped, (clipped - returns) ** 2).mean()


def ppo_loss(new_log_prob: torch.Tensor, entropy: torch.Tensor, new_value: torch.Tensor, old_log_prob: torch.Tensor,
             old_value: torch.Tensor, advantages: torch.Tensor, returns: torch.Tensor, clip: torch.Tensor | float, *,
             norm_adv: bool, clip_vloss: bool, ent_coef: float, vf_coef: float,
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's loss on one minibatch (Schulman et al. 2017, Eq. 9 with the clipped surrogate of
    Eq. 7; CleanRL ``ppo.py``): ``L = L_clip - ent_coef * H + vf_coef * L_V``.

    Args:
        new_log_prob, entropy, new_value: ``(b,)`` under the current networks (with gradients).
        old_log_prob, old_value, advantages, returns: ``(b,)`` from the rollout.
        clip: the clipping coefficient (a float or a 0-d tensor); norm_adv: normalise the
        minibatch's advantages; clip_vloss: the clipped value loss; ent_coef, vf_coef: weights.

    Returns:
        ``(loss, metrics)``: the scalar loss, and 0-d tensors ``losses/value_loss``,
        ``losses/policy_loss``, ``losses/entropy``, ``losses/old_approx_kl``,
        ``losses/approx_kl`` (Schulman's k3 estimator, ``(r - 1) - log r``) and
        ``losses/clipfrac`` (the fraction of ratios outside ``1 +- clip``), detached.
    """
    logratio = new_log_prob - old_log_prob
    ratio = logratio.exp()
    with torch.no_grad():
        old_approx_kl = (-logratio).mean()
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > clip).float().mean()
    adv = normalize_advantages(advantages) if norm_adv else advantages
    pg_loss = clipped_surrogate_loss(adv, ratio, clip)
    v_loss = clipped_value_loss(new_value, old_value, returns, clip if clip_vloss else None)
    entropy_loss = entropy.mean()
    loss = pg_loss - ent_coef * entropy_loss + v_loss * vf_coef
    return loss, {"losses/value_loss": v_loss.detach(), "losses/policy_loss": pg_loss.detach(),
                  "losses/entropy": entropy_loss.detach(), "losses/old_approx_kl": old_approx_kl,
                  "losses/approx_kl": approx_kl, "losses/clipfrac": clipfrac}


def explained_variance(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``1 - Var(target - predicted) / Var(target)`` (NaN where the target does not vary), a 0-d
    tensor: how much of the returns' variance the value function explains."""
    var_y = torch.var(target)
    return torch.where(var_y == 0, float("nan"), 1 - torch.var(target - predicted) / var_y)


def shuffled_minibatches(batch_size: int, num_minibatches: int, generator: torch.Generator,
                         device: torch.device) -> Iterator[torch.Tensor]:
    """One epoch's minibatches: a permutation of ``range(batch_size)`` drawn from ``generator``,
    cut into ``num_minibatches`` index tensors of ``batch_size // num_minibatches`` (at least 1)
    each, int64 on ``device``; a remainder of the permutation is left out (CleanRL's loop)."""
    minibatch_size = max(1, batch_size // num_minibatches)
    perm = torch.randperm(batch_size, generator=generator, device=device)
    for start in range(0, batch_size - minibatch_size + 1, minibatch_size):
        yield perm[start:start + minibatch_size]


def ppo_epochs(evaluate: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
               b_logprobs: torch.Tensor, b_values: torch.Tensor, b_advantages: torch.Tensor, b_returns: torch.Tensor,
               clip: torch.Tensor | float, *, step: Callable[[torch.Tensor], torch.Tensor], generator: torch.Generator,
               update_epochs: int, num_minibatches: int, norm_adv: bool, clip_vloss: bool, ent_coef: float,
               vf_coef: float, target_kl: float | None, loss: Callable[..., Any] = ppo_loss) -> dict[str, Any]:
    """PPO's update loop (CleanRL ``ppo.py``, "Optimizing the policy and value network"):
    ``update_epochs`` epochs of :func:`shuffled_minibatches` of the batch's rows, one gradient
    step on :func:`ppo_loss` each, stopping after an epoch whose last approximate KL exceeds
    ``target_kl`` (the one host read of the update).

    Args:
        evaluate: row indices ``(b,)`` -> ``(log_prob, entropy, value)`` under the current
            networks, each ``(b,)`` or ``(b, G)`` (flattened: MAPPO's rows are env-steps of
            ``G`` agents).
        b_logprobs, b_values, b_advantages, b_returns: ``(B,)`` or ``(B, G)`` from the rollout.
        clip: the clipping coefficient (a float or a 0-d tensor).
        step: takes one gradient step on a loss, returns the gradient norm (a learner's
            ``apply_gradients`` with its ``max_grad_norm``).
        generator: draws the minibatches' permutations.
        update_epochs, num_minibatches, norm_adv, clip_vloss, ent_coef, vf_coef, target_kl:
            PPO's hyperparameters of those names.
        loss: :func:`ppo_loss` or a callable of its signature (a learner's compiled form of it,
            :mod:`msrl.runtime.programs.compiled`).

    Returns:
        :func:`ppo_loss`'s metrics of the last minibatch with ``losses/grad_norm``, then
        ``losses/explained_variance`` and ``losses/clipfrac`` (the mean over minibatches).
    """
    clipfrac_sum = torch.zeros((), device=b_logprobs.device)
    n_minibatches = 0
    stats: dict[str, Any] = {}
    for _epoch in range(update_epochs):
        for mb in shuffled_minibatches(b_logprobs.shape[0], num_minibatches, generator, b_logprobs.device):
            newlogprob, entropy, newvalue = (x.flatten() for x in evaluate(mb))
            value, stats = loss(newlogprob, entropy, newvalue, b_logprobs[mb].flatten(), b_values[mb].flatten(),
                                b_advantages[mb].flatten(), b_returns[mb].flatten(), clip, norm_adv=norm_adv,
                                clip_vloss=clip_vloss, ent_coef=ent_coef, vf_coef=vf_coef)
            clipfrac_sum += stats.pop("losses/clipfrac")
            n_minibatches += 1
            stats["losses/grad_norm"] = step(value)
        if target_kl is not None and stats["losses/approx_kl"] > target_kl:
            break
    stats["losses/explained_variance"] = explained_variance(b_values, b_returns)
    stats["losses/clipfrac"] = clipfrac_sum / max(n_minibatches, 1)
    return stats
