"""PG: REINFORCE with a learned baseline (Williams 1992, "Simple Statistical Gradient-Following
Algorithms for Connectionist Reinforcement Learning"; Sutton and Barto 2018, "Reinforcement
Learning: An Introduction", Section 13.4, "REINFORCE with Baseline"): the Monte Carlo return of
every step to its episode's end, less the critic's ``V(s_t)``, weights the step's
log-probability; the critic regresses on the same returns. One gradient step per rollout.

msrl's loop collects fixed-length rollouts (``num_steps`` steps of every env), not whole
episodes, so the learner uses the steps whose episode ends inside the rollout -- their returns
are exact Monte Carlo returns -- and leaves out of the loss the steps of each env's last
episode, which the rollout cuts before its end (their return is unknown). Those steps are not
bootstrapped from the critic: that would make the update A2C's with ``lambda = 1``, which
:mod:`msrl.algorithms.a2c` is. An episode the rollout cuts goes on in the next rollout, whose
steps of it are used once it ends. Choose ``num_steps`` at least the env's episode limit
(CartPole-v1: 500), else an episode longer than a rollout contributes only its tail;
``charts/used_fraction`` logs the share of the rollout's steps the loss used.

An episode that ends by truncation (a time limit, ``truncated``) is bootstrapped from the
critic's value of its final observation (Pardo et al. 2018, "Time Limits in Reinforcement
Learning"): the time limit is not part of the task. Without a baseline (``baseline: false``) the
return is the discounted sum of the rewards seen.

The actor-critic network, its rollout actor and the rollout buffer are :mod:`msrl.rl`'s (as
A2C's); this file holds PG's hyperparameters, learner and loop body.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

import torch
from tensordict import TensorDict

from msrl.advantages import gae
from msrl.api import (
    AlgorithmSpec,
    BuildContext,
    LayerSizes,
    Learner,
    ModuleWeights,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    Trainer,
    UnitInterval,
)
from msrl.rl.actors import ActorCriticActor
from msrl.rl.buffers import RolloutBuffer
from msrl.rl.networks import ACTION_SPACES, OBSERVATION_SPACES, ActorCritic, build_actor_critic

__all__ = ["PGConfig", "PGLearner", "PGTrainer", "ALGORITHM", "finished_episode_mask", "reinforce_loss"]


@dataclasses.dataclass
class PGConfig:
    """PG's hyperparameters (REINFORCE with a learned baseline; the defaults solve CartPole-v1)."""

    num_steps: PositiveInt = 500
    """rollout length per env per iteration (T); at least the env's episode limit (see the module)"""
    learning_rate: PositiveFloat = 5e-3
    """Adam learning rate"""
    gamma: UnitInterval = 0.99
    """discount factor"""
    baseline: bool = True
    """subtract the critic's ``V(s_t)`` from the return (REINFORCE with baseline) and train the critic"""
    norm_adv: bool = True
    """normalise the weights ``G_t - V(s_t)`` over the steps the loss uses"""
    ent_coef: NonNegativeFloat = 0.0
    """entropy bonus coefficient"""
    vf_coef: NonNegativeFloat = 0.5
    """the critic's loss coefficient"""
    max_grad_norm: PositiveFloat = 10.0
    """global gradient-norm clip (at A2C's 0.5 the critic's early gradients, on returns of up to
    ~100, dominate the clipped norm and CartPole takes ~1.3x the env steps to 475)"""
    hidden_sizes: LayerSizes = (64, 64)
    """hidden layer widths of the actor and of the critic MLPs"""
    cnn: Literal["nature", "impala"] = "nature"
    """the trunk for uint8 frame observations: the Nature CNN (Mnih et al. 2015) or IMPALA's
    residual network (Espeholt et al. 2018, Figure 3)"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)


def finished_episode_mask(terminated: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Which steps of a rollout belong to an episode that ends inside it: step ``t`` of env ``n``
    does when some ``t' >= t`` ended its episode (``terminated or truncated``).

    Args:
        terminated, truncated: ``(T, N)`` bool.

    Returns:
        ``(T, N)`` bool: ``mask[t, n] = any(done[t:, n])``.

    Raises:
        ValueError: the shapes differ or are not 2-D.
    """
    if terminated.shape != truncated.shape or terminated.dim() != 2:
        raise ValueError(f"finished_episode_mask: expects two (T, N) tensors, got {tuple(terminated.shape)} and "
                         f"{tuple(truncated.shape)}")
    done = torch.logical_or(terminated, truncated)
    return done.flip(0).cummax(0).values.flip(0)


