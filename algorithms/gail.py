"""GAIL: generative adversarial imitation learning with a PPO generator (Ho & Ermon 2016,
"Generative Adversarial Imitation Learning", arXiv:1606.03476, Algorithm 1).

A discriminator ``D(s, a)`` learns to tell an expert's state-action pairs (a Minari dataset:
the config's ``dataset:``, e.g. one ``msrl collect`` wrote from a trained policy) from the
policy's, by logistic regression; the policy is PPO (msrl's actor-critic actor, rollout buffer
and PPO losses, :mod:`msrl.rl`) on the reward ``-log(1 - D(s, a))`` in place of the env's, which
it never sees (the training curves still report the env's returns: how well it imitates). Both learners
sit in the ``learner`` role and run in the same loop: each iteration, a rollout, then
``discriminator_updates`` steps of the discriminator on the rollout against as many expert pairs,
then PPO's update on the discriminator's reward. Under ``multi_learner`` each replica reads its
shard of the demonstrations and both optimisers' gradients are all-reduced.

Read top to bottom: hyperparameters (PPO's and the discriminator's), the discriminator, the
learner (the discriminator's steps, then PPO's update), the trainer (PPO's loop), the declaration.

    msrl train configs/gail_cartpole.yaml
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import gymnasium
import numpy as np
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

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
from msrl.normalization import RewardScaler
from msrl.rl.actors import ActorCriticActor
from msrl.rl.buffers import RolloutBuffer
from msrl.rl.datasets import read_shard
from msrl.rl.losses import ppo_epochs, ppo_loss
from msrl.rl.networks import build_actor_critic, mlp
from msrl.rl.schedules import anneal_learning_rate, learning_rate_tensor, load_learning_rate

__all__ = ["GAILConfig", "Discriminator", "GAILLearner", "GAILTrainer", "ALGORITHM"]


@dataclasses.dataclass
class GAILConfig:
    """The PPO generator's hyperparameters (PPO's names and CleanRL's defaults) and the discriminator's."""

    num_steps: PositiveInt = 128
    """rollout length per env per iteration (T)"""
    learning_rate: PositiveFloat = 2.5e-4
    """the policy's Adam learning rate at the start of training"""
    anneal_lr: bool = True
    """anneal the policy's learning rate linearly to 0 over training"""
    gamma: UnitInterval = 0.99
    """discount factor"""
    gae_lambda: UnitInterval = 0.95
    """GAE lambda"""
    num_minibatches: PositiveInt = 4
    """PPO minibatches per epoch"""
    update_epochs: PositiveInt = 4
    """PPO epochs over each rollout"""
    norm_adv: bool = True
    """normalise advantages per minibatch"""
    clip_coef: PositiveFloat = 0.2
    """surrogate clipping coefficient"""
    anneal_clip: bool = False
    """anneal the clipping coefficient linearly to 0"""
    clip_vloss: bool = True
    """clip the value loss around the rollout's values"""
    ent_coef: NonNegativeFloat = 0.01
    """entropy bonus coefficient"""
    vf_coef: NonNegativeFloat = 0.5
    """value loss coefficient"""
    max_grad_norm: PositiveFloat = 0.5
    """global gradient-norm clip of the policy's step"""
    target_kl: PositiveFloat | None = None
    """stop PPO's epochs of an iteration early when the approximate KL exceeds this"""
    hidden_sizes: LayerSizes = (64, 64)
    """hidden layer widths of the actor and of the critic MLPs"""
    normalize_obs: bool = False
    """feed the policy's networks observations normalized by their running mean and std (as
    PPO's ``normalize_obs``: statistics in the network, updated after each update from the
    rollout; the discriminator reads raw observations)"""
    obs_clip: PositiveFloat = 10.0
    """clip normalized observations to [-obs_clip, obs_clip]"""
    normalize_reward: bool = False
    """scale the discriminator's rewards by the running std of their discounted return before GAE
    (PPO's ``normalize_reward``, gymnasium's NormalizeReward, statistics all-reduced over learner
    replicas)"""
    reward_clip: PositiveFloat = 10.0
    """clip scaled rewards to [-reward_clip, reward_clip]"""
    discriminator_lr: PositiveFloat = 3e-4
    """Adam learning rate of the discriminator"""
    discriminator_updates: PositiveInt = 4
    """discriminator steps an iteration, each on the whole rollout against as many expert pairs"""
    discriminator_hidden_sizes: LayerSizes = (64, 64)
    """hidden layer widths of the discriminator (tanh)"""
    gradient_penalty: NonNegativeFloat = 0.0
    """weight of the discriminator's gradient penalty ``(||grad f(x)|| - 1)^2`` at points
    interpolated between expert and policy pairs (Gulrajani et al. 2017, Eq. 3, as Kostrikov et al.
    2019, "Discriminator-Actor-Critic", Section 4.3, use it for GAIL); 0: none"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)
        self.discriminator_hidden_sizes = tuple(self.discriminator_hidden_sizes)


class Discriminator(nn.Module):
    """``D(s, a) = sigmoid(f(s, a))``, the probability that ``(s, a)`` is the expert's: a tanh MLP
    on the flattened observation and the action (one-hot for Discrete, the vector for Box).

    Raises:
        ValueError: an action space other than Discrete and Box.
    """

    def __init__(self, observation_space: gymnasium.Space, action_space: gymnasium.Space, hidden: tuple[int, ...]) -> None:
        super().__init__()
        if isinstance(action_space, gymnasium.spaces.Discrete):
            self.n_actions, width = int(action_space.n), int(action_space.n)
        elif isinstance(action_space, gymnasium.spaces.Box):
            self.n_actions, width = None, int(np.prod(action_space.shape))
        else:
            raise ValueError(f"GAIL's discriminator reads Discrete or Box actions, got {action_space}")
        self.net = mlp(int(np.prod(observation_space.shape)) + width, hidden, 1, out_std=1.0)

    def inputs(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """The network's input ``(B, obs_dim + action_dim)`` float32: the flattened observation
        ``(B, *obs_shape)`` and the action (``(B,)`` int64 one-hot, or ``(B, *shape)`` flattened)."""
        a = F.one_hot(action.long(), self.n_actions).float() if self.n_actions else action.flatten(1).float()
        return torch.cat([obs.flatten(1).float(), a], -1)

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """Logits ``(B,)`` of ``D`` at observations ``(B, *obs_shape)`` and actions ``(B,)`` int64 or ``(B, *shape)``."""
        return self.net(self.inputs(obs, action)).squeeze(-1)

    def gradient_penalty(self, expert: torch.Tensor, policy: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """``mean((||grad_x f(x)||_2 - 1)^2)`` (0-d) at ``x = u expert + (1 - u) policy``, ``u ~ U(0, 1)``
        per row (Gulrajani et al. 2017, Eq. 3), for :meth:`inputs` rows ``(B, D)`` of each kind."""
        u = torch.rand(expert.shape[0], 1, generator=generator, device=expert.device)
        x = (u * expert + (1 - u) * policy).requires_grad_(True)
        (grad,) = torch.autograd.grad(self.net(x).sum(), x, create_graph=True)
        return ((grad.norm(dim=-1) - 1) ** 2).mean()


class GAILLearner(Learner):
    """The discriminator's logistic regression (Ho & Ermon 2016, Algorithm 1, step 4), then
    PPO's update (Schulman et al. 2017, Eq. 7 and 9: :func:`msrl.rl.losses.ppo_epochs` over
    :func:`~msrl.rl.losses.ppo_loss`, GAE) on the reward ``-log(1 - D(s, a))`` (step 5, with PPO
    for TRPO). The demonstrations are this replica's shard of the config's dataset
    (:func:`msrl.rl.datasets.read_shard`), checked against the env's spaces.

    Raises:
        DatasetError: no dataset, a damaged one, or one of other spaces than the env's.
    """

    def __init__(self, ctx: BuildContext) -> None:
        self.hp: GAILConfig = ctx.hparams
        self.net = build_actor_critic(ctx)
        self.weights = ModuleWeights(self.net)
        self.parameters = list(self.net.parameters())
        self.lr = learning_rate_tensor(self.hp.learning_rate, ctx.device)
        self.optimizer = torch.optim.Adam(self.parameters, lr=self.lr, eps=1e-5)
        self.num_iterations = max(1, ctx.total_env_steps // (self.hp.num_steps * ctx.total_num_envs))
        self.iteration = torch.zeros((), dtype=torch.int64, device=ctx.device)
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed + 1)
        self.replicas = ctx.num_replicas  # learners whose statistics reduce_statistics averages
        self.expert, self.expert_total = read_shard(ctx)
        spec = ctx.env_spec
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.seed + 5)
            self.discriminator = Discriminator(spec.observation_space, spec.action_space,
                                               self.hp.discriminator_hidden_sizes).to(ctx.device)
        self.discriminator_optimizer = torch.optim.Adam(self.discriminator.parameters(), lr=self.hp.discriminator_lr)
        self.expert_generator = torch.Generator(device=ctx.device)
        self.expert_generator.manual_seed(ctx.seed + 6)
        if self.hp.normalize_reward:
            self.reward_scaler = RewardScaler(self.hp.gamma, self.hp.reward_clip).to(ctx.device)

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The actor-critic's state dict (detached tensors): all that acting needs."""
        return self.weights.get()

    def describe(self) -> str:
        """``msrl graph``'s note: the discriminator beside PPO's update."""
        return (f"discriminator (expert: {self.expert_total:,} demonstrated steps, this replica's shard "
                f"{self.expert.batch_size[0]:,}) trained here before PPO's update on its reward")

    def learn(self, batch: TensorDict) -> dict[str, Any]:
        """The discriminator's steps, then PPO's update on its reward.

        Args:
            batch: TensorDict ``(T, N)`` with :attr:`~msrl.rl.buffers.RolloutBuffer.KEYS` (its
                ``reward``, the env's, is replaced).

        Returns:
            PPO's metrics (``losses/{policy_loss,value_loss,entropy,approx_kl,...}``,
            ``charts/learning_rate``) and ``losses/discriminator_loss``,
            ``charts/expert_accuracy`` and ``charts/policy_accuracy`` (the last step's share of
            each kind it classifies right), ``charts/gail_reward`` (the rollout's mean reward).

        Raises:
            FloatingPointError: a loss is not finite (no step is taken).
        """
        T, N = batch.batch_size
        obs, action = batch["obs"].flatten(0, 1), batch["action"].flatten(0, 1)
        n = obs.shape[0]
        for _update in range(self.hp.discriminator_updates):
            idx = torch.randint(self.expert.batch_size[0], (n,), generator=self.expert_generator, device=obs.device)
            expert_x = self.discriminator.inputs(self.expert["obs"][idx], self.expert["action"][idx])
            expert_logits = self.discriminator.net(expert_x).squeeze(-1)
            policy_x = self.discriminator.inputs(obs, action)
            policy_logits = self.discriminator.net(policy_x).squeeze(-1)
            loss = (F.binary_cross_entropy_with_logits(expert_logits, torch.ones_like(expert_logits))
                    + F.binary_cross_entropy_with_logits(policy_logits, torch.zeros_like(policy_logits)))
            if self.hp.gradient_penalty > 0:
                loss = loss + self.hp.gradient_penalty * self.discriminator.gradient_penalty(
                    expert_x, policy_x, self.expert_generator)
            self.apply_gradients(loss, optimizer=self.discriminator_optimizer)
        with torch.no_grad():
            reward = -F.logsigmoid(-self.discriminator(obs, action)).view(T, N)  # -log(1 - D)
        metrics = self._ppo_update(batch, reward)
        metrics.update({"losses/discriminator_loss": loss.detach(),
                        "charts/expert_accuracy": (expert_logits.detach() > 0).float().mean(),
                        "charts/policy_accuracy": (policy_logits.detach() < 0).float().mean(),
                        "charts/gail_reward": reward.mean()})
        return metrics

    def _ppo_update(self, batch: TensorDict, reward: torch.Tensor) -> dict[str, Any]:
        """PPO's update on the rollout ``(T, N)`` with ``reward`` ``(T, N)`` for the env's: GAE,
        then ``update_epochs`` epochs of shuffled minibatches of the clipped objective."""
        hp, net = self.hp, self.net
        frac = anneal_learning_rate(self.lr, self.iteration, hp.learning_rate, self.num_iterations, hp.anneal_lr)
        clip = frac * hp.clip_coef if hp.anneal_clip else hp.clip_coef
        T, N = batch.batch_size
        if hp.normalize_reward:
            reward = self.reward_scaler(reward, batch["terminated"], self.reduce_statistics, self.replicas)
        with torch.no_grad():
            next_values = net.value(batch["next_obs"].flatten(0, 1)).view(T, N)
        advantages, returns = gae(reward, batch["value"], next_values, batch["terminated"], batch["truncated"],
                                  hp.gamma, hp.gae_lambda)
        b_obs, b_actions = batch["obs"].flatten(0, 1), batch["action"].flatten(0, 1)
        stats = ppo_epochs(lambda mb: net.evaluate(b_obs[mb], b_actions[mb]), batch["log_prob"].flatten(),
                           batch["value"].flatten(), advantages.flatten(), returns.flatten(), clip,
                           step=lambda loss: self.apply_gradients(loss, hp.max_grad_norm), generator=self.generator,
                           update_epochs=hp.update_epochs, num_minibatches=hp.num_minibatches, norm_adv=hp.norm_adv,
                           clip_vloss=hp.clip_vloss, ent_coef=hp.ent_coef, vf_coef=hp.vf_coef, target_kl=hp.target_kl,
                           loss=ppo_loss)
        stats["charts/learning_rate"] = self.lr.clone()
        if hp.normalize_obs:  # after the update: the next rollout normalizes with these statistics
            net.obs_rms.update(net.observation_vector(b_obs), self.reduce_statistics, self.replicas)
        return stats

    def state_dict(self) -> dict[str, Any]:
        state = {"net": self.net.state_dict(), "optimizer": self.optimizer.state_dict(), "iteration": int(self.iteration),
                 "generator": self.generator.get_state(), "discriminator": self.discriminator.state_dict(),
                 "discriminator_optimizer": self.discriminator_optimizer.state_dict(),
                 "expert_generator": self.expert_generator.get_state()}
        if self.hp.normalize_reward:
            state["reward_scaler"] = {"return_rms": self.reward_scaler.return_rms.state_dict(),
                                      "discounted_return": self.reward_scaler.discounted_return}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])
        load_learning_rate(self.optimizer, self.lr)
        self.iteration.fill_(int(state["iteration"]))
        self.generator.set_state(state["generator"])
        self.discriminator.load_state_dict(state["discriminator"])
        self.discriminator_optimizer.load_state_dict(state["discriminator_optimizer"])
        self.expert_generator.set_state(state["expert_generator"])
        if self.hp.normalize_reward:
            self.reward_scaler.return_rms.load_state_dict(state["reward_scaler"]["return_rms"])
            self.reward_scaler.discounted_return = state["reward_scaler"]["discounted_return"]


