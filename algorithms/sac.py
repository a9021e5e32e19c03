"""Soft Actor-Critic (Haarnoja et al. 2018, "Soft Actor-Critic Algorithms and Applications",
arXiv:1812.05905: twin Q-functions, Eq. 5-7; the policy loss, Eq. 10-12; automatic entropy
temperature, Eq. 18), as CleanRL's ``sac_continuous_action.py`` writes it.

Read top to bottom: hyperparameters, the networks (a tanh-squashed Gaussian policy, two soft
Q-networks), the actor, the learner with its three optimisers (critics, policy, temperature:
each step through :meth:`~msrl.api.Learner.apply_gradients`), and the trainer: uniform random
actions until ``learning_starts``, one critic update per env step after it, delayed policy
updates and target Polyak averaging -- all ``if``s on step counters. The replay buffer is
DQN's (:class:`msrl.rl.buffers.ReplayBuffer`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import gymnasium
import numpy as np
import torch
import torch.nn.functional as F
from tensordict import TensorDict

from msrl.api import (
    Actor,
    AlgorithmSpec,
    BuildContext,
    Fraction,
    LayerSizes,
    Learner,
    ModuleWeights,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Trainer,
    UnitInterval,
)
from msrl.rl.buffers import ReplayBuffer
from msrl.rl.continuous import QNetwork, SquashedGaussianPolicy, polyak_update_

__all__ = ["SACConfig", "SquashedGaussianPolicy", "SoftQNetwork", "SACActor", "SACLearner", "SACTrainer", "ALGORITHM"]



@dataclasses.dataclass
class SACConfig:
    """SAC's hyperparameters (defaults: rl-zoo's Pendulum-v1 SAC, SB3's defaults otherwise)."""

    buffer_size: PositiveInt = 1_000_000
    """replay capacity in transitions"""
    gamma: UnitInterval = 0.99
    """discount factor"""
    tau: Fraction = 0.005
    """target networks' Polyak rate"""
    batch_size: PositiveInt = 256
    """transitions per gradient step"""
    learning_starts: NonNegativeInt = 100
    """env steps of uniform random actions before learning starts"""
    policy_lr: PositiveFloat = 1e-3
    """Adam learning rate of the policy"""
    q_lr: PositiveFloat = 1e-3
    """Adam learning rate of the Q-networks"""
    alpha_lr: PositiveFloat = 1e-3
    """Adam learning rate of the entropy temperature"""
    policy_frequency: PositiveInt = 1
    """critic updates between policy updates (that many policy updates each time: delayed, TD3-style)"""
    target_network_frequency: PositiveInt = 1
    """critic updates between target updates"""
    alpha: NonNegativeFloat = 0.2
    """entropy temperature when not autotuned"""
    autotune: bool = True
    """learn the temperature towards target entropy -dim(A)"""
    initial_alpha: PositiveFloat = 1.0
    """the autotuned temperature's start value (SB3's ``ent_coef='auto'``)"""
    hidden_sizes: LayerSizes = (256, 256)
    """hidden layer widths of the policy and of each Q-network (ReLU)"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)


class SoftQNetwork(QNetwork):
    """The soft ``Q(s, a)``: ``(B, *obs_shape)``, ``(B, n_act)`` -> ``(B,)``
    (:class:`msrl.rl.continuous.QNetwork`).

    Raises:
        ValueError: a non-Box observation or action space.
    """

    def __init__(self, observation_space: gymnasium.Space, action_space: gymnasium.Space, hidden: tuple[int, ...]) -> None:
        super().__init__(observation_space, action_space, hidden, algorithm="SAC")


def _build_policy(ctx: BuildContext) -> SquashedGaussianPolicy:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        net = SquashedGaussianPolicy(ctx.env_spec.observation_space, ctx.env_spec.action_space, ctx.hparams.hidden_sizes)
    return net.to(ctx.device)


class SACActor(Actor):
    """Acts with the current policy, or uniformly at random before learning starts; noise from
    the actor's own ``torch.Generator`` (seeded by ``ctx.seed``)."""

    def __init__(self, ctx: BuildContext) -> None:
        self.policy = _build_policy(ctx)
        self.weights = ModuleWeights(self.policy)
        space = ctx.env_spec.action_space
        self.low = torch.as_tensor(space.low, dtype=torch.float32, device=ctx.device)
        self.high = torch.as_tensor(space.high, dtype=torch.float32, device=ctx.device)
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        """Actions ``(N, *action_shape)`` float32 within the bounds for observations
        ``(N, *obs_shape)``; ``deterministic`` takes the squashed mean."""
        action, _ = self.policy(obs, self.generator, deterministic)
        return action.view(-1, *self.policy.action_shape)

    @torch.no_grad()
    def random_action(self, obs: torch.Tensor) -> torch.Tensor:
        """Uniform actions ``(N, *action_shape)`` in the action space's bounds, one per row of
        ``obs`` ``(N, *obs_shape)``."""
        u = torch.rand((obs.shape[0], *self.low.shape), generator=self.generator, device=obs.device)
        return self.low + u * (self.high - self.low)

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's state dict (detached tensors)."""
        return self.weights.get()

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copies ``weights`` into the policy (in place)."""
        self.weights.load_(weights)

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.generator.set_state(state["generator"])


class SACLearner(Learner):
    """Twin soft Q-learning, the reparameterised policy update and the temperature update,
    each with its own Adam optimiser."""

    def __init__(self, ctx: BuildContext) -> None:
        self.hp: SACConfig = ctx.hparams
        spec, hidden, dev = ctx.env_spec, ctx.hparams.hidden_sizes, ctx.device
        self.policy = _build_policy(ctx)
        self.weights = ModuleWeights(self.policy)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.seed + 1)
            self.qf1 = SoftQNetwork(spec.observation_space, spec.action_space, hidden).to(dev)
            self.qf2 = SoftQNetwork(spec.observation_space, spec.action_space, hidden).to(dev)
        self.qf1_target = SoftQNetwork(spec.observation_space, spec.action_space, hidden).to(dev)
        self.qf2_target = SoftQNetwork(spec.observation_space, spec.action_space, hidden).to(dev)
        self.qf1_target.load_state_dict(self.qf1.state_dict())
        self.qf2_target.load_state_dict(self.qf2.state_dict())
        self.q_parameters = [*self.qf1.parameters(), *self.qf2.parameters()]
        # fused Adam: one kernel per optimiser step (the same update as the for-each one, to rounding)
        self.q_optimizer = torch.optim.Adam(self.q_parameters, lr=self.hp.q_lr, fused=True)
        self.policy_optimizer = torch.optim.Adam(list(self.policy.parameters()), lr=self.hp.policy_lr, fused=True)
        self.parameters = [*self.qf1.parameters(), *self.qf2.parameters(), *self.policy.parameters()]
        self.optimizer = self.q_optimizer
        self.target_entropy = -float(np.prod(spec.action_space.shape))
        self.log_alpha = torch.full((1,), math.log(self.hp.initial_alpha if self.hp.autotune else self.hp.alpha),
                                    device=dev, requires_grad=self.hp.autotune)
        self.alpha_optimizer = torch.optim.Adam([self.log_alpha], lr=self.hp.alpha_lr, fused=True) if self.hp.autotune else None
        self.generator = torch.Generator(device=dev)
        self.generator.manual_seed(ctx.seed + 3)

    def learn(self, batch: TensorDict) -> dict[str, torch.Tensor]:
        """One critic update (:meth:`update_critic`)."""
        return self.update_critic(batch)

    def update_critic(self, batch: TensorDict) -> dict[str, torch.Tensor]:
        """Both Q-networks towards ``r + gamma (1 - d) (min_i Q'_i(s', a') - alpha log pi(a'|s'))``
        with ``a' ~ pi(.|s')`` (Eq. 5-7).

        Args:
            batch: TensorDict ``(B,)`` with :attr:`ReplayBuffer.KEYS`.

        Returns:
            ``losses/qf_loss``, ``losses/qf1_values`` (0-d tensors).
        """
        hp = self.hp
        alpha = self.log_alpha.detach().exp()
        with torch.no_grad():
            next_a, next_logp = self.policy(batch["next_obs"], self.generator)
            next_q = torch.min(self.qf1_target(batch["next_obs"], next_a), self.qf2_target(batch["next_obs"], next_a))
            target = batch["reward"] + hp.gamma * (1.0 - batch["terminated"].float()) * (next_q - alpha * next_logp)
        q1 = self.qf1(batch["obs"], batch["action"])
        q2 = self.qf2(batch["obs"], batch["action"])
        qf_loss = F.mse_loss(q1, target) + F.mse_loss(q2, target)
        self.apply_gradients(qf_loss, optimizer=self.q_optimizer)
        return {"losses/qf_loss": qf_loss.detach(), "losses/qf1_values": q1.detach().mean()}

    def update_actor(self, batch: TensorDict) -> dict[str, torch.Tensor]:
        """The policy towards ``min_i Q_i(s, a) - alpha log pi(a|s)`` (Eq. 10-12), then, when
        autotuned, the temperature towards the target entropy (Eq. 18).

        Returns:
            ``losses/actor_loss``, ``losses/alpha`` (and ``losses/alpha_loss``), 0-d tensors.
        """
        alpha = self.log_alpha.detach().exp()
        a, logp = self.policy(batch["obs"], self.generator)
        # the Q-networks pass gradients to the action only: their own weight gradients would be
        # discarded, so they are not computed (two of the step's 256x256 matmuls)
        for p in self.q_parameters:
            p.requires_grad_(False)
        try:
            q = torch.min(self.qf1(batch["obs"], a), self.qf2(batch["obs"], a))
        finally:
            for p in self.q_parameters:
                p.requires_grad_(True)
        actor_loss = (alpha * logp - q).mean()
        self.apply_gradients(actor_loss, optimizer=self.policy_optimizer)
        out = {"losses/actor_loss": actor_loss.detach(), "losses/alpha": alpha.squeeze(0)}
        if self.alpha_optimizer is not None:
            alpha_loss = (-self.log_alpha.exp() * (logp.detach() + self.target_entropy)).mean()
            self.apply_gradients(alpha_loss, optimizer=self.alpha_optimizer)
            out["losses/alpha_loss"] = alpha_loss.detach()
        return out

    @torch.no_grad()
    def update_targets(self) -> None:
        """``Q'_i <- tau Q_i + (1 - tau) Q'_i``."""
        polyak_update_(self.qf1_target, self.qf1, self.hp.tau)
        polyak_update_(self.qf2_target, self.qf2, self.hp.tau)

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's state dict (what the actor needs; detached tensors)."""
        return self.weights.get()

    def state_dict(self) -> dict[str, Any]:
        nets = ("policy", "qf1", "qf2", "qf1_target", "qf2_target")
        state: dict[str, Any] = {n: getattr(self, n).state_dict() for n in nets}
        state.update(
            q_optimizer=self.q_optimizer.state_dict(),
            policy_optimizer=self.policy_optimizer.state_dict(),
            log_alpha=self.log_alpha.detach().clone(),
            alpha_optimizer=self.alpha_optimizer.state_dict() if self.alpha_optimizer else None,
            generator=self.generator.get_state(),
        )
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for n in ("policy", "qf1", "qf2", "qf1_target", "qf2_target"):
            getattr(self, n).load_state_dict(state[n])
        self.q_optimizer.load_state_dict(state["q_optimizer"])
        self.policy_optimizer.load_state_dict(state["policy_optimizer"])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        if self.alpha_optimizer is not None:
            self.alpha_optimizer.load_state_dict(state["alpha_optimizer"])
        self.generator.set_state(state["generator"])