def reinforce_loss(net: ActorCritic, batch: TensorDict, *, gamma: float, baseline: bool, norm_adv: bool,
                   vf_coef: float, ent_coef: float) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """REINFORCE's loss on the finished episodes of a rollout (Sutton and Barto 2018, Section 13.4)::

        G_t  = r_t + gamma * G_{t+1} * (1 - done_t)   (+ gamma * V(s'_t) where step t was truncated)
        A_t  = G_t - V(s_t)                             (G_t without a baseline)
        loss = -sum_m(A_t * log pi(a_t|s_t)) / |m| + vf_coef * sum_m((G_t - V(s_t))^2) / |m|
               - ent_coef * sum_m(H_t) / |m|

    where ``sum_m`` runs over the steps whose episode ends inside the rollout
    (:func:`finished_episode_mask`); ``A_t`` is a constant (no gradient through the baseline).

    Args:
        net: the actor-critic (``evaluate(obs, action) -> (log_prob, entropy, value)``, each ``(B,)``).
        batch: a TensorDict of batch size ``(T, N)`` with ``obs``, ``action``, ``reward`` float32,
            ``next_obs`` (the final observation where an episode ended), ``terminated`` and
            ``truncated`` bool (:class:`~msrl.rl.buffers.RolloutBuffer`).
        gamma: the discount; baseline, norm_adv, vf_coef, ent_coef: :class:`PGConfig`'s.

    Returns:
        ``(loss, terms, used)``: the 0-d loss (differentiable in ``net``'s parameters; 0 with no
        gradient when no episode ended in the rollout), ``losses/policy_loss``,
        ``losses/value_loss``, ``losses/entropy`` (detached), and ``used``, the 0-d int64 number
        of steps the loss used.
    """
    T, N = batch.batch_size
    terminated, truncated = batch["terminated"], batch["truncated"]
    mask = finished_episode_mask(terminated, truncated).flatten()
    used = mask.sum()
    weight = mask.to(batch["reward"].dtype) / used.clamp(min=1)
    zeros = torch.zeros_like(batch["reward"])
    with torch.no_grad():
        bootstrap = zeros
        if baseline:  # V(s') of the truncated steps' final observations, 0 elsewhere
            bootstrap = net.value(batch["next_obs"].flatten(0, 1)).view(T, N) * truncated.to(zeros.dtype)
        # GAE with lambda = 1 and V = 0 is the discounted return to the episode's end: G_t
        returns, _ = gae(batch["reward"], zeros, bootstrap, terminated, truncated, gamma, 1.0)
    returns = returns.flatten()
    log_prob, entropy, value = net.evaluate(batch["obs"].flatten(0, 1), batch["action"].flatten(0, 1))
    advantages = returns - value.detach() if baseline else returns
    if norm_adv:
        mean = (advantages * weight).sum()
        var = ((advantages - mean) ** 2 * weight).sum() * (used / (used - 1).clamp(min=1))
        advantages = (advantages - mean) / (var.sqrt() + 1e-8)
    pg_loss = -(advantages * log_prob * weight).sum()
    v_loss = ((returns - value) ** 2 * weight).sum() if baseline else torch.zeros((), dtype=value.dtype)
    entropy_loss = (entropy * weight).sum()
    loss = pg_loss + vf_coef * v_loss - ent_coef * entropy_loss
    terms = {"losses/policy_loss": pg_loss.detach(), "losses/value_loss": v_loss.detach(),
             "losses/entropy": entropy_loss.detach()}
    return loss, terms, used


