"""Advantage Actor-Critic (Mnih et al. 2016, "Asynchronous Methods for Deep Reinforcement
Learning", Algorithm S3, in its synchronous form), as Stable-Baselines3's ``A2C`` writes it:
short rollouts of every env, n-step returns bootstrapped from the critic (GAE with
``lambda = 1``), one RMSprop step on policy loss, value loss and entropy bonus per rollout.

The actor-critic network, its rollout actor and the rollout buffer are :mod:`msrl.rl`'s (as
PPO's and IMPALA's); this file holds A2C's hyperparameters, learner and loop body.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

import torch
from tensordict import TensorDict

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
from msrl.rl.losses import actor_critic_loss
from msrl.rl.networks import ACTION_SPACES, OBSERVATION_SPACES, ActorCritic, build_actor_critic

__all__ = ["A2CConfig", "A2CLearner", "A2CTrainer", "ALGORITHM"]


@dataclasses.dataclass
class A2CConfig:
    """A2C's hyperparameters (SB3's defaults, rl-zoo's CartPole-v1 setting)."""

    num_steps: PositiveInt = 5
    """rollout length per env per iteration (T)"""
    learning_rate: PositiveFloat = 7e-4
    """RMSprop learning rate"""
    anneal_lr: bool = False
    """anneal the learning rate linearly to 0 over training"""
    gamma: UnitInterval = 0.99
    """discount factor"""
    gae_lambda: UnitInterval = 1.0
    """GAE lambda (1.0: n-step returns)"""
    ent_coef: NonNegativeFloat = 0.0
    """entropy bonus coefficient"""
    vf_coef: NonNegativeFloat = 0.5
    """value loss coefficient"""
    max_grad_norm: PositiveFloat = 0.5
    """global gradient-norm clip"""
    rms_prop_eps: PositiveFloat = 1e-5
    """RMSprop epsilon (SB3's; TensorFlow's RMSprop puts it inside the square root)"""
    norm_adv: bool = False
    """normalise the advantages of each rollout"""
    hidden_sizes: LayerSizes = (64, 64)
    """hidden layer widths of the actor and of the critic MLPs"""
    cnn: Literal["nature", "impala"] = "nature"
    """the trunk for uint8 frame observations: the Nature CNN (Mnih et al. 2015) or IMPALA's
    residual network (Espeholt et al. 2018, Figure 3)"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)


class A2CLearner(Learner):
    """One gradient step per ``(T, N)`` rollout::

        A_t   = GAE(r, V, lambda)                    (n-step advantage for lambda = 1)
        loss  = -mean(A_t * log pi(a_t|s_t)) + vf_coef * mean((R_t - V(s_t))^2) - ent_coef * H
    """

    def __init__(self, ctx: BuildContext) -> None:
        self.hp: A2CConfig = ctx.hparams
        self.net: ActorCritic = build_actor_critic(ctx)
        self.weights = ModuleWeights(self.net)
        self.parameters = list(self.net.parameters())
        # foreach: one kernel per operation over all tensors (the same update as SB3's
        # per-tensor loop, to rounding; ~75 us less per update on one CPU thread)
        self.optimizer = torch.optim.RMSprop(self.parameters, lr=self.hp.learning_rate, alpha=0.99, eps=self.hp.rms_prop_eps,
                                             foreach=True)
        self.num_iterations = max(1, ctx.total_env_steps // (self.hp.num_steps * ctx.total_num_envs))
        self.iteration = 0

    def learn(self, batch: TensorDict) -> dict[str, Any]:
        """One update on a rollout.

        Args:
            batch: TensorDict of batch size ``(T, N)`` with :attr:`~msrl.rl.buffers.RolloutBuffer.KEYS`.

        Returns:
            ``losses/policy_loss``, ``losses/value_loss``, ``losses/entropy``,
            ``losses/grad_norm`` (0-d tensors) and ``charts/learning_rate`` (float).

        Raises:
            FloatingPointError: the loss is NaN or infinite (no step is taken).
        """
        hp, net = self.hp, self.net
        lr = hp.learning_rate * (1.0 - self.iteration / self.num_iterations) if hp.anneal_lr else hp.learning_rate
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.iteration += 1
        loss, terms = actor_critic_loss(net, batch, gamma=hp.gamma, gae_lambda=hp.gae_lambda, norm_adv=hp.norm_adv,
                                        vf_coef=hp.vf_coef, ent_coef=hp.ent_coef)
        grad_norm = self.apply_gradients(loss, hp.max_grad_norm)
        return {**terms, "losses/grad_norm": grad_norm, "charts/learning_rate": lr}

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The actor-critic's state dict (detached tensors)."""
        return self.weights.get()

    def state_dict(self) -> dict[str, Any]:
        return {"net": self.net.state_dict(), "optimizer": self.optimizer.state_dict(), "iteration": self.iteration}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.iteration = int(state["iteration"])


class A2CTrainer(Trainer):
    """A2C's loop body: a rollout of ``num_steps`` steps, one learner update, weight sync."""

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
    name="a2c",
    observation_spaces=OBSERVATION_SPACES,
    action_spaces=ACTION_SPACES,
    hparams=A2CConfig,
    trainer=A2CTrainer,
    components={"actor": ActorCriticActor, "buffer": RolloutBuffer, "learner": A2CLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: hp.num_steps * total_num_envs,
    policy_lag="uncorrected",  # its gradient assumes the learner's own policy acted
)
