"""Asynchronous Advantage Actor-Critic (Mnih et al. 2016, "Asynchronous Methods for Deep
Reinforcement Learning", Algorithm S3): each actor computes the gradients of the advantage
actor-critic loss on its own rollout with its own copy of the weights, and pushes them to the
learner, which applies them and publishes new weights.

Written once, as a user writes it: the actor's :meth:`A3CWorker.gradients` returns a
``partial`` value (``@returns("partial", reduce="mean")``: each actor holds one part of a mean),
so msrl reduces it where it crosses to fewer replicas, whatever the distribution policy:

* ``single``: one actor, one learner in one process: nothing crosses (A2C's update, computed on
  the actor's copy).
* ``single_learner_coarse`` with N actor replicas: the N gradients are averaged by a ``reduce``
  boundary (in replica order: the same bits on every run) -- synchronous A3C, which is A2C
  over the N actors' rollouts.
* ``async_learner``: each actor pushes its gradients into a queue and pulls the newest weights
  without waiting for the learner (A3C's asynchrony, the Hogwild-free form TorchRL and
  mindrl's ``AsyncMultiActorSingleLearnerDP`` use): the learner applies the mean of one push
  per actor, computed with weights that lag its own; the lag is logged as
  ``async/policy_lag_mean``.

Loss (Algorithm S3, with SB3's A2C coefficients): ``-mean(A_t log pi(a_t|s_t)) + vf_coef *
mean((R_t - V(s_t))^2) - ent_coef * H``, ``A_t`` from GAE with ``lambda = 1`` (n-step returns
bootstrapped from the critic); RMSprop on the learner (the paper's shared RMSProp statistics
live there; torch's or TensorFlow's, ``optimizer``), the gradients clipped to ``max_grad_norm``
after the reduction.
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
    returns,
)
from msrl.rl.actors import ActorCriticActor
from msrl.rl.buffers import RolloutBuffer
from msrl.rl.losses import actor_critic_loss, rollout_next_values
from msrl.rl.networks import ACTION_SPACES, OBSERVATION_SPACES, ActorCritic, build_actor_critic
from msrl.rl.optim import RMSpropTF

__all__ = ["A3CConfig", "A3CWorker", "A3CLearner", "A3CTrainer", "ALGORITHM"]


@dataclasses.dataclass
class A3CConfig:
    """A3C's hyperparameters (the paper's ``t_max = 5`` rollouts and RMSProp; SB3's A2C values
    for the rest)."""

    num_steps: PositiveInt = 5
    """rollout length per env per iteration (the paper's t_max)"""
    learning_rate: PositiveFloat = 7e-4
    """RMSprop learning rate"""
    anneal_lr: bool = False
    """anneal the learning rate linearly to 0 over training (the paper: annealed to 0)"""
    gamma: UnitInterval = 0.99
    """discount factor"""
    gae_lambda: UnitInterval = 1.0
    """GAE lambda (1.0: the paper's n-step returns)"""
    ent_coef: NonNegativeFloat = 0.0
    """entropy bonus coefficient (the paper: 0.01 on Atari)"""
    vf_coef: NonNegativeFloat = 0.5
    """value loss coefficient"""
    max_grad_norm: PositiveFloat = 0.5
    """global gradient-norm clip, applied by the learner to the reduced gradients"""
    rms_prop_eps: PositiveFloat = 1e-5
    """RMSprop epsilon"""
    optimizer: Literal["rmsprop", "rmsprop_tf"] = "rmsprop"
    """the learner's RMSprop: ``rmsprop`` is torch's (``p -= lr g / (sqrt(v) + eps)``, the mean
    square ``v`` from 0); ``rmsprop_tf`` is TensorFlow's, which OpenAI Baselines' A2C and the A3C
    paper's implementations stepped with (``p -= lr g / sqrt(v + eps)``, ``v`` from 1:
    :class:`msrl.rl.optim.RMSpropTF`, Stable Baselines3's ``RMSpropTFLike``, which SB3 recommends
    for A2C on Atari). With eps 1e-5 and the small gradients of a CNN trunk (|g| ~ 1e-4), torch's
    steps every weight by about ``lr`` in the sign of its gradient; TensorFlow's by ``lr g / 3e-3``,
    ~30 times less"""
    norm_adv: bool = False
    """normalise the advantages of each rollout"""
    hidden_sizes: LayerSizes = (64, 64)
    """hidden layer widths of the actor and of the critic MLPs"""
    cnn: Literal["nature", "impala"] = "nature"
    """the trunk for uint8 frame observations"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)


class A3CWorker(ActorCriticActor):
    """An A3C actor-learner thread's half: acts with its copy of the actor-critic (as PPO's and
    A2C's actor) and computes the loss gradients of its own rollout with that copy."""

    def __init__(self, ctx: BuildContext) -> None:
        super().__init__(ctx)
        self.hp: A3CConfig = ctx.hparams
        self.names = [name for name, _ in self.net.named_parameters()]

    @returns("partial", "partial", reduce="mean")
    def gradients(self, batch: TensorDict) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The advantage actor-critic loss's gradients on one rollout, and its terms.

        Args:
            batch: TensorDict of batch size ``(T, N)`` with :attr:`~msrl.rl.buffers.RolloutBuffer.KEYS`.

        Returns:
            ``(gradients, losses)``: parameter name -> gradient (each of its parameter's shape,
            float32), and ``losses/policy_loss``, ``losses/value_loss``, ``losses/entropy`` (0-d).
            Both are ``partial``: crossing to the learner they are averaged over the actor
            replicas.

        Raises:
            FloatingPointError: the loss is NaN or infinite (on the CPU).
        """
        hp, net = self.hp, self.net
        with torch.enable_grad():
            # the rollout's values are this copy's (its weights change only after the push):
            # the critic runs only on the last row's next observations and truncated episodes' final ones
            loss, losses = actor_critic_loss(net, batch, gamma=hp.gamma, gae_lambda=hp.gae_lambda, norm_adv=hp.norm_adv,
                                             vf_coef=hp.vf_coef, ent_coef=hp.ent_coef,
                                             next_values=rollout_next_values(net, batch))
            if loss.device.type == "cpu" and not torch.isfinite(loss):
                raise FloatingPointError(f"loss is {loss.item()}; no gradients were pushed")
            grads = torch.autograd.grad(loss, list(net.parameters()))
        return dict(zip(self.names, grads)), losses


def _rmsprop(hp: A3CConfig, parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The learner's optimiser (``hp.optimizer``): torch's RMSprop, or TensorFlow's
    (:class:`msrl.rl.optim.RMSpropTF`); decay 0.99 for both."""
    if hp.optimizer == "rmsprop_tf":
        return RMSpropTF(parameters, lr=hp.learning_rate, alpha=0.99, eps=hp.rms_prop_eps)
    return torch.optim.RMSprop(parameters, lr=hp.learning_rate, alpha=0.99, eps=hp.rms_prop_eps, foreach=True)


class A3CLearner(Learner):
    """Applies pushed gradients: one RMSprop step per (reduced) push, clipped to ``max_grad_norm``."""

    def __init__(self, ctx: BuildContext) -> None:
        self.hp: A3CConfig = ctx.hparams
        self.net: ActorCritic = build_actor_critic(ctx)
        self.weights = ModuleWeights(self.net)
        self.names = [name for name, _ in self.net.named_parameters()]
        self.parameters = list(self.net.parameters())
        self.optimizer = _rmsprop(self.hp, self.parameters)
        self.num_iterations = max(1, ctx.total_env_steps // (self.hp.num_steps * ctx.total_num_envs))
        self.iteration = 0

    def apply(self, gradients: Mapping[str, torch.Tensor], losses: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """One optimiser step with ``gradients`` (parameter name -> gradient).

        Returns:
            ``losses`` and ``losses/grad_norm`` (0-d tensors), ``charts/learning_rate`` (float).

        Raises:
            KeyError: a parameter without a gradient.
            ValueError, FloatingPointError: as :meth:`~msrl.api.Learner.apply_gradient_values`.
        """
        hp = self.hp
        lr = hp.learning_rate * (1.0 - self.iteration / self.num_iterations) if hp.anneal_lr else hp.learning_rate
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.iteration += 1
        missing = [n for n in self.names if n not in gradients]
        if missing:
            raise KeyError(f"no gradient for parameter(s) {missing}")
        grad_norm = self.apply_gradient_values([gradients[n] for n in self.names], hp.max_grad_norm)
        return {**losses, "losses/grad_norm": grad_norm, "charts/learning_rate": lr}

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The actor-critic's state dict (detached tensors)."""
        return self.weights.get()

    def state_dict(self) -> dict[str, Any]:
        return {"net": self.net.state_dict(), "optimizer": self.optimizer.state_dict(), "iteration": self.iteration}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.iteration = int(state["iteration"])


class A3CTrainer(Trainer):
    """A3C's loop body: a rollout of ``num_steps`` steps, the actor's gradients pushed to the
    learner, one step there, the new weights to the actor."""

    def reset(self) -> None:
        """First observations, and the learner's initial weights to the actor."""
        self.obs = self.env.reset(seed=self.seed)
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, float]:
        """Rollout, gradients on the actor, a step on the learner, weight sync; returns the metrics."""
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
        gradients, losses = self.actor.gradients(trajectory)
        metrics = self.learner.apply(gradients, losses)
        self.actor.set_weights(self.learner.get_weights())
        return metrics


ALGORITHM = AlgorithmSpec(
    name="a3c",
    observation_spaces=OBSERVATION_SPACES,
    action_spaces=ACTION_SPACES,
    hparams=A3CConfig,
    trainer=A3CTrainer,
    components={"actor": A3CWorker, "buffer": RolloutBuffer, "learner": A3CLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: hp.num_steps * total_num_envs,
    policy_lag="tolerated",  # stale gradients are applied as they are (the paper's asynchrony)
)