class PGLearner(Learner):
    """One Adam step per ``(T, N)`` rollout on :func:`reinforce_loss`.

    A rollout in which no episode ends gives a zero gradient, and the step is still taken (its
    moments move Adam's weights a little): skipping it would read the count on the host (a sync
    on a GPU) and, under ``multi_learner``, leave the other replicas waiting in their gradient
    all-reduce. ``num_steps`` at least the env's episode limit rules such rollouts out;
    ``charts/used_fraction`` shows them.
    """

    def __init__(self, ctx: BuildContext) -> None:
        self.hp: PGConfig = ctx.hparams
        self.net: ActorCritic = build_actor_critic(ctx)
        self.weights = ModuleWeights(self.net)
        self.parameters = list(self.net.parameters())
        self.optimizer = torch.optim.Adam(self.parameters, lr=self.hp.learning_rate, eps=1e-5)

    def learn(self, batch: TensorDict) -> dict[str, Any]:
        """One update on a rollout.

        Args:
            batch: TensorDict of batch size ``(T, N)`` with :attr:`~msrl.rl.buffers.RolloutBuffer.KEYS`.

        Returns:
            ``losses/policy_loss``, ``losses/value_loss``, ``losses/entropy``, ``losses/grad_norm``
            and ``charts/used_fraction`` (the share of the rollout's steps whose episode ended in
            it), each a 0-d tensor: nothing is read back to the host.

        Raises:
            FloatingPointError: the loss is NaN or infinite (no step is taken).
        """
        hp = self.hp
        loss, terms, used = reinforce_loss(self.net, batch, gamma=hp.gamma, baseline=hp.baseline, norm_adv=hp.norm_adv,
                                           vf_coef=hp.vf_coef, ent_coef=hp.ent_coef)
        grad_norm = self.apply_gradients(loss, hp.max_grad_norm)
        return {**terms, "losses/grad_norm": grad_norm, "charts/used_fraction": used / batch.batch_size.numel()}

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The actor-critic's state dict (detached tensors)."""
        return self.weights.get()

    def state_dict(self) -> dict[str, Any]:
        return {"net": self.net.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])


class PGTrainer(Trainer):
    """PG's loop body: a rollout of ``num_steps`` steps, one learner update, weight sync."""

    def reset(self) -> None:
        """First observations, and the learner's initial weights to the actor."""
        self.obs = self.env.reset(seed=self.seed)
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, float]:
        """Rollout of ``num_steps`` steps, one learner update, weight sync; returns the metrics."""
        for _step in range(self.hparams.num_steps):
            action, log_prob, value = self.actor.act(self.obs)
            next_obs, reward, terminated, truncated, info = self.env.step(action)
            self.buffer.insert(
                obs=self.obs,
                action=action,
                log_prob=log_prob,
                value=value,
                reward=reward,
                terminated=terminated,
                truncated=truncated,
                next_obs=info["final_obs"],
            )
            self.obs = next_obs
        trajectory = self.buffer.gather()
        metrics = self.learner.learn(trajectory)
        self.actor.set_weights(self.learner.get_weights())
        return metrics


ALGORITHM = AlgorithmSpec(
    name="pg",
    observation_spaces=OBSERVATION_SPACES,
    action_spaces=ACTION_SPACES,
    hparams=PGConfig,
    trainer=PGTrainer,
    components={"actor": ActorCriticActor, "buffer": RolloutBuffer, "learner": PGLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: hp.num_steps * total_num_envs,
    policy_lag="uncorrected",  # its gradient assumes the learner's own policy acted
)