class GAILTrainer(Trainer):
    """GAIL's loop body, PPO's: a rollout of ``num_steps`` steps (the env's reward recorded,
    never learned from), one learner update (discriminator, then policy), weight sync."""

    def reset(self) -> None:
        """First observations, and the learner's initial weights to the actor."""
        self.obs = self.env.reset(seed=self.seed)
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, Any]:
        """Rollout, update, weight sync; returns the metrics."""
        for _step in range(self.hparams.num_steps):
            action, log_prob, value = self.actor.act(self.obs)
            next_obs, reward, terminated, truncated, info = self.env.step(action)
            self.buffer.insert(obs=self.obs, action=action, log_prob=log_prob, value=value, reward=reward,
                               terminated=terminated, truncated=truncated, next_obs=info["final_obs"])
            self.obs = next_obs
        metrics = self.learner.learn(self.buffer.gather())
        self.actor.set_weights(self.learner.get_weights())
        return metrics


ALGORITHM = AlgorithmSpec(
    name="gail",
    hparams=GAILConfig,
    trainer=GAILTrainer,
    components={"actor": ActorCriticActor, "buffer": RolloutBuffer, "learner": GAILLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: hp.num_steps * total_num_envs,
    action_spaces=(gymnasium.spaces.Discrete, gymnasium.spaces.Box),
    policy_lag="corrected",  # PPO's clipped ratio to the behaviour policy's log-prob
    demonstrations=True,
)