class SACTrainer(Trainer):
    """SAC's loop body: one env step (random actions before ``learning_starts``), then one
    critic update, delayed policy updates and target averaging, all counted in steps."""

    def reset(self) -> None:
        """First observations, step counters, the learner's policy to the actor."""
        self.obs = self.env.reset(seed=self.seed)
        self.global_step = 0
        self.num_updates = 0
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, Any]:
        """One env step and, once learning has started, the updates; returns their metrics."""
        hp = self.hparams
        if self.global_step < hp.learning_starts:
            action = self.actor.random_action(self.obs)
        else:
            action = self.actor.act(self.obs)
        next_obs, reward, terminated, truncated, info = self.env.step(action)
        self.buffer.insert(obs=self.obs, action=action, reward=reward, next_obs=info["final_obs"], terminated=terminated)
        self.obs = next_obs
        self.global_step += self.num_envs
        metrics = {}
        if self.global_step > hp.learning_starts:
            batch = self.buffer.sample()
            metrics = self.learner.update_critic(batch)
            self.num_updates += 1
            if self.num_updates % hp.policy_frequency == 0:
                for _update in range(hp.policy_frequency):
                    metrics = {**metrics, **self.learner.update_actor(batch)}
                self.actor.set_weights(self.learner.get_weights())
            if self.num_updates % hp.target_network_frequency == 0:
                self.learner.update_targets()
        return metrics


ALGORITHM = AlgorithmSpec(
    name="sac",
    hparams=SACConfig,
    trainer=SACTrainer,
    components={"actor": SACActor, "buffer": ReplayBuffer, "learner": SACLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: total_num_envs,
    action_spaces=(gymnasium.spaces.Box,),
    policy_lag="corrected",  # off-policy: learns from a replay buffer
)
